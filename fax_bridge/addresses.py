"""HOST:PORT strings: `parse_address` is the one reader, for `--listen`, device addresses,
fleet files and the multi-host coordinator alike; `format_address` writes them back."""

from __future__ import annotations

import ipaddress
from typing import Any

from fax_bridge.errors import AddressError


def parse_address(address: Any, where: str = "device address", *,
                  allow_port_zero: bool = False) -> tuple[str, int]:
    """Splits HOST:PORT into (host without brackets, port); AddressError when malformed.

    The port must lie in 1..65535 (0 too with `allow_port_zero`: a free port to listen
    on). IPv6 hosts are written in brackets, e.g. `[::1]:50051`.
    """
    if not isinstance(address, str):
        raise AddressError(f"{where} {address!r} is not a string; write it as HOST:PORT")
    host, sep, port = address.strip().rpartition(":")
    bare = host.strip("[]")
    low = 0 if allow_port_zero else 1
    if not sep or not bare or not port.isdigit() or not low <= int(port) < 65536:
        example = "127.0.0.1:0 for a free port" if allow_port_zero else "10.0.0.2:50051"
        raise AddressError(
            f"{where} {address!r} is not HOST:PORT with a port in {low}..65535 (e.g. "
            f"{example})")
    if ":" in bare and not host.startswith("["):
        try:
            ipaddress.IPv6Address(bare)
        except ValueError:
            pass
        else:
            raise AddressError(f"{where} {address!r}: write IPv6 hosts in brackets, e.g. "
                               f"[{bare}]:{port}")
    return bare, int(port)


def format_address(host: str, port: int) -> str:
    """HOST:PORT, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
