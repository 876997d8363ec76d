"""The parity check: jit on this machine against an exported path (`check.py`:
`check_parity`), its report, why float results differ (rounding, first order,
shadow runs), a Flower run against jit and its results, and `fax-bridge parity`.

`fax_bridge.parity` serves `check.py`'s public names (`from fax_bridge.parity
import check_parity`); they load on first use, so that the report alone (which
the transports use) does not load the fleet.
"""

from fax_bridge.system import lazy_names

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


__getattr__, __dir__ = lazy_names.served(__name__, dict.fromkeys(__all__, _HOME))
