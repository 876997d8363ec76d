"""The fork server's wire format: its version, typed requests, answers and sizes.

Datagrams on Unix SOCK_SEQPACKET sockets, each one JSON object of at most
`MAX_DATAGRAM` bytes, descriptors passed beside it (SCM_RIGHTS, at most `MAX_FDS`).
The server (`fork_server`) first says `hello`: `{"ready": PID, "version": VERSION}`
(to one that connects, once it has checked its user), or `{"error": TEXT}`. A request
is one of `REQUESTS`, named by its `"kind"`; each takes exactly its `FDS` descriptors:

- `Run` (`{"kind": "run", "target", "argv", "env", "cpus"}` with stdin, stdout, stderr
  and the working directory, an open directory): answered `{"pid": N}` with a pidfd.
- `Status` (`{"kind": "status", "pid"}`, no descriptor): answered `{"returncode": CODE}`
  as `subprocess` gives it (negative: the signal that ended it), or null while it runs.

A request the server cannot serve is answered `{"error": TEXT}` and its descriptors
closed. `decode_request` is the server's only reader of a requester's bytes: it refuses
(`ProtocolError`, naming what is wrong) anything but a request of a known kind with
exactly its fields, their types, and its number of descriptors.

Trust: the server takes requests from processes of its own user only (they may run
any code as that user anyway); this format bounds what one requester can make the
server hold or do for others, not what its children run. The requester trusts answers
from a server of its own user.

Versions (`VERSION`, said in the hello; a requester refuses a server of another):
- 2 (2026-12): typed requests named by "kind"; the hello names the version; a run sends
  its working directory as a descriptor, and always stdin.
- 1: untyped requests ({"run": ...} or {"status": pid}); no version in the hello.

This file imports only the standard library: the server and Flower's forked commands
load it by its path, without fax_bridge's package (whose `__init__` loads jax).
"""

from __future__ import annotations

import dataclasses
import json
from typing import ClassVar, Mapping, Optional

VERSION = 2
MAX_DATAGRAM = 1 << 20  # bytes of one request or answer (an environment travels in a run)
MAX_FDS = 4  # the most descriptors a request kind takes (a run's)
MAX_CPU = 1 << 16  # CPU numbers at or above this are refused


class ProtocolError(ValueError):
    """Bytes that are no request (or answer) of this version; the text says why."""


def _strings(value, what: str) -> None:
    if not all(isinstance(v, str) and "\0" not in v for v in value):
        raise ProtocolError(f"{what} must hold strings without NUL characters")


@dataclasses.dataclass(frozen=True)
class Run:
    """Fork a child running `target`: a module (`python -m MODULE`, with `sys.argv` as
    [MODULE, *argv]) or an entry point `MODULE:FUNCTION` (`sys.argv` is argv, its first
    the command's name), in `env`, on `cpus` (None: the server's); its descriptors are
    stdin, stdout, stderr and its working directory."""

    kind: ClassVar[str] = "run"
    FDS: ClassVar[int] = 4
    target: str
    argv: tuple
    env: Mapping[str, str]
    cpus: Optional[tuple] = None

    def __post_init__(self) -> None:
        module, colon, function = self.target.partition(":")
        if not (module and all(p.isidentifier() for p in module.split("."))
                and (not colon or function.isidentifier())):
            raise ProtocolError(f"target {self.target!r} is neither MODULE nor "
                                "MODULE:FUNCTION")
        if colon and not self.argv:
            raise ProtocolError("an entry point's argv starts with the command's name")
        _strings(self.argv, "argv")
        _strings(self.env, "env names")
        _strings(self.env.values(), "env values")
        if any("=" in name or not name for name in self.env):
            raise ProtocolError("an env name is empty or holds '='")
        if self.cpus is not None and not (self.cpus and all(
                type(c) is int and 0 <= c < MAX_CPU for c in self.cpus)):
            raise ProtocolError(f"cpus {list(self.cpus)!r} is not a non-empty list of CPU "
                                "numbers")

    def fields(self) -> dict:
        return {"target": self.target, "argv": list(self.argv), "env": dict(self.env),
                "cpus": None if self.cpus is None else list(self.cpus)}

    @classmethod
    def parse(cls, fields: dict) -> "Run":
        types = {"target": str, "argv": list, "env": dict, "cpus": (list, type(None))}
        for key, kind in types.items():
            if not isinstance(fields[key], kind):
                raise ProtocolError(f"{key} is {type(fields[key]).__name__}, not "
                                    f"{getattr(kind, '__name__', 'a list or null')}")
        cpus = fields["cpus"]
        return cls(fields["target"], tuple(fields["argv"]), dict(fields["env"]),
                   None if cpus is None else tuple(cpus))


