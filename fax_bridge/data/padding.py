"""Padding clients of unequal sizes to one shape, with masks.

A federated map runs one computation over a leading clients axis, so every client's data
must have the same shape. `pad_clients` stacks a cohort into arrays of shape
`(clients, size, ...)` with a boolean `mask` (True on real examples); `to_batches`
reshapes the example axis into `(steps, batch)` for local training loops.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Optional, Sequence

import numpy as np

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

    `size` defaults to the largest client, rounded up to a multiple of `multiple_of`.
    A client larger than `size` is an error (truncating would silently drop data).
    """
    if not clients:
        raise DataError("pad_clients needs at least one client dataset.")
    keys = sorted(clients[0])
    sizes = []
    for i, c in enumerate(clients):
        if sorted(c) != keys:
            raise DataError(f"client {i} has keys {sorted(c)}, client 0 has {keys}.")
        lens = {k: np.shape(c[k])[0] for k in keys}
        if len(set(lens.values())) != 1:
            raise DataError(f"client {i}'s arrays have different lengths: {lens}.")
        sizes.append(lens[keys[0]])
    sizes = np.asarray(sizes, dtype=np.int64)
    if multiple_of < 1:
        raise DataError(f"multiple_of must be >= 1, got {multiple_of}.")
    if size is None:
        size = int(max(1, sizes.max()))
        size = -(-size // multiple_of) * multiple_of
    if sizes.max() > size:
        raise DataError(
            f"client {int(sizes.argmax())} has {int(sizes.max())} examples, more than the "
            f"padded size {size}; pass a larger size (or size=None for the largest).")
    data = {}
    for k in keys:
        first = np.asarray(clients[0][k])
        out = np.zeros((len(clients), size) + first.shape[1:], dtype=first.dtype)
        for i, c in enumerate(clients):
            out[i, : sizes[i]] = c[k]
        data[k] = out
    mask = np.arange(size)[None, :] < sizes[:, None]
    return PaddedClients(data, mask, sizes)


def to_batches(padded: PaddedClients, batch_size: int) -> PaddedClients:
    """Reshapes `(clients, size, ...)` into `(clients, size // batch_size, batch_size, ...)`.

    The padded size must be a multiple of `batch_size` (use `pad_clients(...,
    multiple_of=batch_size)`). Real examples come first, so a client's padding fills its
    last batches; a batch with no real example is skipped by the algorithms.
    """
    size = padded.mask.shape[1]
    if batch_size < 1 or size % batch_size:
        raise DataError(
            f"padded size {size} is not a multiple of batch_size {batch_size}; pad with "
            f"pad_clients(..., multiple_of={batch_size}).")
    steps = size // batch_size

    def split(a):
        return a.reshape((a.shape[0], steps, batch_size) + a.shape[2:])

    return PaddedClients({k: split(v) for k, v in padded.data.items()},
                         split(padded.mask), padded.counts)
