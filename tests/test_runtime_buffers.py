"""Large buffers handed out again only once nothing holds them (runtime/buffers.py)."""

import gc

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fax_bridge.runtime import buffers

SIZE = buffers.MIN_BYTES // 8  # float64 elements of the smallest kept array


@pytest.fixture(autouse=True)
def _fresh_pool():
    buffers.release()
    yield
    buffers.release()


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_a_dropped_array_is_handed_out_again_with_its_shape_and_dtype():
    a = buffers.empty((SIZE,), np.float64)
    where = _address(a)
    del a
    b = buffers.empty((2, SIZE), np.float32)  # the same bytes, another dtype and shape
    assert _address(b) == where
    assert b.shape == (2, SIZE) and b.dtype == np.float32 and b.flags.c_contiguous
    assert buffers.kept_bytes() == SIZE * 8


@pytest.mark.parametrize("hold", ["array", "view", "memoryview", "reshaped", "frombuffer"])
def test_an_array_someone_still_holds_is_never_handed_out(hold):
    a = buffers.empty(SIZE, np.float64)
    a[:] = 1.5
    keep = {"array": lambda: a, "view": lambda: a[10:], "memoryview": lambda: memoryview(a),
            "reshaped": lambda: a.reshape(2, -1),
            "frombuffer": lambda: np.frombuffer(memoryview(a), np.uint8)}[hold]()
    del a
    b = buffers.empty(SIZE, np.float64)
    b[:] = -2.0
    held = np.frombuffer(keep, np.float64) if hold in ("memoryview", "frombuffer") else keep
    assert np.all(np.asarray(held) == 1.5)  # written over by nobody
    del keep, held, b
    assert buffers.kept_bytes() == 2 * SIZE * 8


def test_small_arrays_are_not_kept():
    a = buffers.empty(16, np.float64)
    assert a.shape == (16,) and buffers.kept_bytes() == 0


def test_the_kept_bytes_stay_under_the_cap(monkeypatch):
    monkeypatch.setattr(buffers, "MAX_KEPT_BYTES", 3 * SIZE * 8)
    held = [buffers.empty(SIZE, np.float64) for _ in range(5)]  # over the cap: 2 not kept
    assert buffers.kept_bytes() == 3 * SIZE * 8
    del held
    gc.collect()
    big = buffers.empty(2 * SIZE, np.float64)  # pushes out free ones to fit
    assert buffers.kept_bytes() <= 3 * SIZE * 8
    del big


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["take", "drop", "view"]),
                          st.sampled_from([1, 2, 3]), st.integers(0, 7)),
                max_size=30))
def test_live_arrays_never_share_memory(steps):
    """Random takes and drops (arrays, or views kept of them): every array or view
    alive holds the value written into it when it was taken, whatever came after."""
    live: list = []  # (array or view, the value written into it)
    for step, (op, blocks, pick) in enumerate(steps):
        if op == "take":
            a = buffers.empty(blocks * SIZE, np.float64)
            value = float(step + 1)  # no two takes write the same value
            a[:] = value
            live.append((a, value))
        elif live and op == "drop":
            live.pop(pick % len(live))
        elif live:
            i = pick % len(live)
            a, value = live[i]
            live[i] = (a[1:], value)  # only a view is left of it
        for a, value in live:
            assert a[0] == value and a[-1] == value
    assert buffers.kept_bytes() <= buffers.MAX_KEPT_BYTES
