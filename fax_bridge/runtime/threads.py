"""The runtime's worker threads: one per CPU this process may run on.

Work that numpy or XLA does without the GIL (the spans of columns of a large exact sum,
`double_sums`; the checks of a large partial's values, `rounds.validate`; the parts of a
cohort's batched client call, `client_map`) runs on these threads at once (`in_spans`
splits work over positions into spans of whole blocks, one per thread). A fleet device
runs on its own share of the CPUs (`LocalFleet` `share_cpus`), one as a rule, and so on
one thread.
"""

from __future__ import annotations

import os
import threading
from concurrent import futures
from typing import Any, Callable

_lock = threading.Lock()
_pools: list = []  # the pool, made on first use


def workers() -> int:
    """How many CPUs this process may run on (at least 1)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def pool() -> futures.ThreadPoolExecutor:
    """The worker threads (`workers()` of them, as many as there were at first use)."""
    with _lock:
        if not _pools:
            _pools.append(futures.ThreadPoolExecutor(max_workers=workers(),
                                                     thread_name_prefix="fax_bridge"))
        return _pools[0]


MIN_SPAN_BLOCKS = 8  # blocks per thread, at least: less work runs on the caller's thread


def in_spans(size: int, step: int, work: Callable[[int, int], Any]) -> list:
    """`work(start, stop)` over [0, size) in blocks of `step`: once over all of it, or
    over spans of whole blocks (at least `MIN_SPAN_BLOCKS` each), one per worker thread
    at once; the results in order of the spans (an exception in one is raised here)."""
    blocks = -(-size // step)
    spans = min(workers(), blocks // MIN_SPAN_BLOCKS)
    if spans <= 1:
        return [work(0, size)]
    per = -(-blocks // spans) * step
    return list(pool().map(lambda lo: work(lo, min(lo + per, size)), range(0, size, per)))
