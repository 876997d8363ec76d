"""The parity check: jit on this machine against an exported path (`check.py`:
`check_parity`), its report, why float results differ (rounding, first order,
shadow runs), a Flower run against jit and its results, and `fax-bridge parity`.

`fax_bridge.parity` serves `check.py`'s public names (`from fax_bridge.parity
import check_parity`); they load on first use, so that the report alone (which
the transports use) does not load the fleet.
"""

import importlib

_HOME = "fax_bridge.parity.check"

__all__ = [
    "LeafParity",
    "ParityReport",
    "bounded_leaves",
    "check_parity",
    "chunking_of",
    "compare_leaves",
    "explain_mismatches",
    "fleet_arguments",
    "leaves_in_type_order",
    "note_chunked_sums",
]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module(_HOME), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
