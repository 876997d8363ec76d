"""FedAdam / FedYogi / FedAdagrad: first server steps in closed form, training progress."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fax_bridge.algorithms import fed_adagrad, fed_adam, fed_avg, fed_opt, fed_yogi


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


def test_fedadagrad_first_step_closed_form():
    alg = fed_adagrad(quad_loss, optax.sgd(ETA), clients=3, server_lr=0.1)
    state, _ = alg.next(alg.init(W0), DATA, MASK)
    d = mean_delta()
    # accumulator starts at 0; optax adds tau inside the square root
    np.testing.assert_allclose(state.params["w"], 0.1 * d / np.sqrt(d ** 2 + 1e-3), rtol=1e-5,
                               atol=1e-7)


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
    for make in (fed_adam, fed_yogi, fed_adagrad):
        alg = make(quad_loss, optax.sgd(ETA), clients=3, server_lr=0.3)
        step = jax.jit(alg.next)
        state = alg.init(W0)
        for _ in range(15):
            state, _ = step(state, DATA, MASK)
        assert np.linalg.norm(state.params["w"] - optimum) < 0.5 * start, make.__name__
    custom = fed_opt(quad_loss, optax.sgd(ETA), optax.sgd(1.0, momentum=0.5), clients=3)
    assert custom.placements == ("server", "clients", "clients")