@dataclasses.dataclass(frozen=True)
class Status:
    """The exit status of `pid`, a child this same connection asked for."""

    kind: ClassVar[str] = "status"
    FDS: ClassVar[int] = 0
    pid: int

    def __post_init__(self) -> None:
        if type(self.pid) is not int or self.pid <= 0:
            raise ProtocolError(f"a status request names a pid, not {self.pid!r}")

    def fields(self) -> dict:
        return {"pid": self.pid}

    @classmethod
    def parse(cls, fields: dict) -> "Status":
        return cls(fields["pid"])


REQUESTS = {kind.kind: kind for kind in (Run, Status)}  # each request kind by its name


def encode_request(request) -> bytes:
    """The datagram of a request (one of `REQUESTS`' kinds)."""
    return json.dumps({"kind": request.kind, **request.fields()}).encode()


def decode_request(data: bytes, fds: int):
    """The request in `data`, sent with `fds` descriptors, or ProtocolError naming what
    is wrong: not JSON, no known kind, a missing or unknown field, a field of the wrong
    type, or a number of descriptors the kind does not take."""
    try:
        message = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ProtocolError(f"not JSON ({e})") from None
    kind = message.get("kind") if isinstance(message, dict) else None
    request_type = REQUESTS.get(kind) if isinstance(kind, str) else None
    if request_type is None:
        raise ProtocolError(f"expected a JSON object whose kind is one of "
                            f"{sorted(REQUESTS)}, got {bytes(data[:80])!r}")
    names = {f.name for f in dataclasses.fields(request_type)}
    if message.keys() != names | {"kind"}:
        raise ProtocolError(f"a {kind} request has the fields {sorted(names)}, not "
                            f"{sorted(set(message) - {'kind'})}")
    if fds != request_type.FDS:
        raise ProtocolError(f"a {kind} request takes {request_type.FDS} descriptors, "
                            f"not {fds}")
    try:
        return request_type.parse({k: message[k] for k in names})
    except TypeError as e:  # a field of a type that cannot even be compared
        raise ProtocolError(f"a {kind} request's field: {e}") from None


def hello(pid: int) -> bytes:
    """The server's first datagram to a requester it serves."""
    return answer(ready=pid, version=VERSION)


def answer(**fields) -> bytes:
    """An answer's datagram: `pid`, `returncode`, `ready` and `version`, or `error`."""
    return json.dumps(fields).encode()


def decode_answer(data: bytes) -> dict:
    """An answer from the server, or ProtocolError."""
    try:
        message = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ProtocolError(f"an answer that is not JSON ({e})") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"an answer that is no JSON object: {bytes(data[:80])!r}")
    return message


def check_hello(message: dict) -> int:
    """The server's pid from its hello, or ProtocolError: a refusal (its text), or a
    server of another protocol version (of another fax_bridge)."""
    if "ready" not in message:
        raise ProtocolError(f"the fork server refused to serve: {message.get('error')}")
    version = message.get("version", 1)
    if version != VERSION:
        raise ProtocolError(
            f"the fork server speaks protocol version {version}, this requester "
            f"{VERSION}: it was started by another fax_bridge; stop it, or start this "
            "program's own")
    if type(message["ready"]) is not int:
        raise ProtocolError(f"the fork server's hello names no pid: {message!r}")
    return message["ready"]
