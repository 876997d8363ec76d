"""Large numpy buffers made once and handed out again once nothing holds them.

A round at 10M parameters makes float64 sums of 80 MB and results of 40 MB; made anew
every round, each is fresh memory the kernel maps, zeroes and (numpy asks for huge
pages on large arrays) may first compact, which cost 25-110 ms a sum from one round to
the next on the 2-core machine. `empty` keeps the large arrays it hands out and hands
one out again for the same number of bytes once no Python object refers to it any more:
no view, memoryview, jax array made from it or message holding it (every one of them
keeps a reference to the array that owns the memory, which `sys.getrefcount` counts).
A buffer someone still holds is never handed out; a caller gets new memory instead.

Only arrays of at least `MIN_BYTES` are kept, `MAX_KEPT_BYTES` in all; a new one that
does not fit pushes out the least recently used free ones, or is not kept.
"""

from __future__ import annotations

import math
import sys
import threading

import numpy as np

MIN_BYTES = 4 << 20  # smaller arrays come from numpy's allocator as they are
MAX_KEPT_BYTES = 1 << 30  # the most this process keeps for later rounds

_lock = threading.Lock()
_kept: list = []  # owners (1-D uint8 arrays), least recently handed out first


def _refs(kept: list, i: int) -> int:
    owner = kept[i]
    return sys.getrefcount(owner)


def _free_refs() -> int:
    """The references `_refs` sees on a kept array that nothing else holds: the list's,
    the local name's and getrefcount's own argument."""
    probe = [np.empty(1, np.uint8)]
    return _refs(probe, 0)


_FREE = _free_refs()


def empty(shape, dtype) -> np.ndarray:
    """An uninitialised array, like `np.empty(shape, dtype)` (C order); large ones on
    memory this process made before and nothing holds now, where there is such memory
    of the same size."""
    dtype = np.dtype(dtype)
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (int(shape),)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < MIN_BYTES:
        return np.empty(shape, dtype)
    with _lock:
        for i in range(len(_kept)):
            if _kept[i].nbytes == nbytes and _refs(_kept, i) == _FREE:
                owner = _kept.pop(i)
                _kept.append(owner)
                return owner.view(dtype).reshape(shape)
        owner = np.empty(nbytes, np.uint8)
        _keep(owner)
        return owner.view(dtype).reshape(shape)


def _keep(owner: np.ndarray) -> None:
    """Adds `owner`, first dropping free ones (least recently used first) while the
    kept bytes would exceed `MAX_KEPT_BYTES`; not kept if it still does not fit."""
    total = sum(a.nbytes for a in _kept) + owner.nbytes
    i = 0
    while total > MAX_KEPT_BYTES and i < len(_kept):
        if _refs(_kept, i) == _FREE:
            total -= _kept.pop(i).nbytes
        else:
            i += 1
    if total <= MAX_KEPT_BYTES:
        _kept.append(owner)


def kept_bytes() -> int:
    """The bytes this process keeps for later rounds, held or not."""
    with _lock:
        return sum(a.nbytes for a in _kept)


def release() -> None:
    """Forgets every kept array (those still held stay alive with their holders)."""
    with _lock:
        _kept.clear()
