"""Exact sums used for partial aggregation: correctly rounded and independent of grouping."""

from __future__ import annotations

import fractions
import math

import federated_language as fl
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fax_bridge.rounds import partials as wire_partials, validate
from fax_bridge.runtime import aggregation, exact
from fax_bridge.runtime.exact import ExactSum


def _rounded_exact(values: list[float], dtype: np.dtype) -> float:
    """The exact rational sum rounded once to `dtype` (reference, slow)."""
    total = sum(fractions.Fraction(float(v)) for v in values)
    if dtype == np.float64:
        return float(total)  # Fraction -> float rounds correctly
    # Round to the target precision by hand: p bits, subnormal floor.
    info = np.finfo(dtype)
    p, emin_sub = info.nmant + 1, int(info.minexp) - info.nmant
    if total == 0:
        return 0.0
    sign = -1 if total < 0 else 1
    mag = abs(total)
    e = math.floor(math.log2(mag.numerator) - math.log2(mag.denominator))
    while fractions.Fraction(2) ** e > mag:
        e -= 1
    while fractions.Fraction(2) ** (e + 1) <= mag:
        e += 1
    ulp = max(e - (p - 1), emin_sub)
    scaled = mag / fractions.Fraction(2) ** ulp
    q = round(scaled)  # Python rounds Fractions half to even
    return sign * float(np.ldexp(float(q), ulp).astype(dtype))


def _sum_in_groups(arrays: list[np.ndarray], cuts: list[int]) -> np.ndarray:
    """Sums the arrays as several partials split at `cuts`, merged in reverse order."""
    bounds = [0, *sorted(set(c % (len(arrays) + 1) for c in cuts)), len(arrays)]
    partials = []
    for lo, hi in zip(bounds, bounds[1:]):
        acc = ExactSum(arrays[0].dtype, arrays[0].shape)
        for a in arrays[lo:hi]:
            acc.add(a)
        partials.append(ExactSum.from_limbs(acc.dtype, acc.shape, *acc.to_limbs()))
    total = ExactSum(arrays[0].dtype, arrays[0].shape)
    for part in reversed(partials):
        total.merge(part)
    return total.result()


floats32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
floats64 = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e300, max_value=1e300)


@settings(max_examples=60, deadline=None)
@given(st.lists(floats32, min_size=1, max_size=12), st.lists(st.integers(0, 12), max_size=3))
def test_float32_sum_is_correctly_rounded_for_any_grouping(values, cuts):
    arrays = [np.array([v], np.float32) for v in values]
    got = _sum_in_groups(arrays, cuts)
    want = _rounded_exact(values, np.dtype(np.float32))
    assert got.dtype == np.float32
    assert got[0] == np.float32(want) or (np.isinf(got[0]) and abs(want) >= 3.4e38)


@settings(max_examples=60, deadline=None)
@given(st.lists(floats64, min_size=1, max_size=12), st.lists(st.integers(0, 12), max_size=3))
def test_float64_sum_matches_fsum(values, cuts):
    arrays = [np.array([v]) for v in values]
    assert _sum_in_groups(arrays, cuts)[0] == math.fsum(values)


def test_cancellation_subnormals_and_specials():
    tiny = np.float32(1e-45)
    big = np.float32(3e38)
    arrays = [np.array([1e8, tiny, big, np.inf, 1.0], np.float32),
              np.array([1.0, tiny, big, 1.0, np.nan], np.float32),
              np.array([-1e8, -tiny, -big, -np.inf, 2.0], np.float32)]
    got = _sum_in_groups(arrays, [1])
    assert got[0] == np.float32(1.0)
    assert got[1] == tiny
    assert got[2] == big
    assert np.isnan(got[3]) and np.isnan(got[4])


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8])
def test_integer_sums_wrap_like_numpy(dtype):
    rng = np.random.default_rng(0)
    info = np.iinfo(dtype)
    arrays = [rng.integers(info.min, info.max, size=(3, 2), dtype=dtype) for _ in range(9)]
    want = arrays[0].copy()
    for a in arrays[1:]:
        want = (want + a).astype(dtype)
    got = _sum_in_groups(arrays, [2, 5])
    np.testing.assert_array_equal(got, want)
    assert got.dtype == dtype


