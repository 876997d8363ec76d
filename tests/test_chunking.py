"""Cohorts in chunks (`clients_per_step`): the chunked round computes the unchunked one
(to the last bits of float sums, exactly for integers and with k >= N), its gradient
too, with temporaries of k clients whatever the cohort; export does not see it."""

import logging
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from processes import run_on_cpu_devices

import fax_bridge as fb
from fax_bridge import privacy
from fax_bridge.local import chunk_size
from fax_bridge.errors import ArgumentError, ProgramError


def _every_aggregation(n: int, k):
    """A round with each aggregation, per-client equations outside the maps, a
    CLIENTS-placed result and a second trip that needs the first one's mean."""

    @fb.program(clients=n, clients_per_step=k)
    def round_(w, data):
        wc = fb.federated_broadcast(w)

        def local(w, d):
            g = jax.grad(lambda w: jnp.mean((d["x"] @ w - d["y"]) ** 2))(w)
            return w - 0.1 * g, 1.0 + jnp.abs(d["y"][0]), jnp.sum(d["c"])

        new_w, weight, count = fb.federated_map_clients(local, (wc, data))
        mean = fb.federated_weighted_mean(new_w, weight)
        scaled = new_w * 2.0 - wc  # per client, outside any map
        codes = fb.federated_map_clients(lambda c: jnp.mod(c, 7), data["c"])
        second = fb.federated_map_clients(
            lambda m, x: jnp.sum(x @ m), (fb.federated_broadcast(mean), data["x"]))
        return {
            "weighted": mean,
            "sum": fb.federated_sum(weight),
            "mean": fb.federated_mean(scaled),
            "ints": fb.federated_sum(count),
            "secure": fb.federated_secure_sum_bitwidth(codes, 3),
            "decoded": fb.federated_decode_sum(lambda c: c.astype(jnp.float32) / 2, codes),
            "second_trip": fb.federated_mean(second),
            "at_clients": scaled,
        }

    return round_


def _data(n: int, seed: int = 0):
    key = jax.random.PRNGKey(seed)
    kx, ky, kc = jax.random.split(key, 3)
    return {"x": jax.random.normal(kx, (n, 5, 3)), "y": jax.random.normal(ky, (n, 5)),
            "c": jax.random.randint(kc, (n, 4), 0, 50, jnp.int32)}


def _close(a, b, exact=False):
    for key in a:
        x, y = np.asarray(a[key]), np.asarray(b[key])
        if exact or x.dtype.kind in "iu":
            np.testing.assert_array_equal(x, y, err_msg=key)
        else:
            np.testing.assert_allclose(x, y, rtol=2e-6, atol=2e-6, err_msg=key)


@settings(max_examples=3, deadline=None)
@given(n=st.integers(2, 11), k=st.integers(1, 13), seed=st.integers(0, 3))
def test_chunked_round_computes_the_unchunked_round(n, k, seed):
    w, data = jnp.array([0.5, -1.0, 2.0]), _data(n, seed)
    whole = jax.jit(_every_aggregation(n, None))(w, data)
    chunked = jax.jit(_every_aggregation(n, k))(w, data)
    _close(chunked, whole, exact=k >= n)  # k >= N: nothing chunked, the same bits


def test_gradient_and_jvp_of_a_chunked_round():
    n, w, data = 10, jnp.array([0.5, -1.0, 2.0]), _data(10)

    def derivatives(k):  # compiled together: op-by-op dispatch of the round took seconds
        def loss(w):
            return jnp.sum(_every_aggregation(n, k)(w, data)["weighted"] ** 2)
        return jax.jit(lambda w: (jax.grad(loss)(w), jax.jvp(loss, (w,), (jnp.ones(3),))[1]))(w)

    for got, want in zip(derivatives(4), derivatives(None)):
        np.testing.assert_allclose(got, want, rtol=1e-5)


def _mapped(w, x):
    return fb.federated_map_clients(lambda w, x: jnp.sin(w * x), (fb.federated_broadcast(w), x))


