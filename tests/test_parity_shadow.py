"""The float64 shadow (`parity.shadow`): the program's own float64 truth, where user code
fixes float32 (a scan carry made with `jnp.zeros(..., jnp.float32)`, which a float64
re-run under x64 refuses), and bounds that hold jit's float32 result to it, under 1e-4
of the values, drawn alike run to run."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

import fax_bridge as fb
from fax_bridge.parity import shadow as parity_shadow
from fax_bridge.language.tracing import trace


@fb.program(clients=2)
def _steps(w, x):
    def local(w, x):
        def step(h, xt):
            h = jnp.tanh(xt @ w + h)
            return h, h.sum()

        h, sums = jax.lax.scan(step, jnp.zeros(w.shape[1], jnp.float32), x)
        return h, sums

    h, sums = fb.federated_map_clients(local, (fb.federated_broadcast(w), x))
    return fb.federated_mean(h), fb.federated_sum(sums)


def _reference(w, x):
    w, x = w.astype(np.float64), x.astype(np.float64)
    hs, all_sums = [], []
    for c in range(x.shape[0]):
        h, sums = np.zeros(w.shape[1]), []
        for t in range(x.shape[1]):
            h = np.tanh(x[c, t] @ w + h)
            sums.append(h.sum())
        hs.append(h)
        all_sums.append(sums)
    return np.mean(hs, 0), np.sum(all_sums, 0)


@settings(max_examples=2, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_the_truth_is_float64_through_a_float32_carry_and_the_bound_holds_jit(seed):
    rng = np.random.default_rng(seed)
    w = (rng.normal(size=(3, 4)) * 0.5).astype(np.float32)
    x = rng.normal(size=(2, 12, 3)).astype(np.float32)
    comp = trace(_steps, w, x, placements=("server", "clients"))
    shadow = parity_shadow.measure(comp, (w, x))
    got = [np.asarray(v, np.float64) for v in _steps(w, x)]
    for truth, want, jit, bound in zip(shadow.truth, _reference(w, x), got,
                                       shadow.bounds()):
        np.testing.assert_allclose(truth, want, rtol=1e-12, atol=1e-12)
        assert np.all(np.abs(jit - want) <= bound), (np.abs(jit - want), bound)
        top = np.float32(np.abs(jit).max())
        assert np.all(bound > 0) and bound.max() <= 1e-4 * top + np.spacing(top)
    again = parity_shadow.measure(comp, (w, x))  # the same draws: the same bounds
    assert len(shadow.bounds()) == len(again.bounds()) == len(got) and \
        all(np.array_equal(a, b) for a, b in zip(shadow.bounds(), again.bounds()))
    kinds = [kind for kind, _ in shadow.aggregands]
    assert kinds == ["mean", "sum"]
    # per client (2), what each hands over: its last h (4) and its 12 steps' sums
    assert [(kind, [np.shape(b) for b in bs]) for kind, bs in shadow.aggregand_bounds()] \
        == [("mean", [(2, 4)]), ("sum", [(2, 12)])]


def _coded_values(rng, clients: int, size: int) -> np.ndarray:
    """Per client, `size` values each 1.25 x a power of two of its largest magnitude
    (the middle of an E3M0 level), signs drawn: no value near a code's edge."""
    exponents = rng.integers(-6, 1, size=(clients, size)).astype(np.float64)
    r = np.where(exponents == 0, 1.0, 1.25 * 2.0 ** exponents)
    scale = rng.uniform(0.5, 4.0, size=(clients, 1))
    signs = rng.choice([-1.0, 1.0], size=(clients, size))
    return (signs * r * scale).astype(np.float32)


@fb.program(clients=3)
def _coded_mean(x):
    from fax_bridge.algorithms import e3m0

    return fb.federated_mean(fb.federated_map_clients(e3m0.quantize, x))


