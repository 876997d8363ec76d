"""runtime.double_sums: the float64 form of exact sums gives the bits of the limbs, in any
split, any mix of forms and through the wire; merges that would lose a bit move to limbs."""

import fractions
import math
from unittest import mock

import federated_language as fl
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fax_bridge.errors import WeightError
from fax_bridge.rounds import partials, validate
from fax_bridge.runtime import aggregation, double_sums, exact, float_bits, threads
from fax_bridge.runtime.double_sums import DoubleSum
from fax_bridge.runtime.exact import ExactSum

DTYPES = [np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]
_SPECIAL = [0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, 6e-8, 1.2e-38, 3.4e38, -3.4e38, 65504.0,
            0.5, -2.0, np.inf, -np.inf, np.nan]


def _as_limbs(sum_):
    return sum_.exact() if isinstance(sum_, DoubleSum) else sum_


def _limbs_only(partial):
    partial.leaves = [_as_limbs(leaf) for leaf in partial.leaves]
    partial.weights = None if partial.weights is None else _as_limbs(partial.weights)
    return partial


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(DTYPES), st.sampled_from(["sum", "mean", "weighted_mean"]),
       st.integers(1, 9), st.data())
def test_the_float64_form_gives_the_limbs_bits(dtype, kind, n, data):
    finite = data.draw(st.booleans(), label="finite only")
    values = st.one_of(st.sampled_from(_SPECIAL[:-3] if finite else _SPECIAL),
                       st.floats(-1e4, 1e4), st.floats(-1e-30, 1e-30),
                       st.floats(width=32, allow_nan=not finite, allow_infinity=not finite))
    rows = data.draw(st.lists(st.lists(values, min_size=3, max_size=3), min_size=n,
                              max_size=n), label="values")
    with np.errstate(over="ignore"):
        members = [np.array(r, np.float64).astype(dtype) for r in rows]
    weights = None
    if kind == "weighted_mean":
        weights = [np.array(w, dtype) for w in data.draw(st.lists(
            st.sampled_from([0.0, 1.0, 0.5, 2.0, 3.0, 1e-3]), min_size=n, max_size=n))]
    cuts = sorted(set(data.draw(st.lists(st.integers(0, n), max_size=4), label="splits")))
    bounds = [0, *cuts, n]
    forms = data.draw(st.lists(st.booleans(), min_size=len(bounds), max_size=len(bounds)),
                      label="limbs on the wire")
    total = aggregation.Partial(kind=kind, leaves=[])
    for (lo, hi), limbs in zip(zip(bounds, bounds[1:]), forms):
        part = aggregation.partial_of(kind, members[lo:hi],
                                      None if weights is None else weights[lo:hi])
        part = _limbs_only(part) if limbs else part
        aggregation.merge(total, partials.from_message(kind, partials.to_message(part)))
    if weights is not None and not any(weights):  # zero total: refused in either form
        for partial in (_limbs_only(aggregation.partial_of(kind, members, weights)), total):
            with pytest.raises(WeightError, match="sum to zero"):
                aggregation.finish(partial)
        return
    want = aggregation.finish(_limbs_only(aggregation.partial_of(kind, members, weights)))
    got = aggregation.finish(total)
    assert [g.tobytes() for g in got] == [w.tobytes() for w in want]