def _int_codes(w, x):
    return fb.federated_map_clients(lambda v: jnp.round(4 * v + 4).astype(jnp.int32),
                                    _mapped(w, x))


def _summed(w, x, keys):
    return fb.federated_sum(_mapped(w, x))


# One small program per federated primitive, its result depending on w through it.
USES = {
    "federated_broadcast": _summed,
    "federated_map": _summed,
    "federated_sum": _summed,
    "federated_mean": lambda w, x, keys: fb.federated_mean(_mapped(w, x)),
    "federated_weighted_mean": lambda w, x, keys: fb.federated_weighted_mean(
        _mapped(w, x), jnp.exp(_mapped(w, x))),  # weights with a tangent too
    "federated_decode_sum": lambda w, x, keys: fb.federated_decode_sum(
        lambda c: 2 * c, _mapped(w, x)),
    "federated_secure_sum_bitwidth": lambda w, x, keys: w * fb.federated_secure_sum_bitwidth(
        _int_codes(w, x), 4).astype(jnp.float32),
    "federated_secure_sum": lambda w, x, keys: w * fb.federated_secure_sum(
        _int_codes(w, x), 9).astype(jnp.float32),
    "federated_secure_mean": lambda w, x, keys: fb.federated_secure_mean(
        _mapped(w, x), keys, value_range=(-0.9, 0.9)),  # some clients clipped
}


def _differentiated(uses, k, n=3, compiled=True):
    """(jacrev, jvp) at w of a program giving the results of `uses` stacked, in chunks
    of k; with `compiled=False` only traced (to see what is refused)."""
    program = fb.program(clients=n, clients_per_step=k)(
        lambda w, x, keys: jnp.stack([use(w, x, keys) for use in uses]))
    x = jnp.linspace(0.2, 1.5, n)
    keys = jax.random.key_data(jax.random.split(jax.random.PRNGKey(0), n))

    def f(w):
        return program(w, x, keys)

    both = lambda w: (jax.jacrev(f)(w), jax.jvp(f, (w,), (jnp.float32(1),))[1])  # noqa: E731
    return (jax.jit(both) if compiled else jax.make_jaxpr(both))(jnp.float32(1.1))


def _refusal(use, k):
    try:
        _differentiated((use,), k, compiled=False)
    except Exception as e:  # compared by class: refused alike, or not at all
        return type(e)
    return None


def test_every_primitive_differentiates_alike_chunked_or_not():
    from fax_bridge.language import primitive_facts
    assert set(USES) == {f.primitive.name for f in primitive_facts.registered()}, \
        "give each registered primitive a use in USES"
    uses = tuple(dict.fromkeys(USES.values()))  # one program may use several primitives
    refused = {use: _refusal(use, None) for use in uses}
    for use in (use for use, error in refused.items() if error):
        for k in (1, 2):  # 2 does not divide the 3 clients
            assert _refusal(use, k) is refused[use], ([n for n, u in USES.items()
                                                       if u is use], k)
    uses = tuple(use for use in uses if not refused[use])
    whole = _differentiated(uses, None)  # every use's derivatives, one compile
    assert np.all(np.asarray(whole) != 0)  # a derivative to compare, for each
    for k in (1, 2):
        for got, want in zip(_differentiated(uses, k), whole):
            for name, use in USES.items():
                if use in uses:
                    np.testing.assert_allclose(got[uses.index(use)], want[uses.index(use)],
                                               rtol=1e-5, err_msg=f"{name} k={k}")
    x, keys = jnp.linspace(0.2, 1.5, 3), jax.random.key_data(jax.random.split(
        jax.random.PRNGKey(0), 3))
    eager = jax.grad(fb.program(clients=3, clients_per_step=2)(USES["federated_secure_mean"]))
    np.testing.assert_allclose(eager(jnp.float32(1.1), x, keys),
                               whole[0][uses.index(USES["federated_secure_mean"])],
                               rtol=1e-5)


