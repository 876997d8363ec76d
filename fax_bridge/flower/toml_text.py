"""TOML text fax_bridge writes for Flower: the one quoting of values (`toml_value`), used
by the app's `pyproject.toml`, the connection file `$FLWR_HOME/config.toml`
(`connection_toml`) and `--node-config`/`--run-config` values (`node_config_text`).

A string is written as a TOML basic string in which `"`, the backslash and control
characters are escapes, never themselves, so no value can end its string early or add a
key; Flower's own config parser (which finds a quoted value up to the next `"`) reads
each back as it was."""

from __future__ import annotations

import math
import numbers
import os
import re
from typing import Optional

CONNECTION = "fax-bridge"  # the SuperLink connection's name in config.toml


def toml_string(text: str) -> str:
    """`text` as a TOML basic string (module docstring). Refuses text that is not
    Unicode scalar values (a lone surrogate, from bytes that are not UTF-8), which a
    UTF-8 TOML file cannot hold."""
    out = []
    for ch in text:
        if 0xD800 <= ord(ch) <= 0xDFFF:
            raise ValueError(f"{text!r} is not valid Unicode (a byte that is not UTF-8 "
                             "was read into it); use a name in UTF-8")
        if ch == "\\":
            out.append("\\\\")
        elif ch == '"' or ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def toml_value(value) -> str:
    """A bool, int, finite float or str as a TOML value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real) and math.isfinite(value):
        return repr(float(value))
    raise ValueError(f"{value!r} is not a bool, whole number, finite number or string")


def toml_key(name: str) -> str:
    """`name` as a TOML key: bare when it is one, else quoted."""
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else toml_string(name)


def node_config_text(config: dict) -> str:
    """A `--node-config` (or `--run-config`) value: space-separated key=value, each
    value a TOML value (`toml_value`)."""
    return " ".join(f"{toml_key(key)}={toml_value(value)}" for key, value in config.items())


def connection_toml(address: str, name: str = CONNECTION,
                    root_certificates: Optional[str] = None) -> str:
    """The Flower configuration (`$FLWR_HOME/config.toml`) of a SuperLink at `address`
    (HOST:PORT): insecure, or TLS checked against the CA certificate
    `root_certificates`."""
    security = "insecure = true" if root_certificates is None else \
        "root-certificates = " + toml_string(os.path.abspath(root_certificates))
    return (f"[superlink]\ndefault = {toml_string(name)}\n\n"
            f"[superlink.{toml_key(name)}]\naddress = {toml_string(address)}\n"
            f"{security}\n")
