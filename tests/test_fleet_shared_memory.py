"""fleet.shared_memory: payloads through shared-memory segments give the bytes the gRPC
path gives; vanished, truncated and foreign segments are refused; a device's answer
segment is written over round after round, never while something read from it is alive;
no other segment outlives its round, and none a killed device or its fleet."""

from __future__ import annotations

import os
import threading
import time

import federated_language as fl
import numpy as np
import pytest
from federated_language.common_libs import structure
from hypothesis import HealthCheck, assume, given, settings, strategies as st

import fax_bridge as fb
from fax_bridge.errors import FleetError
from fax_bridge.fleet import shared_memory as shm
from fax_bridge.rounds import partials, validate, wire
from fax_bridge.fleet.coordinator import GrpcClientsBackend
from fax_bridge.fleet.launcher import LocalFleet
from fax_bridge.runtime import aggregation
from fax_bridge.v1 import device_pb2 as pb

pytestmark = pytest.mark.skipif(not shm.available(), reason="no /dev/shm on this host")


@pytest.fixture
def shared():
    directory = shm.SharedDir.create()
    yield directory
    directory.remove()


def _write(directory, build, min_bytes=0):
    """(the message `build(writer)` made, the segment it wrote, mapped)."""
    writer = shm.Writer(min_bytes)
    message = build(writer)
    name, generation = directory.new_name("t")
    ref = writer.write(directory, name, generation)
    return message, shm.open_segment(directory, ref, "test", unlink=True,
                                     expect=(name, generation))


DTYPES = ["float32", "float64", "int32", "int64", "uint8", "bool", "bfloat16", "float16"]


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shapes=st.lists(st.lists(st.integers(0, 6), max_size=3), min_size=1, max_size=4),
       dtypes=st.lists(st.sampled_from(DTYPES), min_size=4, max_size=4),
       min_bytes=st.sampled_from([0, 16, 1 << 20]), seed=st.integers(0, 1000))
def test_values_through_a_segment_decode_to_the_wire_paths_bytes(shared, shapes, dtypes,
                                                                  min_bytes, seed):
    rng = np.random.default_rng(seed)
    value = structure.Struct([
        (f"t{i}", (rng.normal(size=shape) * 100).astype(wire.dtype_from_name(dtype)))
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes))])
    message, segment = _write(shared, lambda w: wire.to_message(value, w), min_bytes)
    assert not os.listdir(shared.path)  # unlinked once mapped
    got = wire.decode_value(pb.Value.FromString(message.SerializeToString()),
                            segment=segment)
    plain = wire.decode_value(wire.to_message(value))
    for (_, a), (_, b), (_, c) in zip(structure.iter_elements(got),
                                      structure.iter_elements(plain),
                                      structure.iter_elements(value)):
        assert a.dtype == b.dtype == c.dtype and a.shape == b.shape == c.shape
        assert a.tobytes() == b.tobytes() == c.tobytes()
    if min_bytes == 0 and any(np.asarray(c).nbytes for _, c in structure.iter_elements(value)):
        assert segment.length > 0


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["sum", "mean", "weighted_mean", "max", "min"]),
       dtype=st.sampled_from(["float32", "int32", "float64", "float16"]),
       shape=st.lists(st.integers(1, 40), min_size=1, max_size=2),
       clients=st.integers(1, 5), spread=st.sampled_from([1.0, 1e30]),
       seed=st.integers(0, 1000))
def test_partials_through_a_segment_check_and_merge_to_the_wire_paths_bits(
        shared, kind, dtype, shape, clients, spread, seed):
    assume(not (kind in ("mean", "weighted_mean") and dtype == "int32"))  # refused
    rng = np.random.default_rng(seed)
    np_dtype = np.dtype(dtype)
    scale = spread if np_dtype.kind == "f" and np_dtype.itemsize >= 4 else 10.0
    members = [(rng.normal(size=shape) * rng.choice([1.0, scale])).astype(np_dtype)
               for _ in range(clients)]
    weights = ([np.float32(w) for w in rng.uniform(1, 5, clients)]
               if kind == "weighted_mean" else None)
    types = validate.leaf_types(fl.TensorType(np_dtype, shape))
    weight_types = validate.leaf_types(fl.TensorType(np.float32)) if weights else []
    partial = aggregation.partial_of(kind, members, weights)
    message, segment = _write(shared, lambda w: partials.to_message(partial, shared=w))
    view = shm.view_partial(pb.AggregateResponse.FromString(message.SerializeToString()),
                            segment, "d0")
    plain = partials.to_message(partial)
    got, size = validate.check_partial(view, kind, types, weight_types, clients, "d0")
    want, want_size = validate.check_partial(plain, kind, types, weight_types, clients, "d0")
    assert size == want_size
    finished = [[np.asarray(x).tobytes() for x in aggregation.finish(one)]
                for one in (got, want)]
    assert finished[0] == finished[1]


