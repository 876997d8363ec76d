"""FedFish: aggregation weighted by each client's diagonal Fisher (Dhawan et al., 2023).

FedAvg averages parameters; FedFish averages client models in function space by
weighting every parameter with how much the client's predictions depend on it. Each
client estimates the diagonal of its (empirical) Fisher information at its locally
trained model, F_i = mean over its examples of the squared per-example loss gradient,
and the server forms, per parameter,

    params_new = params + sum_i n_i (F_i + d) delta_i / sum_i n_i (F_i + d)

with d a small damping (large d recovers FedAvg). Both sums are `federated_sum`s; the
division and the optional optax server step run at the server.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import optax

from fax_bridge import api as fx
from fax_bridge.algorithms import common as C


def fisher_diagonal(loss: C.Loss, params, batch, mask):
    """Empirical diagonal Fisher: mean over real examples of squared per-example gradients."""
    lead = mask.shape
    n = int(mask.size)
    flat = jax.tree.map(lambda a: a.reshape((n, 1) + a.shape[len(lead):]), batch)
    grads = jax.vmap(jax.grad(loss), in_axes=(None, 0))(params, flat)
    m = mask.reshape((n,)).astype(jnp.float32)
    count = jnp.maximum(jnp.sum(m), 1.0)
    return jax.tree.map(
        lambda g: jnp.tensordot(m, jnp.square(g), axes=(0, 0)) / count, grads)


def fed_fish(loss: C.Loss, client_optimizer: optax.GradientTransformation, *, clients: int,
             server_optimizer: Optional[optax.GradientTransformation] = None,
             local_epochs: int = 1, damping: float = 1e-6,
             clients_per_step: C.ClientsPerStep = None,
             progress: bool = False) -> C.FederatedAlgorithm:
    """FedFish; `next(state, batches, mask)` as in `fed_avg`. Metrics: `loss`."""
    loss = C.check_loss(loss)
    n = C.check_clients(clients)
    client_optimizer = C.check_optimizer(client_optimizer, "client_optimizer")
    server_optimizer = C.check_optimizer(
        optax.sgd(1.0) if server_optimizer is None else server_optimizer, "server_optimizer")
    C.check_real(damping, "damping (it keeps the weights positive)", 0.0, low_open=True)
    C.check_count(local_epochs, "local_epochs")
    server_update = C.server_step(server_optimizer)

    def client_update(params, batches, mask):
        new_params, _, value = C.local_train(loss, client_optimizer, params,
                                             client_optimizer.init(params), batches, mask,
                                             epochs=local_epochs)
        count = C.example_count(mask)
        fisher = fisher_diagonal(loss, new_params, batches, mask)
        weight = jax.tree.map(lambda f: count * (f + damping), fisher)
        delta = C.tree_sub(new_params, params)
        weighted = jax.tree.map(jnp.multiply, weight, delta)
        return weighted, weight, count, value

    def divide(num, den):
        return jax.tree.map(jnp.divide, num, den)

    @fx.program(clients=n, clients_per_step=clients_per_step, progress=progress)
    def next_fn(state: C.ServerState, batches, mask):
        params_c = fx.federated_broadcast(state.params)
        weighted, weight, counts, losses = fx.federated_map_clients(
            client_update, (params_c, batches, mask))
        delta = fx.federated_map_server(
            divide, (fx.federated_sum(weighted), fx.federated_sum(weight)))
        new_state = fx.federated_map_server(
            server_update, (state.params, state.opt_state, state.round, delta))
        return new_state, {"loss": fx.federated_weighted_mean(losses, counts)}

    return C.FederatedAlgorithm(C.init_server_state(server_optimizer), next_fn,
                                ("server", "clients", "clients"))
