"""Exact sums used for partial aggregation: correctly rounded and independent of grouping."""

from __future__ import annotations

import fractions
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

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


def test_many_random_float32_partitions_agree_bitwise():
    rng = np.random.default_rng(1)
    arrays = [(rng.standard_normal(64) * 10.0 ** rng.integers(-6, 6)).astype(np.float32)
              for _ in range(50)]
    results = {_sum_in_groups(arrays, cuts).tobytes()
               for cuts in ([], [25], [10, 20, 30], [1, 2, 3, 49])}
    assert len(results) == 1


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(0, 3), max_size=2),
       scale=st.sampled_from([0.0, 1e-30, 1.0, 3e5]), seed=st.integers(0, 2**16))
def test_partials_cross_the_wire_unchanged_including_all_zero_and_empty(shape, scale, seed):
    from fax_bridge.fleet import partials
    from fax_bridge.runtime import aggregation

    rng = np.random.default_rng(seed)
    members = [(rng.standard_normal(shape) * scale).astype(np.float32) for _ in range(3)]
    for kind in ("sum", "mean"):
        sent = aggregation.partial_of(kind, [[m] for m in members])
        back = partials.from_message(kind, partials.to_message(sent))
        np.testing.assert_array_equal(aggregation.finish(back)[0],
                                      aggregation.finish(sent)[0])