def _one_span_message(shared, nbytes=4096):
    return _write(shared, lambda w: wire.to_message(np.arange(nbytes // 4, dtype=np.float32),
                                                    w))


def test_a_vanished_truncated_or_foreign_segment_is_refused(shared):
    array = np.arange(1024, dtype=np.float32)
    writer = shm.Writer(0)
    wire.to_message(array, writer)
    ref = writer.write(shared, "a-vanish", 7)
    os.unlink(shared.file("a-vanish"))
    with pytest.raises(FleetError, match="vanished"):
        shm.open_segment(shared, ref, "device 0")

    writer = shm.Writer(0)
    wire.to_message(array, writer)
    ref = writer.write(shared, "a-trunc", 8)
    os.truncate(shared.file("a-trunc"), shm.HEADER_BYTES + 100)
    with pytest.raises(FleetError, match="truncated"):
        shm.open_segment(shared, ref, "device 0")

    writer = shm.Writer(0)
    wire.to_message(array, writer)
    ref = writer.write(shared, "a-old", 9)
    stale = pb.SharedSegment(name=ref.name, generation=10, length=ref.length)
    with pytest.raises(FleetError, match="stale or foreign"):
        shm.open_segment(shared, stale, "device 0")
    with pytest.raises(FleetError, match="it was asked for a-other"):
        shm.open_segment(shared, ref, "device 0", expect=("a-other", 9))
    for bad in ("../x", "", "a/b", ".hidden"):
        with pytest.raises(FleetError, match="not a plain file name"):
            shm.open_segment(shared, pb.SharedSegment(name=bad), "device 0")


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.integers(1, 300_000), cut=st.floats(0.0, 1.0, exclude_max=True))
def test_a_segment_that_shrinks_after_its_size_check_is_refused_without_a_signal(
        shared, monkeypatch, size, cut):
    """Another process truncates the file between the size check and the read (here:
    right after `fstat`, to any shorter length, header included): the reader gets a
    FleetError naming the segment, never SIGBUS (which a mapping gives at the first
    page past the new end, killing the process)."""
    writer = shm.Writer(0)
    wire.to_message(np.arange(size, dtype=np.uint8), writer)
    name, generation = shared.new_name("a")
    ref = writer.write(shared, name, generation)
    full = shm.HEADER_BYTES + ref.length
    real_fstat = os.fstat

    def shrinking(fd):
        info = real_fstat(fd)
        os.truncate(shared.file(name), int(cut * full))
        return info

    monkeypatch.setattr(shm.os, "fstat", shrinking)
    with pytest.raises(FleetError, match=f"segment {shared.file(name)} shrank to "
                                         f"{int(cut * full)} bytes while it was read"):
        shm.open_segment(shared, ref, "device 0", expect=(name, generation))
    monkeypatch.setattr(shm.os, "fstat", real_fstat)
    shared.unlink(name)


def test_a_directory_or_fifo_under_a_segments_name_is_refused_and_cleaned_up(shared):
    os.mkdir(shared.file("a-dir"))
    open(shared.file("a-dir/inside"), "wb").close()
    os.mkfifo(shared.file("a-fifo"))  # opened to read, a FIFO would wait for a writer
    for name, kind in (("a-dir", "directory"), ("a-fifo", "FIFO")):
        ref = pb.SharedSegment(name=name, generation=1, length=0)
        with pytest.raises(FleetError, match=f"segment {shared.file(name)} is not a file "
                                             f"\\(a {kind} is under its name\\)"):
            shm.open_segment(shared, ref, "device 0")
        shared.unlink(name)  # the round's clean-up removes whatever is there
    assert os.listdir(shared.path) == []


