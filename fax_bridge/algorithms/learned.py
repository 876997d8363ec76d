"""Learned parts of a federated round, trained by federated automatic differentiation.

`learned_server_lr`: FedAvg whose server learning rate is itself learned. After the
clients' changes are averaged, the post-round loss `L(lr) = F(params + lr * delta)` is a
federated program in `lr` (the candidate model is broadcast and evaluated on the
clients' validation data); `jax.grad` of it is the hypergradient dL/dlr. The meta
optimizer (optax) steps on log(lr), so the rate stays positive, and the round then
applies the new rate.

`learned_client_weights`: FedAvg whose aggregation weights are `n_i * exp(logit_i)`,
with one logit per client slot (CLIENTS-placed, for cross-silo cohorts that keep the
same members). The gradient of the post-round validation loss with respect to the
logits flows through `federated_weighted_mean`'s weights; a per-client optax optimizer
steps on them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fax_bridge import api as fx
from fax_bridge.algorithms import common as C
from fax_bridge.algorithms.fedavg import client_update_fn
from fax_bridge.algorithms.fedsgd import federated_loss


class LearnedLRState(NamedTuple):
    """Model, log of the server learning rate, the meta optimizer's state, rounds."""

    params: Any
    log_lr: jax.Array
    meta_state: Any
    round: jax.Array


class LearnedWeightsState(NamedTuple):
    """Model and round at the server; per-client weight logits and their optimizer state."""

    params: Any
    round: jax.Array
    logits: jax.Array
    meta_state: Any


def _axpy(params, lr, delta):
    return jax.tree.map(lambda p, d: p + lr * d, params, delta)


def learned_server_lr(loss: C.Loss, client_optimizer: optax.GradientTransformation, *,
                      clients: int, initial_lr: float = 1.0,
                      meta_optimizer: optax.GradientTransformation | None = None,
                      local_epochs: int = 1,
                      clients_per_step: C.ClientsPerStep = None,
                      progress: bool = False) -> C.FederatedAlgorithm:
    """FedAvg with a server learning rate learned from hypergradients.

    `next(state, batches, mask, val_data, val_mask)`; validation data may be the
    training batches themselves. Metrics: `loss` (local training), `post_loss` (the
    validation loss after the step with the old rate), `lr_hypergrad` (dL/dlr) and
    `lr` (the rate used this round).
    """
    C.check_real(initial_lr, "initial_lr", 0.0, low_open=True)
    meta = C.check_optimizer(optax.adam(0.05) if meta_optimizer is None else meta_optimizer,
                             "meta_optimizer")
    client_update = client_update_fn(C.check_loss(loss), client_optimizer, local_epochs)
    fed_loss = federated_loss(loss, clients)

    def init(params) -> LearnedLRState:
        params = jax.tree.map(jnp.asarray, params)
        log_lr = jnp.log(jnp.float32(initial_lr))
        return LearnedLRState(params, log_lr, meta.init(log_lr), jnp.zeros((), jnp.int32))

    def meta_step(params, log_lr, meta_state, round_, hypergrad, delta):
        lr = jnp.exp(log_lr)
        updates, meta_state = meta.update(hypergrad * lr, meta_state, log_lr)  # d/dlog(lr)
        log_lr = optax.apply_updates(log_lr, updates)
        return LearnedLRState(_axpy(params, jnp.exp(log_lr), delta), log_lr, meta_state,
                              round_ + 1)

    @fx.program(clients=C.check_clients(clients), clients_per_step=clients_per_step,
                progress=progress)
    def next_fn(state: LearnedLRState, batches, mask, val_data, val_mask):
        params_c = fx.federated_broadcast(state.params)
        delta, counts, losses = fx.federated_map_clients(client_update,
                                                         (params_c, batches, mask))
        mean_delta = fx.federated_weighted_mean(delta, counts)

        def post_round_loss(lr):
            candidate = fx.federated_map_server(_axpy, (state.params, lr, mean_delta))
            return fed_loss(candidate, val_data, val_mask)

        lr = fx.federated_map_server(jnp.exp, state.log_lr)
        post, hypergrad = jax.value_and_grad(post_round_loss)(lr)
        new_state = fx.federated_map_server(
            meta_step, (state.params, state.log_lr, state.meta_state, state.round, hypergrad,
                        mean_delta))
        metrics = {"loss": fx.federated_weighted_mean(losses, counts), "post_loss": post,
                   "lr_hypergrad": hypergrad, "lr": lr}
        return new_state, metrics

    return C.FederatedAlgorithm(init, next_fn,
                                ("server", "clients", "clients", "clients", "clients"))


