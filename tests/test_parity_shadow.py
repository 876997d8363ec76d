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