def _second_derivatives(uses, k, n=3, compiled=True):
    """Second derivatives at w of sin(3 * each use) (so each aggregate's value is itself
    differentiated), in chunks of k: (grad of grad, jvp of grad, the jvp over x of the
    grad over w); with `compiled=False` only traced (to see what is refused)."""
    program = fb.program(clients=n, clients_per_step=k)(
        lambda w, x, keys: jnp.sin(3 * jnp.stack([use(w, x, keys) for use in uses])))
    keys = jax.random.key_data(jax.random.split(jax.random.PRNGKey(0), n))

    def f(w, x):
        return program(w, x, keys)

    def all_three(w, x):
        grad = jax.jacrev(f)
        return (jax.jacrev(grad)(w, x), jax.jvp(lambda w: grad(w, x), (w,), (jnp.float32(1),))[1],
                jax.jvp(lambda x: grad(w, x), (x,), (jnp.ones_like(x),))[1])

    args = (jnp.float32(1.1), jnp.linspace(0.2, 1.5, n))
    return (jax.jit(all_three) if compiled else jax.make_jaxpr(all_three))(*args)


def _second_refusal(use, k, n=3):
    try:
        _second_derivatives((use,), k, n, compiled=False)
    except Exception as e:  # compared by class: refused alike, or not at all
        return type(e)
    return None


def test_every_primitive_differentiates_twice_alike_chunked_or_not():
    """grad of grad, jvp of grad and a jvp over the data of the grad: each primitive's
    second derivatives in chunks of 2 (which does not divide the 3 clients; sizes that
    do: the test below) are the unchunked ones, or refused alike."""
    uses = tuple(dict.fromkeys(USES.values()))
    refused = {use: _second_refusal(use, None) for use in uses}
    for use in (use for use, error in refused.items() if error):
        assert _second_refusal(use, 2) is refused[use], [n for n, u in USES.items()
                                                         if u is use]
    uses = tuple(use for use in uses if not refused[use])
    for which, got, want in zip(("grad of grad", "jvp of grad", "jvp over x"),
                                _second_derivatives(uses, 2), _second_derivatives(uses, None)):
        for name, use in USES.items():
            if use in uses:
                np.testing.assert_allclose(got[uses.index(use)], want[uses.index(use)],
                                           rtol=2e-5, atol=1e-6, err_msg=f"{name}: {which}")


# Compiles second derivatives of several cohorts twice each (about 20 s): make
# test-peers; every primitive's second derivative at one chunk size is in make test.
@pytest.mark.peers
@settings(max_examples=4, deadline=None)
@given(name=st.sampled_from(sorted(USES)), n=st.integers(2, 6), k=st.integers(1, 6))
def test_second_derivatives_in_chunks_of_any_size(name, n, k):
    """Any registered primitive, any cohort, chunks that divide it or not (or cover it)."""
    use = USES[name]
    if _second_refusal(use, None, n):
        assert _second_refusal(use, k, n) is _second_refusal(use, None, n)
        return
    for which, got, want in zip(("grad of grad", "jvp of grad", "jvp over x"),
                                _second_derivatives((use,), k, n),
                                _second_derivatives((use,), None, n)):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6, err_msg=which)


def test_linearize_of_a_chunked_round_gives_the_unchunked_value_and_derivative():
    """jax.linearize (what jax.grad runs) finds the chunked round's value known from the
    primals, whatever jax version partially evaluates it."""
    x, keys = jnp.linspace(0.2, 1.5, 3), jax.random.key_data(jax.random.split(
        jax.random.PRNGKey(0), 3))
    uses = (USES["federated_secure_mean"], USES["federated_weighted_mean"])
    results = {}
    for k in (None, 2):
        program = fb.program(clients=3, clients_per_step=k)(
            lambda w, x, keys: jnp.stack([use(w, x, keys) for use in uses]))
        value, linear = jax.linearize(lambda w: program(w, x, keys), jnp.float32(1.1))
        results[k] = value, linear(jnp.float32(1.0))
    for got, want in zip(results[2], results[None]):
        np.testing.assert_allclose(got, want, rtol=1e-5)


