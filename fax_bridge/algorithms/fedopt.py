"""Adaptive server optimizers for federated learning (Reddi et al., 2021, Algorithm 2).

FedAdam, FedYogi and FedAdagrad are FedAvg whose server treats the example-weighted
average client change Δ_t as a pseudo-gradient. Algorithm 2 of the paper, per
coordinate, starting from m_{-1} = 0 and v_{-1} = τ²:

    m_t = β1 m_{t-1} + (1 - β1) Δ_t
    v_t = v_{t-1} + Δ_t²                                   (FedAdagrad)
    v_t = v_{t-1} - (1 - β2) Δ_t² sign(v_{t-1} - Δ_t²)     (FedYogi)
    v_t = β2 v_{t-1} + (1 - β2) Δ_t²                       (FedAdam)
    x_{t+1} = x_t + η m_t / (√v_t + τ)

There is no bias correction. `reddi_server_optimizer` is that update as an optax
transformation (it receives the negated change, -Δ_t, as optax's gradient, and returns
the step above). FedAdagrad always uses it. FedAdam and FedYogi use it with
`paper_exact=True`; by default they use optax's `adam` / `yogi` with `eps = τ`, which
differ from Algorithm 2 in two ways: both bias-correct m and v (divide by 1 - β^t), and
their accumulators start at 0 (Adam) or 1e-6 (Yogi, m too) instead of τ². Defaults are
the paper's: β1 0.9, β2 0.99, τ 1e-3.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fax_bridge.algorithms import common as C
from fax_bridge.algorithms.fedavg import fed_avg
from fax_bridge.errors import HyperparameterError

DEFAULT_B1 = 0.9
DEFAULT_B2 = 0.99
DEFAULT_TAU = 1e-3
KINDS = ("adagrad", "adam", "yogi")


class ReddiState(NamedTuple):
    """First moment `m` and second moment `v` of Algorithm 2 (pytrees like the params)."""

    m: Any
    v: Any


def _check_settings(lr, b1, b2, tau) -> tuple[float, float, float, float]:
    return (C.check_real(lr, "server_lr", 0.0, low_open=True),
            C.check_real(b1, "b1", 0.0, 1.0, high_open=True),
            C.check_real(b2, "b2", 0.0, 1.0, high_open=True),
            C.check_real(tau, "tau (the adaptivity)", 0.0, low_open=True))


def reddi_server_optimizer(kind: str, learning_rate: float, *, b1: float = DEFAULT_B1,
                           b2: float = DEFAULT_B2,
                           tau: float = DEFAULT_TAU) -> optax.GradientTransformation:
    """The server update of Algorithm 2 (`kind`: 'adagrad', 'adam' or 'yogi').

    Fed the negated average change g = -Δ_t, it returns the update η m_t / (√v_t + τ) with
    m_t = β1 m_{t-1} + (1 - β1) Δ_t and v_t as in the module docstring; m starts at 0,
    v at τ². `b2` is unused by 'adagrad'.
    """
    if kind not in KINDS:
        raise HyperparameterError(f"kind must be one of {KINDS}, got {kind!r}.")
    learning_rate, b1, b2, tau = _check_settings(learning_rate, b1, b2, tau)

    def init(params) -> ReddiState:
        return ReddiState(jax.tree.map(jnp.zeros_like, params),
                          jax.tree.map(lambda p: jnp.full_like(p, tau ** 2), params))

    def second_moment(v, d2):
        if kind == "adagrad":
            return v + d2
        if kind == "yogi":
            return v - (1.0 - b2) * d2 * jnp.sign(v - d2)
        return b2 * v + (1.0 - b2) * d2

    def update(grads, state: ReddiState, params=None):
        del params
        delta = jax.tree.map(jnp.negative, grads)
        m = jax.tree.map(lambda m_, d: b1 * m_ + (1.0 - b1) * d, state.m, delta)
        v = jax.tree.map(lambda v_, d: second_moment(v_, d * d), state.v, delta)
        step = jax.tree.map(lambda m_, v_: learning_rate * m_ / (jnp.sqrt(v_) + tau), m, v)
        return step, ReddiState(m, v)

    return optax.GradientTransformation(init, update)


def fed_opt(loss: C.Loss, client_optimizer: optax.GradientTransformation,
            server_optimizer: optax.GradientTransformation, *, clients: int,
            local_epochs: int = 1,
            clients_per_step: C.ClientsPerStep = None,
            progress: bool = False) -> C.FederatedAlgorithm:
    """FedAvg with an arbitrary optax server optimizer (fed -Δ_t as its gradient)."""
    return C.named(fed_avg(loss, client_optimizer, clients=clients,
                           server_optimizer=server_optimizer, local_epochs=local_epochs,
                           clients_per_step=clients_per_step, progress=progress),
                   "fed_opt")


def fed_adam(loss: C.Loss, client_optimizer: optax.GradientTransformation, *, clients: int,
             server_lr: float = 1e-2, b1: float = DEFAULT_B1, b2: float = DEFAULT_B2,
             tau: float = DEFAULT_TAU, local_epochs: int = 1,
             paper_exact: bool = False,
             clients_per_step: C.ClientsPerStep = None,
             progress: bool = False) -> C.FederatedAlgorithm:
    """FedAdam. `paper_exact=True`: Algorithm 2 (v_{-1} = τ², no bias correction).

    Default: `optax.adam(server_lr, b1, b2, eps=tau)`, i.e. m and v start at 0 and are
    bias-corrected, step η m̂ / (√v̂ + τ).
    """
    server_lr, b1, b2, tau = _check_settings(server_lr, b1, b2, tau)
    opt = (reddi_server_optimizer("adam", server_lr, b1=b1, b2=b2, tau=tau) if paper_exact
           else optax.adam(server_lr, b1=b1, b2=b2, eps=tau))
    return C.named(fed_opt(loss, client_optimizer, opt, clients=clients,
                           local_epochs=local_epochs,
                           clients_per_step=clients_per_step, progress=progress), "fed_adam")


def fed_yogi(loss: C.Loss, client_optimizer: optax.GradientTransformation, *, clients: int,
             server_lr: float = 1e-2, b1: float = DEFAULT_B1, b2: float = DEFAULT_B2,
             tau: float = DEFAULT_TAU, local_epochs: int = 1,
             paper_exact: bool = False,
             clients_per_step: C.ClientsPerStep = None,
             progress: bool = False) -> C.FederatedAlgorithm:
    """FedYogi. `paper_exact=True`: Algorithm 2 (v_{-1} = τ², no bias correction).

    Default: `optax.yogi(server_lr, b1, b2, eps=tau)`: m and v start at 1e-6 and are
    bias-corrected, v_t = v_{t-1} - (1 - β2) g² sign(v_{t-1} - g²), step η m̂ / (√v̂ + τ).
    """
    server_lr, b1, b2, tau = _check_settings(server_lr, b1, b2, tau)
    opt = (reddi_server_optimizer("yogi", server_lr, b1=b1, b2=b2, tau=tau) if paper_exact
           else optax.yogi(server_lr, b1=b1, b2=b2, eps=tau))
    return C.named(fed_opt(loss, client_optimizer, opt, clients=clients,
                           local_epochs=local_epochs,
                           clients_per_step=clients_per_step, progress=progress), "fed_yogi")


def fed_adagrad(loss: C.Loss, client_optimizer: optax.GradientTransformation, *,
                clients: int, server_lr: float = 1e-2, b1: float = DEFAULT_B1,
                tau: float = DEFAULT_TAU, local_epochs: int = 1,
                clients_per_step: C.ClientsPerStep = None,
                progress: bool = False) -> C.FederatedAlgorithm:
    """FedAdagrad exactly as Algorithm 2: v_t = v_{t-1} + Δ_t², v_{-1} = τ², momentum β1,
    step η m_t / (√v_t + τ) (τ outside the square root, no bias correction)."""
    opt = reddi_server_optimizer("adagrad", server_lr, b1=b1, tau=tau)
    return C.named(fed_opt(loss, client_optimizer, opt, clients=clients,
                           local_epochs=local_epochs,
                           clients_per_step=clients_per_step, progress=progress), "fed_adagrad")
