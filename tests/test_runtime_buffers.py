"""Large buffers handed out again only once nothing holds them (runtime/buffers.py)."""

import gc

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fax_bridge.errors import ComputationError
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


BLOCK = 4096  # bytes, in the test below


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["array", "drop", "view", "give", "take",
                                           "drop_kind"]),
                          st.sampled_from([buffers.SPARES, buffers.SEGMENTS]),
                          st.integers(0, 2), st.integers(1, 4), st.integers(0, 7)),
                max_size=40))
def test_every_kind_shares_one_cap_and_nothing_live_is_handed_out_or_written_over(steps):
    """Random sequences over every kind at once (arrays made and dropped or only viewed;
    spare arrays and segment files given back, taken, given back again and dropped by
    key) under one small cap: the kept bytes never pass it, a kind never keeps more than
    `per_key` under a key, nothing is both kept and handed out, every live array, spare
    and segment keeps the contents written into it, and a segment file exists exactly
    while it is kept or handed out (one pushed out or not kept is removed)."""
    import os
    import tempfile
    from collections import Counter

    cap = 8 * BLOCK
    per_key = {buffers.SPARES: 2, buffers.SEGMENTS: 1}
    with pytest.MonkeyPatch.context() as mp, tempfile.TemporaryDirectory() as folder:
        mp.setattr(buffers, "MAX_KEPT_BYTES", cap)
        mp.setattr(buffers, "MIN_BYTES", BLOCK)
        buffers.release()
        content: dict = {}  # a spare array's id or a segment's name -> its byte value
        keys: dict = {}  # the same -> the key it was last given under
        live_arrays: list = []  # (array or view, value)
        taken: list = []  # (kind, key, value) handed out by `take` and held

        def unlink(name):
            os.remove(os.path.join(folder, name))

        def ident(kind, value):
            return id(value) if kind == buffers.SPARES else value

        def holds(kind, value) -> bool:
            if kind == buffers.SPARES:
                return bool(np.all(value == content[id(value)]))
            with open(os.path.join(folder, value), "rb") as f:
                data = f.read()
            return data == bytes([content[value]]) * len(data) and len(data) > 0

        def give(kind, key, value):
            nbytes = (value.nbytes if kind == buffers.SPARES
                      else os.path.getsize(os.path.join(folder, value)))
            keys[id(value) if kind == buffers.SPARES else value] = key
            buffers.give(kind, key, value, nbytes, per_key=per_key[kind],
                         release=unlink if kind == buffers.SEGMENTS else None,
                         latest_key_only=kind == buffers.SPARES)

        for step, (op, kind, key, blocks, pick) in enumerate(steps):
            value = step % 251 + 1
            if op == "array":
                a = buffers.empty(blocks * BLOCK // 8, np.float64)
                a[:] = value
                live_arrays.append((a, float(value)))
            elif op == "drop" and live_arrays and pick % 2:
                live_arrays.pop(pick % len(live_arrays))
            elif op == "drop" and taken:
                kind, _, held = taken.pop(pick % len(taken))
                if kind == buffers.SEGMENTS:
                    unlink(held)  # its round failed: the holder removes it
            elif op == "view" and live_arrays:
                i = pick % len(live_arrays)
                live_arrays[i] = (live_arrays[i][0][1:], live_arrays[i][1])
            elif op == "give" and taken and pick % 2:
                kind, key, held = taken.pop(pick % len(taken))
                give(kind, key, held)  # given back
            elif op == "give":
                if kind == buffers.SPARES:
                    held = np.full(blocks * BLOCK, value, np.uint8)
                    content[id(held)] = value
                else:
                    held = f"a-{step}"
                    with open(os.path.join(folder, held), "wb") as f:
                        f.write(bytes([value]) * (blocks * BLOCK))
                    content[held] = value
                give(kind, key, held)
            elif op == "take":
                held = buffers.take(kind, key)
                if held is not None:
                    assert holds(kind, held)
                    if kind == buffers.SPARES:  # the taker writes over it
                        held[:] = content[id(held)] = value
                    else:
                        with open(os.path.join(folder, held), "wb") as f:
                            f.write(bytes([value]) * (blocks * BLOCK))
                        content[held] = value
                    taken.append((kind, key, held))
            elif op == "drop_kind":
                buffers.drop(kind, lambda k: k != key)

            assert buffers.kept_bytes() <= cap
            for a, v in live_arrays:
                assert a[0] == v and a[-1] == v
            for kind, key, held in taken:
                assert holds(kind, held)
            # a spare by its identity, a segment by its file's name
            handed_out = {ident(kind, held) for kind, _, held in taken}
            kept_now = {ident(k, held) for k in (buffers.SPARES, buffers.SEGMENTS)
                        for held in buffers.kept(k)}
            assert handed_out & kept_now == set()
            for k in (buffers.SPARES, buffers.SEGMENTS):
                for held in buffers.kept(k):
                    assert holds(k, held)
            kept_names = buffers.kept(buffers.SEGMENTS)
            assert len(kept_names) == len(set(kept_names))
            assert sorted(os.listdir(folder)) == sorted(
                kept_names + [h for k, _, h in taken if k == buffers.SEGMENTS])
            for k, most in per_key.items():
                kept_keys = [keys[id(h) if k == buffers.SPARES else h] for h in buffers.kept(k)]
                over = {key_: n for key_, n in Counter(kept_keys).items() if n > most}
                assert over == {}, f"{k} keeps more than {most} under a key: {over}"
                if k == buffers.SPARES:  # the latest key only
                    assert len(set(kept_keys)) <= 1
        buffers.release()  # the kept segments removed, those held left to their holders
        assert sorted(os.listdir(folder)) == sorted(
            h for k, _, h in taken if k == buffers.SEGMENTS)


def test_the_cap_is_one_environment_variable_read_when_first_used(monkeypatch):
    import os
    import subprocess
    import sys

    from fax_bridge.system import env_settings

    # One fresh interpreter: a bad value never fails the import, and the value the
    # variable holds when the cap is first used is the one read.
    code = ("import os; from fax_bridge.runtime import buffers; "
            f"os.environ[{buffers.ENV_VAR!r}] = '12345'; print(buffers.MAX_KEPT_BYTES)")
    env = dict(os.environ, **{buffers.ENV_VAR: "1.5GB"})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["12345"], out.stderr
    for bad in ("1.5GB", "-1"):  # refused with what was wrong and how to set it
        monkeypatch.setenv(buffers.ENV_VAR, bad)
        with pytest.raises(ComputationError, match=rf"FAX_BRIDGE_MAX_KEPT_BYTES='{bad}' "
                                                   r"is not a whole number >= 0; it sets"):
            env_settings.whole_number(buffers.ENV_VAR)
    monkeypatch.setenv(buffers.ENV_VAR, " ")
    assert env_settings.whole_number(buffers.ENV_VAR) == 3 << 30  # blank: the default


def test_threads_taking_and_giving_at_once_share_the_cap_and_never_one_array(monkeypatch):
    """Worker threads make arrays (as the sums do) and give back and take spare sets (as
    batched calls do) at the same time, under a cap that makes them push each other out:
    the kept bytes never pass it, no array is ever handed to two holders (each keeps
    what its thread wrote), and a spare set is taken by one thread only."""
    import threading

    cap = 6 * BLOCK
    monkeypatch.setattr(buffers, "MAX_KEPT_BYTES", cap)
    monkeypatch.setattr(buffers, "MIN_BYTES", BLOCK)
    buffers.release()
    failures: list = []
    taken_ids: list = []
    start = threading.Barrier(4)

    def work(me: int) -> None:
        start.wait()
        held = []
        for step in range(300):
            value = me * 1000 + step
            a = buffers.empty((step % 3 + 1) * BLOCK // 8, np.float64)
            a[:] = value
            held.append((a, value))
            if len(held) > 2:
                held.pop(0)
            spare = buffers.take(buffers.SPARES, "plan")
            if spare is not None:
                taken_ids.append(id(spare))
            mine = spare if spare is not None else np.empty(BLOCK, np.uint8)
            mine[:] = value % 251
            for h, v in held:  # time for another thread to write over it, were it shared
                h.sum()
            if not np.all(mine == value % 251):
                failures.append(f"thread {me}'s spare written by another")
            buffers.give(buffers.SPARES, "plan", mine, mine.nbytes, per_key=3)
            if buffers.kept_bytes() > cap:
                failures.append(f"kept {buffers.kept_bytes()} bytes over a cap of {cap}")
            for h, v in held:
                if not (h[0] == v and h[-1] == v):
                    failures.append(f"thread {me}'s array written by another")

    workers = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert failures == []
    assert taken_ids  # the threads did take each other's spares
    assert buffers.kept_bytes() <= cap