def _mlp_round(n, k, width=128):
    @fb.program(clients=n, clients_per_step=k)
    def round_(w, x):
        def local(w, x):
            g = jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w["a"]) @ w["b"]))(w)
            return jax.tree.map(lambda a, b: a - 0.1 * b, w, g)
        return fb.federated_mean(fb.federated_map_clients(local, (fb.federated_broadcast(w), x)))

    w = {"a": jnp.full((width, width), 0.01), "b": jnp.ones((width,))}
    return round_, w, jnp.ones((n, 16, width))


def _temporaries(fn, *args) -> int:
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("grad", [False, True])
def test_temporaries_stay_those_of_a_chunk_whatever_the_cohort(grad):
    sizes = {}
    for n in (8, 128):
        for k in (None, 4):
            round_, w, x = _mlp_round(n, k)
            fn = (lambda w, x, r=round_: jax.grad(lambda w: r(w, x)["b"].sum())(w)) if grad \
                else round_
            sizes[n, k] = _temporaries(fn, w, x)
    assert sizes[128, None] > 8 * sizes[8, None]  # unchunked: grows with the cohort
    assert sizes[128, 4] <= 1.1 * sizes[8, 4]  # chunked: flat


def test_dp_aggregator_and_secure_mean_in_chunks():
    dp = privacy.gaussian_adaptive(noise_multiplier=1.0, clients_per_round=9)

    def make(k):
        @fb.program(clients=9, clients_per_step=k)
        def dp_round(state, updates, keys):
            mean, new_state, _ = dp.aggregate(state, updates)
            quantized = fb.federated_secure_mean(updates, keys, value_range=(-2.0, 2.0))
            return mean, new_state, quantized
        return dp_round

    updates = jax.random.normal(jax.random.PRNGKey(1), (9, 6))
    keys = jax.random.key_data(jax.random.split(jax.random.PRNGKey(2), 9))
    state = dp.init(0)
    whole = jax.jit(make(None))(state, updates, keys)
    chunked = jax.jit(make(4))(state, updates, keys)
    for a, b in zip(jax.tree.leaves(chunked), jax.tree.leaves(whole)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_nested_programs_chunk_the_outer_cohort():
    @fb.program(placements={"workers": 3})
    def inner(v, x):
        return fb.federated_mean(fb.federated_map_clients(lambda v, x: v * x,
                                                          (fb.federated_broadcast(v), x)))

    def make(k):
        @fb.program(clients=6, clients_per_step=k)
        def outer(w, x):
            per_client = fb.federated_map_clients(inner, (fb.federated_broadcast(w), x))
            return fb.federated_sum(per_client)
        return outer

    w, x = jnp.float32(1.5), jnp.arange(18.0).reshape(6, 3)
    np.testing.assert_allclose(jax.jit(make(4))(w, x), make(None)(w, x), rtol=1e-6)


def test_export_is_the_same_for_every_chunk_size():
    w, data = jnp.array([0.5, -1.0, 2.0]), _data(6)
    protos = {k: fb.export_tff(_every_aggregation(6, k), w, data,
                               placements=("server", "clients")).SerializeToString()
              for k in (None, 2, "auto")}
    assert protos[None] == protos[2] == protos["auto"]


def test_auto_picks_the_largest_chunk_that_fits_and_says_so(monkeypatch, caplog):
    round_, w, x = _mlp_round(16, "auto", width=64)
    need = {k: chunk_size.round_bytes(round_, k, (w, x), {}) for k in (4, 8)}
    assert chunk_size.round_bytes(round_, 4, (w, x), {}, gradient=True) > need[4]
    budget = (need[4] + need[8]) // 2
    with caplog.at_level(logging.INFO, logger="fax_bridge.local.chunk_size"):
        assert round_.chunk_size(w, x, memory_bytes=budget) == 4
    assert "4 of 16 clients a step (forward round" in caplog.text
    monkeypatch.setattr(chunk_size, "memory_limit", lambda: budget)  # "auto" in a call
    whole, _, _ = _mlp_round(16, None, width=64)
    np.testing.assert_allclose(jax.jit(round_)(w, x)["b"], whole(w, x)["b"], rtol=1e-5)
    with pytest.raises(ArgumentError, match="memory_bytes must be a positive"):
        round_.chunk_size(w, x, memory_bytes=0)


def _federated_dot(n: int):
    return fb.program(clients=n, clients_per_step="auto")(lambda w, x: fb.federated_sum(
        fb.federated_map_clients(lambda w, x: w * x, (fb.federated_broadcast(w), x))))


def test_auto_takes_a_compile_refused_for_memory_as_not_fitting(monkeypatch):
    refused = []

    def compile_on_a_small_chip(program, k, args, kwargs, gradient=False):
        if k > 2:  # as jax raises a TPU's refusal from compile()
            refused.append(k)
            raise jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in "
                "memory space hbm. Used 30.61G of 15.75G hbm. Exceeded hbm capacity by "
                "14.86G. Total hbm usage >= 30.61G: ... HLO temporaries (30.61G) exceeds "
                "available HBM (15.75G)")
        return 1000 * k

    monkeypatch.setattr(chunk_size, "round_bytes", compile_on_a_small_chip)
    program, x = _federated_dot(16), jnp.arange(16.0)
    assert program.chunk_size(1.0, x, memory_bytes=1 << 40) == 2 and refused

    def broken(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("INTERNAL: no answer about memory")

    monkeypatch.setattr(chunk_size, "round_bytes", broken)
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        program.chunk_size(1.0, x, memory_bytes=1 << 39)


def test_auto_sizes_the_gradient_of_a_differentiated_round(monkeypatch, caplog):
    def sized(program, k, args, kwargs, gradient=False):
        return (3 if gradient else 1) * 1000 * k  # a gradient takes 3x the forward round

    monkeypatch.setattr(chunk_size, "round_bytes", sized)
    monkeypatch.setattr(chunk_size, "memory_limit", lambda: 8000)
    program, x = _federated_dot(16), jnp.arange(16.0)
    with caplog.at_level(logging.INFO, logger="fax_bridge.local.chunk_size"):
        assert float(program(2.0, x)) == 2 * float(x.sum())
        assert float(jax.grad(program)(2.0, x)) == float(x.sum())
    assert "8 of 16 clients a step (forward round: 8000" in caplog.text
    assert "2 of 16 clients a step (gradient: 6000" in caplog.text
    assert program.chunk_size(2.0, x) == 8


def test_compiled_bytes_counts_a_donated_argument_once():
    spec = jax.ShapeDtypeStruct((1000,), jnp.float32)
    kept = jax.jit(lambda x: 2 * x).lower(spec).compile()
    donated = jax.jit(lambda x: 2 * x, donate_argnums=0).lower(spec).compile()
    assert chunk_size.compiled_bytes(kept) >= 8000       # the argument and the result
    assert chunk_size.compiled_bytes(donated) == 4000    # the result reuses the argument


def test_memory_limit_says_when_the_device_reports_none(monkeypatch):

    class Device:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            return self.stats

    monkeypatch.setattr(jax, "devices", lambda: [Device({"bytes_limit": 1 << 34})])
    assert chunk_size.memory_limit() == chunk_size.memory_limit(host_fallback=False) == 1 << 34
    monkeypatch.setattr(jax, "devices", lambda: [Device(None)])
    assert chunk_size.memory_limit(host_fallback=False) is None
    assert chunk_size.memory_limit() > 0                 # half the host's memory


def test_progress_counts_the_clients_of_each_chunked_round(monkeypatch):
    from fax_bridge.system import progress
    bars = []

    class Bar:
        def __init__(self, total, **kwargs):
            self.total, self.updates, self.closed = total, [], False
            bars.append(self)

        def update(self, n):
            self.updates.append(n)

        def close(self):
            self.closed = True

    monkeypatch.setattr(progress, "bar", Bar)
    quiet, x = _federated_dot(5).with_clients_per_step(2), np.arange(5.0, dtype=np.float32)
    shown = fb.program(clients=5, clients_per_step=2, progress=True)(quiet.fn)
    jax.block_until_ready(jax.jit(quiet)(2.0, x))
    assert not bars  # off by default
    jax.block_until_ready(jax.jit(shown)(2.0, x))
    jax.block_until_ready(jax.grad(shown)(2.0, x))
    fb.stream_clients(shown, 1)(2.0, lambda ids: x[ids])
    jax.effects_barrier()
    assert [(b.total, sorted(b.updates), b.closed) for b in bars] == [(5, [1, 2, 2], True)] * 3
    with pytest.raises(ProgramError, match="progress must be True or False"):
        fb.program(clients=5, progress="yes")(quiet.fn)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "all", [4]])
