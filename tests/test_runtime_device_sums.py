"""Exact sums on the device (jax, 32-bit integers): the bits of the host's `ExactSum`."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from fax_bridge.errors import ArgumentError, WeightError
from fax_bridge.runtime import aggregation, device_exact, device_sums
from fax_bridge.runtime.device_sums import DeviceColumn
from fax_bridge.runtime.exact import ExactSum
from fax_bridge.runtime.float_bits import float_params

FLOATS = [np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]


def _bits(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _host(stack: np.ndarray) -> np.ndarray:
    acc = ExactSum(stack.dtype, stack.shape[1:])
    acc.add_many(stack)
    return acc.result()


def _specials(dtype: np.dtype) -> np.ndarray:
    """Zeros, -0, the smallest and largest subnormals and normals, inf, NaN, +-1."""
    p, nexp, _, uint = float_params(dtype)
    top = (1 << nexp) - 1
    words = [0, 1, (1 << (p - 1)) - 1, 1 << (p - 1), (top << (p - 1)) - 1,
             top << (p - 1), (top << (p - 1)) | 1, ((top - 1) // 2) << (p - 1)]
    sign = 1 << (8 * dtype.itemsize - 1)
    return np.array(words + [w | sign for w in words], uint).view(dtype)


ROWS, SIZE = 12, 24  # one shape: the sums compile once per limb count


MIXES = ("raw", "near", "special", "mixed", "near_special")


@st.composite
def stacks(draw, dtype: np.dtype, mixes: tuple = MIXES):
    """[ROWS, SIZE] of `dtype`: random bit patterns (every class of value), values of a
    few nearby binades (long carries, ties), and the special values, mixed."""
    n, size = ROWS, SIZE
    _, _, _, uint = float_params(dtype)
    seed = draw(st.integers(0, 2 ** 32 - 1))
    rng = np.random.default_rng(seed)
    nbits = 8 * dtype.itemsize
    raw = rng.integers(0, 1 << nbits, (n, size), dtype=np.uint64).astype(uint).view(dtype)
    scale = draw(st.integers(-30, 30))
    near = (rng.standard_normal((n, size)) * 2.0 ** scale).astype(np.float32)
    near = np.asarray(near, dtype=np.float32).astype(dtype)
    specials = _specials(dtype)[rng.integers(0, 16, (n, size))]
    pick = rng.integers(0, 3, (n, size))
    mix = draw(st.sampled_from(mixes))
    if mix == "raw":
        return raw
    if mix == "near":
        return near
    if mix == "special":
        return specials
    if mix == "near_special":
        return np.where(pick == 0, specials, near)
    return np.where(pick == 0, raw, np.where(pick == 1, near, specials))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_float_sums_have_the_host_bits(dtype, data):
    stack = data.draw(stacks(dtype))
    count = data.draw(st.integers(1, ROWS))  # the rows after it are padding
    got = device_sums.exact_sum(DeviceColumn([jnp.asarray(stack)], [count]))
    np.testing.assert_array_equal(_bits(got), _bits(_host(stack[:count])))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_parts_with_padding_rows_sum_their_clients_only(dtype, data):
    """Several calls' arrays, each with padding rows after its clients (any values,
    never read): the sum of the clients' rows, in any grouping."""
    first, second = data.draw(stacks(dtype)), data.draw(stacks(dtype))
    cut = data.draw(st.integers(1, ROWS))
    padded = np.concatenate([first, np.full((4, SIZE), np.nan, dtype)])
    column = DeviceColumn([jnp.asarray(padded), jnp.asarray(second)], [cut, ROWS])
    want = _host(np.concatenate([first[:cut], second]))
    np.testing.assert_array_equal(_bits(device_sums.exact_sum(column)), _bits(want))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_sums_of_chunks_merged_have_the_host_bits(dtype, data):
    """Addends summed in any grouping (sums of chunks joined, windows moved down as
    lower addends arrive, the wider limbs of a joined sum) give the host's bits."""
    stack = data.draw(stacks(dtype))
    counts = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 6))
    parts = [device_sums.partial_of("sum", [DeviceColumn([jnp.asarray(rows)], [n])])
             for rows, n in zip((stack[:6], stack[6:]), counts)]
    joined = parts[0].joined(parts[1])
    assert joined.count == sum(counts)
    want = _host(np.concatenate([stack[:counts[0]], stack[6:6 + counts[1]]]))
    np.testing.assert_array_equal(_bits(device_sums.finish(joined)[0]), _bits(want))


