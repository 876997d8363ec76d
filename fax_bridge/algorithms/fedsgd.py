"""FedSGD through federated automatic differentiation.

The federated loss program broadcasts the model, evaluates each client's mean loss over
all its examples and takes the example-weighted mean. `jax.grad` of that program is
again a federated program (the gradient of a broadcast is a sum), so the server
receives the example-weighted mean of the clients' gradients and steps with its optax
optimizer. With server SGD of rate eta this equals FedAvg with one local SGD step of
rate eta on one batch holding all of a client's data.
"""

from __future__ import annotations

from typing import Optional

import jax
import optax

from fax_bridge import api as fx
from fax_bridge.algorithms import common as C


def federated_loss(loss: C.Loss, clients: int, *,
                   clients_per_step: C.ClientsPerStep = None, progress: bool = False):
    """The program `(params, data, mask) -> weighted mean loss over every client's examples`."""
    loss = C.check_loss(loss)

    def client_loss(params, data, mask):
        return C.masked_loss(loss, params, data, mask), C.example_count(mask)

    @fx.program(clients=C.check_clients(clients), clients_per_step=clients_per_step,
                progress=progress)
    def fed_loss(params, data, mask):
        params_c = fx.federated_broadcast(params)
        losses, counts = fx.federated_map_clients(client_loss, (params_c, data, mask))
        return fx.federated_weighted_mean(losses, counts)

    return fed_loss


def fed_sgd(loss: C.Loss, *, clients: int,
            server_optimizer: Optional[optax.GradientTransformation] = None,
            learning_rate: float = 0.1,
            clients_per_step: C.ClientsPerStep = None,
            progress: bool = False) -> C.FederatedAlgorithm:
    """FedSGD; the server optimizer defaults to `optax.sgd(learning_rate)`.

    `next(state, data, mask)`: CLIENTS data whose leaves lead with `mask.shape`
    (any layout: `(clients, size)` or `(clients, steps, batch)`); every real example of
    a client counts once. Metrics: `loss`, the federated loss before the step.
    """
    server_optimizer = C.check_optimizer(
        optax.sgd(learning_rate) if server_optimizer is None else server_optimizer,
        "server_optimizer")
    fed_loss = federated_loss(loss, clients)

    def server_update(params, opt_state, round_, grads):
        updates, opt_state = server_optimizer.update(grads, opt_state, params)
        return C.ServerState(optax.apply_updates(params, updates), opt_state, round_ + 1)

    @fx.program(clients=clients, clients_per_step=clients_per_step, progress=progress)
    def next_fn(state: C.ServerState, data, mask):
        value, grads = jax.value_and_grad(fed_loss)(state.params, data, mask)
        new_state = fx.federated_map_server(
            server_update, (state.params, state.opt_state, state.round, grads))
        return new_state, {"loss": value}

    return C.FederatedAlgorithm(C.init_server_state(server_optimizer), next_fn,
                                ("server", "clients", "clients"))
