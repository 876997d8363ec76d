"""DiLoCo / Streaming DiLoCo: the papers' equations in numpy, fragments, and the bytes a
fleet really carries."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fax_bridge as fb
from fax_bridge.algorithms import diloco, streaming_diloco
from fax_bridge.algorithms.diloco import SYNC_PLACEMENTS, payload_bytes, split_fragments


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


def _np_e3m0(x):
    """E3M0 from its definition: sign, and |x| / max|x| rounded to the nearer of the two
    powers of two around it, 2**e with e in -6..0 (ties up), zero below 2**-7."""
    x = np.asarray(x, np.float64)
    scale = np.abs(x).max()
    if scale == 0:
        return np.zeros_like(x)
    r = np.abs(x) / scale
    out = np.zeros_like(x)
    for idx, v in np.ndenumerate(r):
        if v < 2.0 ** -7:
            continue
        k = np.floor(np.log2(v))
        e = min(0, max(-6, k + (v / 2.0 ** k >= 1.5)))
        out[idx] = np.sign(x[idx]) * 2.0 ** e * scale
    return out


@pytest.mark.parametrize("streaming", [True, False])
def test_rounds_match_the_papers_equations_in_numpy(streaming):
    """Two rounds recomputed in numpy from the papers' equations: inner SGD on a linear
    least-squares loss, outer gradient = global - local, averaged over workers, Nesterov
    outer step, local = a * local + (1 - a) * global for the synced parameters.
    Streaming: 4-bit, fragments {b} then {w}, overlap 1 (the outer gradient is taken
    one inner step before the sync), a = 0.3; every message and the mean are E3M0
    rounded. Plain DiLoCo: both leaves every round, float32, no overlap, a = 0."""
    data, mask = problem(workers=3, steps=2)
    lr, outer_lr, mu = 0.05, 0.7, 0.9
    if streaming:
        a, overlap, q = 0.3, 1, _np_e3m0
        alg = streaming_diloco(loss, P0, clients=3, sync_every=4, num_fragments=2,
                               overlap=overlap, mixing=a, inner_optimizer=optax.sgd(lr),
                               fragments=[[0], [1]])
        synced = [["b"], ["w"]]                          # jax's leaf order: sorted keys
    else:
        a, overlap, q = 0.0, 0, (lambda x: x)
        alg = diloco(loss, P0, clients=3, sync_every=2, inner_optimizer=optax.sgd(lr))
        synced = [["b", "w"], ["b", "w"]]
    state = alg.init(P0)
    for r in range(2):
        state, _ = jax.jit(alg.rounds[alg.schedule(r)])(state, data, mask)

    glob = {"b": np.zeros(()), "w": np.zeros(3)}
    local = [dict(glob) for _ in range(3)]
    mom = {"b": np.zeros(()), "w": np.zeros(3)}

    def grad(p, x, y):
        err = x @ p["w"] + p["b"] - y
        return {"w": 2 * x.T @ err / len(y), "b": 2 * err.mean()}

    for r in range(2):
        sent = {k: [] for k in synced[r]}
        for i in range(3):
            for t in range(2):
                if t == 2 - overlap:
                    for k in synced[r]:
                        sent[k].append(q(glob[k] - local[i][k]))
                g = grad(local[i], data["x"][i, t], data["y"][i, t])
                local[i] = {k: local[i][k] - lr * g[k] for k in local[i]}
            if overlap == 0:
                for k in synced[r]:
                    sent[k].append(q(glob[k] - local[i][k]))
        for k in synced[r]:
            avg = q(np.mean(sent[k], axis=0))
            mom[k] = mu * mom[k] + avg
            glob[k] = glob[k] - outer_lr * (avg + mu * mom[k])
            for i in range(3):
                local[i][k] = a * local[i][k] + (1 - a) * glob[k]
    for k in ("w", "b"):
        np.testing.assert_allclose(state.global_params[k], glob[k], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(state.worker_global[k][2], glob[k], rtol=1e-4, atol=1e-6)
        for i in range(3):
            np.testing.assert_allclose(state.worker_params[k][i], local[i][k], rtol=1e-4,
                                       atol=1e-6)


def test_the_fleet_carries_packed_codes_both_ways():
    """One sync on a LocalFleet, one device per worker: what goes up is each worker's
    packed codes and scales as they are (a decode-sum's members), or without quantizing
    its float32 outer gradient as it is (one client's addend); what is
    broadcast is the re-quantized mean's."""
    params = {"a": jnp.zeros((9, 4)), "b": jnp.zeros(4)}
    data = {"x": np.ones((3, 2, 2, 9), np.float32), "y": np.ones((3, 2, 2), np.float32)}
    measured = {}
    with fb.LocalFleet(devices=3) as fleet:
        for quant in (True, False):
            alg = streaming_diloco(lambda p, b: jnp.mean((b["x"] @ p["a"] + p["b"]).sum(-1)
                                                         - b["y"]) ** 2,
                                   params, clients=3, sync_every=2, quantize=quant, mixing=0.5,
                                   inner_optimizer=optax.sgd(0.1))
            state = alg.init(params)
            state, _ = alg.rounds[0](state, data, np.ones((3, 2, 2), bool))
            args = alg.sync_args(state, 0)
            want = alg.syncs[0](*args)
            proto = fb.export_tff(alg.syncs[0], *args, placements=SYNC_PLACEMENTS)
            fleet.run(proto, *args)                        # loads the computations once
            got, rep = fleet.run(proto, *args, report=True)
            for w, g in zip(jax.tree.leaves(want[:2]), jax.tree.leaves(got[:2])):
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
            measured[quant] = rep
            per_worker = alg.payload_bytes[0]
            assert per_worker == (payload_bytes(jax.tree.leaves(params), quant))
            # up: the workers' messages, and each device's int32 acknowledgement: a device
            # of one client sends its addends in their own dtype (float32 for the mean)
            assert int(got[2]) == 3
            assert rep.payload_up == 3 * per_worker + 3 * 4
            # down: placing the payloads on the workers, then one broadcast to each
            assert rep.payload_down == 3 * per_worker + 3 * per_worker
    assert measured[True].payload_up == 3 * ((36 + 1) // 2 + 4 + 2 + 4) + 3 * 4
    assert 4 * measured[True].payload_up < measured[False].payload_up


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
