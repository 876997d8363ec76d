"""Learned server learning rate and client weights through federated AD."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fax_bridge.algorithms import learned_client_weights, learned_server_lr


def quad_loss(p, b):
    return 0.5 * jnp.mean(jnp.sum((p["w"] - b["t"]) ** 2, axis=-1))


def targets(c, steps=1, batch=2):
    c = np.asarray(c, np.float32)
    return {"t": np.broadcast_to(c[:, None, None, :], (len(c), steps, batch, c.shape[1])).copy()}


def test_lr_hypergradient_closed_form():
    c = np.array([[1.0, 0.0], [0.0, 2.0], [-1.0, 1.0]], np.float32)
    data, eta = targets(c), 0.4
    mask = np.ones((3, 1, 2), bool)
    mask[2, 0, 1] = False
    w0 = np.array([0.5, -0.5], np.float32)
    alg = learned_server_lr(quad_loss, optax.sgd(eta), clients=3, initial_lr=1.0)
    _, m = jax.jit(alg.next)(alg.init({"w": jnp.asarray(w0)}), data, mask, data, mask)
    n = mask.sum((1, 2))
    c_bar = (n[:, None] * c).sum(0) / n.sum()
    delta = eta * (c_bar - w0)                          # weighted mean client change
    # L(s) = sum_i n_i/2 |w0 + s delta - c_i|^2 / sum n  =>  dL/ds at s = 1:
    expect = float(np.dot(w0 + delta - c_bar, delta))
    np.testing.assert_allclose(float(m["lr_hypergrad"]), expect, rtol=1e-4, atol=1e-7)
    assert float(m["lr"]) == 1.0


def test_lr_grows_when_the_step_is_too_short():
    c = np.array([[4.0, 4.0], [4.0, 4.0]], np.float32)
    data, mask = targets(c), np.ones((2, 1, 2), bool)
    alg = learned_server_lr(quad_loss, optax.sgd(0.1), clients=2, initial_lr=0.5,
                            meta_optimizer=optax.sgd(0.05))
    step = jax.jit(alg.next)
    state = alg.init({"w": jnp.zeros(2)})
    lrs = []
    for _ in range(4):
        state, m = step(state, data, mask, data, mask)
        assert float(m["lr_hypergrad"]) < 0       # a longer step lowers the loss
        lrs.append(float(m["lr"]))
    assert lrs == sorted(lrs) and lrs[-1] > lrs[0]


def test_client_weight_gradient_matches_plain_jax_reference():
    c = np.array([[1.0, 0.0], [0.0, 2.0], [5.0, -5.0]], np.float32)
    data, mask, eta = targets(c), np.ones((3, 1, 2), bool), 0.5
    val = targets(np.zeros((3, 2), np.float32) + np.array([0.5, 1.0], np.float32))
    alg = learned_client_weights(quad_loss, optax.sgd(eta), clients=3,
                                 meta_optimizer=optax.sgd(1.0))
    w0 = jnp.array([0.0, 0.0])
    state = alg.init({"w": w0})
    new, m = jax.jit(alg.next)(state, data, mask, val, mask)

    def reference(logits):
        deltas = eta * (jnp.asarray(c) - w0)
        w = 2.0 * jnp.exp(logits)
        w_new = w0 + (w[:, None] * deltas).sum(0) / w.sum()
        return 0.5 * jnp.sum((w_new - jnp.array([0.5, 1.0])) ** 2)

    grad = jax.grad(reference)(jnp.zeros(3))
    np.testing.assert_allclose(new.logits, -grad, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(m["weights"], np.full(3, 1 / 3), rtol=1e-6)


def test_outlier_client_is_down_weighted():
    c = np.array([[1.0, 1.0], [1.2, 0.8], [0.9, 1.1], [-6.0, 8.0]], np.float32)
    data, mask = targets(c), np.ones((4, 1, 2), bool)
    val = targets(np.ones((4, 2), np.float32))
    alg = learned_client_weights(quad_loss, optax.sgd(0.5), clients=4)
    step = jax.jit(alg.next)
    state = alg.init({"w": jnp.zeros(2)})
    for _ in range(8):
        state, m = step(state, data, mask, val, mask)
    weights = np.asarray(m["weights"])
    assert weights.argmin() == 3 and weights[3] < 0.5 * weights[:3].min()
    assert alg.placements[0].logits == "clients"


def test_client_weights_round_matches_the_equations_in_numpy():
    """One round in numpy: client changes d_i = eta (c_i - w0); weights a = softmax of
    log(n_i) + logits; w1 = w0 + sum_i a_i d_i; validation loss 0.5 |w1 - v|^2 has
    dL/dlogit_j = (w1 - v) . a_j (d_j - sum_i a_i d_i); meta SGD(1) steps the logits."""
    c = np.array([[1.0, 0.0], [0.0, 2.0], [5.0, -5.0]])
    data, mask, eta = targets(c), np.ones((3, 1, 2), bool), 0.5
    mask[1, 0, 1] = False                                  # client 1 has one example
    v = np.array([0.5, 1.0])
    val = targets(np.zeros((3, 2)) + v)
    alg = learned_client_weights(quad_loss, optax.sgd(eta), clients=3,
                                 meta_optimizer=optax.sgd(1.0))
    new, m = jax.jit(alg.next)(alg.init({"w": jnp.zeros(2)}), data, mask, val,
                               np.ones((3, 1, 2), bool))
    d = eta * c
    n = mask.sum((1, 2)).astype(np.float64)
    a = n / n.sum()
    w1 = (a[:, None] * d).sum(0)
    grad = np.array([(w1 - v) @ (a[j] * (d[j] - w1)) for j in range(3)])
    np.testing.assert_allclose(m["weights"], a, rtol=1e-6)
    np.testing.assert_allclose(new.logits, -grad, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(new.params["w"], w1, rtol=1e-5, atol=1e-6)
