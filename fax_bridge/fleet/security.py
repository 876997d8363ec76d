"""Fleet security: the per-fleet token, mutual TLS, loopback-only binding by default.

- Token: every RPC carries `x-fax-bridge-token` metadata; a device compares it with its
  own token in constant time (`hmac.compare_digest`) and refuses anything else with
  UNAUTHENTICATED. A device reads its token from the `FAX_BRIDGE_FLEET_TOKEN`
  environment variable or from a file only its owner can read (mode 0600), never from
  the command line (other users can read a process's arguments).
- TLS: `TlsConfig` names PEM files (CA, own certificate and key); devices then demand a
  client certificate signed by the CA (mutual TLS) and coordinators check the device's.
- Binding: loopback addresses only, unless the caller sets `allow_remote`, which logs a
  warning (and another one when such an address goes without TLS).
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import logging
import os
import secrets
from typing import Mapping, Optional, Sequence

import grpc

from fax_bridge.system import private_files
from fax_bridge.errors import FleetError

TOKEN_ENV = "FAX_BRIDGE_FLEET_TOKEN"
TOKEN_HEADER = "x-fax-bridge-token"
TOKEN_BYTES = 32
MIN_TOKEN_CHARS = 16  # a guessable token is no token; new_token() gives 64 hex digits

log = logging.getLogger("fax_bridge.fleet.security")


# ---------------------------------------------------------------------------------------
# Tokens


def new_token() -> str:
    """A fresh random fleet token (hex, 256 bits)."""
    return secrets.token_hex(TOKEN_BYTES)


def write_token_file(path: "os.PathLike | str", token: str) -> None:
    """Writes `token` to a new file readable and writable by its owner only (0600)."""
    fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)


def read_token_file(path: "os.PathLike | str") -> str:
    """Reads a token file; refuses one that other users may read or write, that is not
    ours, or a link (`private_files.read_private`)."""
    try:
        token = private_files.read_private(path).decode(errors="replace").strip()
    except private_files.UnsafePathError as e:
        raise FleetError(f"token file {e}") from None
    except OSError as e:
        raise FleetError(f"cannot read the token file {path}: {e}") from None
    if not token:
        raise FleetError(f"token file {path} is empty; write the fleet token into it")
    return token


def check_token(token: str, where: str) -> str:
    """`token` when it is long enough to resist guessing; FleetError naming `where` else."""
    if len(token) < MIN_TOKEN_CHARS:
        raise FleetError(
            f"the fleet token from {where} has {len(token)} characters; at least "
            f"{MIN_TOKEN_CHARS} are needed (security.new_token() makes a good one)")
    return token


def resolve_token(token: Optional[str] = None, token_file: Optional[str] = None,
                  environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The token from, in order: `token`, `token_file`, the FAX_BRIDGE_FLEET_TOKEN variable.

    A token shorter than MIN_TOKEN_CHARS is refused (FleetError naming where it came from).
    """
    if token:
        return check_token(token, "the token argument")
    if token_file:
        return check_token(read_token_file(token_file), f"token file {token_file}")
    env = os.environ if environ is None else environ
    value = env.get(TOKEN_ENV) or None
    return check_token(value, f"${TOKEN_ENV}") if value else None


def call_metadata(token: Optional[str]) -> tuple:
    """gRPC metadata carrying `token` (empty without one)."""
    return ((TOKEN_HEADER, token),) if token else ()


def token_matches(expected: str, metadata: Sequence) -> bool:
    """True when `metadata` holds exactly the expected token (constant-time comparison)."""
    got = [value for key, value in (metadata or ()) if key == TOKEN_HEADER]
    if len(got) != 1 or not isinstance(got[0], str):
        return False
    return hmac.compare_digest(got[0].encode("utf-8", "replace"), expected.encode("utf-8"))


def _refuse(method: str):
    def abort(request_or_iterator, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED,
                      f"{method}: missing or wrong fleet token; the coordinator must send "
                      f"the device's token as `{TOKEN_HEADER}` metadata")
    return abort


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses every call whose metadata does not carry the fleet token."""

    def __init__(self, token: str):
        if not token:
            raise FleetError("TokenAuthInterceptor needs a non-empty token")
        self._token = check_token(token, "the device's configuration")

    def intercept_service(self, continuation, handler_call_details):
        if token_matches(self._token, handler_call_details.invocation_metadata):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None:
            return None
        # A request-streaming handler runs before any request message is read, so the
        # refusal costs the device the metadata only: a huge unauthenticated body is never
        # received (flow control holds it back until the call is closed). The caller sees
        # the same UNAUTHENTICATED status whatever the method's shape.
        return grpc.stream_unary_rpc_method_handler(_refuse(method))


# ---------------------------------------------------------------------------------------
# TLS


@dataclasses.dataclass(frozen=True)
class TlsConfig:
    """PEM file paths for mutual TLS.

    Attributes:
      ca_cert: the CA that signed the peers' certificates (devices check coordinators
        with it, coordinators check devices).
      cert, key: this side's certificate chain and private key.
      server_name: the name the coordinator expects in a device's certificate when it
        differs from the host it dials (e.g. "localhost" while dialling 127.0.0.1).
    """

    ca_cert: str
    cert: str
    key: str
    server_name: Optional[str] = None

    def _read(self) -> tuple[bytes, bytes, bytes]:
        out = []
        for what, path in (("CA certificate", self.ca_cert), ("certificate", self.cert),
                           ("private key", self.key)):
            try:
                with open(path, "rb") as f:
                    out.append(f.read())
            except OSError as e:
                raise FleetError(f"TLS: cannot read the {what} {path}: {e}") from None
        return out[0], out[1], out[2]

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server credentials that require a client certificate signed by the CA."""
        ca, cert, key = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Channel credentials presenting this side's certificate and checking the peer's."""
        ca, cert, key = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                            certificate_chain=cert)

    def channel_options(self) -> tuple:
        if self.server_name:
            return (("grpc.ssl_target_name_override", self.server_name),)
        return ()


def tls_from_args(ca_cert: Optional[str], cert: Optional[str], key: Optional[str],
                  server_name: Optional[str] = None) -> Optional[TlsConfig]:
    """A TlsConfig when all three files are given, None when none is; else a FleetError."""
    given = [p for p in (ca_cert, cert, key) if p]
    if not given:
        return None
    if len(given) != 3:
        raise FleetError("mutual TLS needs all three of --tls-ca, --tls-cert and --tls-key")
    return TlsConfig(ca_cert, cert, key, server_name)


# ---------------------------------------------------------------------------------------
# Addresses


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and `localhost`."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_address(host: str, allow_remote: bool, tls: Optional[TlsConfig], what: str) -> None:
    """Refuses a non-loopback `host` unless `allow_remote`; warns when it is allowed."""
    if is_loopback(host):
        return
    if not allow_remote:
        raise FleetError(
            f"{what} {host!r} is not a loopback address; fleets stay on 127.0.0.1 unless "
            "you opt in explicitly (--allow-remote / allow_remote=True)")
    log.warning("%s %s is reachable from other machines (allow_remote is set)", what, host)
    if tls is None:
        log.warning("%s %s is used without TLS: the fleet token and all values travel in "
                    "clear text; configure mutual TLS for anything but a trusted network",
                    what, host)