def test_many_random_float32_partitions_give_the_exact_sum_rounded_once():
    rng = np.random.default_rng(1)
    arrays = [(rng.standard_normal(64) * 10.0 ** rng.integers(-6, 6)).astype(np.float32)
              for _ in range(50)]
    # Each element's exact sum rounded once to float32 (the reference does not group).
    want = np.array([_rounded_exact([a[i] for a in arrays], np.float32) for i in range(64)],
                    np.float32)
    for cuts in ([], [25], [10, 20, 30], [1, 2, 3, 49]):
        got = _sum_in_groups(arrays, cuts)
        assert got.dtype == np.float32 and got.tobytes() == want.tobytes(), cuts
    # The reference tells a sum rounded at each step from the exact one here.
    naive = np.zeros(64, np.float32)
    for a in arrays:
        naive = naive + a
    assert naive.tobytes() != want.tobytes()


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(0, 3), max_size=2),
       scale=st.sampled_from([0.0, 1e-30, 1.0, 3e5]), seed=st.integers(0, 2**16))
def test_partials_cross_the_wire_unchanged_including_all_zero_and_empty(shape, scale, seed):
    from fax_bridge.rounds import partials
    from fax_bridge.runtime import aggregation

    rng = np.random.default_rng(seed)
    members = [(rng.standard_normal(shape) * scale).astype(np.float32) for _ in range(3)]
    for kind in ("sum", "mean"):
        sent = aggregation.partial_of(kind, [[m] for m in members])
        back = partials.from_message(kind, partials.to_message(sent))
        np.testing.assert_array_equal(aggregation.finish(back)[0],
                                      aggregation.finish(sent)[0])


# -- fast paths against slow references ----------------------------------------------
# Sums of floats of at most 4 bytes go through float64 where that is exact, and dtypes
# of at most 24 significant bits are rounded through a float64 rounded to odd. Each is
# checked here against exact rational arithmetic and against the general paths.

_DTYPES = ["float16", "bfloat16", "float32", "float64"]


def _dtype(name: str) -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _reference(column: np.ndarray) -> float:
    """The exact semantics for one element's addends, from Python fractions."""
    dtype = column.dtype
    wide = column.astype(np.float64)
    if np.isnan(wide).any() or (np.isposinf(wide).any() and np.isneginf(wide).any()):
        return math.nan
    if np.isinf(wide).any():
        return float(wide[np.isinf(wide)][0])
    if all(v == 0 and math.copysign(1, v) < 0 for v in wide):
        return -0.0
    total = sum(fractions.Fraction(float(v)) for v in wide)
    if total == 0:
        return 0.0
    if dtype == np.float64:
        try:
            return float(total)  # rounds correctly
        except OverflowError:
            return math.inf if total > 0 else -math.inf
    info = _info(dtype)
    p, emin_sub = info.nmant + 1, int(info.minexp) - info.nmant
    mag = abs(total)
    e = mag.numerator.bit_length() - mag.denominator.bit_length()
    while fractions.Fraction(2) ** e > mag:
        e -= 1
    while fractions.Fraction(2) ** (e + 1) <= mag:
        e += 1
    ulp = max(e - (p - 1), emin_sub)
    q = round(mag / fractions.Fraction(2) ** ulp)  # half to even
    with np.errstate(over="ignore"):
        return math.copysign(float(np.ldexp(float(q), ulp)), total)


def _info(dtype: np.dtype):
    import ml_dtypes

    return ml_dtypes.finfo(dtype) if dtype.name == "bfloat16" else np.finfo(dtype)


