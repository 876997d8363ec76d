"""Federated Averaging (McMahan et al., 2017), generalised to any optax server optimizer.

Each round the server broadcasts the model; every client runs its optax optimizer over
its local batches and returns the change of its parameters; the server averages the
changes weighted by the clients' example counts (`federated_weighted_mean`) and applies
the average as a negative pseudo-gradient with its own optimizer (plain FedAvg is server
SGD with learning rate 1).
"""

from __future__ import annotations

from typing import Optional

import optax

from fax_bridge import api as fx
from fax_bridge.algorithms import common as C


def client_update_fn(loss: C.Loss, client_optimizer: optax.GradientTransformation,
                     local_epochs: int = 1):
    """`(params, batches, mask) -> (delta, num_examples, mean_loss)` for one client."""
    local_epochs = C.check_count(local_epochs, "local_epochs")

    def client_update(params, batches, mask):
        new_params, _, value = C.local_train(loss, client_optimizer, params,
                                             client_optimizer.init(params), batches, mask,
                                             epochs=local_epochs)
        return C.tree_sub(new_params, params), C.example_count(mask), value

    return client_update


def fed_avg(loss: C.Loss, client_optimizer: optax.GradientTransformation, *, clients: int,
            server_optimizer: Optional[optax.GradientTransformation] = None,
            local_epochs: int = 1,
            clients_per_step: C.ClientsPerStep = None,
            progress: bool = False) -> C.FederatedAlgorithm:
    """FedAvg over cohorts of `clients` clients.

    `next(state, batches, mask)`: `batches` is a CLIENTS pytree with leaves of shape
    `(clients, steps, batch, ...)`, `mask` `(clients, steps, batch)` (see
    `fax_bridge.data.to_batches`). Metrics: `loss`, the example-weighted mean local
    training loss.
    """
    loss = C.check_loss(loss)
    n = C.check_clients(clients)
    client_optimizer = C.check_optimizer(client_optimizer, "client_optimizer")
    server_optimizer = C.check_optimizer(
        optax.sgd(1.0) if server_optimizer is None else server_optimizer, "server_optimizer")
    client_update = client_update_fn(loss, client_optimizer, local_epochs)
    server_update = C.server_step(server_optimizer)

    @fx.program(clients=n, clients_per_step=clients_per_step, progress=progress)
    def next_fn(state: C.ServerState, batches, mask):
        params_c = fx.federated_broadcast(state.params)
        delta, counts, losses = fx.federated_map_clients(client_update,
                                                         (params_c, batches, mask))
        mean_delta = fx.federated_weighted_mean(delta, counts)
        new_state = fx.federated_map_server(
            server_update, (state.params, state.opt_state, state.round, mean_delta))
        return new_state, {"loss": fx.federated_weighted_mean(losses, counts)}

    return C.FederatedAlgorithm(C.init_server_state(server_optimizer), next_fn,
                                ("server", "clients", "clients"))