def learned_client_weights(loss: C.Loss, client_optimizer: optax.GradientTransformation, *,
                           clients: int,
                           meta_optimizer: optax.GradientTransformation | None = None,
                           local_epochs: int = 1,
                           clients_per_step: C.ClientsPerStep = None,
                           progress: bool = False) -> C.FederatedAlgorithm:
    """FedAvg with learned per-client aggregation weights `n_i * exp(logit_i)`.

    `init(params)` is a program (it places zero logits at the clients).
    `next(state, batches, mask, val_data, val_mask)`; metrics: `loss`, `post_loss` and
    `weights` (the normalised aggregation weights used this round, CLIENTS).
    """
    n = C.check_clients(clients)
    meta = C.check_optimizer(optax.adam(0.1) if meta_optimizer is None else meta_optimizer,
                             "meta_optimizer")
    client_update = client_update_fn(C.check_loss(loss), client_optimizer, local_epochs)
    fed_loss = federated_loss(loss, clients)

    def weight(logit, count):
        return count * jnp.exp(logit)

    def meta_step(logit, meta_state, grad):
        updates, meta_state = meta.update(grad, meta_state, logit)
        return optax.apply_updates(logit, updates), meta_state

    @fx.program(clients=n, clients_per_step=clients_per_step, progress=progress)
    def init(params) -> LearnedWeightsState:
        params = jax.tree.map(jnp.asarray, params)
        zero = jnp.zeros((), jnp.float32)
        logits = fx.federated_broadcast(zero)
        meta_state = fx.federated_broadcast(meta.init(zero))
        return LearnedWeightsState(params, jnp.zeros((), jnp.int32), logits, meta_state)

    @fx.program(clients=n, clients_per_step=clients_per_step, progress=progress)
    def next_fn(state: LearnedWeightsState, batches, mask, val_data, val_mask):
        params_c = fx.federated_broadcast(state.params)
        delta, counts, losses = fx.federated_map_clients(client_update,
                                                         (params_c, batches, mask))

        def post_round_loss(logits):
            w = fx.federated_map_clients(weight, (logits, counts))
            mean_delta = fx.federated_weighted_mean(delta, w)
            candidate = fx.federated_map_server(C.tree_add, (state.params, mean_delta))
            return fed_loss(candidate, val_data, val_mask), mean_delta

        (post, mean_delta), grads = jax.value_and_grad(post_round_loss, has_aux=True)(
            state.logits)
        logits, meta_state = fx.federated_map_clients(
            meta_step, (state.logits, state.meta_state, grads))
        params = fx.federated_map_server(C.tree_add, (state.params, mean_delta))
        w = fx.federated_map_clients(weight, (state.logits, counts))
        total = fx.federated_broadcast(fx.federated_sum(w))
        metrics = {"loss": fx.federated_weighted_mean(losses, counts), "post_loss": post,
                   "weights": fx.federated_map_clients(jnp.divide, (w, total))}
        return LearnedWeightsState(params, state.round + 1, logits, meta_state), metrics

    placements = (LearnedWeightsState("server", "server", "clients", "clients"),
                  "clients", "clients", "clients", "clients")
    return C.FederatedAlgorithm(init, next_fn, placements)