@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_exact_conversions_draw_no_rounding(seed):
    """A comparison's bool and a quantization code made floats, and random bits read
    as a float, are exact: the shadow draws no rounding there, so clients sending E3M0
    codes of values away from a code's edge get a bound of rounding, not of a whole
    quantization level (drawn there, the top level dropped to half in the samples)."""
    x = _coded_values(np.random.default_rng(seed), 3, 16)
    shadow = parity_shadow.measure(trace(_coded_mean, x, placements="clients"), (x,))
    (bound,) = shadow.bounds()
    top = np.float32(np.abs(np.asarray(_coded_mean(x))).max())
    assert bound.max() <= 1e-4 * top + np.spacing(top), (bound.max(), top)

    @fb.program(clients=2)
    def uniform(w):  # float32 bits made a float in [1, 2), less 1: no rounding at all
        return fb.federated_map_server(
            lambda w: w * 0.0 + jax.random.uniform(jax.random.key(seed % 1000), w.shape),
            w)

    w = np.ones(64, np.float32)
    (bound,) = parity_shadow.measure(trace(uniform, w, placements="server"), (w,)).bounds()
    assert bound.max() <= 3 * np.spacing(np.float32(1.0)), bound.max()



# ---------------------------------------------------------------------------------------
# Decisions on floats (a comparison, argmax, a float made an index, floor, sign, a while
# predicate) follow the float32 path: 1 + 2^-25 is 1.0 in float32 (a tie, to even) and
# above 1 in float64, so a shadow deciding in float64 takes the other branch there.

TIE, ABOVE, BELOW = 2.0 ** -25, 2.0 ** -20, -(2.0 ** -20)


def _above_one(t):
    """Each kind of decision that `t > 1` is, as a 0/1 float."""
    pick = jnp.stack([jnp.float32(0.0), jnp.float32(1.0)])
    index = jnp.clip(((t - 1.0) * 2.0 ** 25).astype(jnp.int32), 0, 1)
    return {"where": jnp.where(t > 1.0, 1.0, 0.0),
            "cond": jax.lax.cond(t > 1.0, lambda: 1.0, lambda: 0.0),
            "argmax": pick[jnp.argmax(jnp.stack([jnp.float32(1.0), t]))],
            "index": pick[index],
            "floor": jnp.clip(jnp.floor((t - 1.0) * 2.0 ** 25), 0.0, 1.0),
            "sign": jnp.clip(jnp.sign(t - 1.0), 0.0, 1.0)}


def _decided_steps(kind):
    @fb.program(clients=3)
    def steps(x, a):
        def local(x, a):
            def step(h, xt):
                up = _above_one(xt[0] + xt[1])[kind]
                h = h * 0.75 + (2.0 * up - 1.0) * a
                return h, h.sum()

            return jax.lax.scan(step, jnp.zeros_like(a), x)

        h, sums = fb.federated_map_clients(local, (x, a))
        return fb.federated_mean(h), fb.federated_sum(sums)

    return steps


_DECIDED = {kind: _decided_steps(kind) for kind in
            ("where", "cond", "argmax", "index", "floor", "sign")}


def _decided_reference(x, a):
    """The program in float64 on float32's branches (numpy)."""
    hs, all_sums = [], []
    for c in range(x.shape[0]):
        h, sums = np.zeros(a.shape[1]), []
        for t in range(x.shape[1]):
            up = float(np.float32(x[c, t, 0]) + np.float32(x[c, t, 1]) > np.float32(1.0))
            h = h * 0.75 + (2.0 * up - 1.0) * a[c].astype(np.float64)
            sums.append(h.sum())
        hs.append(h)
        all_sums.append(sums)
    return np.mean(hs, 0), np.sum(all_sums, 0)