def test_a_bad_chunk_size_is_refused_naming_it(bad):
    with pytest.raises(ProgramError, match="clients_per_step must be a positive integer"):
        fb.program(clients=8, clients_per_step=bad)(lambda x: x)


def test_jit_program_takes_the_chunk_size_for_programs_only():
    mesh = jax.make_mesh((1,), ("clients",))
    with pytest.raises(ArgumentError, match="needs a fax_bridge.program"):
        fb.jit_program(lambda x: x, mesh, clients_per_step=2)


MESH_SCRIPT = textwrap.dedent("""
    import json, re
    import jax, jax.numpy as jnp, numpy as np
    import fax_bridge as fb
    from fax_bridge.errors import ArgumentError

    N = 40
    @fb.program(clients=N)
    def step(w, x):
        g = fb.federated_map_clients(lambda a, b: jnp.tanh(b @ a) @ b,
                                     (fb.federated_broadcast(w), x))
        return w - 0.1 * fb.federated_mean(g), fb.federated_sum(g)

    mesh = jax.make_mesh((8,), ("clients",))
    w = jnp.ones(3) * 0.1
    x = jnp.arange(N * 4 * 3, dtype=jnp.float32).reshape(N, 4, 3) / 1000
    whole = fb.jit_program(step, mesh, placements=("server", "clients"))(w, x)
    run = fb.jit_program(step, mesh, placements=("server", "clients"), clients_per_step=16)
    out = run(w, x)
    hlo = run.lower(w, x).compile().as_text()
    try:
        fb.jit_program(step, mesh, placements=("server", "clients"), clients_per_step=12)(w, x)
        refused = ""
    except ArgumentError as e:
        refused = str(e)
    print(json.dumps({
        "err": max(float(np.max(np.abs(a - b))) for a, b in zip(out, whole)),
        "chunk_shapes": sorted(set(re.findall(r"f32\\[(\\d+),4,3\\]", hlo))),
        "refused": refused}))
""")


