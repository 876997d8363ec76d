"""runtime.threads: one worker per CPU this process may run on, one pool for the runtime."""

import os

import pytest

from fax_bridge.runtime import threads


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux only")
def test_one_worker_per_cpu_this_process_may_run_on():
    assert threads.workers() == len(os.sched_getaffinity(0))


def test_one_pool_shared_by_every_caller_and_running_work_in_order():
    pool = threads.pool()
    assert threads.pool() is pool
    assert list(pool.map(lambda i: i * i, range(10))) == [i * i for i in range(10)]