@st.composite
def _stacks(draw, dtype=None):
    """[addends, elements] of one float dtype (`dtype`, or any): any bit patterns, values
    of nearby exponents (the float64 path), specials, and cancelling negations."""
    dtype = _dtype(draw(st.sampled_from(_DTYPES))) if dtype is None else np.dtype(dtype)
    uint = {2: np.uint16, 4: np.uint32, 8: np.uint64}[dtype.itemsize]
    n = draw(st.one_of(st.integers(1, 6), st.integers(7, 70)))
    width = draw(st.integers(1, 5))
    mode = draw(st.sampled_from(["bits", "near", "wide", "mixed", "ties"]))
    info = _info(dtype)
    p = info.nmant + 1
    bits = np.array(draw(st.lists(st.integers(0, 2 ** (8 * dtype.itemsize) - 1),
                                  min_size=n * width, max_size=n * width)), np.uint64)
    values = bits.astype(uint).view(dtype).astype(np.float64).reshape(n, width)
    if mode in ("near", "wide", "mixed"):  # full significands, exponents within a spread
        scale = draw(st.sampled_from([1.0, float(info.tiny), float(info.max) / 4,
                                      float(info.smallest_subnormal) * 2 ** (p + 8)]))
        spread = 2 if mode == "near" else draw(st.sampled_from([16, 28, 31, 34, 60]))
        grid = bits.reshape(n, width)
        mant = (grid % 2 ** p).astype(np.float64) / 2 ** (p - 1) - 1
        expo = (grid >> np.uint64(p)) % np.uint64(spread)
        with np.errstate(all="ignore"):
            values = mant * scale * np.exp2(-expo.astype(np.float64))
        if mode == "mixed":
            values[::3] = draw(st.sampled_from([0.0, -0.0, np.inf, -np.inf, np.nan,
                                                float(info.max), -float(info.max)]))
    if mode == "ties":  # a value, half its last place, and tiny amounts that break ties
        picks = [1.0, -1.0, 2.0 ** -p, -(2.0 ** -p), 3 * 2.0 ** -p, 2.0 ** (1 - p),
                 float(info.smallest_subnormal), -float(info.smallest_subnormal),
                 float(info.max), 2.0 ** (int(info.maxexp) - 1 - p), -0.0]
        values = np.array(picks)[bits.reshape(n, width) % len(picks)]
    stack = values.astype(dtype)
    if draw(st.booleans()):  # negations cancel
        stack = np.concatenate([stack, -stack[: draw(st.integers(0, n))]])
    return stack


def _split_sum(stack: np.ndarray, cuts: list[int], order: list[int]) -> ExactSum:
    """The sum as partials over blocks of addends, each passing the coordinator's checks
    of an honest device's partial, merged in `order`."""
    bounds = [0, *sorted({c % (len(stack) + 1) for c in cuts}), len(stack)]
    parts = []
    for lo, hi in zip(bounds, bounds[1:]):
        acc = ExactSum(stack.dtype, stack.shape[1:])
        acc.add_many(stack[lo:hi])
        if hi > lo:
            message = wire_partials.to_message(aggregation.Partial("sum", [acc], count=hi - lo))
            validate.check_partial(message, "sum", [fl.TensorType(acc.dtype, acc.shape)], [],
                                   hi - lo, "d")
        parts.append(ExactSum.from_limbs(acc.dtype, acc.shape, *acc.to_limbs()))
    total = ExactSum(stack.dtype, stack.shape[1:])
    for i in sorted(range(len(parts)), key=lambda i: order[i % len(order)] if order else i):
        total.merge(parts[i])
    return total


@settings(max_examples=150, deadline=None)
@given(_stacks(), st.lists(st.integers(0, 200), max_size=4),
       st.lists(st.integers(0, 9), max_size=5))
