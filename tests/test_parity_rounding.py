"""Parity reports explain a mismatch that float rounding in an aggregation causes:
generated cancellation-heavy client values, compared against the exact sums."""

import math
import re

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import event, given, settings, strategies as st

import fax_bridge as fb
from fax_bridge.parity.check import check_parity, compare_leaves
from fax_bridge.parity.rounding import Rounding, aggregation_roundings, explain
from fax_bridge.runtime import run_computation
from fax_bridge.language.tracing import trace

N = 6


class _InProcess:
    """The runtime in this process: exact aggregations, as on a fleet, without devices."""

    num_devices = 0

    def run(self, proto, *args, num_clients=None):
        return run_computation(proto, *args, num_clients=num_clients)


@fb.program(clients=N)
def _total(x):
    return fb.federated_sum(x)


@fb.program(clients=N)
def _average(x):
    return fb.federated_mean(x)


@fb.program(clients=N)
def _scaled_total(x):
    return fb.federated_map_server(lambda s: 2.0 * s - 1.0, fb.federated_sum(x))


def _cancelling(draw) -> np.ndarray:
    """N float32 addends per element: pairs of large values of opposite signs among
    small ones, shuffled, so jit's float sum loses what the exact sum keeps."""
    columns = []
    for _ in range(3):
        big = draw(st.floats(1e3, 1e9))
        small = draw(st.lists(st.floats(-8.0, 8.0, width=32), min_size=N - 2,
                              max_size=N - 2))
        column = np.asarray([big, -big * draw(st.sampled_from([1.0, 1.0 + 2 ** -20]))]
                            + small, np.float32)
        columns.append(column[draw(st.permutations(range(N)))])
    return np.stack(columns, axis=1)


@settings(max_examples=8, deadline=None)
@given(st.data(), st.sampled_from([_total, _average, _scaled_total]))
def test_a_rounding_mismatch_says_so_with_its_size_and_a_covering_tolerance(data, fn):
    """Held to the rounding bound (the default), jit's float sum and the exact one
    agree; compared with fixed tolerances, a difference past them is explained."""
    x = _cancelling(data.draw)
    bounded = check_parity(fn, jnp.asarray(x), placements="clients", fleet=_InProcess())
    [b] = bounded.leaves
    assert bounded.ok and b.bound is not None and b.bound >= b.max_abs, bounded.table()
    report = check_parity(fn, jnp.asarray(x), placements="clients", fleet=_InProcess(),
                          rtol=1e-5, atol=1e-6)
    [leaf] = report.leaves
    assert leaf.max_abs == b.max_abs
    event(f"{fn.__name__} ok={leaf.ok}")
    exact = np.asarray([math.fsum(map(float, column)) for column in x.T])
    if fn is _average:
        exact = exact / N
    if fn is not _scaled_total:  # the fleet's value is the exact sum, rounded once
        fleet = np.asarray(run_computation(fb.export_tff(fn, jnp.asarray(x),
                                                         placements="clients"), x))
        np.testing.assert_allclose(fleet, exact.astype(np.float32), rtol=2e-7, atol=1e-30)
    if leaf.ok:
        assert leaf.explanation == "" and "PARITY OK" in report.table()
        return
    text = report.table()
    assert f"{leaf.path}: float rounding" in text and text.endswith("PARITY MISMATCH")
    assert "n*eps*sum|x|" in leaf.explanation and "exact" in leaf.explanation
    atol = float(re.search(r"atol=([0-9.e+-]+) (covers|accepts) this",
                           leaf.explanation).group(1))
    assert atol >= leaf.max_abs
    [again] = compare_leaves(np.asarray(fn(jnp.asarray(x))),
                             np.asarray(run_computation(fb.export_tff(
                                 fn, jnp.asarray(x), placements="clients"), x)), 0.0, atol)
    assert again.ok  # the tolerance it names does cover the difference
    if fn is not _scaled_total:
        roundings, _, direct = aggregation_roundings(trace(fn, jnp.asarray(x),
                                                           placements="clients"), (x,))
        assert direct == [0] and roundings[0].bound >= leaf.max_abs
        assert leaf.explanation.startswith("float rounding explains it")
    else:
        assert leaf.explanation.startswith("float rounding may explain it")


def test_more_than_the_bound_is_not_called_rounding():
    r = Rounding("federated_sum", "f.py:1 (f)", 4, "float32", 10.0, 4.8e-6, 0.0, 1.0, 1.0)
    assert explain(1e-6, [r], frozenset({0}), 0).startswith("float rounding explains it")
    assert explain(1.0, [r], frozenset({0}), 0).startswith("not float rounding alone")
    assert explain(1.0, [r], frozenset(), None) == ""  # no aggregation feeds it


