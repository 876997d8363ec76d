"""Fleet files: where the devices of a fleet started elsewhere listen, as JSON.

    {
      "devices": ["10.0.0.2:50051", {"address": "10.0.0.3:50051", "name": "node-3"}],
      "token_file": "fleet.token",
      "tls": {"ca_cert": "ca.pem", "cert": "coordinator.pem", "key": "coordinator.key",
              "server_name": "fax-bridge-device"}
    }

`devices` is required: HOST:PORT strings (or objects with an `address`), in the order
clients are assigned to them. `token_file` (optional) names a file holding the fleet
token, readable by its owner only; `tls` (optional) names PEM files for mutual TLS. The
token itself never sits in the fleet file, so the file can be shared and committed.
Relative paths are relative to the fleet file. `parse_devices("h1:p1,h2:p2")` reads the
same addresses from a command line. The file is read as another party's
(`private_files.read_json`: a regular file of at most `MAX_FLEET_FILE_BYTES`, JSON of
bounded depth with finite numbers).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional, Sequence

from fax_bridge.system import private_files
from fax_bridge.errors import FleetError
from fax_bridge.fleet.protocol import parse_address

_KEYS = {"devices", "token_file", "tls"}
MAX_FLEET_FILE_BYTES = 1 << 20  # thousands of devices; a larger file is refused unread
_TLS_KEYS = {"ca_cert", "cert", "key", "server_name"}


@dataclasses.dataclass(frozen=True)
class FleetSpec:
    """The devices of a fleet and how to reach them.

    Attributes:
      addresses: HOST:PORT of each device, in client-assignment order.
      names: a name per device (its address when the file gives none).
      token_file: path of the fleet token file, or None.
      tls: mapping of the TLS PEM paths (`ca_cert`, `cert`, `key`, optional
        `server_name`), or None.
    """

    addresses: tuple
    names: tuple
    token_file: Optional[str] = None
    tls: Optional[dict] = None


def check_address(address: Any, where: str = "device address") -> str:
    """Returns `address` if it is HOST:PORT with a port in 1..65535; else AddressError.

    A remote device needs a fixed port, not 0.
    """
    parse_address(address, where)
    return address.strip()


def parse_devices(text: str) -> list[str]:
    """Device addresses from a comma-separated `HOST:PORT,HOST:PORT,...` string."""
    addresses = [part.strip() for part in text.split(",") if part.strip()]
    if not addresses:
        raise FleetError(f"--devices {text!r} names no device; give HOST:PORT,HOST:PORT,...")
    return _unique([check_address(a, "--devices entry") for a in addresses], "--devices")


def _unique(addresses: Sequence[str], where: str) -> list[str]:
    seen: set = set()
    for address in addresses:
        if address in seen:
            raise FleetError(
                f"{where} lists {address} twice; each device must appear once (clients "
                "are assigned per entry)")
        seen.add(address)
    return list(addresses)


def load_fleet_file(path: "os.PathLike | str") -> FleetSpec:
    """Reads and checks a fleet file (see the module docstring for the format)."""
    path = os.fspath(path)
    try:  # a regular file (a FIFO never blocks), bounded JSON (`private_files.read_json`)
        data = private_files.read_json(path, MAX_FLEET_FILE_BYTES, what="the fleet file",
                                       follow_links=True)
    except private_files.HandedFileError as e:
        raise FleetError(f"the fleet file is not valid JSON: {e}") from None
    except OSError as e:
        raise FleetError(f"cannot read the fleet file {path}: {e}") from None
    if not isinstance(data, dict):
        raise FleetError(f"the fleet file {path} must hold a JSON object with a 'devices' "
                         "list")
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise FleetError(f"the fleet file {path} has unknown keys {unknown}; allowed: "
                         f"{sorted(_KEYS)}")
    devices = data.get("devices")
    if not isinstance(devices, list) or not devices:
        raise FleetError(f"the fleet file {path} needs a non-empty 'devices' list of "
                         "HOST:PORT strings")
    addresses, names = [], []
    for i, entry in enumerate(devices):
        where = f"{path}: devices[{i}]"
        if isinstance(entry, dict):
            if "address" not in entry or set(entry) - {"address", "name"}:
                raise FleetError(f"{where} must be HOST:PORT or {{\"address\": ..., "
                                 "\"name\": ...}}")
            address = check_address(entry["address"], where)
            names.append(str(entry.get("name", address)))
        else:
            address = check_address(entry, where)
            names.append(address)
        addresses.append(address)
    _unique(addresses, path)
    base = os.path.dirname(os.path.abspath(path))
    token_file = data.get("token_file")
    if token_file is not None:
        if not isinstance(token_file, str) or not token_file:
            raise FleetError(f"{path}: 'token_file' must be a path string")
        token_file = os.path.join(base, token_file)
    tls = data.get("tls")
    if tls is not None:
        if not isinstance(tls, dict) or not {"ca_cert", "cert", "key"} <= set(tls) or \
                set(tls) - _TLS_KEYS:
            raise FleetError(f"{path}: 'tls' must be an object with ca_cert, cert, key "
                             "(and optionally server_name)")
        tls = {k: (v if k == "server_name" else os.path.join(base, v)) for k, v in tls.items()}
    return FleetSpec(addresses=tuple(addresses), names=tuple(names), token_file=token_file,
                     tls=tls)


def write_fleet_file(path: "os.PathLike | str", addresses: Sequence[str], *,
                     token_file: Optional[str] = None, tls: Optional[dict] = None) -> None:
    """Writes a fleet file for `addresses` (checked as `load_fleet_file` would), anew
    and renamed into place (`private_files.write_file`: a link at `path` is refused)."""
    checked = _unique([check_address(a) for a in addresses], "addresses")
    data: dict = {"devices": checked}
    if token_file is not None:
        data["token_file"] = os.fspath(token_file)
    if tls is not None:
        data["tls"] = dict(tls)
    private_files.write_file(path, json.dumps(data, indent=2) + "\n", 0o644)