def test_any_dtype_any_split_matches_exact_rationals(stack, cuts, order):
    got = _split_sum(stack, cuts, order).result()
    want = np.array([_reference(stack[:, j]) for j in range(stack.shape[1])])
    with np.errstate(over="ignore"):
        want = want.astype(stack.dtype)
    assert got.dtype == stack.dtype
    assert got.tobytes() == want.tobytes(), (got, want)


@settings(max_examples=100, deadline=None)
@given(_stacks(), st.lists(st.integers(0, 200), max_size=3))
def test_float64_path_equals_the_general_path_limb_for_limb(stack, cuts):
    fast = _split_sum(stack, cuts, [])
    general = ExactSum(stack.dtype, stack.shape[1:])
    for row in stack:  # one at a time, never through float64 sums
        general._add_block(row[None], slice(0, stack.shape[1]))
    general.pending = len(stack)
    (base, limbs, flags), (want_base, want_limbs, want_flags) = fast.to_limbs(), general.to_limbs()
    np.testing.assert_array_equal(limbs, want_limbs)
    np.testing.assert_array_equal(flags, want_flags)
    assert base == want_base or not limbs.size  # the base of no limbs means nothing
    assert fast.result().tobytes() == general.result().tobytes()


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(_DTYPES[:3]), st.integers(-6, 12),
       st.lists(st.lists(st.one_of(st.integers(-2**62, 2**62), st.integers(-4, 4),
                                   st.integers(0, 62).map(lambda k: 1 << k),
                                   st.integers(0, 62).map(lambda k: -(1 << k)),
                                   st.sampled_from([2**32 - 1, 2**32, -2**32, 2**31, 0])),
                         min_size=3, max_size=3), min_size=1, max_size=6))
def test_rounding_to_odd_equals_the_general_rounding(name, base, rows):
    """Any limb stack (not normalized, of any sign) rounds the same both ways."""
    acc = ExactSum(_dtype(name), (3,))
    acc.base, acc.limbs = base, np.array(rows, np.int64)
    with np.errstate(over="ignore"):
        odd = acc._round_to_odd().astype(acc.dtype)
        general = acc._round().astype(acc.dtype)
    assert odd.tobytes() == general.tobytes()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(_stacks(), st.sampled_from([(), (1,), None])), min_size=1,
                max_size=5),
       st.integers(0, 2**16))
def test_results_round_several_accumulators_as_each_alone(stacks, seed):
    """`results` joins the float sums of each dtype into one; nothing changes."""
    accs = []
    for stack, shape in stacks:
        acc = ExactSum(stack.dtype, stack.shape[1:] if shape is None else shape)
        acc.add_many(stack if shape is None else stack[:, :1].reshape((-1,) + shape))
        accs.append(acc)
    integers = ExactSum(np.dtype(np.int64), (2,))  # integer sums stay as they are
    integers.add_many(np.random.default_rng(seed).integers(-2**40, 2**40, size=(3, 2)))
    accs.insert(seed % (len(accs) + 1), integers)
    alone = [acc.result() for acc in accs]
    together = exact.results(accs)
    assert [a.tobytes() for a in together] == [a.tobytes() for a in alone]
    assert [a.shape for a in together] == [a.shape for a in alone]
    assert [a.dtype for a in together] == [a.dtype for a in alone]


@pytest.mark.parametrize("name", _DTYPES[:3])
def test_rounding_in_blocks_of_columns_matches_the_general_rounding(name):
    """Large sums are rounded a block of columns at a time."""
    dtype = _dtype(name)
    uint = {2: np.uint16, 4: np.uint32}[dtype.itemsize]
    rng = np.random.default_rng(3)
    stack = rng.integers(0, 2 ** (8 * dtype.itemsize), size=(4, 50_000)).astype(uint)
    stack = stack.view(dtype)
    stack[:, ::2] = np.where(np.isfinite(stack[:, ::2].astype(np.float64)),
                             stack[:, ::2], 0)  # and finite elements in every block
    acc = ExactSum(dtype, (50_000,))
    acc.add_many(stack)
    with np.errstate(over="ignore"):
        odd = acc._round_to_odd().astype(dtype)
        general = acc._round().astype(dtype)
    assert odd.tobytes() == general.tobytes()