def test_integer_sums_need_no_explanation():
    x = np.asarray([2 ** 30, 5, -(2 ** 30), 1, 0, 0], np.int32)
    roundings, depends, _ = aggregation_roundings(trace(_total, x, placements="clients"),
                                                  (x,))
    assert roundings == [] and depends == [frozenset()]


@pytest.mark.parametrize("values", [[1e8, 1, -1e8, 1, 0, 0]])
def test_the_documented_example(values):
    """jit's float sum is 0 where the exact one is 2: within the rounding bound, but
    past the default tolerances, which say why."""
    x = jnp.asarray(values, jnp.float32)
    report = check_parity(_total, x, placements="clients", fleet=_InProcess())
    [leaf] = report.leaves
    assert report.ok and leaf.max_abs > 0 and leaf.bound >= leaf.max_abs
    report = check_parity(_total, x, placements="clients", fleet=_InProcess(), rtol=1e-5)
    assert not report.ok
    assert "exact 2, jit " in report.leaves[0].explanation


def test_bfloat16_sums_are_explained_too():
    """numpy calls bfloat16 kind 'V' and np.finfo refuses it; it is a float all the same."""
    # jit adds bfloat16 members in float32, where 2^30 + 1 rounds back to 2^30
    x = jnp.asarray([2.0 ** 30, 1.0, -2.0 ** 30, 1.0, 0.5, 0.5], jnp.bfloat16)
    report = check_parity(_total, x, placements="clients", fleet=_InProcess(), atol=1e-6)
    [leaf] = report.leaves
    assert not leaf.ok and leaf.explanation.startswith("float rounding explains it")
    assert "6 bfloat16 values" in leaf.explanation and "exact 3" in leaf.explanation


@fb.program(clients=3)
def _client_steps(w, x):
    def local(w, x):
        h = jnp.tanh(x @ w)
        return h.sum() * w + jnp.exp(-h.mean()) * x.sum(axis=0)

    return fb.federated_mean(fb.federated_map_clients(local, (fb.federated_broadcast(w), x)))


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([1e-3, 1.0, 1e3]))
def test_float32_results_stay_within_the_evaluation_bound_of_the_exact_result(seed, scale):
    """`evaluation_bounds` bounds how far a float32 evaluation (jit's) is from the exact
    one (float64 here), output element by element, through dots, transcendental
    functions and the mean over clients; so does the first-order analysis alone. The
    bound is under 1e-4 of the output's values (a bound above it would pass answers
    wrong by that much), and says which method gave it."""
    from fax_bridge.parity.first_order import first_order_bounds
    from fax_bridge.parity.rounding import FIRST_ORDER, SHADOW, evaluation_bounds

    rng = np.random.default_rng(seed)
    w = (rng.normal(size=4) * scale).astype(np.float32)
    x = (rng.normal(size=(3, 5, 4)) * scale).astype(np.float32)
    got = np.asarray(_client_steps(w, x), np.float64)
    w64, x64 = w.astype(np.float64), x.astype(np.float64)
    h = np.tanh(x64 @ w64)
    exact = np.mean([h[c].sum() * w64 + np.exp(-h[c].mean()) * x64[c].sum(axis=0)
                     for c in range(3)], axis=0)
    comp = trace(_client_steps, w, x, placements=("server", "clients"))
    methods: list = []
    (bound,) = evaluation_bounds(comp, (w, x), methods)
    (first,) = first_order_bounds(comp, (w, x))
    assert bound.shape == got.shape and np.all(bound > 0) and np.all(bound <= first)
    assert np.all(np.abs(got - exact) <= bound), (np.abs(got - exact), bound)
    assert np.all(np.abs(got - exact) <= first), (np.abs(got - exact), first)
    top = np.float32(np.abs(got).max())
    assert bound.max() <= 1e-4 * top + np.spacing(top), (bound.max(), top)
    assert len(methods) == 1 and (SHADOW in methods[0] or FIRST_ORDER in methods[0])


def _cnn_loss(k, w, x, y):
    import jax

    h = jax.lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    pooled = jnp.max(jax.nn.relu(h), axis=(1, 2))  # a global max pool
    logits = pooled @ w
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1)
    return -jnp.mean(picked), pooled


@fb.program(clients=2)
def _cnn_steps(params, data):
    """Five SGD steps of a small CNN (a global max pool, a cross-entropy) per client."""
    import jax

    def local(p, d):
        def step(p, _):
            g = jax.grad(lambda p: _cnn_loss(p[0], p[1], d["x"], d["y"])[0])(p)
            return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g), None

        p, _ = jax.lax.scan(step, p, None, length=5)
        loss, pooled = _cnn_loss(p[0], p[1], d["x"], d["y"])
        return loss, pooled

    loss, pooled = fb.federated_map_clients(local, (fb.federated_broadcast(params), data))
    return fb.federated_mean(loss), fb.federated_mean(pooled)


