"""Partitioning by key and by Dirichlet label skew."""

import numpy as np
import pytest

from fax_bridge.data import dirichlet_label_skew, partition_by_key, partition_dirichlet
from fax_bridge.errors import DataError


def _labels(n=600, classes=10, seed=0):
    return np.random.default_rng(seed).integers(0, classes, size=n)


def test_partition_by_key_groups_every_example_once():
    x = np.arange(10)
    keys = np.array([3, 1, 3, 2, 1, 1, 3, 2, 2, 2])
    unique, clients = partition_by_key({"x": x, "k": keys}, keys)
    assert list(unique) == [1, 2, 3]
    assert [len(c["x"]) for c in clients] == [3, 4, 3]
    for u, c in zip(unique, clients):
        assert (c["k"] == u).all()
    np.testing.assert_array_equal(clients[0]["x"], [1, 4, 5])  # original order kept
    assert sorted(np.concatenate([c["x"] for c in clients])) == list(range(10))


def test_partition_by_key_rejects_wrong_length():
    with pytest.raises(ValueError, match="one entry per example"):
        partition_by_key({"x": np.arange(4)}, np.arange(3))


def test_dirichlet_is_a_partition_and_deterministic():
    y = _labels()
    a = dirichlet_label_skew(y, 8, alpha=0.5, seed=3)
    b = dirichlet_label_skew(y, 8, alpha=0.5, seed=3)
    c = dirichlet_label_skew(y, 8, alpha=0.5, seed=4)
    assert len(a) == len(b) == len(c) == 8
    all_idx = np.concatenate(a)
    assert np.array_equal(np.sort(all_idx), np.arange(y.size))
    assert all(np.array_equal(i, j) for i, j in zip(a, b))
    assert not all(np.array_equal(i, j) for i, j in zip(a, c))


def _mean_tv_to_global(y, parts):
    glob = np.bincount(y, minlength=10) / y.size
    tvs = [0.5 * np.abs(np.bincount(y[p], minlength=10) / p.size - glob).sum() for p in parts]
    return float(np.mean(tvs))


def test_small_alpha_skews_labels_more_than_large_alpha():
    y = _labels(2000)
    skewed = _mean_tv_to_global(y, dirichlet_label_skew(y, 10, alpha=0.1, seed=0))
    iid = _mean_tv_to_global(y, dirichlet_label_skew(y, 10, alpha=100.0, seed=0))
    assert skewed > 0.4
    assert iid < 0.1


def test_min_size_is_respected():
    y = _labels(300)
    parts = dirichlet_label_skew(y, 20, alpha=0.3, seed=1, min_size=5)
    assert min(p.size for p in parts) >= 5


def test_partition_dirichlet_carries_all_arrays():
    y = _labels(100)
    x = np.arange(100) * 10
    clients = partition_dirichlet({"x": x, "y": y}, "y", 4, alpha=1.0, seed=0)
    for c in clients:
        np.testing.assert_array_equal(c["x"] // 10 >= 0, True)
        np.testing.assert_array_equal(y[c["x"] // 10], c["y"])
    with pytest.raises(DataError, match="label_key 'y' is not one of the arrays"):
        partition_dirichlet({"x": x}, "y", 4, alpha=1.0)
