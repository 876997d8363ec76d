"""Padding clients of unequal sizes to one shape, with masks.

A federated map runs one computation over a leading clients axis, so every client's data
must have the same shape. `pad_clients` stacks a cohort into arrays of shape
`(clients, size, ...)` with a boolean `mask` (True on real examples); `to_batches`
reshapes the example axis into `(steps, batch)` for local training loops.
"""

from __future__ import annotations

from typing import Iterable, Mapping, NamedTuple, Optional, Sequence

import numpy as np

from fax_bridge.data import checks
from fax_bridge.errors import DataError


class PaddedClients(NamedTuple):
    """A cohort stacked along a leading clients axis.

    `data[k]` has shape `(clients, size, ...)` (or `(clients, steps, batch, ...)` after
    `to_batches`); `mask` has the same leading shape and is True on real examples;
    `counts[i]` is client i's number of real examples.
    """

    data: dict
    mask: np.ndarray
    counts: np.ndarray

    @property
    def num_clients(self) -> int:
        return int(self.mask.shape[0])


def pad_clients(clients: Sequence[Mapping[str, np.ndarray]], size: Optional[int] = None,
                multiple_of: int = 1) -> PaddedClients:
    """Stacks client datasets, padding each with zeros to `size` examples.

    `size` defaults to the largest client, rounded up to a multiple of `multiple_of`;
    a given `size` must be such a multiple. A client larger than `size` is an error
    (truncating would silently drop data), as are clients whose arrays differ in dtype
    or example shape (stacking would cast or fail).

    Args:
      clients: client datasets (dicts of arrays with the same keys).
      size: the padded number of examples; default the largest client's.
      multiple_of: round the default size up to a multiple of this (a batch size).

    Returns:
      `PaddedClients`: the stacked data, the mask of real examples and each count.

    Example:
      >>> import numpy as np
      >>> from fax_bridge.data import pad_clients
      >>> padded = pad_clients([{"x": np.ones(3)}, {"x": np.ones(1)}], multiple_of=2)
      >>> padded.data["x"].shape, padded.counts.tolist()
      ((2, 4), [3, 1])
      >>> padded.mask.astype(int).tolist()
      [[1, 1, 1, 0], [1, 0, 0, 0]]
    """
    clients = _client_list(clients)
    multiple_of = checks.integer("multiple_of", multiple_of, 1,
                                 fix="pass 1, or the batch size the data will be cut into")
    keys = sorted(clients[0])
    sizes = []
    for i, c in enumerate(clients):
        if sorted(c) != keys:
            raise DataError(f"client {i} has keys {sorted(c)}, client 0 has {keys}.")
        for k in keys:
            first, mine = np.asarray(clients[0][k]), np.asarray(c[k])
            if (mine.shape[1:], mine.dtype) != (first.shape[1:], first.dtype):
                raise DataError(
                    f"client {i}'s {k!r} has examples of {mine.dtype}{list(mine.shape[1:])}, "
                    f"client 0's {first.dtype}{list(first.shape[1:])}; give every client "
                    "the same dtype and example shape (e.g. .astype(...)).")
        lens = {k: np.shape(c[k])[0] for k in keys}
        if len(set(lens.values())) != 1:
            raise DataError(f"client {i}'s arrays have different lengths: {lens}.")
        sizes.append(lens[keys[0]])
    sizes = np.asarray(sizes, dtype=np.int64)
    if size is None:
        size = int(max(1, sizes.max()))
        size = -(-size // multiple_of) * multiple_of
    size = checks.integer("size", size, 1, fix="pass None for the largest client's size")
    if size % multiple_of:
        raise DataError(f"size {size} is not a multiple of multiple_of {multiple_of}; pass "
                        "a size that is, or size=None to round the largest client up.")
    if sizes.max() > size:
        raise DataError(
            f"client {int(sizes.argmax())} has {int(sizes.max())} examples, more than the "
            f"padded size {size}; pass a larger size (or size=None for the largest).")
    data = {}
    for k in keys:
        first = np.asarray(clients[0][k])
        shape = (len(clients), size) + first.shape[1:]
        try:
            out = np.zeros(shape, dtype=first.dtype)
        except (ValueError, MemoryError):
            raise DataError(
                f"padding to size={size} (multiple_of={multiple_of}) needs {k!r} of shape "
                f"{shape}, more memory than there is; pass a smaller size or "
                "multiple_of.") from None
        for i, c in enumerate(clients):
            out[i, : sizes[i]] = c[k]
        data[k] = out
    mask = np.arange(size)[None, :] < sizes[:, None]
    return PaddedClients(data, mask, sizes)


def _client_list(clients) -> list:
    """`clients` as a non-empty list of client datasets (dicts of arrays)."""
    if isinstance(clients, (Mapping, str, bytes, np.ndarray)) or not isinstance(
            clients, Iterable):
        raise DataError(f"clients must be a list of client datasets (dicts of arrays), "
                        f"got {checks.shown(clients)}; wrap one client as [client].")
    clients = list(clients)
    if not clients:
        raise DataError("pad_clients needs at least one client dataset.")
    for i, c in enumerate(clients):
        checks.dataset(f"clients[{i}]", c)
    return clients


def to_batches(padded: PaddedClients, batch_size: int) -> PaddedClients:
    """Reshapes `(clients, size, ...)` into `(clients, size // batch_size, batch_size, ...)`.

    The padded size must be a multiple of `batch_size` (use `pad_clients(...,
    multiple_of=batch_size)`). Real examples come first, so a client's padding fills its
    last batches; a batch with no real example is skipped by the algorithms.

    Args:
      padded: what `pad_clients` returned.
      batch_size: examples per batch.

    Returns:
      `PaddedClients` whose data and mask have a steps axis and a batch axis.

    Example:
      >>> import numpy as np
      >>> from fax_bridge.data import pad_clients, to_batches
      >>> padded = pad_clients([{"x": np.ones(3)}, {"x": np.ones(1)}], multiple_of=2)
      >>> to_batches(padded, 2).data["x"].shape
      (2, 2, 2)
    """
    if not isinstance(padded, PaddedClients):
        raise DataError(f"padded must be the PaddedClients that pad_clients returns, got "
                        f"{type(padded).__name__}.")
    batch_size = checks.integer("batch_size", batch_size, 1,
                                fix="pass the number of examples per local step, e.g. 16")
    size = padded.mask.shape[1]
    if size % batch_size:
        raise DataError(
            f"padded size {size} is not a multiple of batch_size {batch_size}; pad with "
            f"pad_clients(..., multiple_of={batch_size}).")
    steps = size // batch_size

    def split(a):
        return a.reshape((a.shape[0], steps, batch_size) + a.shape[2:])

    return PaddedClients({k: split(v) for k, v in padded.data.items()},
                         split(padded.mask), padded.counts)
