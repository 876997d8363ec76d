"""The local path: a federated program under `jax.jit` (`jit.py`: the clients mesh,
sharding), cohorts run in chunks and the chunk size chosen, clients streamed from
a source, and one program across hosts (`multihost`).

`fax_bridge.local` serves `jit.py`'s public names (`from fax_bridge.local import
jit_program`); they load on first use.
"""

from fax_bridge.system import lazy_names

_HOME = "fax_bridge.local.jit"

__all__ = [
    "AnyMesh",
    "CLIENTS_AXIS",
    "ambient_mesh",
    "argument_sharding",
    "axis_is_explicit",
    "clients_mesh",
    "clients_sharding",
    "current_mesh",
    "jit_program",
    "place_leading",
    "replicated",
    "resolve_mesh",
    "to_hlo",
]


__getattr__, __dir__ = lazy_names.served(__name__, dict.fromkeys(__all__, _HOME))
