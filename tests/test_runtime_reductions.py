"""Tests of fax_bridge.runtime.reductions: each kind against numpy, partial merges, errors."""

import numpy as np
import pytest
from federated_language.common_libs import structure

from fax_bridge.errors import ComputationError
from fax_bridge.runtime import reductions

RNG = np.random.default_rng(1)
XS = [RNG.normal(size=(2, 3)).astype(np.float32) for _ in range(7)]
WS = [np.float32(w) for w in RNG.uniform(0.5, 2.0, size=7)]


@pytest.mark.parametrize("kind,closed_form", [
    ("sum", lambda x: x.sum(0)),
    ("mean", lambda x: x.mean(0)),
    ("min", lambda x: x.min(0)),
    ("max", lambda x: x.max(0)),
])
def test_kinds_match_numpy(kind, closed_form):
    out = reductions.reduce(kind, XS)
    np.testing.assert_allclose(out, closed_form(np.stack(XS)), rtol=1e-6)
    assert out.dtype == np.float32


def test_weighted_mean_over_structs():
    members = [structure.Struct([("a", x), ("b", x[0])]) for x in XS]
    out = reductions.reduce("weighted_mean", members, WS)
    w = np.array(WS)
    want = (np.stack(XS) * w[:, None, None]).sum(0) / w.sum()
    np.testing.assert_allclose(out.a, want, rtol=1e-5)
    np.testing.assert_allclose(out.b, want[0], rtol=1e-5)


@pytest.mark.parametrize("kind", ["sum", "mean", "weighted_mean", "max"])
def test_partials_merged_in_order_equal_the_whole(kind):
    weights = WS if kind == "weighted_mean" else None
    parts = [reductions.accumulate(kind, XS[i:j], weights and weights[i:j])
             for i, j in [(0, 3), (3, 4), (4, 7)]]
    merged = reductions.finalize(reductions.merge(parts))
    np.testing.assert_allclose(merged, reductions.reduce(kind, XS, weights), rtol=1e-6)


def test_secure_sum_bitwidth_bounds_inputs_not_the_sum():
    members = [np.array([255, 0], np.int32), np.array([255, 1], np.int32)]
    np.testing.assert_array_equal(
        reductions.reduce("secure_sum_bitwidth", members, bitwidth=np.int32(8)), [510, 1])
    with pytest.raises(ComputationError, match="outside"):
        reductions.reduce("secure_sum_bitwidth", members, bitwidth=np.int32(7))
    with pytest.raises(ComputationError, match="at most|outside \\[0, 62\\]"):
        reductions.reduce("secure_sum_bitwidth", members, bitwidth=np.int32(63))
    with pytest.raises(ComputationError, match="integers"):
        reductions.reduce("secure_sum_bitwidth", XS, bitwidth=np.int32(8))


def test_errors():
    with pytest.raises(ComputationError, match="unknown aggregation"):
        reductions.reduce("median", XS)
    with pytest.raises(ComputationError, match="zero clients"):
        reductions.reduce("sum", [])
    with pytest.raises(ComputationError, match="floating-point"):
        reductions.reduce("mean", [np.int32(1), np.int32(2)])
    with pytest.raises(ComputationError, match="one weight per client"):
        reductions.reduce("weighted_mean", XS, WS[:2])