@settings(max_examples=1, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_loop_bounds_hold_and_do_not_grow_geometrically_with_the_local_steps(seed):
    """The bound of five local SGD steps (a loop) is the float64 shadow's: it holds
    against the exact (float64) result within 1e-4 of the values. The first-order
    analysis carries a loop's carry through each step's Jacobian: it holds too, and is
    far below carrying it op by op, which widens it
    by each op's |J| every step (hundreds on a loss of a few tenths)."""
    import jax

    from fax_bridge.parity import first_order as parity_first_order
    from fax_bridge.parity import rounding as parity_rounding

    rng = np.random.default_rng(seed)
    params = ((rng.normal(size=(3, 3, 2, 4)) * 0.3).astype(np.float32),
              (rng.normal(size=(4, 5)) * 0.3).astype(np.float32))
    data = {"x": rng.normal(size=(2, 3, 6, 6, 2)).astype(np.float32),
            "y": rng.integers(0, 5, size=(2, 3)).astype(np.int32)}
    comp = trace(_cnn_steps, params, data, placements=("server", "clients"))
    first = parity_first_order.first_order_bounds(comp, (params, data))
    methods: list = []
    bounds = parity_rounding.evaluation_bounds(comp, (params, data), methods)
    got = [np.asarray(v, np.float64) for v in _cnn_steps(params, data)]
    with jax.enable_x64(True):
        wide = jax.tree_util.tree_map(
            lambda a: a.astype(np.float64) if a.dtype == np.float32 else a, (params, data))
        exact = [np.asarray(v) for v in _cnn_steps(*wide)]
    for g, e, b, f in zip(got, exact, bounds, first):
        assert np.all(np.abs(g - e) <= b), (np.abs(g - e), b)
        assert np.all(np.abs(g - e) <= f), (np.abs(g - e), f)
        top = np.float32(np.abs(g).max())  # the shadow's: within 1e-4 of the values
        assert np.max(b) <= 1e-4 * top + np.spacing(top), (np.max(b), top)
    assert len(methods) == len(bounds) == len(got) and \
        all(m.startswith(parity_rounding.SHADOW) for m in methods), methods
    assert float(first[0]) < 0.5 * (1.0 + abs(float(got[0])))
    saved = parity_first_order.MAX_JACOBIAN_ENTRIES
    parity_first_order.MAX_JACOBIAN_ENTRIES = 0
    try:
        op_by_op = parity_first_order.first_order_bounds(comp, (params, data))
    finally:
        parity_first_order.MAX_JACOBIAN_ENTRIES = saved
    assert len(op_by_op) == len(first) == len(got) and \
        all(np.all(b <= o) for b, o in zip(first, op_by_op))
    assert float(op_by_op[0]) > 10 * float(first[0])


@fb.program(clients=4)
def _decoded_sum(x):
    """Each client sends its values as int8 codes and a float32 scale (computed at the
    client, so it carries rounding); the server decodes and sums them."""
    def encode(v):
        scale = jnp.max(jnp.abs(v)) / 7.0
        return jnp.round(v / scale).astype(jnp.int8), scale

    codes = fb.federated_map_clients(encode, x)
    return fb.federated_decode_sum(lambda c, s: c.astype(jnp.float32) * s, codes)


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([1e-3, 1.0, 1e4]))
def test_a_decode_sum_is_bounded_client_by_client_then_as_a_sum(seed, scale):
    """`evaluation_bounds` decodes each client's member with its bounds (the scale's
    rounding at the client carried through the decoder) and sums as `federated_sum`
    does: jit's float32 result is within it of the exact sum of the same codes."""
    from fax_bridge.parity.rounding import aggregand_bounds, evaluation_bounds

    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(4, 6)) * scale).astype(np.float32)
    got = np.asarray(_decoded_sum(x), np.float64)
    comp = trace(_decoded_sum, x, placements="clients")
    (bound,) = evaluation_bounds(comp, (x,))
    codes = np.stack([np.round(x[c] / (np.max(np.abs(x[c])) / np.float32(7.0)))
                      for c in range(4)]).astype(np.float64)  # jit's codes, taken alike
    exact = sum(codes[c] * (np.max(np.abs(x[c]).astype(np.float64)) / 7.0)
                for c in range(4))
    assert bound.shape == got.shape and np.all(np.isfinite(bound)) and np.all(bound > 0)
    assert np.all(np.abs(got - exact) <= bound), (np.abs(got - exact), bound)
    assert bound.max() <= 1e-5 * np.abs(codes).sum(0).max() * np.abs(x).max()  # not vacuous
    ((_, members),) = [r for r in aggregand_bounds(comp, (x,)) if len(r[1]) == 2]
    assert members[0].shape == (4, 6) and members[1].shape == (4,)  # per client
    assert np.all(members[0] == 0) and np.all(members[1] > 0)  # codes exact, scales not
