"""The bounded comparison (`parity.bounded`) holds non-finite values to their class and
sign whatever the bound: +inf against -inf, +inf against a finite number, NaN against a
number are mismatches, as in the comparison with tolerances; the same non-finite value
on both paths is no difference."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from fax_bridge.parity.bounded import bounded_leaves
from fax_bridge.parity.report import compare_leaves

SPECIAL = [np.inf, -np.inf, np.nan, 3e38, -3e38, 0.0, 1.5]


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(SPECIAL), st.sampled_from(SPECIAL),
       st.sampled_from([0.0, 1.0, 1e30, np.inf]),
       st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=4), st.data())
def test_a_non_finite_value_must_be_the_same_on_both_paths(jit, other, bound, rest, data):
    want = np.asarray(rest, np.float32)
    i = data.draw(st.integers(0, want.size - 1))
    want[i], got = jit, want.copy()
    got[i] = other
    same = bool(np.float32(jit) == np.float32(other)
                or (np.isnan(jit) and np.isnan(other)))
    finite = bool(np.isfinite(jit) and np.isfinite(other))
    [leaf] = bounded_leaves(want, got, [np.full(want.shape, bound)], ["result"])
    if not finite:
        assert leaf.ok == same, (jit, other, bound, leaf)
    [leaf] = compare_leaves(want, got, 1e-5, 1e30)
    if not finite:
        assert leaf.ok == same, (jit, other, leaf)