def test_compiles_once_whatever_the_tensors_and_the_data():
    """One tensor or many of one dtype: one compiled sum; data of any scale or spread
    within the window: no new compile (a compile counter, not a timing)."""
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _s, **_k: compiles.append(event)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    rng = np.random.default_rng(0)

    def run(scale, tensors):
        columns = [DeviceColumn([jnp.asarray((rng.standard_normal((3, 5)) * scale
                                              ).astype(np.float32))], [3])
                   for _ in range(tensors)]
        return device_sums.exact_sums(columns)

    run(1.0, 40)
    before = len(compiles)
    for scale in (1e-30, 1e-3, 7.0, 1e20, 1e35):
        run(scale, 40)
    assert len(compiles) == before


def _operations_compiled(folder, run) -> int:
    """The StableHLO operations of the programs jax compiles while `run()` runs (read
    from jax's `jax_dump_ir_to` files)."""
    before = set(os.listdir(folder)) if os.path.isdir(folder) else set()
    old = jax.config.read("jax_dump_ir_to")
    jax.config.update("jax_dump_ir_to", str(folder))
    try:
        run()
    finally:
        jax.config.update("jax_dump_ir_to", old)
    return sum(open(os.path.join(folder, f)).read().count("stablehlo.")
               for f in set(os.listdir(folder)) - before if f.endswith("_compile.mlir"))


def test_finishing_the_sums_of_more_tensors_compiles_no_more_operations(tmp_path):
    """Finishing the sums of 24 tensors of one shape, then of 96: the programs compiled
    for each hold as many operations, whatever the number of tensors. Each tensor is
    cut out of its dtype's flat results by one program per shape; in one program with
    an output per tensor XLA compiled a kernel per tensor (83 s for 1,000 tensors of 4
    floats, a compile that grew with the model's leaves). Counts, not a timing."""
    rng = np.random.default_rng(1)
    compiled = []
    for tensors in (24, 96):
        stacks = [rng.standard_normal((3, 2, 3)).astype(np.float32) for _ in range(tensors)]
        partial = device_sums.partial_of(
            "mean", [DeviceColumn([jnp.asarray(x)], [3]) for x in stacks])
        got = []
        compiled.append(_operations_compiled(
            tmp_path, lambda: got.extend(device_sums.finish(partial))))
        assert len(got) == tensors
        for x, g in zip(stacks, got):  # each tensor its own mean, with the host's bits
            np.testing.assert_array_equal(_bits(g),
                                          _bits(aggregation.reduce("mean", list(x))))
    assert compiled[1] == compiled[0] > 0


def test_many_addends_carry_between_blocks():
    """More addends than a block (carries propagated between blocks) of the largest
    finite values, and of values that cancel down to a subnormal."""
    rows = device_exact.BLOCK_ROWS + 5
    big = np.full((rows, 3), np.finfo(np.float32).max, np.float32)
    big[::2, 1] *= -1
    big[:, 2] = np.float32(2.0 ** -126)
    big[-1, 2] = -np.float32(2.0 ** -126 * (rows - 1)) + np.float32(2.0 ** -149)
    got = device_sums.exact_sum(DeviceColumn([jnp.asarray(big)], [rows]))
    np.testing.assert_array_equal(_bits(got), _bits(_host(big)))


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.uint16], ids=str)
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), n=st.integers(1, 9))
def test_integer_sums_wrap_as_the_host_does(dtype, seed, n):
    info = np.iinfo(dtype)
    rng = np.random.default_rng(seed)
    stack = rng.integers(info.min, int(info.max) + 1, (9, 7), dtype=np.int64).astype(dtype)
    stack[0, :2] = info.max, info.min
    got = device_sums.exact_sum(DeviceColumn([jnp.asarray(stack)], [n]))
    assert np.asarray(got).dtype == np.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(got), _host(stack[:n]))


@pytest.mark.parametrize("kind", ["sum", "mean", "weighted_mean"])
def test_finished_aggregates_match_the_host(kind):
    """Sums, means and weighted means (each value times its weight, rounded, in the
    pass that sums them) have the host's bits, over tensors of several dtypes."""
    rng = np.random.default_rng(3)
    values = [(rng.standard_normal((5, 4, 3)) * 2.0 ** rng.integers(-20, 20, (5, 4, 3))
               ).astype(dtype) for dtype in (np.float32, ml_dtypes.bfloat16, np.float32)]
    weights = (rng.random(5) * 7).astype(np.float32)  # products round
    w = [weights] if kind == "weighted_mean" else None
    host = aggregation.finish(aggregation.partial_of_columns(
        kind, [v.copy() for v in values], 5, w))
    device = aggregation.finish(aggregation.device_partial(
        kind, [[jnp.asarray(v)] for v in values], [5],
        None if w is None else [jnp.asarray(weights)]))
    for d, h in zip(device, host):
        np.testing.assert_array_equal(_bits(np.asarray(d)), _bits(h))


