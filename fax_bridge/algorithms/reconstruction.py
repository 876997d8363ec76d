"""Federated Reconstruction (Singhal et al., 2021): partially local models.

The model has global parameters, trained federatedly, and local parameters that never
leave a client and are not even stored: at every round each client starts its local
parameters from `local_init`, reconstructs them with the global ones frozen (a few
optax steps on its reconstruction batches), then trains the global parameters with the
local ones frozen on its training batches and sends back only the change of the global
ones. The server aggregates those changes weighted by example counts. Evaluation
reconstructs the same way and measures the loss on held-out batches.

The user loss takes both parts: `loss(global_params, local_params, batch) -> scalar`.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from fax_bridge import api as fx
from fax_bridge.algorithms import common as C
from fax_bridge.errors import ArgumentError


class Reconstruction(NamedTuple):
    """`init(global_params)`, `next(state, recon_b, recon_m, train_b, train_m)`,
    `evaluate(global_params, recon_b, recon_m, eval_b, eval_m) -> weighted mean loss`
    (all programs but `init`), and `reconstruct(global_params, recon_b, recon_m)` for
    one client (plain JAX)."""

    init: Callable
    next: Callable
    evaluate: Callable
    reconstruct: Callable
    placements: tuple


def fed_reconstruction(loss: Callable[[Any, Any, Any], jax.Array], local_init, *,
                       clients: int, client_optimizer: optax.GradientTransformation,
                       reconstruction_optimizer: optax.GradientTransformation,
                       server_optimizer: Optional[optax.GradientTransformation] = None,
                       reconstruction_epochs: int = 1,
                       local_epochs: int = 1,
                       clients_per_step: C.ClientsPerStep = None,
                       progress: bool = False) -> Reconstruction:
    """Federated Reconstruction with local parameters started at `local_init`."""
    if not callable(loss):
        raise ArgumentError("loss must be a function loss(global_params, local_params, batch).")
    n = C.check_clients(clients)
    C.check_count(reconstruction_epochs, "reconstruction_epochs")
    C.check_count(local_epochs, "local_epochs")
    client_optimizer = C.check_optimizer(client_optimizer, "client_optimizer")
    recon_opt = C.check_optimizer(reconstruction_optimizer, "reconstruction_optimizer")
    server_optimizer = C.check_optimizer(
        optax.sgd(1.0) if server_optimizer is None else server_optimizer, "server_optimizer")
    local_init = jax.tree.map(jnp.asarray, local_init)
    server_update = C.server_step(server_optimizer)

    def reconstruct(global_params, batches, mask):
        local_loss = lambda lp, b: loss(global_params, lp, b)  # noqa: E731
        lp, _, _ = C.local_train(local_loss, recon_opt, local_init, recon_opt.init(local_init),
                                 batches, mask, epochs=reconstruction_epochs)
        return lp

    def client_update(global_params, recon_b, recon_m, train_b, train_m):
        lp = jax.lax.stop_gradient(reconstruct(global_params, recon_b, recon_m))
        global_loss = lambda gp, b: loss(gp, lp, b)  # noqa: E731
        new_gp, _, value = C.local_train(global_loss, client_optimizer, global_params,
                                         client_optimizer.init(global_params), train_b,
                                         train_m, epochs=local_epochs)
        return C.tree_sub(new_gp, global_params), C.example_count(train_m), value

    def client_eval(global_params, recon_b, recon_m, eval_b, eval_m):
        lp = reconstruct(global_params, recon_b, recon_m)
        value = C.masked_loss(lambda gp, b: loss(gp, lp, b), global_params, eval_b, eval_m)
        return value, C.example_count(eval_m)

    @fx.program(clients=n, clients_per_step=clients_per_step, progress=progress)
    def next_fn(state: C.ServerState, recon_b, recon_m, train_b, train_m):
        params_c = fx.federated_broadcast(state.params)
        delta, counts, losses = fx.federated_map_clients(
            client_update, (params_c, recon_b, recon_m, train_b, train_m))
        mean_delta = fx.federated_weighted_mean(delta, counts)
        new_state = fx.federated_map_server(
            server_update, (state.params, state.opt_state, state.round, mean_delta))
        return new_state, {"loss": fx.federated_weighted_mean(losses, counts)}

    @fx.program(clients=n, clients_per_step=clients_per_step, progress=progress)
    def evaluate(global_params, recon_b, recon_m, eval_b, eval_m):
        params_c = fx.federated_broadcast(global_params)
        values, counts = fx.federated_map_clients(
            client_eval, (params_c, recon_b, recon_m, eval_b, eval_m))
        return fx.federated_weighted_mean(values, counts)

    return Reconstruction(C.init_server_state(server_optimizer), next_fn, evaluate,
                          reconstruct, ("server",) + ("clients",) * 4)
