"""HOST:PORT strings: `parse_address` is the one reader, for `--listen`, `--superlink`,
device addresses, fleet files and the multi-host coordinator alike; `format_address`
writes them back, and `normalized` gives the one spelling a checked address is written
in (a config file, a command line).

A host is an IPv4 address, an IPv6 address in brackets, or a DNS name (labels of ASCII
letters, digits, `-` and `_`, at most 63 characters each, 253 in all); anything else
(spaces, quotes, other characters, an empty host) is refused, so an address can be
written into a config file or a shell command as it is."""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from fax_bridge.errors import AddressError

_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")
_PORT = re.compile(r"[0-9]{1,5}")


def _host_problem(host: str, bracketed: bool) -> str:
    """Why `host` is not a host (module docstring); "" when it is one."""
    if bracketed:
        address, _, zone = host.partition("%")
        try:
            ipaddress.IPv6Address(address)
        except ValueError:
            return "holds no IPv6 address in its brackets"
        if "%" in host and not re.fullmatch(r"[A-Za-z0-9_.-]+", zone):
            return "has an IPv6 zone that is not an interface name"
        return ""
    if not host:
        return "has no host"
    if not host.isascii() or not _NAME.fullmatch(host) or len(host.rstrip(".")) > 253:
        return ("has a host that is neither an IP address nor a DNS name (ASCII letters, "
                "digits, '-', '_' and dots; write an internationalized name in its "
                "xn-- form)")
    if re.fullmatch(r"[0-9.]+", host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return "has a host that is not a valid IPv4 address"
    return ""


def parse_address(address: Any, where: str = "device address", *,
                  allow_port_zero: bool = False) -> tuple[str, int]:
    """Splits HOST:PORT into (host without brackets, port); AddressError when malformed.

    The port must lie in 1..65535 (0 too with `allow_port_zero`: a free port to listen
    on). IPv6 hosts are written in brackets, e.g. `[::1]:50051`. Whitespace around the
    whole address is ignored.
    """
    if not isinstance(address, str):
        raise AddressError(f"{where} {address!r} is not a string; write it as HOST:PORT")
    text = address.strip()
    host, sep, port = text.rpartition(":")
    low = 0 if allow_port_zero else 1
    example = "127.0.0.1:0 for a free port" if allow_port_zero else "10.0.0.2:50051"
    if not sep or not _PORT.fullmatch(port) or not low <= int(port) < 65536:
        raise AddressError(
            f"{where} {address!r} is not HOST:PORT with a port in {low}..65535 (e.g. "
            f"{example})")
    bracketed = host.startswith("[") and host.endswith("]") and len(host) >= 2
    bare = host[1:-1] if bracketed else host
    if not bracketed and ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            pass
        else:
            raise AddressError(f"{where} {address!r}: write IPv6 hosts in brackets, e.g. "
                               f"[{host}]:{port}")
    problem = _host_problem(bare, bracketed)
    if problem:
        raise AddressError(f"{where} {address!r} {problem}; write it as HOST:PORT (e.g. "
                           f"{example})")
    return bare, int(port)


def format_address(host: str, port: int) -> str:
    """HOST:PORT, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def normalized(address: Any, where: str = "device address", *,
               allow_port_zero: bool = False) -> str:
    """`address` checked (`parse_address`) and written back in one spelling."""
    return format_address(*parse_address(address, where, allow_port_zero=allow_port_zero))