def test_weighted_mean_refuses_negative_and_zero_weights_on_the_device():
    values = [[jnp.ones((2, 3), jnp.float32)]]
    for weights, said in (([1.0, -2.0], "negative"), ([0.0, 0.0], "sum to zero")):
        partial = aggregation.device_partial("weighted_mean", values, [2],
                                             [jnp.asarray(weights, jnp.float32)])
        with pytest.raises(WeightError, match=said):
            aggregation.finish(partial)


def test_on_device_reads_the_keyword_then_the_environment(monkeypatch):
    monkeypatch.setenv(device_sums.ENV_VAR, "1")
    assert device_sums.on_device() and not device_sums.on_device(False)
    monkeypatch.setenv(device_sums.ENV_VAR, "0")
    assert not device_sums.on_device() and device_sums.on_device(True)
    monkeypatch.setenv(device_sums.ENV_VAR, "yes")
    with pytest.raises(ArgumentError, match=device_sums.ENV_VAR):
        device_sums.on_device()
    monkeypatch.delenv(device_sums.ENV_VAR)
    assert device_sums.on_device() is False  # the tests run on the CPU backend


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1))
def test_division_is_numpy_s_on_any_bits(dtype, seed):
    """A mean's division: the float32 quotient rounded correctly (not the backend's
    division, which may be an ulp off), then rounded to the dtype, as numpy does."""
    rng = np.random.default_rng(seed)
    uint = float_params(dtype)[3]
    a = rng.integers(0, 1 << (8 * dtype.itemsize), 4096, dtype=np.uint64).astype(uint)
    b = np.concatenate([a[:1], np.array(3, dtype).view(uint)[None]]).view(dtype)
    a = a.view(dtype)
    for by in b:
        with np.errstate(all="ignore"):
            want = np.divide(a, np.asarray(by, dtype))
        got = np.asarray(device_sums.divide(jnp.asarray(a), jnp.asarray(by)))
        both_nan = np.isnan(want.astype(np.float32)) & np.isnan(got.astype(np.float32))
        np.testing.assert_array_equal(np.where(both_nan, 0, _bits(got)),
                                      np.where(both_nan, 0, _bits(want)))


@settings(max_examples=20, deadline=None)
@given(weights=st.lists(st.sampled_from(
    [0.0, -0.0, 1e-45, -1e-45, -1e-40, 2.5, -3.0, np.inf, np.nan, 1e-38]), min_size=1,
    max_size=6))
@example(weights=[np.inf])  # inf / inf: the host's own NaN
def test_weights_are_refused_as_the_host_refuses_them(weights):
    """The device refuses a weighted mean's weights exactly where the host does: a
    negative subnormal weight is negative, a NaN weight is not refused here."""
    w = np.array(weights, np.float32)
    values = np.ones((len(w), 3), np.float32)
    host = lambda: aggregation.partial_of_columns("weighted_mean", [values.copy()], len(w),
                                                  [w.copy()])
    padded = np.concatenate([w, np.full(6 - len(w), np.nan, np.float32)])  # one shape
    device = lambda: aggregation.device_partial(
        "weighted_mean", [[jnp.ones((6, 3), jnp.float32)]], [len(w)], [jnp.asarray(padded)])
    outcomes = []
    for partial in (host, device):
        try:
            outcomes.append(_bits(np.asarray(aggregation.finish(partial())[0])).tolist())
        except WeightError as e:
            outcomes.append(str(e).split(";")[0].split("(")[0])
    assert outcomes[0] == outcomes[1]



NARROW = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]


def _identical(dtype: np.dtype, kind: str, n: int, weight: float, wide_weights: bool,
               v: np.ndarray) -> tuple:
    """(n clients each holding `v`, the weights of a weighted mean or None)."""
    values = np.broadcast_to(v, (n, v.size)).copy()
    if kind != "weighted_mean":
        return values, None
    return values, [np.full(n, weight, np.float32 if wide_weights else dtype)]


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(NARROW), kind=st.sampled_from(["mean", "weighted_mean"]),
       n=st.one_of(st.integers(1, 300), st.sampled_from([2049, 65520, 70001])),
       weight=st.sampled_from([1.0, 0.5, 4.0]), wide_weights=st.booleans(),
       data=st.data())
