"""Group-structured partitions of a dataset into clients.

`partition_by_key` groups examples by a key (a writer id, a user id...), one client per
distinct key value. `dirichlet_label_skew` draws, for every class, the share of that
class each client receives from a Dirichlet(alpha) distribution: small alpha gives
clients that see few classes (strong label skew), large alpha approaches IID.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from fax_bridge.errors import ArgumentError, DataError

Arrays = Mapping[str, np.ndarray]


def _check_arrays(arrays: Arrays) -> int:
    if not isinstance(arrays, Mapping) or not arrays:
        raise ArgumentError(
            "expected a non-empty dict of arrays sharing a leading example axis, e.g. "
            "{'x': images, 'y': labels}.")
    sizes = {k: np.shape(v)[0] if np.ndim(v) else None for k, v in arrays.items()}
    if None in sizes.values() or len(set(sizes.values())) != 1:
        raise DataError(
            f"every array needs the same leading (example) axis; got sizes {sizes}.")
    return next(iter(sizes.values()))


def split_clients(arrays: Arrays, indices: Sequence[np.ndarray]) -> list[dict]:
    """One client dataset per index array: `{k: arrays[k][idx]}`."""
    _check_arrays(arrays)
    return [{k: np.asarray(v)[np.asarray(idx, dtype=np.int64)] for k, v in arrays.items()}
            for idx in indices]


def partition_by_key(arrays: Arrays, keys: np.ndarray) -> tuple[np.ndarray, list[dict]]:
    """Groups examples by `keys` (one value per example): one client per distinct key.

    Returns `(unique_keys, clients)`; `clients[i]` holds the examples whose key is
    `unique_keys[i]`, in their original order.
    """
    n = _check_arrays(arrays)
    keys = np.asarray(keys)
    if keys.shape != (n,):
        raise DataError(
            f"keys must have one entry per example, shape ({n},); got {keys.shape}.")
    unique, inverse = np.unique(keys, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    bounds = np.cumsum(np.bincount(inverse, minlength=len(unique)))[:-1]
    return unique, split_clients(arrays, np.split(order, bounds))


def dirichlet_label_skew(labels: np.ndarray, num_clients: int, alpha: float,
                         seed: int = 0, min_size: int = 1,
                         max_tries: int = 100) -> list[np.ndarray]:
    """Indices of each client's examples under Dirichlet(alpha) label skew.

    For each class, its examples are shuffled and cut into `num_clients` pieces whose
    proportions follow a Dirichlet(alpha) draw. The draw is repeated (same seed stream)
    until every client has at least `min_size` examples. Every example goes to exactly
    one client. Deterministic in `seed`.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise DataError(f"labels must be a 1-D array of class ids; got shape {labels.shape}.")
    if num_clients < 1:
        raise DataError(f"num_clients must be >= 1, got {num_clients}.")
    if not alpha > 0:
        raise DataError(f"alpha must be > 0 (smaller is more skewed), got {alpha}.")
    if num_clients * min_size > labels.size:
        raise DataError(
            f"{labels.size} examples cannot give {num_clients} clients {min_size} each; "
            "lower num_clients or min_size.")
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            shares = rng.dirichlet(np.full(num_clients, float(alpha)))
            cuts = (np.cumsum(shares)[:-1] * idx.size).astype(np.int64)
            for i, piece in enumerate(np.split(idx, cuts)):
                parts[i].append(piece)
        out = [np.sort(np.concatenate(p)) for p in parts]
        if min(o.size for o in out) >= min_size:
            return out
    raise DataError(
        f"could not give every one of {num_clients} clients {min_size} examples in "
        f"{max_tries} Dirichlet draws with alpha={alpha}; raise alpha or lower min_size.")


def partition_dirichlet(arrays: Arrays, label_key: str, num_clients: int, alpha: float,
                        seed: int = 0, min_size: int = 1) -> list[dict]:
    """Splits `arrays` into `num_clients` client datasets skewed on `arrays[label_key]`."""
    _check_arrays(arrays)
    if label_key not in arrays:
        raise KeyError(f"label_key {label_key!r} is not one of the arrays {sorted(arrays)}.")
    idx = dirichlet_label_skew(arrays[label_key], num_clients, alpha, seed, min_size)
    return split_clients(arrays, idx)
