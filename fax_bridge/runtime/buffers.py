"""Memory kept for reuse between rounds: the one owner, under one cap for the process.

A round at 10M parameters makes float64 sums of 80 MB, results of 40 MB, batched calls'
outputs of 40 MB a client row and answer segments of 80 MB; made anew every round, each
is fresh memory the kernel maps, zeroes and (numpy asks for huge pages on large arrays)
may first compact, which cost 25-110 ms a sum from one round to the next on the 2-core
machine, about 20 ms per 40 MB row of a batched call's outputs, and 30 ms for a
device's answer segment. So the process keeps such memory and hands it out again, and
everything it keeps for later is registered here, whatever its kind:

- numpy arrays (`empty`): kept from the moment they are made (the owner of the memory
  stays registered, to see when nothing holds it) and handed out again for the same
  number of bytes once no Python object refers to it: no view, memoryview, jax array
  made from it or message holding it (every one of them keeps a reference to the array
  that owns the memory, which `sys.getrefcount` counts). Used by the exact sums
  (`double_sums.py`) and the copies of shared-memory segments (`fleet/shared_memory.py`);
- anything else a caller gives back once it is done with it (`give`) and takes again
  (`take`) under a kind and a key: a batched call's jax outputs, which the next call of
  the same executable writes over (`client_map`, kind `SPARES`: one set per worker
  thread, for the most recent executable only), and a device's answer segment file in
  /dev/shm, which its next answer writes over (`fleet/shared_memory.SharedDir.keep`,
  kind `SEGMENTS`: one per device). Taken, it is the taker's and no longer counted
  here; a `release` callback given with it says how to let it go (a file is removed).

One cap: `MAX_KEPT_BYTES` (3 GiB unless `FAX_BRIDGE_MAX_KEPT_BYTES` sets it, in bytes, for
the process; read when first used, `env_settings`) bounds `kept_bytes()`, the bytes of
every kind together. Whatever is added past it pushes out the least recently used
entries nothing holds, of any kind, and only as many as it needs; when even that would
not make room, the new one is not kept (and is released). An array someone still holds
is never handed out, nor pushed out: a caller gets new memory instead. A kept entry is
handed out once: `take` removes it.

Memory that is freed but not returned to the system (glibc's free lists after gRPC's
many small buffers) is not kept for reuse: `fleet/memory.py` hands it back.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
from typing import Any, Callable, Hashable, Optional

import numpy as np

from fax_bridge.errors import ComputationError

ARRAYS = "arrays"      # numpy arrays handed out by `empty`, keyed by their bytes
SPARES = "spares"      # a batched call's outputs, keyed by its executable (client_map)
SEGMENTS = "segments"  # answer segment files, keyed by (directory, device address)

MIN_BYTES = 4 << 20  # smaller arrays come from numpy's allocator as they are
ENV_VAR = "FAX_BRIDGE_MAX_KEPT_BYTES"


def __getattr__(name: str) -> Any:
    """`MAX_KEPT_BYTES`, read from `ENV_VAR` when first used (`env_settings`: never on
    import, so a bad value is one named error where it is used, not an import's)."""
    if name == "MAX_KEPT_BYTES":
        from fax_bridge.system import env_settings

        globals()[name] = value = env_settings.whole_number(ENV_VAR)
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _cap() -> int:
    """The cap: `MAX_KEPT_BYTES` as set (tests set it), else as read from `ENV_VAR`."""
    cap = globals().get("MAX_KEPT_BYTES")
    return __getattr__("MAX_KEPT_BYTES") if cap is None else cap


@dataclasses.dataclass(eq=False)
class _Entry:
    kind: str
    key: Hashable
    value: Any
    nbytes: int
    release: Optional[Callable[[Any], None]] = None


_lock = threading.Lock()
_kept: list[_Entry] = []  # least recently used first


def _refs(kept: list, i: int) -> int:
    owner = kept[i].value
    return sys.getrefcount(owner)


def _free_refs() -> int:
    """The references `_refs` sees on a kept array that nothing else holds: the entry's,
    the local name's and getrefcount's own argument."""
    probe = [_Entry(ARRAYS, 1, np.empty(1, np.uint8), 1)]
    return _refs(probe, 0)


_FREE = _free_refs()


def _free(kept: list, i: int) -> bool:
    """Whether entry `i` may be handed out or pushed out: an array nothing else refers
    to; any other kind, as it was given back (a spare that is still viewed is written
    over by nobody: jax allocates anew for a donated array with live views)."""
    return kept[i].kind != ARRAYS or _refs(kept, i) == _FREE


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
            entry = _kept[i]
            if entry.kind == ARRAYS and entry.nbytes == nbytes and _free(_kept, i):
                _kept.append(_kept.pop(i))
                return entry.value.view(dtype).reshape(shape)
        owner = np.empty(nbytes, np.uint8)
        dropped = _make_room(nbytes)
        if dropped is not None:
            _kept.append(_Entry(ARRAYS, nbytes, owner, nbytes))
    _release(dropped or [])
    return owner.view(dtype).reshape(shape)


def give(kind: str, key: Hashable, value: Any, nbytes: int, *,
         release: Optional[Callable[[Any], None]] = None, per_key: Optional[int] = None,
         latest_key_only: bool = False) -> bool:
    """Keeps `value` (`nbytes` of memory, of `kind`) for a later `take(kind, key)`;
    True if kept. Not kept when it does not fit under `MAX_KEPT_BYTES` even once the
    least recently used free entries are pushed out: then `release(value)` runs.

    `per_key`: at most this many entries of the kind under `key` (a new one pushes out
    the oldest; a value equal to one kept under the key, such as a file's name, is the
    same memory: kept once, not released). `latest_key_only`: the kind's entries under
    other keys are pushed out. Pushed-out entries are released (their `release`)."""
    if kind == ARRAYS:
        raise ComputationError("arrays are kept by `buffers.empty`; give another kind")
    nbytes = int(nbytes)
    new = _Entry(kind, key, value, nbytes, release)
    dropped: list = []
    with _lock:
        same = []
        for entry in [e for e in _kept if e.kind == kind and e.key == key]:
            if entry.value is value or isinstance(value, str) and entry.value == value:
                _kept.remove(entry)  # the same memory, kept again
            else:
                same.append(entry)
        if per_key is not None:
            dropped += same[:max(0, len(same) - (per_key - 1))]
        if latest_key_only:
            dropped += [e for e in _kept if e.kind == kind and e.key != key]
        for entry in dropped:
            _kept.remove(entry)
        room = _make_room(nbytes)
        kept = room is not None
        if kept:
            dropped += room
            _kept.append(new)
    _release(dropped if kept else dropped + [new])
    return kept


def take(kind: str, key: Hashable) -> Optional[Any]:
    """The most recently given value of `kind` under `key`, no longer kept (the
    caller's now); None when there is none."""
    with _lock:
        for i in range(len(_kept) - 1, -1, -1):
            entry = _kept[i]
            if entry.kind == kind and entry.key == key:
                del _kept[i]
                return entry.value
    return None


def drop(kind: str, keep: Callable[[Hashable], bool] = lambda key: False) -> None:
    """Releases the entries of `kind` whose key `keep` refuses (every one by default)."""
    with _lock:
        dropped = [e for e in _kept if e.kind == kind and not keep(e.key)]
        for entry in dropped:
            _kept.remove(entry)
    _release(dropped)


def kept(kind: str) -> list:
    """The values of `kind` kept now, least recently used first (for inspection)."""
    with _lock:
        return [e.value for e in _kept if e.kind == kind]


def kept_bytes(kind: Optional[str] = None) -> int:
    """The bytes this process keeps for later (of `kind`, or of every kind); arrays
    count whether held or not."""
    with _lock:
        return sum(e.nbytes for e in _kept if kind is None or e.kind == kind)


def release() -> None:
    """Forgets everything kept, releasing it (arrays still held stay alive with their
    holders)."""
    with _lock:
        dropped = list(_kept)
        _kept.clear()
    _release(dropped)


def _make_room(nbytes: int) -> Optional[list]:
    """Under the lock: removes the least recently used free entries while the kept
    bytes plus `nbytes` exceed the cap, and returns them (to release outside the lock);
    None, removing nothing, when even all of them would not make room."""
    cap = _cap()
    over = sum(e.nbytes for e in _kept) + nbytes - cap
    if over <= 0:
        return []
    if nbytes > cap:
        return None
    chosen = []
    for i in range(len(_kept)):
        if over <= 0:
            break
        if _free(_kept, i):
            chosen.append(_kept[i])
            over -= _kept[i].nbytes
    if over > 0:
        return None
    for entry in chosen:
        _kept.remove(entry)
    return chosen


def _release(entries: list) -> None:
    """Lets each of `entries` go (their `release`, outside the lock)."""
    for entry in entries:
        if entry.release is not None:
            entry.release(entry.value)