def test_sums_take_the_float64_form_only_where_it_is_exact():
    f32 = np.float32
    exact_stack = np.array([[1.5, -0.0, 0.0], [2.25, -0.0, -0.0]], f32)
    wide = np.array([[3e38, 1.0], [1e-45, 1.0]], f32)  # 3e38 + 1e-45 needs 276 bits
    special = np.array([[np.inf, 1.0]], f32)
    ints = np.array([[1, 2]], np.int32)
    out = double_sums.sums_of([exact_stack, wide, special, ints,
                               exact_stack.astype(np.float64)])
    assert [type(s) for s in out] == [DoubleSum, ExactSum, ExactSum, ExactSum, ExactSum]
    assert out[0].values.tolist() == [3.75, -0.0, 0.0]
    assert np.signbit(out[0].values).tolist() == [False, True, False]  # only -0 added: -0
    assert out[0].result().tobytes() == np.array([3.75, -0.0, 0.0], f32).tobytes()
    # A merge that would round moves to limbs, and keeps every bit.
    big = double_sums.sums_of([np.array([[3e38]], f32)])[0]
    tiny = double_sums.sums_of([np.array([[1e-45]], f32)])[0]
    both, = double_sums.merged_all([big], [tiny])
    assert isinstance(both, ExactSum)
    want = ExactSum(np.float32, (1,))
    want.add_many(np.array([[3e38], [1e-45]], f32))
    assert both.result().tobytes() == want.result().tobytes()
    again, = double_sums.merged_all(double_sums.sums_of([np.array([[1.5]], f32)]),
                                    double_sums.sums_of([np.array([[2.5]], f32)]))
    assert isinstance(again, DoubleSum) and again.values.tolist() == [4.0]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(DTYPES[:2]), st.integers(1, 4)), min_size=1,
                max_size=5), st.data())
def test_merging_many_leaves_together_gives_each_merges_bits(specs, data):
    """`merged_all` adds the float64-form pairs in one set of array operations; where any
    pair's sum would round, each pair goes its own way. Either way every leaf gets the
    bits (and the form) a merge of that pair alone gives."""
    values = st.one_of(st.sampled_from(_SPECIAL), st.floats(-1e4, 1e4),
                       st.floats(width=32))

    def draw() -> list:
        return [data.draw(st.lists(st.lists(values, min_size=size, max_size=size),
                                   min_size=1, max_size=3)) for _, size in specs]

    def sums(stacks: list) -> list:  # fresh each time: a limbs merge updates its first sum
        with np.errstate(over="ignore"):
            return [double_sums.sums_of([np.array(rows, np.float64).astype(dtype)])[0]
                    for (dtype, _), rows in zip(specs, stacks)]

    first, second = draw(), draw()
    alone = [double_sums.merged_all([a], [b])[0] for a, b in zip(sums(first), sums(second))]
    together = double_sums.merged_all(sums(first), sums(second))
    assert [type(s) for s in together] == [type(s) for s in alone]
    assert [s.result().tobytes() for s in together] == [s.result().tobytes() for s in alone]


def _column_by_column(rows):
    """The float64 sums of `rows`' columns by the rule each column alone: None unless
    every one is exact or holds only +-0 (then -0 where every addend is -0)."""
    fast, zero, negative_zero = float_bits.exact_in_doubles(rows)
    if not (fast | zero).all():
        return None
    sums = rows.astype(np.float64).sum(axis=0)
    sums[zero] = np.where(negative_zero[zero], -0.0, 0.0)
    return sums


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(DTYPES), st.integers(1, 6), st.integers(1, 5), st.data())
def test_the_one_block_test_decides_as_the_columns_do(dtype, n, size, data):
    """`block_test` passes a block only when every column passes alone, says whether it
    holds a zero, and the float64 sums (signs of zero included) are the column-by-column
    ones."""
    values = st.one_of(st.sampled_from(_SPECIAL), st.floats(-1e4, 1e4),
                       st.floats(-1e-30, 1e-30), st.floats(width=32))
    flat = data.draw(st.lists(values, min_size=n * size, max_size=n * size))
    with np.errstate(over="ignore", invalid="ignore"):
        rows = np.array(flat, np.float64).astype(dtype).reshape(n, size)
    passed, zeros = float_bits.block_test(rows)
    assert zeros == bool((rows.astype(np.float64) == 0).any())
    # a caller's scratch buffer (written over, left dirty) gives the same verdict
    scratch = np.full(rows.shape, 12345, float_bits.float_params(rows.dtype)[3])
    assert float_bits.block_test(rows, scratch) == (passed, zeros)
    if passed:
        fast, zero, _ = float_bits.exact_in_doubles(rows)
        assert (fast | zero).all()
    # the verdict is the rule's on the block's largest and smallest nonzero magnitude
    bits, nexp, _, uint = float_bits.float_params(rows.dtype)
    mag = rows.view(uint) & uint((1 << (8 * rows.dtype.itemsize - 1)) - 1)
    nonzero = mag[mag != 0]
    least = int(nonzero.min()) if nonzero.size else 0
    assert passed == bool(float_bits._sums_fit(int(mag.max()) >> (bits - 1),
                                               least >> (bits - 1), bits, nexp, n))
    got, want = double_sums._double_values(rows), _column_by_column(rows)
    assert (got is None) == (want is None)
    if got is not None:
        assert got.tobytes() == want.tobytes()


