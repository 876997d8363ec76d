"""One-trip forms of FedSGD and the learned server learning rate.

A production form (TFF's MapReduceForm / DistributeAggregateForm) has one broadcast
before one aggregation. `fed_sgd` and `learned_server_lr` take a second trip: federated
AD sends the aggregate's cotangent (the normaliser of the weighted mean) back to the
clients, and the learned rate evaluates a candidate model built from the round's
aggregate on the clients. The variants here compute the same quantities in one trip:

- `fed_sgd_one_trip`: each client differentiates its own mean loss and the server takes
  the example-weighted mean of the gradients. That is exactly the gradient of the
  federated loss (the weights do not depend on the model), so a round equals `fed_sgd`'s.
- `learned_server_lr_one_trip`: the hypergradient of the rate used in round t,
  dL/dlr = <grad F(params_{t+1}), delta_t>, needs the clients to see params_{t+1}; that
  model is what round t+1 broadcasts anyway. So the state carries the last averaged
  change `prev_delta`, round t+1 broadcasts it with the model, every client returns the
  directional derivative of its validation loss along it, and the server steps the rate
  with that (one round late: hypergradient descent, Baydin et al. 2018) before applying
  this round's change.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from fax_bridge import api as fx
from fax_bridge.algorithms import common as C
from fax_bridge.algorithms.fedavg import client_update_fn
from fax_bridge.errors import HyperparameterError


def fed_sgd_one_trip(loss: C.Loss, *, clients: int,
                     server_optimizer: Optional[optax.GradientTransformation] = None,
                     learning_rate: float = 0.1,
                     clients_per_step: C.ClientsPerStep = None,
                     progress: bool = False) -> C.FederatedAlgorithm:
    """FedSGD in one broadcast and one aggregation; the same rounds as `fed_sgd`.

    `next(state, data, mask)` and the metrics (`loss`, before the step) are `fed_sgd`'s.
    """
    loss = C.check_loss(loss)
    server_optimizer = C.check_optimizer(
        optax.sgd(learning_rate) if server_optimizer is None else server_optimizer,
        "server_optimizer")
    value_and_grad = jax.value_and_grad(lambda p, d, m: C.masked_loss(loss, p, d, m))

    def client_grad(params, data, mask):
        value, grads = value_and_grad(params, data, mask)
        return value, grads, C.example_count(mask)

    def server_update(params, opt_state, round_, grads):
        updates, opt_state = server_optimizer.update(grads, opt_state, params)
        return C.ServerState(optax.apply_updates(params, updates), opt_state, round_ + 1)

    @fx.program(clients=C.check_clients(clients), clients_per_step=clients_per_step,
                progress=progress)
    def next_fn(state: C.ServerState, data, mask):
        params_c = fx.federated_broadcast(state.params)
        values, grads, counts = fx.federated_map_clients(client_grad, (params_c, data, mask))
        mean_grads = fx.federated_weighted_mean(grads, counts)
        new_state = fx.federated_map_server(
            server_update, (state.params, state.opt_state, state.round, mean_grads))
        return new_state, {"loss": fx.federated_weighted_mean(values, counts)}

    return C.FederatedAlgorithm(C.init_server_state(server_optimizer), next_fn,
                                ("server", "clients", "clients"))


class OneTripLRState(NamedTuple):
    """`LearnedLRState` plus the last round's averaged change (zeros before round 1)."""

    params: Any
    log_lr: jax.Array
    meta_state: Any
    round: jax.Array
    prev_delta: Any


def learned_server_lr_one_trip(loss: C.Loss, client_optimizer: optax.GradientTransformation,
                               *, clients: int, initial_lr: float = 1.0,
                               meta_optimizer: Optional[optax.GradientTransformation] = None,
                               local_epochs: int = 1,
                               clients_per_step: C.ClientsPerStep = None,
                               progress: bool = False) -> C.FederatedAlgorithm:
    """FedAvg with a learned server rate, in one trip (see the module docstring).

    `next(state, batches, mask, val_data, val_mask)` as in `learned_server_lr`. Metrics:
    `loss` (local training), `post_loss` (validation loss of the broadcast model, i.e.
    after the previous step), `lr_hypergrad` (dL/dlr of the previous step's rate) and
    `lr` (the rate applied this round).
    """
    if not initial_lr > 0:
        raise HyperparameterError(f"initial_lr must be > 0, got {initial_lr}.")
    loss = C.check_loss(loss)
    meta = C.check_optimizer(optax.adam(0.05) if meta_optimizer is None else meta_optimizer,
                             "meta_optimizer")
    client_update = client_update_fn(loss, client_optimizer, local_epochs)

    def init(params) -> OneTripLRState:
        params = jax.tree.map(jnp.asarray, params)
        log_lr = jnp.log(jnp.float32(initial_lr))
        return OneTripLRState(params, log_lr, meta.init(log_lr), jnp.zeros((), jnp.int32),
                              jax.tree.map(jnp.zeros_like, params))

    def client_work(params, prev_delta, batches, mask, val_data, val_mask):
        delta, count, train_loss = client_update(params, batches, mask)
        post, slope = jax.jvp(lambda p: C.masked_loss(loss, p, val_data, val_mask),
                              (params,), (prev_delta,))
        return delta, count, train_loss, post, slope, C.example_count(val_mask)

    def meta_step(params, log_lr, meta_state, round_, hypergrad, delta):
        lr_used = jnp.exp(log_lr)
        updates, meta_state = meta.update(hypergrad * lr_used, meta_state, log_lr)
        log_lr = optax.apply_updates(log_lr, updates)
        new_params = jax.tree.map(lambda p, d: p + jnp.exp(log_lr) * d, params, delta)
        return OneTripLRState(new_params, log_lr, meta_state, round_ + 1, delta)

    @fx.program(clients=C.check_clients(clients), clients_per_step=clients_per_step,
                progress=progress)
    def next_fn(state: OneTripLRState, batches, mask, val_data, val_mask):
        params_c = fx.federated_broadcast(state.params)
        prev_c = fx.federated_broadcast(state.prev_delta)
        delta, counts, losses, post, slopes, val_counts = fx.federated_map_clients(
            client_work, (params_c, prev_c, batches, mask, val_data, val_mask))
        mean_delta = fx.federated_weighted_mean(delta, counts)
        hypergrad = fx.federated_weighted_mean(slopes, val_counts)
        new_state = fx.federated_map_server(
            meta_step, (state.params, state.log_lr, state.meta_state, state.round,
                        hypergrad, mean_delta))
        metrics = {"loss": fx.federated_weighted_mean(losses, counts),
                   "post_loss": fx.federated_weighted_mean(post, val_counts),
                   "lr_hypergrad": hypergrad, "lr": fx.federated_map_server(
                       jnp.exp, new_state.log_lr)}
        return new_state, metrics

    return C.FederatedAlgorithm(init, next_fn,
                                ("server", "clients", "clients", "clients", "clients"))