def _holds_jit_tightly(shadow, got, want):
    """The shadow's truth is `want`, its bounds hold jit's result to it within 1e-4 of
    the values, and a jit result off by a relative 1e-3 at its largest element is not."""
    for truth, expect, jit, bound in zip(shadow.truth, want, got, shadow.bounds()):
        np.testing.assert_allclose(truth, expect, rtol=1e-12, atol=1e-12)
        assert np.all(np.abs(jit - expect) <= bound), (np.abs(jit - expect), bound)
        top = np.float32(np.abs(jit).max())
        assert bound.max() <= 1e-4 * top + np.spacing(top), (bound.max(), top)
        i = np.unravel_index(np.argmax(np.abs(jit)), np.shape(jit))
        off = np.array(jit, copy=True)
        off[i] *= 1.0 + 1e-3
        assert np.abs(off - expect)[i] > np.asarray(bound)[i]


@settings(max_examples=2, deadline=None)
@given(kind=st.sampled_from(sorted(_DECIDED)), seed=st.integers(0, 2**31 - 1))
def test_decisions_on_floats_follow_float32_s_branch(kind, seed):
    """Per step of a scan in a client map, a decision `t > 1` made as a comparison, a
    `cond`, an argmax, a float made an index, a floor or a sign, where t is a sum float32
    rounds to 1.0 at some steps and float64 does not: the shadow's truth is the program
    on float32's branches, and its bound is float32's rounding there (deciding in
    float64, it was the other branch's: a bound of a whole step, so a result 1e-3 off
    passed)."""
    rng = np.random.default_rng(seed)
    x = np.ones((3, 5, 2), np.float32)
    x[..., 1] = rng.choice([TIE, ABOVE, BELOW], size=(3, 5))
    x[0, 0, 1] = TIE
    a = rng.uniform(0.5, 2.0, size=(3, 4)).astype(np.float32)
    program = _DECIDED[kind]
    shadow = parity_shadow.measure(trace(program, x, a, placements="clients"), (x, a))
    got = [np.asarray(v, np.float64) for v in program(x, a)]
    _holds_jit_tightly(shadow, got, _decided_reference(x, a))


@fb.program(clients=3)
def _until_one(x, w):
    """Per client, from t = x0 + x1, steps down by float32's ulp at 1 while t > 1 (at
    most 4 steps), accumulating w each step."""
    def local(x, w):
        def more(s):
            return (s[0] > 1.0) & (s[2] < 4)

        def step(s):
            t, acc, k = s
            return t - 2.0 ** -23, acc * 0.75 + w, k + 1

        _, acc, k = jax.lax.while_loop(more, step, (x[0] + x[1], jnp.ones_like(w), 0))
        return acc, k

    acc, trips = fb.federated_map_clients(local, (x, w))
    return fb.federated_mean(acc), fb.federated_sum(trips)


@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_a_while_loop_runs_float32_s_trip_count(seed):
    """A while loop whose predicate reads a float that float32 rounds to the limit (no
    trip) and float64 does not (one trip): the shadow runs float32's trip count."""
    rng = np.random.default_rng(seed)
    x = np.ones((3, 2), np.float32)
    x[:, 1] = rng.choice([TIE, ABOVE, BELOW], size=3)
    x[0, 1] = TIE
    w = rng.uniform(0.5, 2.0, size=(3, 4)).astype(np.float32)
    accs, trips = [], 0
    for c in range(3):
        t, acc = np.float32(x[c, 0]) + np.float32(x[c, 1]), np.ones(4)
        k = 0
        while t > np.float32(1.0) and k < 4:
            t, acc, k = t - np.float32(2.0 ** -23), acc * 0.75 + w[c].astype(np.float64), k + 1
        accs.append(acc)
        trips += k
    shadow = parity_shadow.measure(trace(_until_one, x, w, placements="clients"), (x, w))
    got = [np.asarray(v, np.float64) for v in _until_one(x, w)]
    assert int(got[1]) == trips and int(shadow.float32[1]) == trips
    _holds_jit_tightly(shadow, got[:1], [np.mean(accs, 0)])