def test_spans_outside_the_segment_or_beside_bytes_or_without_one_are_refused(shared):
    message, segment = _one_span_message(shared)
    message.tensor.data_at.length += 8
    with pytest.raises(FleetError, match="outside shared-memory segment"):
        wire.decode_value(message, segment=segment)
    message, segment = _one_span_message(shared)
    with pytest.raises(FleetError, match="names no segment"):
        wire.decode_value(message)
    message.tensor.data = b"\0" * 4096
    with pytest.raises(FleetError, match="also holds bytes"):
        wire.decode_value(message, segment=segment)
    # A partial's spans: without a segment, or beside the field's own bytes.
    partial = aggregation.partial_of("sum", [np.ones(2048, np.float32)] * 2)
    answer, segment = _write(shared, lambda w: partials.to_message(partial, shared=w))
    assert answer.leaves[0].HasField("doubles_at") and not answer.leaves[0].doubles
    with pytest.raises(FleetError, match="names no segment"):
        shm.view_partial(answer, None, "device 1")
    answer.leaves[0].doubles = b"\0" * 8
    with pytest.raises(FleetError, match="both in the message and in shared memory"):
        shm.view_partial(answer, segment, "device 1")


def test_a_directory_must_be_the_users_and_closed_to_others(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    with pytest.raises(FleetError, match="closed to others"):
        shm.SharedDir(str(open_dir))
    with pytest.raises(FleetError, match="not a directory|No such file"):
        shm.SharedDir(str(tmp_path / "missing"))


def test_directories_of_coordinators_that_no_longer_run_are_swept(tmp_path):
    dead = tmp_path / f"{shm.PREFIX}999999999-abcd"
    mine = tmp_path / f"{shm.PREFIX}{os.getpid()}-abcd"
    for d in (dead, mine):
        d.mkdir(mode=0o700)
        (d / "a-left").write_bytes(b"x")
    assert shm.sweep_stale(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and mine.exists()


# ---------------------------------------------------------------------------------------
# Rounds on LocalFleet

D = 20_000  # float32: 80 KB broadcast, 160 KB float64 partials a device (above the cut)
N = 6


@fb.program(clients=N)
def _round(params, x, counts):
    at = fb.federated_broadcast(params)
    out = fb.federated_map_clients(lambda p, x: (p * x.sum() + x.mean(), (x * 2.0).sum()),
                                   (at, x))
    return fb.federated_weighted_mean(out[0], counts), fb.federated_sum(out[1])


def _args(seed=0, spread=1.0):
    rng = np.random.default_rng(seed)
    return ((rng.normal(size=D) * spread).astype(np.float32),
            rng.normal(size=(N, 3)).astype(np.float32),
            rng.uniform(1, 5, size=N).astype(np.float32))


PROTO = fb.export_tff(_round, *_args(), placements=("server", "clients", "clients"))


def _bits(result) -> list:
    import jax

    return [np.asarray(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(result)]


def test_rounds_through_shared_memory_keep_the_byte_paths_bits_in_every_split():
    got = {}
    for devices, shared in ((2, True), (2, False), (3, True), (1, True)):
        with LocalFleet(devices=devices, shared_memory=shared, seed=1) as fleet:
            directory = fleet.backend.shared_memory
            assert (directory is not None) == shared
            kept = None
            for spread in (1.0, 1e30):
                result, rep = fleet.run(PROTO, *_args(2, spread), report=True)
                got[devices, shared, spread] = _bits(result)
                if shared:
                    assert rep.shared_up > rep.payload_up // 2
                    assert rep.shared_down == 4 * D * devices
                    assert rep.bytes_up < rep.shared_up // 10
                    # one answer segment per device is left, the same files every round
                    names = sorted(os.listdir(directory.path))
                    assert len(names) == devices and all(n.startswith("a-") for n in names)
                    assert kept is None or names == kept
                    kept = names
                    assert "through shared memory" in rep.summary()
                else:
                    assert rep.shared_up == rep.shared_down == 0
                    assert rep.bytes_up > rep.payload_up
                got[devices, shared, spread, "payload"] = (rep.payload_up // devices,
                                                           rep.payload_down // devices)
        if shared:
            assert not os.path.exists(directory.path)  # removed with its fleet
    for spread in (1.0, 1e30):
        assert len({tuple(got[k, s, spread]) for k, s in
                    ((2, True), (2, False), (3, True), (1, True))}) == 1
    assert got[2, True, 1.0, "payload"] == got[2, False, 1.0, "payload"]


def test_a_coordinator_of_another_directory_sends_bytes():
    with LocalFleet(devices=1) as fleet:
        other = shm.SharedDir.create()
        try:
            with GrpcClientsBackend(fleet.addresses, token=fleet._token,
                                    shared_memory=other) as backend:
                assert fleet.backend.shares_memory(0) and not backend.shares_memory(0)
        finally:
            other.remove()


def test_no_segment_outlives_a_device_killed_in_its_round():
    with LocalFleet(devices=2, straggler_delay_s=30.0, seed=0) as fleet:
        directory = fleet.backend.shared_memory
        done = {}

        def run():
            try:
                done["result"] = fleet.run(PROTO, *_args(), report=True)
            except Exception as e:  # noqa: BLE001 (reported below)
                done["error"] = e

        thread = threading.Thread(target=run)
        thread.start()
        # A device writes its answer's segment, then waits out its clients' delay.
        while not [n for n in os.listdir(directory.path) if n.startswith("a-")]:
            assert thread.is_alive(), done
            time.sleep(0.01)
        fleet.kill_device(0)
        fleet.kill_device(1)
        thread.join(120)
        assert not thread.is_alive()
        assert "error" in done or done["result"][1].lost_devices
        assert not os.listdir(directory.path)
    assert not os.path.exists(directory.path)


def test_a_truncated_answer_segment_fails_the_round_clearly_and_leaves_nothing(monkeypatch):
    from fax_bridge.fleet import grpc_transport

    with LocalFleet(devices=1, survive_device_loss=False) as fleet:
        directory = fleet.backend.shared_memory
        original = shm.open_segment

        def truncating(directory, ref, where, **kwargs):
            os.truncate(directory.file(ref.name), shm.HEADER_BYTES + ref.length // 2)
            return original(directory, ref, where, **kwargs)

        monkeypatch.setattr(grpc_transport.shared_memory, "open_segment", truncating)
        with pytest.raises(FleetError, match=r"device 0 at .*truncated or rewritten"):
            fleet.run(PROTO, *_args())
        assert not os.listdir(directory.path)
        monkeypatch.setattr(grpc_transport.shared_memory, "open_segment", original)
        result, rep = fleet.run(PROTO, *_args(), report=True)  # the next round is whole
        assert rep.shared_up > 0 and len(os.listdir(directory.path)) == 1  # kept answer


def test_bytes_read_from_an_answer_segment_stay_as_read_when_it_is_written_over(
        monkeypatch):
    """A caller holding bytes of a round's answer past the round: the segment's file is
    kept and the next round's answer is written over it in place, while the held bytes,
    copied out when read, stay as they were."""
    from fax_bridge.fleet import grpc_transport

    with LocalFleet(devices=1) as fleet:
        directory = fleet.backend.shared_memory
        original, held = shm.open_segment, []

        def holding(directory, ref, where, **kwargs):
            segment = original(directory, ref, where, **kwargs)
            held.append((ref.name, segment.data[:segment.length]))
            return segment

        monkeypatch.setattr(grpc_transport.shared_memory, "open_segment", holding)
        first = _bits(fleet.run(PROTO, *_args(2, 1.0)))
        name, data = held[0]
        before = bytes(data)
        assert os.path.exists(directory.file(name))  # kept: nothing reads the file
        second = _bits(fleet.run(PROTO, *_args(2, 1e30)))
        assert held[1][0] == name and bytes(data) == before != bytes(held[1][1])
        monkeypatch.setattr(grpc_transport.shared_memory, "open_segment", original)
        del held, data
        third = _bits(fleet.run(PROTO, *_args(2, 1.0)))
        fourth = _bits(fleet.run(PROTO, *_args(2, 1e30)))
        assert third == first and fourth == second
        assert len(os.listdir(directory.path)) == 1


def test_kept_answer_segments_are_taken_once_and_dropped_with_their_devices(shared):
    for name in ("a-1", "a-2", "a-3"):
        open(shared.file(name), "wb").close()
    shared.keep("host:1", "a-1")
    shared.keep("host:1", "a-2")  # the one kept before for that device is removed
    shared.keep("host:2", "a-3")
    assert sorted(os.listdir(shared.path)) == ["a-2", "a-3"]
    assert shared.kept("host:1") == "a-2" and shared.kept("host:1") is None
    shared.keep("host:1", "a-2")
    shared.drop_kept(["host:1"])  # host:2 is gone
    assert os.listdir(shared.path) == ["a-2"] and shared.kept("host:2") is None


def test_kept_answer_segments_count_against_the_process_cap_with_all_kept_memory(
        shared, monkeypatch):
    from fax_bridge.runtime import buffers

    buffers.release()  # what earlier tests in this process kept would be evicted first
    for name in ("a-1", "a-2", "a-3"):
        with open(shared.file(name), "wb") as f:
            f.write(bytes(1000))
    monkeypatch.setattr(buffers, "MAX_KEPT_BYTES", 2500)
    assert shared.keep("host:1", "a-1") and shared.keep("host:2", "a-2")
    assert buffers.kept_bytes(buffers.SEGMENTS) == 2000
    assert shared.keep("host:3", "a-3")  # over the cap: the least recently kept goes
    assert sorted(os.listdir(shared.path)) == ["a-2", "a-3"] and shared.kept("host:1") is None
    monkeypatch.setattr(buffers, "MAX_KEPT_BYTES", 0)
    assert not shared.keep("host:2", shared.kept("host:2"))  # does not fit: removed
    assert sorted(os.listdir(shared.path)) == ["a-3"]
    shared.remove()  # its kept segments leave the count with it
    assert buffers.kept_bytes(buffers.SEGMENTS) == 0


def test_a_segment_written_over_holds_exactly_its_new_arrays(shared):
    big, small = np.arange(5000, dtype=np.float64), np.arange(7, dtype=np.int32)
    for arrays in ([big, small], [small], [big]):
        writer = shm.Writer(0)
        spans = [pb.SharedSpan() for _ in arrays]
        for a, span in zip(arrays, spans):
            writer.span(a, span)
        name, generation = "a-over", len(arrays) * 7
        ref = writer.write(shared, name, generation, over=True)
        segment = shm.open_segment(shared, ref, "test", expect=(name, generation))
        for a, span in zip(arrays, spans):
            assert bytes(segment.bytes_of(span, "test")) == a.tobytes()
        assert os.path.getsize(shared.file(name)) == shm.HEADER_BYTES + writer.length
        assert segment.close()


def test_writing_over_a_name_that_is_not_a_regular_file_is_refused_at_once(shared):
    os.mkfifo(shared.file("a-fifo"))  # opened to write, a FIFO would wait for a reader
    os.mkdir(shared.file("a-dir"))
    writer = shm.Writer(0)
    writer.span(np.zeros(4), pb.SharedSpan())
    for name in ("a-fifo", "a-dir"):
        with pytest.raises(OSError):
            writer.write(shared, name, 1, over=True)


def test_a_device_whose_launcher_is_gone_removes_the_directory():
    import subprocess
    import sys

    from fax_bridge.fleet import security

    directory = shm.SharedDir.create()
    launcher = (
        "import os, subprocess, sys\n"
        "p = subprocess.Popen([sys.executable, '-m', 'fax_bridge.fleet.device_cli',\n"
        "    '--parent-pid', str(os.getpid()), '--shared-memory', sys.argv[1]],\n"
        "    stdout=subprocess.PIPE, start_new_session=True)\n"
        "p.stdout.readline()\n"  # listening: then this launcher dies without cleaning up
        "print(p.pid, flush=True)\n"
        "os._exit(0)\n")
    try:
        done = subprocess.run([sys.executable, "-c", launcher, directory.path],
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, security.TOKEN_ENV: security.new_token()})
        pid = int(done.stdout.split()[0])
        deadline = time.monotonic() + 30
        while os.path.exists(directory.path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(directory.path)
    finally:
        directory.remove()
    for _ in range(200):  # the device exits by itself once its launcher is gone
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        raise AssertionError("the device outlived its launcher")


def test_a_device_without_the_directory_refuses_shared_payloads(monkeypatch):
    with LocalFleet(devices=1, shared_memory=False) as fleet:
        directory = shm.SharedDir.create()
        try:
            fleet.backend.shared_memory = directory
            assert not fleet.backend.shares_memory(0)  # it reported no directory
            monkeypatch.setattr(fleet.backend, "shares_memory", lambda index: True)
            with pytest.raises(FleetError, match="started without --shared-memory"):
                fleet.run(PROTO, *_args())
            assert not os.listdir(directory.path)
        finally:
            directory.remove()


def test_one_clients_addend_crosses_a_segment_in_its_own_dtype(shared):
    value = np.linspace(-3, 3, 2048, dtype=np.float32)
    partial = aggregation.partial_of("sum", [value])
    answer, segment = _write(shared, lambda w: partials.to_message(partial, shared=w))
    leaf = answer.leaves[0]
    assert leaf.addend.HasField("data_at") and leaf.addend.data_at.length == value.nbytes
    checked, payload = validate.check_partial(
        shm.view_partial(answer, segment, "device 0"), "sum",
        [fl.TensorType(np.float32, [2048])], [], 1, "device 0")
    assert payload == value.nbytes
    assert aggregation.finish(checked)[0].tobytes() == value.tobytes()