def _rounded(addends: list, dtype: np.dtype) -> np.ndarray:
    """The exact sum of float `addends` (Python rationals), rounded once to `dtype`, with
    IEEE's rules for non-finite addends and for zeros (reference, slow)."""
    if any(math.isnan(a) for a in addends) or (math.inf in addends
                                               and -math.inf in addends):
        return np.array(np.nan, dtype)
    if math.inf in addends or -math.inf in addends:
        return np.array(math.inf if math.inf in addends else -math.inf, dtype)
    total = sum(fractions.Fraction(a) for a in addends)
    if total == 0:
        negative = all(a == 0 and math.copysign(1, a) < 0 for a in addends)
        return np.array(-0.0 if negative else 0.0, dtype)
    info = ml_dtypes.finfo(dtype)
    p, emin_sub = info.nmant + 1, int(info.minexp) - info.nmant
    mag = abs(total)
    e = mag.numerator.bit_length() - mag.denominator.bit_length()
    e += 1 if fractions.Fraction(2) ** (e + 1) <= mag else 0
    e -= 1 if fractions.Fraction(2) ** e > mag else 0
    ulp = max(e - (p - 1), emin_sub)
    value = math.ldexp(round(mag / fractions.Fraction(2) ** ulp), ulp)  # half to even
    if value > float(info.max):
        value = math.inf
    with np.errstate(over="ignore"):
        return np.array(math.copysign(value, total), dtype)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(DTYPES), st.integers(1, 12), st.integers(64, 320), st.data())
