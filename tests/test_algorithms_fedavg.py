"""FedAvg: closed form on a quadratic, masks, jit, training progress."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


# Every numeric setting of every constructor, with values that are out of range for all
# of them; each must give the project's HyperparameterError naming the setting.
def _recon_loss(g, l, b):
    return quad_loss({"w": g["w"] + l["b"]}, b)


def _constructors():
    from fax_bridge import algorithms as A

    sgd = optax.sgd(0.1)
    p = {"w": jnp.zeros(2), "b": jnp.zeros(())}
    return {
        "fed_avg": (lambda **k: A.fed_avg(quad_loss, sgd, **{"clients": 3, **k}),
                    ["clients", "local_epochs"]),
        "fed_adam": (lambda **k: A.fed_adam(quad_loss, sgd, clients=3, **k),
                     ["server_lr", "b1", "b2", "tau", "local_epochs"]),
        "fed_yogi": (lambda **k: A.fed_yogi(quad_loss, sgd, clients=3, paper_exact=True, **k),
                     ["server_lr", "b1", "b2", "tau"]),
        "fed_adagrad": (lambda **k: A.fed_adagrad(quad_loss, sgd, clients=3, **k),
                        ["server_lr", "b1", "tau"]),
        "learned_server_lr": (lambda **k: A.learned_server_lr(quad_loss, sgd, clients=3, **k),
                              ["initial_lr", "local_epochs"]),
        "learned_client_weights": (
            lambda **k: A.learned_client_weights(quad_loss, sgd, **{"clients": 3, **k}),
            ["clients", "local_epochs"]),
        "fed_fish": (lambda **k: A.fed_fish(quad_loss, sgd, clients=3, **k),
                     ["damping", "local_epochs"]),
        "fed_reconstruction": (
            lambda **k: A.fed_reconstruction(_recon_loss, {"b": jnp.zeros(())}, clients=3,
                                             client_optimizer=sgd,
                                             reconstruction_optimizer=sgd, **k),
            ["reconstruction_epochs", "local_epochs"]),
        "streaming_diloco": (
            lambda **k: A.streaming_diloco(quad_loss, p, clients=3, **{"sync_every": 4, **k}),
            ["sync_every", "num_fragments", "overlap", "mixing", "outer_lr",
             "outer_momentum"]),
    }


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from([(name, key) for name, (_, keys) in _constructors().items()
                             for key in keys]),
       bad=st.sampled_from([-1, -0.5, float("nan"), float("inf"), True, "1", None]))
def test_bad_settings_raise_a_hyperparameter_error_naming_them(case, bad):
    from fax_bridge.errors import HyperparameterError

    name, key = case
    make, _ = _constructors()[name]
    with pytest.raises(HyperparameterError, match=key.split("_")[0]):
        make(**{key: bad})
    if key in ("b1", "b2", "mixing", "outer_momentum"):       # bounded above by 1
        with pytest.raises(HyperparameterError, match=key.split("_")[0]):
            make(**{key: 1.5})