@settings(max_examples=40, deadline=None)
@given(st.lists(_stacks(), min_size=1, max_size=4), st.integers(1, 6), st.data())
def test_sums_of_several_stacks_equal_each_alone(stacks, count, data):
    """`sums_of` adds the stacks of one dtype and count as one; every accumulator keeps
    its own value, wire form and later merges."""
    stacks = [np.resize(s, (count,) + s.shape[1:]) for s in stacks]  # some share counts
    together = exact.sums_of(stacks)
    for stack, acc in zip(stacks, together):
        alone = ExactSum(stack.dtype, stack.shape[1:])
        alone.add_many(stack)
        extra = data.draw(_stacks(stack.dtype), "extra")  # drawn in its dtype, not filtered
        extra = np.resize(extra, (len(extra),) + stack.shape[1:])
        for a in (acc, alone):  # merging into the shared columns touches no other sum
            more = ExactSum(stack.dtype, stack.shape[1:])
            more.add_many(extra)
            a.merge(more)
        (base, limbs, flags), (want_base, want_limbs, want_flags) = (acc.to_limbs(),
                                                                      alone.to_limbs())
        np.testing.assert_array_equal(limbs, want_limbs)
        np.testing.assert_array_equal(flags, want_flags)
        assert base == want_base or not limbs.size
        assert acc.result().tobytes() == alone.result().tobytes()


# -- magnitudes: no limb stack overflows int64 ---------------------------------------


def _units(acc: ExactSum) -> list[int]:
    """Each element's exact value, in units of the smallest subnormal (Python ints)."""
    return [sum(int(acc.limbs[k, j]) << (exact.LIMB_BITS * (acc.base + k))
                for k in range(acc.limbs.shape[0])) for j in range(acc.size)]


_INT64 = st.one_of(st.integers(-2**63, 2**63 - 1), st.integers(-3, 3),
                   st.sampled_from([2**63 - 1, -2**63, 2**62, -2**62, 2**61 - 1, -(2**61),
                                    2**32 - 1, 2**32, -(2**32)]))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4),
                          st.lists(st.lists(_INT64, min_size=2, max_size=2), max_size=4)),
                min_size=1, max_size=8))
def test_merging_any_int64_limbs_stays_exact(stacks):
    """`from_limbs` takes any int64 stack (a hostile device's included) and merges of
    such stacks, in any number, equal the sum of the values they denote."""
    total = ExactSum(np.dtype(np.float32), (2,))
    want = [0, 0]
    for base, rows in stacks:
        part = ExactSum.from_limbs(total.dtype, (2,), base, np.array(rows, np.int64)
                                   .reshape(len(rows), 2))
        assert np.abs(part.limbs).max(initial=0) < exact.TOP_LIMIT
        assert _units(part) == [sum(int(r[j]) << (32 * (base + k)) for k, r in enumerate(rows))
                                for j in range(2)]
        want = [w + u for w, u in zip(want, _units(part))]
        total.merge(part)
        assert _units(total) == want
        assert np.abs(total.limbs).max(initial=0) < exact.TOP_LIMIT


@pytest.mark.parametrize("name", _DTYPES)
def test_max_units_is_the_largest_finite_value_in_units(name):
    dtype = _dtype(name)
    info = _info(dtype)
    unit = fractions.Fraction(float(info.smallest_subnormal))
    assert exact.max_units(dtype, 1) == fractions.Fraction(float(info.max)) / unit
    assert exact.max_units(dtype, 7) == 7 * exact.max_units(dtype, 1)
    assert exact.max_units(np.dtype(np.int8), 3) == 3 * 128
