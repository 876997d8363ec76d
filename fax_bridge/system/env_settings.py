"""Whole numbers set through `FAX_BRIDGE_*` environment variables: one reader and one
table of them (`VARIABLES`: name, default, least value, what it sets).

`whole_number(name)` reads one: unset or blank gives the default; anything but a whole
number of at least the least value is a `ComputationError` naming the variable, what it
holds, the form it takes and how to get the default. The modules that use them read them
when first used, never on import, so `fax-bridge --help` works whatever the environment
holds; the command line calls `check()` once its arguments are read, so a bad value
stops a command with that one line before any work starts.
"""

from __future__ import annotations

import os
import re

from fax_bridge.errors import ComputationError

# name: (default, least value, what it sets, an example)
VARIABLES = {
    "FAX_BRIDGE_MAX_KEPT_BYTES": (3 << 30, 0, "the bytes kept for reuse between rounds "
                                  "(0 keeps nothing)", "3221225472 for 3 GiB"),
    "FAX_BRIDGE_MAX_TENSOR_BYTES": (4 << 30, 1, "the bytes one tensor may take",
                                    "4294967296 for 4 GiB"),
    "FAX_BRIDGE_MAX_VALUE_BYTES": (16 << 30, 1, "the bytes one value's tensors may take",
                                   "17179869184 for 16 GiB"),
    "FAX_BRIDGE_MAX_EVAL_STEPS": (1_000_000, 1, "the steps one evaluation may take",
                                  "1000000"),
    "FAX_BRIDGE_STEP_BYTES": (1 << 30, 1, "the bytes a chunk step of an exported round "
                              "on the device may hold when clients_per_step is None or "
                              "'auto'", "1073741824 for 1 GiB"),
    "FAX_BRIDGE_MAX_PROTO_BYTES": (256 << 20, 1, "the bytes of one proto built for the "
                                   "devices", "268435456 for 256 MiB"),
    "FAX_BRIDGE_VMAP_CLIENTS": (0, 0, "whether an exported client part's batched rows run "
                                "as jax.vmap of its lax reading (1) or as XLA's loop (0)",
                                "1 for vmap"),
}


def whole_number(name: str) -> int:
    """The value of `VARIABLES`' `name` in the environment (module docstring)."""
    default, low, what, example = VARIABLES[name]
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if re.fullmatch(r"[0-9]+", raw) and int(raw) >= low:
        return int(raw)
    raise ComputationError(
        f"{name}={raw!r} is not a whole number >= {low}; it sets {what}: write it in "
        f"digits (e.g. {name}={example.split()[0]}, that is {example}), or unset it for "
        f"the default {default}")


def check() -> None:
    """Reads every variable of `VARIABLES`; the first bad one's ComputationError."""
    for name in VARIABLES:
        whole_number(name)
