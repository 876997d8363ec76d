"""FedAdam / FedYogi / FedAdagrad: Algorithm 2 of Reddi et al. in numpy, optax variants,
training progress."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fax_bridge.algorithms import fed_adagrad, fed_adam, fed_avg, fed_opt, fed_yogi
from fax_bridge.algorithms.fedopt import reddi_server_optimizer


def quad_loss(p, b):
    return 0.5 * jnp.mean(jnp.sum((p["w"] - b["t"]) ** 2, axis=-1))


C = np.array([[1.0, -1.0, 0.0], [3.0, 0.0, 0.001], [-2.0, 2.0, 0.0]], np.float32)
DATA = {"t": np.broadcast_to(C[:, None, None, :], (3, 1, 2, 3)).copy()}
MASK = np.ones((3, 1, 2), bool)
W0 = {"w": jnp.zeros(3)}
ETA = 0.5


def mean_delta():
    """The averaged client change after one local step (FedAvg's delta)."""
    return ETA * (C.mean(0) - 0.0)


def test_fedadam_first_step_closed_form():
    alg = fed_adam(quad_loss, optax.sgd(ETA), clients=3, server_lr=0.1)
    state, _ = alg.next(alg.init(W0), DATA, MASK)
    d = mean_delta()
    # first Adam step with bias correction: lr * g / (|g| + tau), g = -delta
    np.testing.assert_allclose(state.params["w"], 0.1 * d / (np.abs(d) + 1e-3), rtol=1e-5,
                               atol=1e-7)


def algorithm2_reference(kind, rounds, lr, b1=0.9, b2=0.99, tau=1e-3):
    """Reddi et al. 2021, Algorithm 2, in numpy (float64), on this quadratic problem.

    Each client takes one SGD step of size ETA on 0.5 |x - c_i|^2, so its change is
    ETA (c_i - x); all clients hold 2 examples, so the average is unweighted.
    """
    x = np.zeros(3)
    m, v = np.zeros(3), np.full(3, tau ** 2)
    for _ in range(rounds):
        delta = np.mean(ETA * (C.astype(np.float64) - x), axis=0)
        m = b1 * m + (1 - b1) * delta
        if kind == "adagrad":
            v = v + delta ** 2
        elif kind == "yogi":
            v = v - (1 - b2) * delta ** 2 * np.sign(v - delta ** 2)
        else:
            v = b2 * v + (1 - b2) * delta ** 2
        x = x + lr * m / (np.sqrt(v) + tau)
    return x


@pytest.mark.parametrize("rounds", [1, 4])
@pytest.mark.parametrize("kind", ["adagrad", "adam", "yogi"])
def test_paper_exact_rounds_match_algorithm2_in_numpy(kind, rounds):
    if kind == "adagrad":
        alg = fed_adagrad(quad_loss, optax.sgd(ETA), clients=3, server_lr=0.1)
    else:
        make = fed_adam if kind == "adam" else fed_yogi
        alg = make(quad_loss, optax.sgd(ETA), clients=3, server_lr=0.1, paper_exact=True)
    step = jax.jit(alg.next)
    state = alg.init(W0)
    for _ in range(rounds):
        state, _ = step(state, DATA, MASK)
    np.testing.assert_allclose(state.params["w"], algorithm2_reference(kind, rounds, 0.1),
                               rtol=2e-5, atol=1e-6)


def test_fedadagrad_keeps_tau_outside_the_root():
    # the first step is lr * 0.1 d / (sqrt(tau^2 + d^2) + tau), not lr * d / sqrt(d^2 + tau)
    alg = fed_adagrad(quad_loss, optax.sgd(ETA), clients=3, server_lr=0.1, b1=0.0, tau=0.1)
    state, _ = alg.next(alg.init(W0), DATA, MASK)
    d = mean_delta()
    np.testing.assert_allclose(state.params["w"], 0.1 * d / (np.sqrt(0.01 + d ** 2) + 0.1),
                               rtol=1e-5, atol=1e-7)


def test_server_optimizer_arguments_are_checked():
    with pytest.raises(ValueError, match="kind"):
        reddi_server_optimizer("sgd", 0.1)
    with pytest.raises(ValueError, match="tau"):
        fed_adagrad(quad_loss, optax.sgd(ETA), clients=3, tau=0.0)
    with pytest.raises(ValueError, match="b1"):
        fed_yogi(quad_loss, optax.sgd(ETA), clients=3, b1=1.0, paper_exact=True)


def test_fedyogi_is_optax_yogi_on_the_negated_average_change():
    alg = fed_yogi(quad_loss, optax.sgd(ETA), clients=3, server_lr=0.1)
    state = alg.init(W0)
    ref_opt = optax.yogi(0.1, b1=0.9, b2=0.99, eps=1e-3)
    ref_params, ref_state = W0, ref_opt.init(W0)
    avg = fed_avg(quad_loss, optax.sgd(ETA), clients=3)
    for _ in range(3):
        delta = avg.next(avg.init(ref_params), DATA, MASK)[0].params["w"] - ref_params["w"]
        upd, ref_state = ref_opt.update({"w": -delta}, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, upd)
        state, _ = alg.next(state, DATA, MASK)
    np.testing.assert_allclose(state.params["w"], ref_params["w"], rtol=1e-5, atol=1e-7)


def test_every_server_optimizer_approaches_the_optimum():
    optimum = C.mean(0)              # the minimiser of the federated loss
    start = np.linalg.norm(optimum)
    for make, exact in ((fed_adam, False), (fed_yogi, False), (fed_adam, True),
                        (fed_yogi, True), (fed_adagrad, None)):
        kw = {} if exact is None else {"paper_exact": exact}
        alg = make(quad_loss, optax.sgd(ETA), clients=3, server_lr=0.3, **kw)
        step = jax.jit(alg.next)
        state = alg.init(W0)
        for _ in range(15):
            state, _ = step(state, DATA, MASK)
        assert np.linalg.norm(state.params["w"] - optimum) < 0.5 * start, (make.__name__, exact)
    custom = fed_opt(quad_loss, optax.sgd(ETA), optax.sgd(1.0, momentum=0.5), clients=3)
    assert custom.placements == ("server", "clients", "clients")
