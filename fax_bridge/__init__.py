"""fax_bridge: federated computations in JAX, run locally or exported to TFF.

Write a program once with the FAX building blocks, run it with `jit` on accelerators
(CLIENTS values sharded over a `clients` mesh axis), export it as a TFF building-block
proto, and run that proto on a simulated device fleet.
"""

from fax_bridge.api import (
    Program,
    federated_broadcast,
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
)
from fax_bridge.fleet.launcher import LocalFleet
from fax_bridge.local import clients_mesh, jit_program, to_hlo
from fax_bridge.parity import ParityReport, check_parity
from fax_bridge.placements import Placement
from fax_bridge.tff.export import export_tff, load_computation, save_computation
from fax_bridge.tracing import FederatedComputation, trace

__version__ = "0.1.0"

__all__ = [
    "ComputationError",
    "ExportError",
    "FederatedComputation",
    "FaxBridgeError",
    "FleetError",
    "LocalFleet",
    "ParityReport",
    "Placement",
    "PlacementError",
    "Program",
    "check_parity",
    "clients_mesh",
    "export_tff",
    "federated_broadcast",
    "federated_map_clients",
    "federated_map_server",
    "federated_mean",
    "federated_sum",
    "federated_weighted_mean",
    "jit_program",
    "load_computation",
    "program",
    "save_computation",
    "to_hlo",
    "trace",
]
