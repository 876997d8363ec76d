"""FedAvg: closed form on a quadratic, masks, jit, training progress."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fax_bridge.algorithms import fed_avg


def quad_loss(p, b):
    return 0.5 * jnp.mean(jnp.sum((p["w"] - b["t"]) ** 2, axis=-1))


def quad_problem():
    """3 clients, 2 batches of 2; client i's targets are all c_i; masks differ."""
    c = np.array([[1.0, -1.0], [3.0, 0.0], [-2.0, 2.0]], np.float32)
    t = np.broadcast_to(c[:, None, None, :], (3, 2, 2, 2)).copy()
    mask = np.ones((3, 2, 2), bool)
    mask[1, 1] = False          # client 1: one real batch (its second step is skipped)
    mask[2, 0, 1] = False       # client 2: 3 examples
    return c, {"t": t}, mask


def test_one_round_matches_closed_form():
    c, data, mask = quad_problem()
    eta = 0.3
    alg = fed_avg(quad_loss, optax.sgd(eta), clients=3)
    w0 = np.array([0.5, 0.5], np.float32)
    state, metrics = alg.next(alg.init({"w": jnp.asarray(w0)}), data, mask)
    steps = mask.any(-1).sum(-1)                         # [2, 1, 2]
    deltas = (1 - (1 - eta) ** steps)[:, None] * (c - w0)
    counts = mask.sum((1, 2))
    expect = w0 + (counts[:, None] * deltas).sum(0) / counts.sum()
    np.testing.assert_allclose(state.params["w"], expect, rtol=1e-5)
    assert int(state.round) == 1
    assert np.isfinite(float(metrics["loss"]))


def test_jit_matches_eager_and_loss_decreases():
    rng = np.random.default_rng(0)
    w_true = np.array([1.0, -2.0], np.float32)
    x = rng.normal(size=(4, 3, 4, 2)).astype(np.float32)
    data = {"x": x, "y": x @ w_true}
    mask = np.ones((4, 3, 4), bool)

    def loss(p, b):
        return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)

    alg = fed_avg(loss, optax.sgd(0.05), clients=4, local_epochs=2)
    state = alg.init({"w": jnp.zeros(2)})
    eager, _ = alg.next(state, data, mask)
    step = jax.jit(alg.next)
    jitted, _ = step(state, data, mask)
    np.testing.assert_allclose(eager.params["w"], jitted.params["w"], rtol=1e-5)
    losses = []
    for _ in range(5):
        state, m = step(state, data, mask)
        losses.append(float(m["loss"]))
    assert losses[-1] < 0.5 * losses[0]


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="client_optimizer"):
        fed_avg(quad_loss, 0.1, clients=3)
    with pytest.raises(ValueError, match="clients"):
        fed_avg(quad_loss, optax.sgd(0.1), clients=0)
