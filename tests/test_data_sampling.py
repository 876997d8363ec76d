"""Seeded cohort sampling."""

import numpy as np
import pytest

from fax_bridge.data import CohortSampler, PoissonSampler, sample_cohort


def test_same_seed_and_round_same_cohort():
    a = sample_cohort(100, 10, round_index=4, seed=1)
    assert np.array_equal(a, sample_cohort(100, 10, round_index=4, seed=1))
    assert len(np.unique(a)) == 10 and a.min() >= 0 and a.max() < 100
    assert not np.array_equal(a, sample_cohort(100, 10, round_index=5, seed=1))
    assert not np.array_equal(a, sample_cohort(100, 10, round_index=4, seed=2))


def test_sampler_replays_rounds_in_any_order():
    s = CohortSampler(50, 5, seed=7)
    forward = [s(r) for r in range(6)]
    assert all(np.array_equal(s(r), forward[r]) for r in reversed(range(6)))


def test_weights_exclude_zero_weight_clients():
    w = np.zeros(20)
    w[[1, 3, 5, 7]] = 1.0
    for r in range(5):
        assert set(sample_cohort(20, 3, r, seed=0, weights=w)) <= {1, 3, 5, 7}


def test_bad_arguments():
    with pytest.raises(ValueError, match="cohort_size"):
        sample_cohort(5, 6, 0)
    with pytest.raises(ValueError, match="non-negative"):
        sample_cohort(5, 2, 0, weights=np.ones(4))


def test_poisson_sampler_draws_independent_members_within_capacity():
    s = PoissonSampler(1000, 0.05, capacity=90, seed=3)
    sizes = [len(s(r)) for r in range(200)]
    assert abs(np.mean(sizes) - 50) < 2 and len(set(sizes)) > 5   # varies, mean q * N
    np.testing.assert_array_equal(s(7), s(7))
    assert np.all(np.diff(s(7)) > 0)
    with pytest.raises(ValueError, match="capacity"):
        PoissonSampler(1000, 0.5, capacity=10)(0)
