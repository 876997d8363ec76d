"""Handing memory back to the system after large calls.

gRPC receives a large message as many small buffers; glibc keeps such pieces for reuse
once they are freed, so a process that served one 600 MB call would stay at that peak
for good. A `MovedBytes` tally counts what calls moved (requests decoded, answers
encoded) and, once it passes `RELEASE_AFTER_BYTES`, returns the freed heap to the
system with glibc's `malloc_trim(0)` (a few milliseconds; nothing on other C libraries).
"""

from __future__ import annotations

import ctypes
import functools
import threading

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

    def add(self, count: int) -> None:
        with self._lock:
            self._bytes += int(count)

    def settle(self) -> None:
        """Hands freed memory back once `threshold` bytes have moved (call after a call)."""
        with self._lock:
            if self._bytes < self.threshold:
                return
            self._bytes = 0
        release_memory()