def test_spilled_elements_keep_every_bit_in_any_split(dtype, n, size, data):
    """Large sums keep the float64 form with the few elements it cannot hold exactly
    (widely spread or non-finite addends, merges past 53 bits) spilled to limbs; any
    split into partials, through the wire and the coordinator's checks, in either form,
    gives the bits of the exact rational sum rounded once."""
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    rng = np.random.default_rng(seed)
    info = ml_dtypes.finfo(dtype)
    stack = (rng.normal(size=(n, size)) * data.draw(st.sampled_from([1e-3, 1.0, 100.0]))
             ).astype(np.float64)
    wide = rng.choice(size, size=data.draw(st.integers(0, size // 64 + 2)), replace=False)
    for col in wide:  # a huge addend, tiny ones, cancellations, non-finite values
        kind = data.draw(st.sampled_from(["spread", "cancel", "special", "negative"]))
        stack[:, col] = float(info.smallest_subnormal) * rng.integers(-3, 4, size=n)
        if kind == "negative":  # of sign - only, -0 among them: spilled, never -0
            stack[:, col] = -np.abs(stack[:, col])
            stack[:, col][stack[:, col] == 0] = -0.0
            stack[rng.integers(n), col] = -float(info.max) * rng.uniform(0.5, 1)
        elif kind != "special":
            stack[rng.integers(n), col] = float(info.max) * rng.uniform(-1, 1)
        if kind == "cancel":
            stack[rng.integers(n), col] = -stack[:, col].max()
        if kind == "special":
            stack[rng.integers(n), col] = data.draw(st.sampled_from(_SPECIAL[-3:]))
    if data.draw(st.booleans(), label="-0 columns"):
        stack[:, rng.integers(size)] = -0.0
    with np.errstate(over="ignore"):
        stack = stack.astype(dtype)
    cuts = sorted(set(data.draw(st.lists(st.integers(0, n), max_size=4), label="splits")))
    bounds = [0, *cuts, n]
    forms = data.draw(st.lists(st.booleans(), min_size=len(bounds), max_size=len(bounds)),
                      label="limbs on the wire")
    leaf_type = validate.leaf_types(fl.TensorType(dtype, [size]))
    total = aggregation.Partial(kind="sum", leaves=[])
    # Small blocks: many blocks per tensor, each written into the buffers of the last.
    block = data.draw(st.sampled_from([exact.BLOCK_ELEMENTS, 3 * n, 64]), label="block")
    with mock.patch.object(exact, "BLOCK_ELEMENTS", block):
        for (lo, hi), limbs in zip(zip(bounds, bounds[1:]), forms):
            if hi == lo:
                continue
            part = aggregation.partial_of_columns("sum", [stack[lo:hi]], hi - lo)
            part = _limbs_only(part) if limbs else part
            checked, _ = validate.check_partial(partials.to_message(part), "sum", leaf_type,
                                                [], hi - lo, "d")
            aggregation.merge(total, checked)
        got, = aggregation.finish(total)
    as_floats = stack.astype(np.float64)
    want = np.array([_rounded(as_floats[:, j].tolist(), dtype) for j in range(size)], dtype)
    assert got.tobytes() == want.tobytes()


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(DTYPES), st.integers(1, 6), st.integers(1, 40), st.data())
def test_zero_sums_are_minus_zero_exactly_where_every_addend_is(dtype, n, size, data):
    values = st.sampled_from([0.0, -0.0, 1.0, -1.0, -2.0, 0.5, -1e-45])
    rows = np.array(data.draw(st.lists(st.lists(values, min_size=size, max_size=size),
                                       min_size=n, max_size=n)), np.float64).astype(dtype)
    sums = rows.astype(np.float64).sum(axis=0)
    sums[sums == 0] = data.draw(st.sampled_from([0.0, -0.0]))  # either sign going in
    float_bits.signed_zeros(rows, sums)
    for j in range(size):
        column = rows[:, j].astype(np.float64)
        if sums[j] == 0:
            negative = all(a == 0 and math.copysign(1, a) < 0 for a in column)
            assert math.copysign(1, sums[j]) == (-1 if negative else 1), column
        else:
            assert sums[j] == column.sum()


def test_a_few_spread_elements_spill_and_the_rest_stay_float64():
    """One element in a thousand with addends too far apart for float64 spills to limbs;
    the others keep the float64 form (8 bytes an element on the wire); past one element
    in `SPILL_RATIO`, the whole tensor takes the limbs."""
    f32 = np.float32
    stack = np.ones((4, 1000), f32)
    stack[0, [7, 500]] = 3e38
    stack[1, [7, 500]] = 1e-45
    sum_, = double_sums.sums_of([stack])
    assert isinstance(sum_, DoubleSum) and sum_.cols.tolist() == [7, 500]
    assert sum_.values[[7, 500]].tolist() == [0.0, 0.0] and sum_.values[0] == 4.0
    message = partials.to_message(aggregation.Partial("sum", [sum_], count=4))
    assert len(message.leaves[0].doubles) == 8000 and len(message.leaves[0].spilled) == 16
    want = ExactSum(f32, (1000,))
    want.add_many(stack)
    assert sum_.result().tobytes() == want.result().tobytes()
    stack[0, :double_sums.most_spilled(1000) + 1] = 3e38
    stack[1, :double_sums.most_spilled(1000) + 1] = 1e-45
    assert isinstance(double_sums.sums_of([stack])[0], ExactSum)


@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize("weighted", [False, True])
def test_large_stacks_summed_on_several_threads_give_one_threads_sums(count, weighted):
    """Spans of columns summed at once: the same values, spilled columns (in order) and
    bits as one thread; too many spills in any span give the limbs form all the same."""
    rng = np.random.default_rng(0)
    rows = 6
    size = 40 * (exact.BLOCK_ELEMENTS // rows) + 17  # 41 blocks: several spans each
    stack = rng.standard_normal((rows, size)).astype(np.float32)
    stack[0, [5, size // 2, size - 1]] = 3e38
    stack[1, [5, size // 2, size - 1]] = 1e-45
    stack[:, 100] = -0.0
    weights = rng.integers(1, 9, rows).astype(np.float32)

    def sums(workers: int):
        with mock.patch.object(threads, "workers", return_value=workers):
            if weighted:
                return double_sums.weighted_sums_of([stack], weights)[0]
            return double_sums.sums_of([stack])[0]

    one, many = sums(1), sums(count)
    assert isinstance(many, DoubleSum)
    assert many.cols.tolist() == one.cols.tolist() == [5, size // 2, size - 1]
    assert many.values.tobytes() == one.values.tobytes()
    assert many.result().tobytes() == one.result().tobytes()
    assert np.signbit(many.result()[100])
    spread = stack.copy()
    spread[0, ::20] = 3e38  # one column in 20 spills: past `SPILL_RATIO`
    spread[1, ::20] = 1e-45
    with mock.patch.object(threads, "workers", return_value=count):
        limbs = double_sums.sums_of([spread])[0]
    assert isinstance(limbs, ExactSum)
    want = ExactSum(np.float32, (size,))
    want.add_many(spread)
    assert limbs.result().tobytes() == want.result().tobytes()


@settings(max_examples=10, deadline=None)
@given(st.integers(2, 3), st.integers(0, 40), st.data())
def test_merges_of_large_partials_on_several_threads_give_one_threads_bits(
        workers, inexact, data):
    """Two large float64-form partials merged in spans of blocks at once: the same
    sums, the same elements spilled (those past 53 bits) and the same bits as one
    thread."""
    size = 16 * exact.BLOCK_ELEMENTS + data.draw(st.integers(0, 999))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    first = (rng.uniform(1, 2, (2, size)) * rng.choice([-1, 1], (2, size))).astype(
        np.float32)  # one binade: no column spills alone
    second = rng.uniform(1, 2, (3, size)).astype(np.float32)
    where = rng.choice(size, inexact, replace=False)
    first[:, where], second[:, where] = 3e38, 1e-45  # each exact alone, not together

    def merged(count: int):
        a, = double_sums.sums_of([first])
        b, = double_sums.sums_of([second])
        assert not (a.cols.size or b.cols.size)
        with mock.patch.object(threads, "workers", return_value=count):
            return double_sums.merged_all([a], [b])[0]

    one, many = merged(1), merged(workers)
    assert sorted(where.tolist()) == one.cols.tolist() == many.cols.tolist()
    assert many.values.tobytes() == one.values.tobytes()
    want = ExactSum(np.float32, (size,))
    want.add_many(np.concatenate([first, second]))
    assert many.result().tobytes() == one.result().tobytes() == want.result().tobytes()


def test_a_merge_past_53_bits_spills_only_that_element():
    """Two partials, each exact in float64, whose sum at one element is not: that
    element spills (the others stay float64) and the result keeps every bit."""
    f32 = np.float32
    first, second = np.ones((2, 1000), f32), np.ones((3, 1000), f32)
    first[:, 9] = [3e38, 0.0]
    second[:, 9] = [1e-45, -1e-45, 2e-45]
    a, = double_sums.sums_of([first])
    b, = double_sums.sums_of([second])
    assert not (a.cols.size or b.cols.size)
    both, = double_sums.merged_all([a], [b])
    assert isinstance(both, DoubleSum) and both.cols.tolist() == [9]
    again, = double_sums.merged_all([both], double_sums.sums_of([second]))
    assert isinstance(again, DoubleSum) and again.cols.tolist() == [9]
    want = ExactSum(f32, (1000,))
    for stack in (first, second, second):
        want.add_many(stack)
    assert again.result().tobytes() == want.result().tobytes()
    assert again.exact().result().tobytes() == want.result().tobytes()
