"""fax_bridge: federated computations in JAX, run locally or exported to TFF.

Write a program once with the FAX building blocks, run it with `jit` on accelerators
(CLIENTS values sharded over a `clients` mesh axis), export it as a TFF building-block
proto, and run that proto on a simulated device fleet.
"""

from fax_bridge.api import (
    Program,
    federated_broadcast,
    federated_decode_sum,
    federated_map_clients,
    federated_map_server,
    federated_mean,
    federated_sum,
    federated_weighted_mean,
    program,
)
from fax_bridge.errors import (
    ComputationError,
    ExportError,
    FaxBridgeError,
    FleetError,
    PlacementError,
    ProgramError,
    WeightError,
)
from fax_bridge.local.chunk_stream import stream_clients
from fax_bridge.system import lazy_names
from fax_bridge.local.jit import clients_mesh, jit_program, to_hlo
from fax_bridge.language.placements import Placement
from fax_bridge.tff.export import export_tff
from fax_bridge.tff.files import load_computation, save_computation
from fax_bridge.language.tracing import FederatedComputation, trace
from fax_bridge.language.secure import (
    SecureAggregationError,
    federated_secure_mean,
    federated_secure_modular_sum,
    federated_secure_sum,
    federated_secure_sum_bitwidth,
)

__version__ = "0.1.0"

# The fleet (gRPC, device processes), parity, forms and multihost load on first use:
# together they add about a quarter to `import fax_bridge` (gRPC, the interpreter,
# jax.distributed).
_LAZY = {
    "FleetConfig": "fax_bridge.fleet.config",
    "LocalFleet": "fax_bridge.fleet.launcher",
    "ParityReport": "fax_bridge.parity.check",
    "RemoteFleet": "fax_bridge.fleet.remote",
    "PopulationRef": "fax_bridge.runtime.population",
    "check_parity": "fax_bridge.parity.check",
    "to_distribute_aggregate_form": "fax_bridge.tff.forms",
    "to_map_reduce_form": "fax_bridge.tff.forms",
    "write_form": "fax_bridge.tff.forms",
}

# Modules also served at the top (`from fax_bridge import multihost`), for programs
# written so: each loads from its room on first use.
_MODULES = {
    "cli_args": "fax_bridge.system.cli_args",
    "flower_results": "fax_bridge.parity.flower_results",
    "multihost": "fax_bridge.local.multihost",
}

__getattr__, _ = lazy_names.served(__name__, _LAZY, _MODULES)

__all__ = [
    "ComputationError",
    "ExportError",
    "FederatedComputation",
    "FaxBridgeError",
    "FleetConfig",
    "FleetError",
    "LocalFleet",
    "ParityReport",
    "PopulationRef",
    "RemoteFleet",
    "Placement",
    "PlacementError",
    "ProgramError",
    "Program",
    "SecureAggregationError",
    "WeightError",
    "check_parity",
    "clients_mesh",
    "export_tff",
    "federated_broadcast",
    "federated_decode_sum",
    "federated_map_clients",
    "federated_map_server",
    "federated_mean",
    "federated_secure_mean",
    "federated_secure_modular_sum",
    "federated_secure_sum",
    "federated_secure_sum_bitwidth",
    "federated_sum",
    "federated_weighted_mean",
    "jit_program",
    "load_computation",
    "program",
    "save_computation",
    "stream_clients",
    "to_distribute_aggregate_form",
    "to_hlo",
    "to_map_reduce_form",
    "trace",
    "write_form",
]
