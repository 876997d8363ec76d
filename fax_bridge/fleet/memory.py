"""Handing memory back to the system after large calls.

gRPC receives a large message as many small buffers; glibc keeps such pieces for reuse
once they are freed, so a process that served one 600 MB call would stay at that peak
for good. A `MovedBytes` tally counts what calls moved (requests decoded, answers
encoded) and, once it passes `RELEASE_AFTER_BYTES`, returns the freed heap to the
system with glibc's `malloc_trim(0)` (nothing on other C libraries), in a thread of its
own: it took 20-114 ms after each 100 MB call on a loaded 2-core machine, and the call's
answer need not wait for it (nor the call's own request, freed once it returns).

This is release, not reuse: what `malloc_trim` hands back is heap that nothing holds
and nothing will hand out again (glibc's free lists), so it is not memory kept for
reuse and has no place under that memory's cap. What the process keeps for reuse
(`runtime/buffers.py`: arrays, spare call outputs, answer segments, one cap for all) is
live memory `malloc_trim` cannot touch. It stays in the fleet because only gRPC's many
small receive buffers leave such a heap behind; `RELEASE_AFTER_BYTES` says when to
trim, not how much may be kept.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import time

RELEASE_AFTER_BYTES = 64 << 20


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: its allocator returns memory itself
        return None


def release_memory() -> bool:
    """Returns the heap memory this process freed to the system; False where the C
    library offers no way to (not glibc)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class MovedBytes:
    """Bytes moved by calls since freed memory was last handed back."""

    def __init__(self, threshold: int = RELEASE_AFTER_BYTES):
        self.threshold = int(threshold)
        self._bytes = 0
        self._lock = threading.Lock()
        self._releasing = threading.Event()  # set while a release runs

    def add(self, count: int) -> None:
        with self._lock:
            self._bytes += int(count)

    def settle(self) -> None:
        """Once `threshold` bytes have moved (call it as a call ends), hands freed memory
        back in a thread of its own, one at a time."""
        with self._lock:
            if self._bytes < self.threshold or self._releasing.is_set():
                return
            self._bytes = 0
            self._releasing.set()
        threading.Thread(target=self._release, name="release-memory", daemon=True).start()

    def _release(self) -> None:
        try:
            time.sleep(0.05)  # let the ending call free its request and answer first
            release_memory()
        finally:
            self._releasing.clear()
