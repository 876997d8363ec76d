"""DP-FedAvg: FedAvg without noise and clipping, empty slots, progress, export and fleet."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fax_bridge as fb
from fax_bridge.algorithms import dp_fed_avg, fed_avg
from fax_bridge import privacy
from fax_bridge.errors import ArgumentError, HyperparameterError, PrivacyError


def loss(p, b):
    return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)


def _data(clients=3, seed=0):
    rng = np.random.default_rng(seed)
    w = np.array([1.5, -2.0], np.float32)
    x = rng.normal(size=(clients, 2, 4, 2)).astype(np.float32)
    y = (x @ w + 0.5).astype(np.float32)
    return {"x": x, "y": y}, np.ones((clients, 2, 4), bool)


P0 = {"w": jnp.zeros(2), "b": jnp.zeros(())}


def test_without_noise_and_with_a_loose_clip_it_is_fedavg():
    data, mask = _data()
    dp = dp_fed_avg(loss, optax.sgd(0.1), clients=3, noise_multiplier=0.0, clip=1e6,
                    server_optimizer=optax.sgd(1.0, momentum=0.5))
    ref = fed_avg(loss, optax.sgd(0.1), clients=3,
                  server_optimizer=optax.sgd(1.0, momentum=0.5))
    s, r = dp.init(P0), ref.init(P0)
    dp_step, ref_step = jax.jit(dp.next), jax.jit(ref.next)
    for _ in range(3):
        s, m = dp_step(s, data, mask)
        r, _ = ref_step(r, data, mask)
    for k in P0:
        np.testing.assert_allclose(s.params[k], r.params[k], rtol=1e-5, atol=1e-6)
    assert float(m["participants"]) == 3 and int(s.round) == 3


def test_empty_slots_are_not_clients():
    data, mask = _data(4)
    mask[3] = False                       # a Poisson cohort of 3 in a program of 4 slots
    four = dp_fed_avg(loss, optax.sgd(0.1), clients=4, noise_multiplier=0.0,
                      clients_per_round=3.0)
    three = dp_fed_avg(loss, optax.sgd(0.1), clients=3, noise_multiplier=0.0)
    s4, m4 = jax.jit(four.next)(four.init(P0), data, mask)
    s3, m3 = jax.jit(three.next)(three.init(P0), jax.tree.map(lambda a: a[:3], data),
                                 mask[:3])
    for k in P0:
        np.testing.assert_allclose(s4.params[k], s3.params[k], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(s4.dp.clip, s3.dp.clip, rtol=1e-6)
    assert float(m4["participants"]) == 3


def test_noisy_training_still_learns():
    data, mask = _data(8, seed=1)
    alg = dp_fed_avg(loss, optax.sgd(0.1), clients=8, noise_multiplier=0.3,
                     server_optimizer=optax.sgd(1.0, momentum=0.9))
    step = jax.jit(alg.next)
    state = alg.init(P0, seed=1)
    first = None
    for _ in range(25):
        state, m = step(state, data, mask)
        first = float(m["loss"]) if first is None else first
    assert float(m["loss"]) < 0.3 * first
    assert float(state.dp.clip) > 0.1            # the clip grew toward the update norms


def test_round_exports_and_matches_on_a_fleet():
    from federated_language.compiler import building_blocks

    data, mask = _data()
    alg = dp_fed_avg(loss, optax.sgd(0.1), clients=3, noise_multiplier=0.5,
                     clients_per_round=3.0, clip=0.5)
    state = alg.init(P0, seed=2)
    proto = fb.export_tff(alg.next, state, data, mask, placements=alg.placements)
    sig = str(building_blocks.ComputationBuildingBlock.from_proto(proto).type_signature)
    assert "key=uint32[2]" in sig and "@CLIENTS" in sig
    with fb.LocalFleet(devices=2) as fleet:
        report = fb.check_parity(alg.next, state, data, mask, placements=alg.placements,
                                 fleet=fleet)
    assert report.ok, report.table()


def test_bad_arguments():
    with pytest.raises(PrivacyError, match="noise_multiplier"):
        dp_fed_avg(loss, optax.sgd(0.1), clients=3, noise_multiplier=-1.0)
    with pytest.raises(ArgumentError, match="DPAggregator"):
        dp_fed_avg(loss, optax.sgd(0.1), clients=3, noise_multiplier=0.0, aggregator=object())
    with pytest.raises(HyperparameterError, match="clients_per_round"):
        dp_fed_avg(loss, optax.sgd(0.1), clients=3, noise_multiplier=0.0,
                   clients_per_round=float("nan"))
    with pytest.raises(HyperparameterError, match="local_epochs"):
        dp_fed_avg(loss, optax.sgd(0.1), clients=3, noise_multiplier=0.0, local_epochs=0)


def test_the_default_adaptive_clip_takes_any_noise_multiplier():
    for clients, z in [(10, 1.0), (3, 5.0), (1000, 1.0)]:
        alg = dp_fed_avg(loss, optax.sgd(0.1), clients=clients, noise_multiplier=z)
        dp = alg.init(P0).dp
        assert float(dp.clip) == pytest.approx(0.1)
    data, mask = _data(3)
    chosen = dp_fed_avg(loss, optax.sgd(0.1), clients=3, noise_multiplier=1.0,
                        clipped_count_stddev=3.0)
    state, metrics = jax.jit(chosen.next)(chosen.init(P0), data, mask)
    assert np.isfinite(float(metrics["unclipped_fraction"]))
    with pytest.raises(PrivacyError, match="clipped_count_stddev=0.4 is too small"):
        dp_fed_avg(loss, optax.sgd(0.1), clients=3, noise_multiplier=1.0,
                   clipped_count_stddev=0.4)
    with pytest.raises(ArgumentError, match="clipped_count_stddev"):
        dp_fed_avg(loss, optax.sgd(0.1), clients=3, noise_multiplier=1.0, clip=1.0,
                   clipped_count_stddev=3.0)
    with pytest.raises(ArgumentError, match="clipped_count_stddev"):
        dp_fed_avg(loss, optax.sgd(0.1), clients=3, noise_multiplier=1.0,
                   clipped_count_stddev=3.0,
                   aggregator=privacy.gaussian_fixed(1.0, 3.0, 1.0))