def test_a_narrow_mean_of_identical_values_is_that_value(dtype, kind, n, weight,
                                                         wide_weights, data):
    """float16/bfloat16 means are summed exactly, rounded to float32, divided there and
    rounded once to the dtype: the mean of n copies of v is v (not the sum rounded to
    the dtype, which drifts from 2,049 float16 clients and overflows at 65,520), for
    every v whose sum fits float32 (bfloat16's range is float32's)."""
    top = float(np.float32(min(float(ml_dtypes.finfo(dtype).max),
                               float(np.finfo(np.float32).max) / n) / 8))
    v = np.array([data.draw(st.floats(-top, top, width=32)) for _ in range(2)] + [1, 3],
                 np.float32).astype(dtype)
    values, w = _identical(dtype, kind, n, weight, wide_weights, v)
    host = aggregation.finish(aggregation.partial_of_columns(kind, [values], n, w))[0]
    np.testing.assert_array_equal(_bits(host), _bits(v))


@pytest.mark.parametrize("dtype", NARROW, ids=str)
@pytest.mark.parametrize("kind", ["mean", "weighted_mean"])
def test_a_narrow_mean_on_the_device_has_the_host_s_bits(dtype, kind):
    rng = np.random.default_rng(5)
    n = 2049  # float16 sums of 2,049 threes drift when rounded to float16
    v = np.concatenate([rng.standard_normal(6) * 100, [1, 3]]).astype(dtype)
    values, w = _identical(dtype, kind, n, 0.5, dtype == NARROW[0], v)
    values[:, :3] = (rng.standard_normal((n, 3)) * 50).astype(dtype)  # and other values
    host = aggregation.finish(aggregation.partial_of_columns(kind, [values.copy()], n, w))[0]
    device = aggregation.finish(aggregation.device_partial(
        kind, [[jnp.asarray(values)]], [n], None if w is None else [jnp.asarray(w[0])]))[0]
    np.testing.assert_array_equal(_bits(host)[3:], _bits(v)[3:])
    np.testing.assert_array_equal(_bits(np.asarray(device)), _bits(host))


def _state_bytes(layout: device_sums.Layout) -> int:
    return sum(leaf.size * leaf.dtype.itemsize
               for leaf in jax.tree.leaves(jax.eval_shape(layout.empty)))


@pytest.mark.parametrize("count, each", [(5, 36), (255, 36), (256, 36), (4095, 36),
                                         (4096, 40)])
def test_float32_sums_hold_36_bytes_an_element_up_to_4095_clients(count, each):
    """Six int32 limbs leave a window of at least `WINDOW_SPREAD` bits (44) between an
    element's lowest and highest addend bits up to 4,095 clients: no seventh limb (40
    bytes an element) before the carries of 4,096 clients need it."""
    layout = device_sums.Layout("sum", ((np.dtype(np.float32), (10,)),), None, count)
    assert _state_bytes(layout) == each * 10 + 1  # and the one overflow flag
    window = 16 * device_exact.limbs_for(np.float32, count) - 24 - 15 - \
        device_exact.count_bits(count)
    assert device_exact.WINDOW_SPREAD <= window < device_exact.WINDOW_SPREAD + 16


def test_a_window_cut_to_six_limbs_still_gives_the_host_bits():
    """4,000 clients (six limbs, a window of 44 bits): addends spread 44 bits sum in the
    window; spread 80 bits, the sum says so and the whole range gives the host's bits."""
    rng = np.random.default_rng(3)
    stack = rng.standard_normal((4000, 3)).astype(np.float32)
    stack[0, 0], stack[1, 0] = np.float32(2.0 ** 20), np.float32(2.0 ** -24)  # 44 bits
    stack[0, 1], stack[1, 1] = np.float32(2.0 ** 40), np.float32(2.0 ** -40)  # 80 bits
    for spread, cols in ((44, [0, 2]), (80, [0, 1, 2])):
        rows = np.ascontiguousarray(stack[:, cols])
        sums = device_sums.partial_of("sum", [DeviceColumn([jnp.asarray(rows)], [4000])])
        assert sums.layout.full == (spread == 80)
        np.testing.assert_array_equal(_bits(device_sums.finish(sums)[0]), _bits(_host(rows)))
