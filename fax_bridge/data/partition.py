"""Group-structured partitions of a dataset into clients.

`partition_by_key` groups examples by a key (a writer id, a user id...), one client per
distinct key value. `dirichlet_label_skew` draws, for every class, the share of that
class each client receives from a Dirichlet(alpha) distribution: small alpha gives
clients that see few classes (strong label skew), large alpha approaches IID.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np

from fax_bridge.data import checks
from fax_bridge.errors import DataError

Arrays = Mapping[str, np.ndarray]


def _check_arrays(arrays: Arrays) -> int:
    checks.dataset("arrays", arrays)
    sizes = {k: np.shape(v)[0] for k, v in arrays.items()}
    if len(set(sizes.values())) != 1:
        raise DataError(
            f"every array needs the same leading (example) axis; got sizes {sizes}.")
    return next(iter(sizes.values()))


def contiguous_blocks(num_clients: int, num_parts: int) -> list[range]:
    """The clients of each of `num_parts` parts (devices, SuperNodes): contiguous blocks in
    client order, sizes within one."""
    return [range(d * num_clients // num_parts, (d + 1) * num_clients // num_parts)
            for d in range(num_parts)]


def split_clients(arrays: Arrays, indices: Sequence[np.ndarray]) -> list[dict]:
    """One client dataset per index array: `{k: arrays[k][idx]}`.

    Every index array holds positions in [0, examples); negative positions and floats
    are refused rather than wrapped or truncated.

    Args:
      arrays: a dataset: a dict of arrays sharing a leading example axis.
      indices: one array of example positions per client.

    Returns:
      One dataset per client.

    Example:
      >>> import numpy as np
      >>> from fax_bridge.data import split_clients
      >>> clients = split_clients({"x": np.arange(5)}, [np.array([0, 1]), np.array([4])])
      >>> [c["x"].tolist() for c in clients]
      [[0, 1], [4]]
    """
    n = _check_arrays(arrays)
    if isinstance(indices, (Mapping, str, bytes)) or not isinstance(indices, Iterable):
        raise DataError(f"indices must be a list of index arrays (one per client), got "
                        f"{type(indices).__name__}.")
    picked = [checks.indices(f"indices[{i}]", idx, n) for i, idx in enumerate(indices)]
    return [{k: np.asarray(v)[idx] for k, v in arrays.items()} for idx in picked]


def partition_by_key(arrays: Arrays, keys: np.ndarray) -> tuple[np.ndarray, list[dict]]:
    """Groups examples by `keys` (one value per example): one client per distinct key.

    Args:
      arrays: a dataset: a dict of arrays sharing a leading example axis.
      keys: one key (a number or a string) per example, e.g. the writer of each example.

    Returns:
      `(unique_keys, clients)`; `clients[i]` holds the examples whose key is
      `unique_keys[i]`, in their original order.

    Example:
      >>> import numpy as np
      >>> from fax_bridge.data import partition_by_key
      >>> keys, clients = partition_by_key({"x": np.arange(4)}, np.array(["b", "a", "b", "a"]))
      >>> keys.tolist(), [c["x"].tolist() for c in clients]
      (['a', 'b'], [[1, 3], [0, 2]])
    """
    n = _check_arrays(arrays)
    try:
        keys = np.asarray(keys)
    except Exception:  # noqa: BLE001 - ragged nested lists
        keys = np.asarray(None)
    if keys.shape != (n,):
        raise DataError(
            f"keys must have one entry per example of the arrays, shape ({n},); got "
            f"{keys.shape}.")
    if keys.dtype == object or (keys.dtype.kind == "f" and not np.isfinite(keys).all()):
        raise DataError("keys must be finite numbers or strings of one kind, one per "
                        f"example; got dtype {keys.dtype} with {checks.shown(keys)}.")
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

    Args:
      labels: one class id per example (1-D).
      num_clients: the number of clients.
      alpha: the Dirichlet concentration: smaller is more skewed.
      seed: the seed of the draws.
      min_size: the fewest examples a client may get.
      max_tries: draws to try before giving up with a `DataError`.

    Returns:
      One sorted array of example positions per client.

    Example:
      >>> import numpy as np
      >>> from fax_bridge.data import dirichlet_label_skew
      >>> parts = dirichlet_label_skew(np.repeat([0, 1], 50), num_clients=4, alpha=0.5)
      >>> len(parts), sum(p.size for p in parts)
      (4, 100)
    """
    try:
        labels = np.asarray(labels)
    except Exception:  # noqa: BLE001 - ragged nested lists
        labels = np.asarray(None)
    if labels.ndim != 1 or labels.dtype == object or (
            labels.dtype.kind == "f" and not np.isfinite(labels).all()):
        raise DataError(f"labels must be a 1-D array of class ids (integers, strings or "
                        f"finite numbers); got {checks.shown(labels)}.")
    num_clients = checks.integer("num_clients", num_clients, 1)
    alpha = checks.real("alpha", alpha, 0.0, low_open=True,
                        fix="smaller is more skewed, e.g. 0.5")
    seed = checks.seed(seed)
    min_size = checks.integer("min_size", min_size, 0)
    max_tries = checks.integer("max_tries", max_tries, 1)
    if num_clients * min_size > labels.size:
        raise DataError(
            f"labels has {labels.size} examples, which cannot give num_clients="
            f"{num_clients} clients min_size={min_size} each; lower num_clients or min_size.")
    if labels.size == 0:
        return [np.zeros(0, np.int64) for _ in range(num_clients)]
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            shares = rng.dirichlet(np.full(num_clients, alpha))
            if not np.isfinite(shares).all():
                raise DataError(f"alpha={alpha!r} is too small for numpy's Dirichlet "
                                "draws (they came back NaN); use alpha >= 1e-3.")
            cuts = (np.cumsum(shares)[:-1] * idx.size).astype(np.int64)
            for i, piece in enumerate(np.split(idx, cuts)):
                parts[i].append(piece)
        out = [np.sort(np.concatenate(p)) for p in parts]
        if min(o.size for o in out) >= min_size:
            return out
    raise DataError(
        f"could not give every one of num_clients={num_clients} clients min_size="
        f"{min_size} of the {labels.size} labels in max_tries={max_tries} Dirichlet draws "
        f"with alpha={alpha}; raise alpha or lower min_size.")


def partition_dirichlet(arrays: Arrays, label_key: str, num_clients: int, alpha: float,
                        seed: int = 0, min_size: int = 1) -> list[dict]:
    """Splits `arrays` into `num_clients` client datasets skewed on `arrays[label_key]`.

    Args:
      arrays: a dataset: a dict of arrays sharing a leading example axis.
      label_key: the key of the labels in `arrays`.
      num_clients, alpha, seed, min_size: as `dirichlet_label_skew`.

    Returns:
      One dataset per client (see `dirichlet_label_skew`).

    Example:
      >>> import numpy as np
      >>> from fax_bridge.data import partition_dirichlet
      >>> data = {"x": np.zeros((100, 2)), "y": np.repeat([0, 1], 50)}
      >>> clients = partition_dirichlet(data, "y", num_clients=4, alpha=0.5, min_size=1)
      >>> sum(len(c["y"]) for c in clients)
      100
    """
    _check_arrays(arrays)
    if not isinstance(label_key, str) or label_key not in arrays:
        raise DataError(f"label_key {checks.shown(label_key)} is not one of the arrays "
                        f"{sorted(map(str, arrays))}; pass the key of the labels.")
    idx = dirichlet_label_skew(arrays[label_key], num_clients, alpha, seed, min_size)
    return split_clients(arrays, idx)
