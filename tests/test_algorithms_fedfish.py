"""FedFish: diagonal Fisher in closed form and Fisher-weighted aggregation."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fax_bridge.algorithms import fed_avg, fed_fish, fisher_diagonal


def loss(p, b):
    return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)


def problem(seed=0, zero_feature_client=None):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(3, 1, 6, 2)).astype(np.float32)
    if zero_feature_client is not None:
        x[zero_feature_client, ..., 1] = 0.0
    y = (x @ np.array([2.0, -1.0], np.float32) + rng.normal(size=(3, 1, 6)) * 0.1)
    mask = np.ones((3, 1, 6), bool)
    mask[0, 0, 4:] = False
    return {"x": x, "y": y.astype(np.float32)}, mask


def test_fisher_diagonal_closed_form():
    data, mask = problem()
    p = {"w": jnp.array([0.5, 0.2]), "b": jnp.array(0.1)}
    b = {k: v[0, 0] for k, v in data.items()}
    m = mask[0, 0]
    f = fisher_diagonal(loss, p, b, m)
    r = (b["x"] @ np.asarray(p["w"]) + 0.1 - b["y"])[m]
    np.testing.assert_allclose(f["w"], (4 * r[:, None] ** 2 * b["x"][m] ** 2).mean(0), rtol=1e-5)
    np.testing.assert_allclose(f["b"], (4 * r ** 2).mean(), rtol=1e-5)


def test_round_is_fisher_weighted_mean_of_client_models():
    data, mask = problem()
    eta, damping = 0.05, 1e-6
    alg = fed_fish(loss, optax.sgd(eta), clients=3, damping=damping)
    p0 = {"w": jnp.array([0.5, 0.2]), "b": jnp.array(0.1)}
    state, _ = jax.jit(alg.next)(alg.init(p0), data, mask)
    num = {k: 0.0 for k in p0}
    den = {k: 0.0 for k in p0}
    for i in range(3):
        b = {k: v[i, 0][mask[i, 0]] for k, v in data.items()}
        g = jax.grad(loss)(p0, b)
        local = {k: p0[k] - eta * g[k] for k in p0}                  # one local SGD step
        f = fisher_diagonal(loss, local, b, np.ones(len(b["y"]), bool))
        for k in p0:
            weight = len(b["y"]) * (np.asarray(f[k]) + damping)
            num[k] = num[k] + weight * np.asarray(local[k])
            den[k] = den[k] + weight
    for k in p0:
        np.testing.assert_allclose(state.params[k], num[k] / den[k], rtol=1e-4, atol=1e-6)


def test_identical_clients_reduce_to_fedavg():
    data, mask = problem()
    data = {k: np.broadcast_to(v[1:2], v.shape).copy() for k, v in data.items()}
    mask = np.ones_like(mask)
    p0 = {"w": jnp.zeros(2), "b": jnp.zeros(())}
    fish = fed_fish(loss, optax.sgd(0.05), clients=3)
    avg = fed_avg(loss, optax.sgd(0.05), clients=3)
    a, _ = jax.jit(fish.next)(fish.init(p0), data, mask)
    b, _ = jax.jit(avg.next)(avg.init(p0), data, mask)
    for k in p0:
        np.testing.assert_allclose(a.params[k], b.params[k], rtol=1e-4, atol=1e-6)


def test_client_without_signal_on_a_weight_does_not_dilute_it():
    # client 2's second feature is always 0: its change and its Fisher for w[1] are 0
    data, mask = problem(zero_feature_client=2)
    without = mask.copy()
    without[2] = False                                  # the same round without client 2
    p0 = {"w": jnp.array([0.3, 0.3]), "b": jnp.zeros(())}
    fish = fed_fish(loss, optax.sgd(0.05), clients=3)
    avg = fed_avg(loss, optax.sgd(0.05), clients=3)
    f_all, m = jax.jit(fish.next)(fish.init(p0), data, mask)
    f_two, _ = jax.jit(fish.next)(fish.init(p0), data, without)
    a_all, _ = jax.jit(avg.next)(avg.init(p0), data, mask)
    a_two, _ = jax.jit(avg.next)(avg.init(p0), data, without)
    np.testing.assert_allclose(f_all.params["w"][1], f_two.params["w"][1], rtol=1e-4)
    d_all, d_two = a_all.params["w"][1] - 0.3, a_two.params["w"][1] - 0.3
    assert abs(float(d_all)) < 0.8 * abs(float(d_two))  # FedAvg averages the zero change in
    assert np.isfinite(float(m["loss"]))


def test_one_round_matches_the_equations_in_numpy():
    """FedFish in numpy: one local SGD step of the squared error, the diagonal Fisher
    F_i = mean over examples of the squared per-example gradient (2 r x)^2 at the local
    model, and the round's model sum_i n_i (F_i + d) w_i / sum_i n_i (F_i + d)."""
    data, mask = problem()
    eta, damping = 0.05, 1e-6
    alg = fed_fish(loss, optax.sgd(eta), clients=3, damping=damping)
    w0, b0 = np.array([0.5, 0.2]), 0.1
    state, _ = jax.jit(alg.next)(alg.init({"w": jnp.asarray(w0, jnp.float32),
                                           "b": jnp.float32(b0)}), data, mask)
    num_w, den_w, num_b, den_b = np.zeros(2), np.zeros(2), 0.0, 0.0
    for i in range(3):
        m = mask[i, 0]
        x, y = data["x"][i, 0][m].astype(np.float64), data["y"][i, 0][m].astype(np.float64)
        r = x @ w0 + b0 - y
        w1, b1 = w0 - eta * 2 * x.T @ r / len(y), b0 - eta * 2 * r.mean()
        r1 = x @ w1 + b1 - y
        fw, fb = (4 * r1[:, None] ** 2 * x ** 2).mean(0), (4 * r1 ** 2).mean()
        num_w += len(y) * (fw + damping) * w1
        den_w += len(y) * (fw + damping)
        num_b += len(y) * (fb + damping) * b1
        den_b += len(y) * (fb + damping)
    np.testing.assert_allclose(state.params["w"], num_w / den_w, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(state.params["b"], num_b / den_b, rtol=1e-4, atol=1e-6)