def test_each_device_runs_its_share_of_every_chunk():
    r = run_on_cpu_devices(MESH_SCRIPT)
    assert r["err"] < 1e-5
    assert "2" in r["chunk_shapes"]  # 16 a step over 8 devices: 2 clients a device
    assert "multiple of 8" in r["refused"]


def test_parity_explains_chunked_sums():
    from fax_bridge.parity.check import note_chunked_sums
    from fax_bridge.parity.report import LeafParity

    def leaves():
        return [LeafParity("result", (3,), "float32", 1e-7, 1e-7, False,
                           explanation="float rounding explains it: ..."),
                LeafParity("result[1]", (), "int32", 0, 0, True)]

    chunked = fb.program(clients=8, clients_per_step=4)(lambda x: fb.federated_sum(x))
    got = leaves()
    note_chunked_sums(got, chunked, 8)
    assert "in chunks of 4" in got[0].explanation and not got[1].explanation
    whole = leaves()
    note_chunked_sums(whole, chunked.with_clients_per_step(8), 8)  # k >= N: not chunked
    assert "chunks" not in whole[0].explanation


def _runs_in_chunks(fn, *args) -> bool:
    """Whether jit of `fn` runs its clients in chunks: its traced jaxpr loops (`scan`)."""
    return "scan" in str(jax.jit(fn).trace(*args).jaxpr)


def _tracings():
    """Every way a program is traced whole (for export or a parity check), each taking
    (program, w, data)."""
    where = ("server", "clients")
    return {
        "trace": lambda p, w, data: fb.trace(p, w, data, placements=where),
        "export_tff": lambda p, w, data: fb.export_tff(p, w, data, placements=where),
        "trace of its jit": lambda p, w, data: fb.trace(jax.jit(p), w, data,
                                                        placements=where, clients=6),
    }


