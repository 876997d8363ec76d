"""Compact sets of client ids for round plans and reports.

A cohort of 100,000 clients held as a Python list costs about 36 bytes a client (the
list's pointer and an int object each), a dict of delays about 100 more. `ClientIds`
holds a sorted set of population indices as ranges [start, stop) when that is shorter
(a whole population is one range) and as one int64 array otherwise; `ClientDelays`
holds the emulated delays of a cohort as one float64 array beside it (none at all when
nobody straggles). Both read like the lists and dicts they replace: `len`, iteration,
indexing, `in`, `==` with a list, and numpy indexing (`xs[ids]`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Iterator, Optional

import numpy as np

from fax_bridge.errors import FleetError

_CHUNK = 4096  # ids turned into Python ints at a time when iterating


class ClientIds(Sequence):
    """A sorted set of distinct client ids (population indices), stored compactly."""

    __slots__ = ("_starts", "_stops", "_offsets", "_ids", "_n")

    def __init__(self, ids=()) -> None:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and np.any(np.diff(ids) <= 0):
            raise FleetError("client ids must be distinct and in ascending order; sort "
                             "them (np.unique) first")
        self._n = int(ids.size)
        breaks = np.flatnonzero(np.diff(ids) != 1) + 1
        if ids.size and 2 * (len(breaks) + 1) < ids.size:
            firsts = np.concatenate([[0], breaks])
            lasts = np.concatenate([breaks, [ids.size]])
            self._set_ranges(ids[firsts], ids[lasts - 1] + 1)
        else:
            self._starts = self._stops = self._offsets = None
            self._ids = ids.copy() if ids.base is not None else ids

    def _set_ranges(self, starts: np.ndarray, stops: np.ndarray) -> None:
        self._starts = np.asarray(starts, np.int64)
        self._stops = np.asarray(stops, np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(self._stops - self._starts)])
        self._ids = None

    @classmethod
    def span(cls, start: int, stop: int) -> "ClientIds":
        """The ids start, start + 1, ..., stop - 1 (stored as one range)."""
        out = cls.__new__(cls)
        start, stop = int(start), max(int(start), int(stop))
        out._n = stop - start
        if out._n:
            out._set_ranges(np.array([start]), np.array([stop]))
        else:
            out._starts = out._stops = out._offsets = None
            out._ids = np.zeros(0, np.int64)
        return out

    # -- reading -------------------------------------------------------------------

    def __len__(self) -> int:
        return self._n

    def array(self) -> np.ndarray:
        """Every id, ascending, as a new int64 array."""
        if self._ids is not None:
            return self._ids.copy()
        return np.concatenate([np.arange(a, b, dtype=np.int64)
                               for a, b in zip(self._starts, self._stops)])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self.array()
        return out if dtype is None else out.astype(dtype)

    def ranges(self) -> list[tuple[int, int]]:
        """The ids as maximal ranges [start, stop), ascending."""
        if self._ids is None:
            return [(int(a), int(b)) for a, b in zip(self._starts, self._stops)]
        ids = self._ids
        if not ids.size:
            return []
        breaks = np.flatnonzero(np.diff(ids) != 1) + 1
        firsts = np.concatenate([[0], breaks])
        lasts = np.concatenate([breaks, [ids.size]])
        return [(int(ids[a]), int(ids[b - 1]) + 1) for a, b in zip(firsts, lasts)]

    def __iter__(self) -> Iterator[int]:
        if self._ids is None:
            for a, b in zip(self._starts.tolist(), self._stops.tolist()):
                yield from range(a, b)
        else:
            for lo in range(0, self._n, _CHUNK):
                yield from self._ids[lo:lo + _CHUNK].tolist()

    def __getitem__(self, index):
        if isinstance(index, slice):
            return ClientIds(self.array()[index])
        i = int(index)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"client position {index} out of range for {self._n} clients")
        if self._ids is not None:
            return int(self._ids[i])
        k = int(np.searchsorted(self._offsets, i, side="right")) - 1
        return int(self._starts[k] + (i - self._offsets[k]))

    def positions(self, ids) -> np.ndarray:
        """Where each of `ids` (all members) stands in this set, as an int64 array."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if self._ids is not None:
            return np.searchsorted(self._ids, ids).astype(np.int64)
        k = np.searchsorted(self._starts, ids, side="right") - 1
        return self._offsets[k] + ids - self._starts[k]

    def __contains__(self, client) -> bool:
        try:
            c = int(client)
        except (TypeError, ValueError):
            return False
        if self._ids is not None:
            i = int(np.searchsorted(self._ids, c))
            return i < self._n and int(self._ids[i]) == c
        if self._n == 0:
            return False
        k = int(np.searchsorted(self._starts, c, side="right")) - 1
        return k >= 0 and c < int(self._stops[k])

    def __eq__(self, other) -> bool:
        if isinstance(other, (ClientIds, Sequence, np.ndarray)) and not isinstance(
                other, (str, bytes)):
            if len(other) != self._n:
                return False
            return bool(np.array_equal(self.array(), np.asarray(other, dtype=np.int64)))
        return NotImplemented

    __hash__ = None

    # -- deriving ------------------------------------------------------------------

    def without(self, removed) -> "ClientIds":
        """These ids less those in `removed`."""
        removed = np.asarray(list(removed) if not isinstance(removed, np.ndarray)
                             else removed, dtype=np.int64)
        if not removed.size:
            return self
        return ClientIds(np.setdiff1d(self.array(), removed, assume_unique=True))

    @property
    def nbytes(self) -> int:
        """Bytes the encoding holds (its arrays)."""
        if self._ids is not None:
            return int(self._ids.nbytes)
        return int(self._starts.nbytes + self._stops.nbytes + self._offsets.nbytes)

    def __repr__(self) -> str:
        if self._n <= 8:
            return f"ClientIds({list(self)})"
        form = (f"{len(self._starts)} ranges" if self._ids is None else "an array")
        return f"ClientIds({self._n} ids from {self[0]} to {self[-1]}, as {form})"


class ClientDelays(Mapping):
    """Emulated delay (seconds) of each client of a cohort: client id -> float."""

    __slots__ = ("cohort", "_delays")

    def __init__(self, cohort: ClientIds, delays: Optional[np.ndarray] = None) -> None:
        self.cohort = cohort
        if delays is not None:
            delays = np.asarray(delays, dtype=np.float64).reshape(-1)
            if delays.size != len(cohort):
                raise FleetError(f"{delays.size} delays for a cohort of {len(cohort)}")
        self._delays = delays  # None: nobody is delayed

    def of(self, ids) -> np.ndarray:
        """The delays of `ids` (members of the cohort), in their order."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if self._delays is None:
            return np.zeros(ids.size, np.float64)
        return self._delays[self.cohort.positions(ids)]

    def __getitem__(self, client) -> float:
        if client not in self.cohort:
            raise KeyError(client)
        return float(self.of([client])[0])

    def __iter__(self) -> Iterator[int]:
        return iter(self.cohort)

    def __len__(self) -> int:
        return len(self.cohort)

    def __eq__(self, other) -> bool:
        if isinstance(other, ClientDelays):
            return self.cohort == other.cohort and np.array_equal(
                self.of(self.cohort.array()), other.of(other.cohort.array()))
        return Mapping.__eq__(self, other)

    __hash__ = None
