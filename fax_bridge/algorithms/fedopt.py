"""Adaptive server optimizers for federated learning (Reddi et al., 2021).

FedAdam, FedYogi and FedAdagrad are FedAvg whose server treats the averaged client
change as a negative pseudo-gradient and steps with Adam, Yogi or Adagrad. Defaults
follow the paper: beta1 0.9, beta2 0.99 and adaptivity tau 1e-3, passed to optax as
`eps` (Adagrad's accumulator starts at 0).
"""

from __future__ import annotations

import optax

from fax_bridge.algorithms import common as C
from fax_bridge.algorithms.fedavg import fed_avg

DEFAULT_B1 = 0.9
DEFAULT_B2 = 0.99
DEFAULT_TAU = 1e-3


def fed_opt(loss: C.Loss, client_optimizer: optax.GradientTransformation,
            server_optimizer: optax.GradientTransformation, *, clients: int,
            local_epochs: int = 1) -> C.FederatedAlgorithm:
    """FedAvg with an arbitrary optax server optimizer."""
    return fed_avg(loss, client_optimizer, clients=clients,
                   server_optimizer=server_optimizer, local_epochs=local_epochs)


def fed_adam(loss: C.Loss, client_optimizer: optax.GradientTransformation, *, clients: int,
             server_lr: float = 1e-2, b1: float = DEFAULT_B1, b2: float = DEFAULT_B2,
             tau: float = DEFAULT_TAU, local_epochs: int = 1) -> C.FederatedAlgorithm:
    """FedAdam: server Adam on the averaged client change."""
    return fed_opt(loss, client_optimizer, optax.adam(server_lr, b1=b1, b2=b2, eps=tau),
                   clients=clients, local_epochs=local_epochs)


def fed_yogi(loss: C.Loss, client_optimizer: optax.GradientTransformation, *, clients: int,
             server_lr: float = 1e-2, b1: float = DEFAULT_B1, b2: float = DEFAULT_B2,
             tau: float = DEFAULT_TAU, local_epochs: int = 1) -> C.FederatedAlgorithm:
    """FedYogi: server Yogi (additive second-moment update) on the averaged change."""
    return fed_opt(loss, client_optimizer, optax.yogi(server_lr, b1=b1, b2=b2, eps=tau),
                   clients=clients, local_epochs=local_epochs)


def fed_adagrad(loss: C.Loss, client_optimizer: optax.GradientTransformation, *,
                clients: int, server_lr: float = 1e-2, tau: float = DEFAULT_TAU,
                local_epochs: int = 1) -> C.FederatedAlgorithm:
    """FedAdagrad: server Adagrad on the averaged client change."""
    opt = optax.adagrad(server_lr, initial_accumulator_value=0.0, eps=tau)
    return fed_opt(loss, client_optimizer, opt, clients=clients, local_epochs=local_epochs)
