"""Federated algorithms written once with the federated primitives.

Each constructor takes a user model (a loss `loss(params, batch) -> scalar` and, through
`init`, a parameter pytree) and optax optimizers, and returns a small named tuple of
programs, optax style: `init(params) -> state` and `next(state, ...) -> (state, metrics)`.
Every constructor also takes `clients_per_step=` and `progress=`, which it passes to each
program it builds (`fax_bridge.program`'s options: how jit runs the cohort).
"""

from fax_bridge.algorithms.common import FederatedAlgorithm, ServerState
from fax_bridge.algorithms.fedavg import fed_avg
from fax_bridge.algorithms.fedsgd import fed_sgd, federated_loss
from fax_bridge.algorithms.fedopt import (
    fed_adagrad, fed_adam, fed_opt, fed_yogi, reddi_server_optimizer)
from fax_bridge.algorithms.learned import learned_client_weights, learned_server_lr
from fax_bridge.algorithms.diloco import (
    DiLoCoState, StreamingDiLoCo, diloco, quantize_e3m0, streaming_diloco)
from fax_bridge.algorithms.fedfish import fed_fish, fisher_diagonal
from fax_bridge.algorithms.reconstruction import Reconstruction, fed_reconstruction
from fax_bridge.algorithms.one_trip import (
    OneTripLRState, fed_sgd_one_trip, learned_server_lr_one_trip)
from fax_bridge.algorithms.dp_fedavg import DPServerState, dp_fed_avg
from fax_bridge.algorithms.evaluation import accuracy, federated_evaluation

__all__ = [
    "DPServerState", "DiLoCoState", "FederatedAlgorithm", "OneTripLRState", "Reconstruction",
    "ServerState", "StreamingDiLoCo", "accuracy", "diloco", "dp_fed_avg", "fed_adagrad",
    "fed_adam", "fed_avg", "fed_fish", "fed_opt", "fed_reconstruction", "fed_sgd",
    "fed_sgd_one_trip", "fed_yogi", "federated_evaluation", "federated_loss",
    "fisher_diagonal",
    "learned_client_weights", "learned_server_lr", "learned_server_lr_one_trip",
    "quantize_e3m0", "reddi_server_optimizer",
    "streaming_diloco",
]
