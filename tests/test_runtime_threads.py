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


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("size", [0, 1, 7, 64, 65, 1000])
def test_in_spans_covers_every_position_once_in_whole_blocks_and_in_order(monkeypatch,
                                                                           workers, size):
    monkeypatch.setattr(threads, "workers", lambda: workers)
    monkeypatch.setattr(threads, "MIN_SPAN_BLOCKS", 2)
    spans = threads.in_spans(size, 8, lambda lo, hi: (lo, hi))
    assert spans[0][0] == 0 and spans[-1][1] == size
    covered = [i for lo, hi in spans for i in range(lo, hi)]
    assert covered == list(range(size))  # every position once, in order, no gap
    assert all(lo % 8 == 0 for lo, _ in spans)  # spans of whole blocks
    assert len(spans) <= max(1, workers)


def test_in_spans_raises_what_a_span_raises(monkeypatch):
    monkeypatch.setattr(threads, "workers", lambda: 2)
    monkeypatch.setattr(threads, "MIN_SPAN_BLOCKS", 1)

    def work(lo, hi):
        if lo:
            raise ValueError(f"span at {lo}")
        return lo

    with pytest.raises(ValueError, match="span at 8"):
        threads.in_spans(16, 8, work)
