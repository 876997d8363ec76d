"""The runtime's worker threads: one per CPU this process may run on.

Work that numpy or XLA does without the GIL (the spans of columns of a large exact sum,
`double_sums`; the parts of a cohort's batched client call, `client_map`) runs on these
threads at once. A fleet device runs on its own share of the CPUs (`LocalFleet`
`share_cpus`), one as a rule, and so on one thread.
"""

from __future__ import annotations

import os
import threading
from concurrent import futures

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
