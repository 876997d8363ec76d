"""Federated Reconstruction: closed-form reconstruction and global update."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fax_bridge.algorithms import fed_reconstruction


def loss(g, l, b):
    return 0.5 * jnp.mean((b["x"] @ g["w"] + l["b"] - b["y"]) ** 2)


def problem(seed=0):
    """4 clients sharing w = (1, -1) with personal offsets b_i."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(4, 1, 6, 2)).astype(np.float32)
    offsets = np.array([-3.0, 0.0, 2.0, 5.0], np.float32)
    y = x @ np.array([1.0, -1.0], np.float32) + offsets[:, None, None]
    mask = np.ones((4, 1, 6), bool)
    mask[3, 0, 3:] = False
    return {"x": x, "y": y.astype(np.float32)}, mask, offsets


def make(eta=0.2):
    return fed_reconstruction(loss, {"b": jnp.zeros(())}, clients=4,
                              client_optimizer=optax.sgd(eta),
                              reconstruction_optimizer=optax.sgd(1.0))


def test_reconstruction_closed_form():
    data, mask, offsets = problem()
    alg = make()
    g = {"w": jnp.array([1.0, -1.0])}
    for i in range(4):
        b = {k: v[i] for k, v in data.items()}
        # one SGD step of rate 1 on a 0.5 * mean square in b lands on the mean residual
        np.testing.assert_allclose(alg.reconstruct(g, b, mask[i])["b"], offsets[i], atol=1e-5)


def test_round_matches_closed_form_and_only_globals_are_aggregated():
    data, mask, _ = problem()
    eta = 0.2
    alg = make(eta)
    w0 = np.array([0.3, 0.1], np.float32)
    state, _ = jax.jit(alg.next)(alg.init({"w": jnp.asarray(w0)}), data, mask, data, mask)
    assert set(state.params) == {"w"}
    new, counts = [], []
    for i in range(4):
        m = mask[i, 0]
        x, y = data["x"][i, 0][m], data["y"][i, 0][m]
        b = (y - x @ w0).mean()
        r = x @ w0 + b - y
        new.append(w0 - eta * (r[:, None] * x).mean(0))
        counts.append(m.sum())
    expect = sum(c * w for c, w in zip(counts, new)) / sum(counts)
    np.testing.assert_allclose(state.params["w"], expect, rtol=1e-5, atol=1e-6)


def test_evaluation_loss_falls_with_training():
    data, mask, _ = problem()
    alg = make(0.5)
    state = alg.init({"w": jnp.zeros(2)})
    step, evaluate = jax.jit(alg.next), jax.jit(alg.evaluate)
    before = float(evaluate(state.params, data, mask, data, mask))
    for _ in range(15):
        state, _ = step(state, data, mask, data, mask)
    after = float(evaluate(state.params, data, mask, data, mask))
    assert after < 0.1 * before
    assert np.linalg.norm(state.params["w"] - np.array([1.0, -1.0])) < 0.3