@pytest.mark.parametrize("tracing", list(_tracings()))
def test_tracing_a_program_leaves_what_jit_of_it_computes(tracing):
    """Tracing whole for export runs the same program object unchunked: jit of that
    object afterwards still runs (and computes) in chunks, and a jitted object jitted
    again sees the same."""
    w, data = jnp.array([0.5, -1.0, 2.0]), _data(6)
    fresh = jax.jit(_every_aggregation(6, 2))(w, data)
    program = _every_aggregation(6, 2)
    jitted = jax.jit(program)
    _tracings()[tracing](program, w, data)
    assert _runs_in_chunks(program, w, data) and _runs_in_chunks(jitted, w, data)
    for got in (jax.jit(program)(w, data), jitted(w, data)):
        _close(got, fresh, exact=True)  # the bits of an object never traced


@pytest.mark.parametrize("tracing", list(_tracings()))
def test_a_program_traces_whole_after_jit_ran_it_in_chunks(tracing):
    w, data = jnp.array([0.5, -1.0, 2.0]), _data(6)
    program = _every_aggregation(6, 2)
    jax.block_until_ready(jax.jit(program)(w, data))
    # one call site for both: an export records its callers' source lines
    got, want = (_tracings()[tracing](p, w, data) for p in (program, _every_aggregation(6, 2)))
    if tracing == "export_tff":
        assert got.SerializeToString() == want.SerializeToString()
    else:
        assert str(got) == str(want) and "scan" not in str(got)


@settings(max_examples=12, deadline=None)
@given(declared=st.fixed_dictionaries({}, optional={
           "clients_per_step": st.sampled_from([None, 2, 4, "auto"]),
           "progress": st.booleans()}),
       given_=st.fixed_dictionaries({}, optional={
           "clients_per_step": st.sampled_from([None, 2, 3, "auto"]),
           "progress": st.booleans(), "clients": st.just(6)}))
def test_program_of_a_program_applies_the_options_given(declared, given_):
    """fb.program(existing_program, ...) is that program with the options given applied
    and the others as it declared them: none is dropped."""
    existing = fb.program(clients=6, **declared)(_mapped)
    again = fb.program(existing, **given_)
    assert again.fn is _mapped and again.clients == 6 and again.placement == "clients"
    for option in ("clients_per_step", "progress"):
        want = given_.get(option, declared.get(option, False if option == "progress" else None))
        assert getattr(again, option) == want, option
    assert (existing.clients_per_step, existing.progress) == (
        declared.get("clients_per_step"), declared.get("progress", False))  # left as it was
    as_decorator = fb.program(**dict(given_, clients=6))(existing)
    assert (as_decorator.clients_per_step, as_decorator.progress) == (
        again.clients_per_step, again.progress)


def test_program_of_a_program_runs_in_the_chunks_given():
    existing = fb.program(clients=6)(_summed_program_body)
    w, x = jnp.float32(0.5), jnp.linspace(0.0, 1.0, 6)
    assert not _runs_in_chunks(existing, w, x)
    assert _runs_in_chunks(fb.program(existing, clients=6, clients_per_step=2), w, x)
    shown = existing.with_clients_per_step(2, progress=True)
    assert (shown.clients_per_step, shown.progress) == (2, True)
    assert existing.with_clients_per_step(3).progress is False  # kept as declared


def _summed_program_body(w, x):
    return fb.federated_sum(_mapped(w, x))


@pytest.mark.parametrize("given_, named", [
    (dict(clients=8), "clients=8"),
    (dict(placements={"workers": 6}), "workers=6"),
])
def test_program_of_a_program_refuses_another_cohort_by_name(given_, named):
    existing = fb.program(clients=6)(_mapped)
    with pytest.raises(ProgramError, match="already a program") as info:
        fb.program(existing, **given_)
    assert named in str(info.value) and "clients_per_step" in str(info.value)
