"""Pieces every algorithm shares: masked losses, local training loops, server steps.

Conventions. A user model is a loss `loss(params, batch) -> scalar`, the mean of a
per-example loss over the leading axis of every leaf of `batch`. A client's data is a
pytree whose leaves have leading axes `mask.shape` (e.g. `(steps, batch)` from
`fax_bridge.data.to_batches`); `mask` is True on real examples. Padded examples are
excluded by evaluating the loss one example at a time (a batch of one) and averaging
with the mask, so any batch-mean loss works unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import math

import jax
import jax.numpy as jnp
import optax

from fax_bridge.errors import ArgumentError, HyperparameterError
from fax_bridge.local.execution import ClientsPerStep  # noqa: F401 (the builders' option)

Loss = Callable[[Any, Any], jax.Array]


class ServerState(NamedTuple):
    """Global model, the server optimizer's state and the number of finished rounds."""

    params: Any
    opt_state: Any
    round: jax.Array


class FederatedAlgorithm(NamedTuple):
    """`init(params) -> state`; `next(state, *data) -> (state, metrics)`, a program.

    `placements` is the placement prefix of `next`'s arguments ('server' / 'clients'
    per argument), as `fax_bridge.export_tff` and `check_parity` take it.
    """

    init: Callable
    next: Callable
    placements: tuple


def named(alg: FederatedAlgorithm, builder: str) -> FederatedAlgorithm:
    """`alg`, its round's function named for the `builder` that made it (`fed_adam`'s
    round is `fed_adam.next_fn`, not the `fed_avg.next_fn` it builds on), as errors and
    logs name a round."""
    fn = getattr(alg.next, "fn", alg.next)
    fn.__qualname__ = f"{builder}.{getattr(fn, '__name__', 'next_fn')}"
    return alg


def check_loss(loss: Any, name: str = "loss") -> Loss:
    if not callable(loss):
        raise ArgumentError(
            f"{name} must be a function loss(params, batch) -> scalar, got {type(loss).__name__}.")
    return loss


def check_count(value: Any, name: str, minimum: int = 1, what: str = "") -> int:
    """`value` as an int >= `minimum`, else HyperparameterError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise HyperparameterError(
            f"{name} must be an int >= {minimum}{what}, got {value!r}.")
    return value


def check_clients(clients: Any) -> int:
    return check_count(clients, "clients", what=" (the cohort size)")


def check_real(value: Any, name: str, low: float | None = None, high: float | None = None, *,
               low_open: bool = False, high_open: bool = False) -> float:
    """`value` as a finite float in the given range, else HyperparameterError."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    ok = ok and math.isfinite(float(value))
    if ok and low is not None:
        ok = float(value) > low if low_open else float(value) >= low
    if ok and high is not None:
        ok = float(value) < high if high_open else float(value) <= high
    if not ok:
        lo = "" if low is None else f"{'(' if low_open else '['}{low}"
        hi = "" if high is None else f"{high}{')' if high_open else ']'}"
        where = f"in {lo or '(-inf'}, {hi or 'inf)'}"
        raise HyperparameterError(f"{name} must be a finite number {where}, got {value!r}.")
    return float(value)


def check_optimizer(opt: Any, name: str) -> optax.GradientTransformation:
    if not (hasattr(opt, "init") and hasattr(opt, "update")):
        raise ArgumentError(
            f"{name} must be an optax GradientTransformation (e.g. optax.sgd(0.1)), got "
            f"{type(opt).__name__}.")
    return opt


def per_example_losses(loss: Loss, params, batch, mask) -> jax.Array:
    """The loss of every example, shape `mask.shape`."""
    lead = mask.shape
    n = int(mask.size)
    flat = jax.tree.map(lambda a: a.reshape((n, 1) + a.shape[len(lead):]), batch)
    per = jax.vmap(lambda ex: loss(params, ex))(flat)
    return per.reshape(lead)


def masked_loss(loss: Loss, params, batch, mask) -> jax.Array:
    """Mean loss over the real examples of `batch` (0 when there are none)."""
    m = mask.astype(jnp.float32)
    per = per_example_losses(loss, params, batch, mask)
    return jnp.sum(per * m) / jnp.maximum(jnp.sum(m), 1.0)


def example_count(mask) -> jax.Array:
    """Number of real examples as float32 (the aggregation weight of a client)."""
    return jnp.sum(mask.astype(jnp.float32))


def local_train(loss: Loss, optimizer: optax.GradientTransformation, params, opt_state,
                batches, mask, epochs: int = 1):
    """Runs `optimizer` over the batches (leading axis: steps) `epochs` times.

    A batch without real examples is skipped: neither the parameters nor the optimizer
    state change. Returns `(params, opt_state, mean_loss)`, `mean_loss` the
    example-weighted mean of the pre-step batch losses.
    """
    grad_fn = jax.value_and_grad(lambda p, b, m: masked_loss(loss, p, b, m))

    def step(carry, xs):
        p, s, total, count = carry
        b, m = xs
        value, g = grad_fn(p, b, m)
        updates, s_new = optimizer.update(g, s, p)
        p_new = optax.apply_updates(p, updates)
        has = jnp.any(m)
        p = jax.tree.map(lambda a, b_: jnp.where(has, a, b_), p_new, p)
        s = jax.tree.map(lambda a, b_: jnp.where(has, a, b_), s_new, s)
        k = example_count(m)
        return (p, s, total + value * k, count + k), None

    def epoch(carry, _):
        carry, _ = jax.lax.scan(step, carry, (batches, mask))
        return carry, None

    init = (params, opt_state, jnp.float32(0.0), jnp.float32(0.0))
    (params, opt_state, total, count), _ = jax.lax.scan(epoch, init, None, length=epochs)
    return params, opt_state, total / jnp.maximum(count, 1.0)


def tree_sub(a, b):
    return jax.tree.map(jnp.subtract, a, b)


def server_step(optimizer: optax.GradientTransformation):
    """`(params, opt_state, round, delta) -> ServerState`: `-delta` is the pseudo-gradient."""

    def apply(params, opt_state, round_, delta):
        grads = jax.tree.map(jnp.negative, delta)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return ServerState(optax.apply_updates(params, updates), opt_state, round_ + 1)

    return apply


def init_server_state(optimizer: optax.GradientTransformation) -> Callable:
    def init(params) -> ServerState:
        params = jax.tree.map(jnp.asarray, params)
        return ServerState(params, optimizer.init(params), jnp.zeros((), jnp.int32))

    return init


def tree_add(a, b):
    return jax.tree.map(jnp.add, a, b)
