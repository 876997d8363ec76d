"""Credentials for a Flower deployment on one machine: TLS and SuperNode keys.

`local_credentials(folder, nodes)` writes a certificate authority, a server certificate
for the SuperLink on loopback (`127.0.0.1`, `::1`, `localhost`) signed by it, and one
NIST P-256 key pair per SuperNode (PEM private key, OpenSSH public key, the form
`flwr supernode register` takes), and returns their paths as `Credentials`, which
`deployment.LocalDeployment(credentials=...)` turns into Flower's own flags:

    flower-superlink --ssl-ca-certfile CA --ssl-certfile CERT --ssl-keyfile KEY \
        --enable-supernode-auth
    flwr supernode register NODE.pub fax-bridge      (once per node, before it starts)
    flower-supernode --root-certificates CA --auth-supernode-private-key NODE.key

and `.flwr/config.toml`'s connection names `root-certificates = CA`. Private keys are
written with mode 0600, each file anew in a folder of ours alone (`private_files`: a
link planted under its name is refused). These are for a deployment on this machine
(tests, trials); a real federation's certificates come from its own authority.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
from typing import Optional

from fax_bridge.system import private_files


@dataclasses.dataclass(frozen=True)
class Credentials:
    """Paths of a deployment's TLS files and, when `node_keys` is not empty, the
    private and public (OpenSSH) key of each SuperNode, by node index."""

    ca_cert: str
    server_cert: str
    server_key: str
    node_keys: tuple = ()  # ((private key path, public key path), ...)

    @property
    def node_auth(self) -> bool:
        return bool(self.node_keys)


def _write(path: str, data: bytes, private: bool = False) -> str:
    return private_files.write_file(path, data, 0o600 if private else 0o644)


def _key_pem(key, openssh: bool = False) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM,
                             serialization.PrivateFormat.OpenSSH if openssh
                             else serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def node_key_pair(folder: str, name: str) -> tuple:
    """Writes `name.key` and `name.pub` of a new P-256 key, both in OpenSSH's format
    (the one `flower-supernode` and `flwr supernode register` read) into `folder`,
    made if missing; returns their paths."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    private_files.private_dir(folder, 0o755)
    key = ec.generate_private_key(ec.SECP256R1())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                           serialization.PublicFormat.OpenSSH)
    return (_write(os.path.join(folder, f"{name}.key"), _key_pem(key, openssh=True),
                   private=True),
            _write(os.path.join(folder, f"{name}.pub"), public + b"\n"))


def local_credentials(folder: str, nodes: int = 0, days: int = 2,
                      hosts: Optional[list] = None) -> Credentials:
    """Writes a CA, a SuperLink certificate for `hosts` (loopback by default) and
    `nodes` SuperNode key pairs into `folder` (module docstring)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    private_files.private_dir(folder, 0o755)
    now = datetime.datetime.now(datetime.timezone.utc)
    begin, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fax_bridge local CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(begin).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(False, False, False, False, False, True, True,
                                       False, False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    names = []
    for host in hosts or ["127.0.0.1", "::1", "localhost"]:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                        "fax_bridge SuperLink")]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(begin).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return Credentials(
        ca_cert=_write(os.path.join(folder, "ca.crt"), ca.public_bytes(pem)),
        server_cert=_write(os.path.join(folder, "server.crt"), cert.public_bytes(pem)),
        server_key=_write(os.path.join(folder, "server.key"), _key_pem(key), private=True),
        node_keys=tuple(node_key_pair(folder, f"node-{i}") for i in range(nodes)))
