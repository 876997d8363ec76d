"""One-trip FedSGD and learned server rate: same quantities as the two-trip rounds, and
rounds that one production form can hold."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fax_bridge as fb
from fax_bridge.algorithms import (fed_sgd, fed_sgd_one_trip, federated_loss,
                                   learned_server_lr, learned_server_lr_one_trip)
from fax_bridge.tff import forms


def loss(p, b):
    return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)


def problem(clients=4, steps=2, size=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(clients, steps, size, 3)).astype(np.float32)
    y = (x @ np.array([1.0, 0.0, -1.0], np.float32) + 0.5).astype(np.float32)
    mask = np.ones((clients, steps, size), bool)
    mask[1, 1, 1:] = False
    mask[3] = False  # a client without examples weighs nothing
    return {"x": x, "y": y}, mask


P0 = {"w": jnp.array([0.3, -0.2, 0.1]), "b": jnp.array(0.2)}


def test_fed_sgd_one_trip_equals_fed_sgd_over_rounds():
    data, mask = problem()
    two = fed_sgd(loss, clients=4, server_optimizer=optax.adam(0.05))
    one = fed_sgd_one_trip(loss, clients=4, server_optimizer=optax.adam(0.05))
    s2, s1 = two.init(P0), one.init(P0)
    for _ in range(3):
        s2, m2 = jax.jit(two.next)(s2, data, mask)
        s1, m1 = jax.jit(one.next)(s1, data, mask)
        np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-5)
    for k in P0:
        np.testing.assert_allclose(s1.params[k], s2.params[k], rtol=1e-5, atol=1e-6)


def test_learned_lr_one_trip_hypergradient_is_that_of_the_previous_step():
    data, mask = problem()
    alg = learned_server_lr_one_trip(loss, optax.sgd(0.1), clients=4, initial_lr=0.7)
    step = jax.jit(alg.next)
    s0 = alg.init(P0)
    s1, m0 = step(s0, data, mask, data, mask)
    assert float(m0["lr_hypergrad"]) == 0.0  # no previous step yet
    s2, m1 = step(s1, data, mask, data, mask)
    # dL/dlr of L(lr) = F(params_0 + lr * delta_0) at the rate round 0 applied.
    fed_loss = federated_loss(loss, 4)
    lr_used = float(jnp.exp(s1.log_lr))

    def post(lr):
        return fed_loss(jax.tree.map(lambda p, d: p + lr * d, s0.params, s1.prev_delta),
                        data, mask)

    np.testing.assert_allclose(float(m1["lr_hypergrad"]), float(jax.grad(post)(lr_used)),
                               rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(float(m1["post_loss"]), float(post(lr_used)), rtol=1e-5)
    for k in P0:  # the state is the model the broadcast of round 1 used
        np.testing.assert_allclose(s1.params[k], s0.params[k] + lr_used * s1.prev_delta[k],
                                   rtol=1e-5, atol=1e-7)
    assert float(m1["lr"]) == pytest.approx(float(jnp.exp(s2.log_lr)))


def test_learned_lr_one_trip_first_round_matches_fedavg_change_of_the_two_trip_round():
    data, mask = problem()
    one = learned_server_lr_one_trip(loss, optax.sgd(0.1), clients=4)
    two = learned_server_lr(loss, optax.sgd(0.1), clients=4)
    s1, m1 = jax.jit(one.next)(one.init(P0), data, mask, data, mask)
    _, m2 = jax.jit(two.next)(two.init(P0), data, mask, data, mask)
    np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-5)


@pytest.mark.parametrize("make,refused", [
    (lambda: fed_sgd(loss, clients=4), True),
    (lambda: fed_sgd_one_trip(loss, clients=4), False),
    (lambda: learned_server_lr(loss, optax.sgd(0.1), clients=4), True),
    (lambda: learned_server_lr_one_trip(loss, optax.sgd(0.1), clients=4), False),
])
def test_only_the_one_trip_rounds_fit_one_form(make, refused):
    alg = make()
    data, mask = problem()
    extra = (data, mask) if len(alg.placements) == 5 else ()
    args = (alg.init(P0), data, mask) + extra
    if refused:
        with pytest.raises(fb.ExportError, match="two server-client trips.*one_trip"):
            forms.round_proto(alg.next, *args, placements=alg.placements)
    else:
        proto, _ = forms.round_proto(alg.next, *args, placements=alg.placements)
        assert set(forms.intrinsic_uris(proto)) <= forms.FORM_INTRINSICS
