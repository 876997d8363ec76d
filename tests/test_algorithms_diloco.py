"""DiLoCo / Streaming DiLoCo: E3M0 quantizer, reference DiLoCo, fragments, bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fax_bridge.algorithms import diloco, quantize_e3m0, streaming_diloco
from fax_bridge.algorithms.diloco import e3m0_decode, e3m0_encode, payload_bytes, split_fragments


def test_e3m0_grid_sign_scale_and_error():
    x = jnp.asarray(np.random.default_rng(0).normal(size=1000).astype(np.float32))
    q = np.asarray(jax.jit(quantize_e3m0)(x))
    scale = float(jnp.max(jnp.abs(x)))
    levels = scale * 2.0 ** np.arange(-6, 1)
    assert np.all(np.isclose(np.abs(q[:, None]), levels[None], rtol=1e-6).any(1) | (q == 0))
    assert len(np.unique(np.abs(q))) <= 8                  # 7 magnitudes and zero
    assert np.all(np.sign(q[q != 0]) == np.sign(np.asarray(x)[q != 0]))
    assert np.isclose(np.abs(q).max(), scale)
    normal = np.abs(np.asarray(x)) >= scale * 2.0 ** -6
    rel = np.abs(q - np.asarray(x))[normal] / np.abs(np.asarray(x))[normal]
    assert rel.max() <= 1 / 3 + 1e-6                      # round to nearest power of two
    np.testing.assert_array_equal(jax.jit(quantize_e3m0)(q), q)    # idempotent
    np.testing.assert_array_equal(quantize_e3m0(jnp.zeros(4)), np.zeros(4))


def test_e3m0_codes_are_four_bits_and_decode():
    x = jnp.array([0.0, 1e-3, -0.02, 0.3, -0.5, 0.74, 0.76, -1.0])
    codes, scale = e3m0_encode(x)
    assert codes.dtype == jnp.uint8 and int(codes.max()) < 16
    np.testing.assert_allclose(e3m0_decode(codes, scale),
                               [0, 0, -2.0 ** -6, 0.25, -0.5, 0.5, 1.0, -1.0])


def loss(p, b):
    return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)


def problem(workers=3, steps=4, batch=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(workers, steps, batch, 3)).astype(np.float32)
    y = (x @ np.array([1.0, -1.0, 0.5], np.float32) + 0.3).astype(np.float32)
    return {"x": x, "y": y}, np.ones((workers, steps, batch), bool)


P0 = {"w": jnp.zeros(3), "b": jnp.zeros(())}


def test_plain_diloco_matches_a_direct_reference():
    data, mask = problem()
    inner = optax.adamw(0.05, weight_decay=0.1)
    alg = diloco(loss, P0, clients=3, sync_every=4, inner_optimizer=inner)
    state = alg.init(P0)
    step = jax.jit(alg.rounds[0])
    for _ in range(2):
        state, _ = step(state, data, mask)
    # reference: per worker H AdamW steps (state kept), mean outer gradient, Nesterov SGD
    outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
    g, o = P0, outer.init(P0)
    inner_states = [inner.init(P0) for _ in range(3)]
    for _ in range(2):
        outs = []
        for i in range(3):
            p = g
            for t in range(4):
                grads = jax.grad(loss)(p, {"x": data["x"][i, t], "y": data["y"][i, t]})
                upd, inner_states[i] = inner.update(grads, inner_states[i], p)
                p = optax.apply_updates(p, upd)
            outs.append(jax.tree.map(jnp.subtract, g, p))
        mean = jax.tree.map(lambda *a: sum(a) / 3, *outs)
        upd, o = outer.update(mean, o, g)
        g = optax.apply_updates(g, upd)
    for k in P0:
        np.testing.assert_allclose(state.global_params[k], g[k], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(state.worker_params[k][1], g[k], rtol=1e-4, atol=1e-6)


def test_streaming_syncs_one_fragment_per_round_and_learns():
    data, mask = problem(steps=2)
    alg = streaming_diloco(loss, P0, clients=3, sync_every=4, num_fragments=2, overlap=1,
                           inner_optimizer=optax.adamw(0.05))
    assert alg.inner_steps_per_round == 2 and [alg.schedule(r) for r in range(4)] == [0, 1, 0, 1]
    leaves0 = jax.tree.leaves(P0)
    state = alg.init(P0)
    steps = [jax.jit(r) for r in alg.rounds]
    losses = []
    for r in range(12):
        before = jax.tree.leaves(state.global_params)
        state, m = steps[alg.schedule(r)](state, data, mask)
        after = jax.tree.leaves(state.global_params)
        changed = {i for i, (a, b) in enumerate(zip(before, after)) if not np.array_equal(a, b)}
        assert changed <= set(alg.fragments[alg.schedule(r)])
        losses.append(float(m["loss"]))
    assert len(leaves0) == 2 and losses[-1] < 0.5 * losses[0]


def test_bytes_accounting_against_plain_diloco():
    params = {"a": jnp.zeros((64, 32)), "b": jnp.zeros(32), "c": jnp.zeros((32, 10)),
              "d": jnp.zeros(10)}
    plain = diloco(loss, params, clients=4, sync_every=8)
    stream = streaming_diloco(loss, params, clients=4, sync_every=8, num_fragments=2,
                              overlap=1)
    size = 64 * 32 + 32 + 32 * 10 + 10
    inner_steps = 80
    p = plain.communication(inner_steps // plain.inner_steps_per_round)
    s = stream.communication(inner_steps // stream.inner_steps_per_round)
    assert p["total_bytes"] == 10 * 2 * 4 * size * 4    # 10 syncs, up+down, 4 workers, fp32
    codes = sum(-(-k * 4 // 8) for k in (64 * 32, 32, 32 * 10, 10))
    assert s["total_bytes"] == 10 * 2 * 4 * (codes + 4 * 4)   # each fragment 10 times
    assert s["peak_bytes"] == max(stream.bytes_per_round)
    # the larger fragment is leaf "a" alone: 4-bit codes of 2048 values plus its scale
    assert s["peak_bytes"] == 2 * 4 * (1024 + 4) < p["peak_bytes"] / 8
    assert payload_bytes([jnp.zeros(3)], quantized=True) == 2 + 4


def test_fragments_partition_and_argument_errors():
    params = {"a": jnp.zeros((8, 8)), "b": jnp.zeros(8), "c": jnp.zeros((8, 4)), "d": jnp.zeros(4)}
    frags = split_fragments(params, 2)
    assert sorted(i for f in frags for i in f) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="multiple of the number of fragments"):
        streaming_diloco(loss, params, clients=2, sync_every=3, num_fragments=2)
    with pytest.raises(ValueError, match="overlap"):
        streaming_diloco(loss, params, clients=2, sync_every=4, num_fragments=2, overlap=3)
    with pytest.raises(ValueError, match="num_fragments"):
        split_fragments(params, 5)
