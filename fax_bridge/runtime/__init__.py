"""Runtime: interprets federated_language Computation protos (coordinator side).

`run_computation` (rounds by the round engine, the rest interpreted) lives with the
in-process transport, `fax_bridge.in_process`, and is named here too. Modules:
`interpreter` (evaluate / interpret), `local_eval` (compile_local for
local parts, also used by device servers), `values` (pytree conversions), `npz_keys`
(npz keys of inputs and results), `backend` (the ClientsBackend contract),
`local_backend` (in-process clients), `aggregation` (what each aggregation means, exact
sums via `exact`), `population` (CLIENTS inputs read from a population store by
reference), `hlo` (HLO compilation), `client_map` (a local computation over many clients
as one XLA call).
The names below load their module on first use.
"""

from fax_bridge.system import lazy_names

_LAZY = {
    "evaluate": "interpreter",
    "run_computation": "fax_bridge.in_process",
    "computation_type": "interpreter",
    "compile_local": "local_eval",
    "content_hash": "local_eval",
    "args_from_npz": "npz_keys",
    "result_to_npz": "npz_keys",
    "LocalClientsBackend": "local_backend",
    "ClientsBackend": "backend",
    "ClientsValue": "backend",
    "PopulationRef": "population",
}

__all__ = sorted(_LAZY)


__getattr__, _ = lazy_names.served(__name__, _LAZY)
