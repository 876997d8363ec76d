"""scikit-learn's handwritten digits, split non-IID over clients with a held-out test set.

The data set (1,797 8x8 images, 10 classes) ships with scikit-learn, so nothing is
downloaded; its file is read as `sklearn.datasets.load_digits` reads it, without
importing scikit-learn (seconds: `digits_arrays`). Pixels are scaled to [0, 1] and
flattened to 64 features.
"""

from __future__ import annotations

import gzip
import importlib.util
import os
from typing import NamedTuple

import numpy as np

from fax_bridge.data import checks
from fax_bridge.data.partition import partition_dirichlet


class FederatedDigits(NamedTuple):
    """`clients[i]` is `{'x': (n_i, 64) float32, 'y': (n_i,) int32}`; `test` likewise."""

    clients: list
    test: dict

    @property
    def sizes(self) -> np.ndarray:
        return np.asarray([len(c["y"]) for c in self.clients])


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The digits as `sklearn.datasets.load_digits()` gives them: pixels float64
    [1797, 64] in 0..16 and labels int [1797], read from the file scikit-learn ships
    (`sklearn/datasets/data/digits.csv.gz`) without importing scikit-learn; where that
    file is not found, from `load_digits` itself."""
    spec = importlib.util.find_spec("sklearn")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = os.path.join(folder, "datasets", "data", "digits.csv.gz")
        if os.path.isfile(path):
            with gzip.open(path, mode="rt", encoding="utf-8") as f:
                data = np.loadtxt(f, delimiter=",")
            return data[:, :-1], data[:, -1].astype(int)
    from sklearn.datasets import load_digits

    raw = load_digits()
    return raw.data, raw.target


def load_federated_digits(num_clients: int = 100, alpha: float = 0.5,
                          test_fraction: float = 0.2, seed: int = 0,
                          min_size: int = 2) -> FederatedDigits:
    """Digits split over `num_clients` clients by Dirichlet(alpha) label skew.

    A stratified `test_fraction` of the examples is held out first (same seed).

    Args:
      num_clients: the number of clients.
      alpha: the Dirichlet concentration (smaller: more label skew).
      test_fraction: the share of examples held out as `test`.
      seed: the seed of the split.
      min_size: the fewest examples a client may get.

    Returns:
      `FederatedDigits(clients, test)`.

    Example:
      >>> from fax_bridge.data import load_federated_digits
      >>> digits = load_federated_digits(num_clients=10)
      >>> len(digits.clients), digits.test["x"].shape[1]
      (10, 64)
    """
    test_fraction = checks.real("test_fraction", test_fraction, 0.0, 1.0, low_open=True,
                                high_open=True, fix="e.g. 0.2 holds out a fifth")
    seed = checks.seed(seed)
    pixels, labels = digits_arrays()
    x = (pixels / 16.0).astype(np.float32)
    y = labels.astype(np.int32)
    rng = np.random.default_rng(seed)
    test_idx = []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        test_idx.append(idx[: int(round(test_fraction * idx.size))])
    test_idx = np.sort(np.concatenate(test_idx))
    train = np.setdiff1d(np.arange(y.size), test_idx)
    clients = partition_dirichlet({"x": x[train], "y": y[train]}, "y", num_clients, alpha,
                                  seed=seed, min_size=min_size)
    return FederatedDigits(clients, {"x": x[test_idx], "y": y[test_idx]})
