"""FedSGD through federated AD equals FedAvg with one local step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fax_bridge.algorithms import fed_avg, fed_sgd, federated_loss


def loss(p, b):
    return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)


def problem(clients=4, size=5, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(clients, 1, size, 3)).astype(np.float32)
    y = (x @ np.array([1.0, 0.0, -1.0], np.float32) + 0.5).astype(np.float32)
    mask = np.ones((clients, 1, size), bool)
    mask[1, 0, 3:] = False
    mask[3, 0, 1:] = False
    return {"x": x, "y": y}, mask


def test_fedsgd_equals_fedavg_with_one_local_step():
    data, mask = problem()
    eta = 0.1
    avg = fed_avg(loss, optax.sgd(eta), clients=4)          # one batch = one local step
    sgd = fed_sgd(loss, clients=4, learning_rate=eta)
    p0 = {"w": jnp.zeros(3), "b": jnp.zeros(())}
    sa, ss = avg.init(p0), sgd.init(p0)
    for _ in range(3):
        sa, _ = avg.next(sa, data, mask)
        ss, _ = jax.jit(sgd.next)(ss, data, mask)
    for k in p0:
        np.testing.assert_allclose(sa.params[k], ss.params[k], rtol=1e-5, atol=1e-6)


def test_federated_gradient_is_example_weighted_mean_of_client_gradients():
    data, mask = problem()
    p = {"w": jnp.array([0.3, -0.2, 0.1]), "b": jnp.array(0.2)}
    got = jax.grad(federated_loss(loss, 4))(p, data, mask)
    counts = mask.sum((1, 2))
    grads = []
    for i in range(4):
        keep = mask[i, 0]
        batch = {"x": data["x"][i, 0][keep], "y": data["y"][i, 0][keep]}
        grads.append(jax.grad(loss)(p, batch))
    for k in p:
        expect = sum(c * g[k] for c, g in zip(counts, grads)) / counts.sum()
        np.testing.assert_allclose(got[k], expect, rtol=1e-5, atol=1e-6)


def test_loss_decreases_with_adam_server():
    data, mask = problem()
    alg = fed_sgd(loss, clients=4, server_optimizer=optax.adam(0.1))
    state = alg.init({"w": jnp.zeros(3), "b": jnp.zeros(())})
    step = jax.jit(alg.next)
    losses = []
    for _ in range(10):
        state, m = step(state, data, mask)
        losses.append(float(m["loss"]))
    assert losses[-1] < 0.5 * losses[0]


def test_one_round_matches_the_equations_in_numpy():
    """w1 = w0 - lr * sum_i n_i g_i / sum_i n_i, g_i the gradient of client i's mean
    squared error, written out: 2 x^T (x w + b - y) / n_i and 2 mean(x w + b - y)."""
    data, mask = problem()
    lr = 0.3
    alg = fed_sgd(loss, clients=4, learning_rate=lr)
    w0, b0 = np.array([0.3, -0.2, 0.1]), 0.2
    state, _ = jax.jit(alg.next)(alg.init({"w": jnp.asarray(w0, jnp.float32),
                                           "b": jnp.float32(b0)}), data, mask)
    gw, gb, total = np.zeros(3), 0.0, 0
    for i in range(4):
        m = mask[i, 0]
        x, y = data["x"][i, 0][m].astype(np.float64), data["y"][i, 0][m].astype(np.float64)
        r = x @ w0 + b0 - y
        gw += m.sum() * 2 * x.T @ r / m.sum()
        gb += m.sum() * 2 * r.mean()
        total += m.sum()
    np.testing.assert_allclose(state.params["w"], w0 - lr * gw / total, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.params["b"], b0 - lr * gb / total, rtol=1e-5, atol=1e-6)
