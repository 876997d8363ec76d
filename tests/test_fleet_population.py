"""Devices that host a population: CLIENTS inputs named by id, rows read on the devices."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence

import federated_language
import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from fax_bridge.data.stream import write_population
from fax_bridge.errors import ComputationError, FleetError
import sample_computations as sc
from fax_bridge.fleet import security
from fax_bridge.fleet.coordinator import GrpcClientsBackend
from fax_bridge.fleet.device import DeviceServicer
from fax_bridge.fleet.device_process import start_server
from fax_bridge.fleet.launcher import LocalFleet
from fax_bridge.fleet.remote import RemoteFleet
from fax_bridge.rounds.policy import RoundPolicy, plan_round
from fax_bridge.runtime import interpreter
from fax_bridge.runtime.local_backend import LocalClientsBackend
from fax_bridge.runtime.population import PopulationRef
from fax_bridge.v1 import device_pb2 as pb
from fax_bridge.v1 import device_pb2_grpc as pb_grpc

CLIENTS = 60
FEATURES = 4
EXAMPLES = 3
S = np.array([1.0, -2.0, 3.0, 0.5], np.float32)
X = PopulationRef(keys=["x"])  # the fixture's store holds x, bx and by


def _write(directory, xs, examples=False, **extra):
    """One client per row of `xs`: one example each (`examples`: xs[i] is a block of
    examples); `extra` arrays hold one more example per client each."""
    def gen():
        for i, x in enumerate(xs):
            client = {"x": x if examples else x[None]}
            client.update({k: v[i][None] for k, v in extra.items()})
            yield client
    write_population(str(directory), gen())
    return str(directory)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(CLIENTS, FEATURES)).astype(np.float32)
    bx = rng.normal(size=(CLIENTS, EXAMPLES, FEATURES)).astype(np.float32)
    by = rng.normal(size=(CLIENTS, EXAMPLES)).astype(np.float32)
    root = tmp_path_factory.mktemp("population")
    directory = _write(root / "pop", xs, bx=bx, by=by)
    return {"dir": directory, "xs": xs, "bx": bx, "by": by}


@pytest.fixture(scope="module")
def fleet(data):
    with LocalFleet(devices=2, population=data["dir"]) as fleet:
        yield fleet


@contextlib.contextmanager
def _devices(*populations, token=None, **servicer_options):
    """In-process device servers, one per population directory (None: none hosted)."""
    token = token or security.new_token()
    servers, addresses = [], []
    try:
        for i, directory in enumerate(populations):
            servicer = DeviceServicer(f"device-{i}", population=directory, **servicer_options)
            server, port = start_server("127.0.0.1:0", servicer, token=token)
            servers.append(server)
            addresses.append(f"127.0.0.1:{port}")
        yield addresses, token
    finally:
        for server in servers:
            server.stop(grace=None)


def test_device_hosted_round_equals_coordinator_fed_round(fleet, data):
    proto = sc.scaled_aggregate((FEATURES,), "sum")
    fed = fleet.run(proto, data["xs"], S)
    hosted, rep = fleet.run(proto, X, S, report=True)
    np.testing.assert_array_equal(hosted, fed)  # exact partials: the same bits
    local = interpreter.interpret(proto, PopulationRef(directory=data["dir"],
                                                             keys=["x"]), S,
                                        backend=LocalClientsBackend())
    np.testing.assert_allclose(hosted, local, rtol=1e-5)  # float32 folded in order
    assert rep.payload_down == 2 * S.nbytes  # only the broadcast: no client data sent
    assert len(rep.participants) == CLIENTS


def test_several_clients_arguments_read_by_key_with_examples(fleet, data):
    proto = sc.linear_regression_step(features=FEATURES, examples=EXAMPLES)
    w = np.linspace(-1, 1, FEATURES).astype(np.float32)
    fed = fleet.run(proto, w, data["bx"], data["by"])
    hosted = fleet.run(proto, w, PopulationRef(keys=["bx"]), PopulationRef(keys=["by"]))
    for key in ("w", "loss", "losses"):
        np.testing.assert_array_equal(hosted[key], fed[key])


def test_cohort_reads_only_the_chosen_clients(tmp_path):
    population, cohort, seed = 400, 25, 7
    chosen = plan_round(RoundPolicy(cohort_size=cohort, seed=seed), population,
                        0).participants
    rng = np.random.default_rng(1)
    # two examples per client; the member is the client's whole [2, F] block
    xs = rng.integers(-20, 20, size=(population, 2, FEATURES)).astype(np.float32)
    others = np.setdiff1d(np.arange(population), chosen)
    xs[others] = np.nan  # any row outside the cohort would poison the sum
    directory = _write(tmp_path / "big", xs, examples=True)
    proto = sc.scaled_aggregate((2, FEATURES), "sum")
    s = np.tile(S, (2, 1))
    with _devices(directory, directory) as (addresses, token):
        with RemoteFleet(addresses, token=token, cohort_size=cohort, seed=seed,
                         population="big") as remote:
            got, rep = remote.run(proto, remote.population, s, report=True)
    assert rep.cohort == list(chosen) and rep.population == population
    expected = (xs[chosen] * s).sum(axis=0)
    assert np.all(np.isfinite(got))
    np.testing.assert_array_equal(got, expected)


def test_stored_dtype_or_shape_mismatch_is_a_clear_error(fleet, data, tmp_path):
    with pytest.raises(FleetError, match=r"dtypes differ \(float32 stored, int32"):
        fleet.run(sc.scaled_aggregate((FEATURES,), "sum", dtype=np.int32),
                  X, S.astype(np.int32))
    with pytest.raises(FleetError, match="example shapes differ"):
        fleet.run(sc.scaled_aggregate((FEATURES + 1,), "sum"), X,
                  np.ones(FEATURES + 1, np.float32))
    with pytest.raises(FleetError, match="holds only"):
        fleet.run(sc.scaled_aggregate((FEATURES,), "sum"), PopulationRef(keys=["nope"]), S)
    with pytest.raises(FleetError, match="which stored arrays"):
        # three arrays are stored and no key is named
        fleet.run(sc.scaled_aggregate((FEATURES,), "sum"), fleet.population, S)
    # the same checks on the local backend raise ComputationError
    with pytest.raises(ComputationError, match="dtypes differ"):
        interpreter.interpret(
            sc.scaled_aggregate((FEATURES,), "sum", dtype=np.int32),
            PopulationRef(directory=data["dir"], keys=["x"]), S.astype(np.int32),
            backend=LocalClientsBackend())
    # a block of 2 examples per client where the member wants exactly one
    blocks = _write(tmp_path / "blocks", np.ones((3, 2, FEATURES), np.float32),
                    examples=True)
    with pytest.raises(ComputationError, match="one example per client"):
        interpreter.interpret(sc.scaled_aggregate((FEATURES,), "sum"),
                                    PopulationRef(directory=blocks), S,
                                    backend=LocalClientsBackend())


def test_devices_must_host_the_same_population(data, tmp_path):
    other = _write(tmp_path / "other", np.zeros((5, FEATURES), np.float32))
    proto = sc.scaled_aggregate((FEATURES,), "sum")
    with _devices(data["dir"], other) as (addresses, token):
        with GrpcClientsBackend(addresses, token=token) as backend:
            with pytest.raises(FleetError, match="different populations"):
                interpreter.interpret(proto, PopulationRef(keys=["x"]), S,
                                            backend=backend)
    with _devices(data["dir"], None) as (addresses, token):
        with GrpcClientsBackend(addresses, token=token) as backend:
            with pytest.raises(FleetError, match="host no population"):
                backend.population_size()
    with _devices(data["dir"]) as (addresses, token):
        with pytest.raises(FleetError, match="asks for population 'elsewhere'"):
            RemoteFleet(addresses, token=token, population="elsewhere").start()


def test_reads_from_the_store_respect_the_stored_bytes_cap(data):
    """Rows are counted before they are read: a read past --max-stored-bytes is refused
    and the device keeps serving. 60 clients' rows are 960 bytes, above a 950-byte cap;
    5 clients are stored as 880 bytes (data, array and id overhead), under it."""
    member = federated_language.TensorType(np.float32, (FEATURES,))
    with _devices(data["dir"], max_stored_bytes=950) as (addresses, token):
        with GrpcClientsBackend(addresses, token=token) as backend:
            with pytest.raises(FleetError, match="reading 60 clients would hold 960"):
                backend.put_from_store(member, X, range(CLIENTS))
            small = backend.put_from_store(member, X, range(5))
            np.testing.assert_array_equal(np.stack(backend.get(small)), data["xs"][:5])


def test_reads_from_the_store_need_the_fleet_token(data):
    with _devices(data["dir"]) as (addresses, token):
        channel = grpc.insecure_channel(addresses[0])
        try:
            stub = pb_grpc.DeviceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                read = pb.StoreRead(population_ids=[0])
                stub.Put(iter([pb.PutRequest(handle=1, from_store=read)]), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            channel.close()


def test_hosted_round_never_puts_client_data(fleet, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("client data was placed from the coordinator")

    monkeypatch.setattr(fleet.backend, "put", refuse)
    got = fleet.run(sc.scaled_aggregate((FEATURES,), "mean"), X, S)
    assert got.shape == (FEATURES,)


class _Recording(Sequence):
    """A sequence of client values that records how far it has been read."""

    def __init__(self, values):
        self._values = values
        self.read = 0

    def __len__(self):
        return len(self._values)

    def __getitem__(self, i):
        self.read = max(self.read, i + 1)
        return self._values[i]


def test_put_streams_messages_one_at_a_time(data):
    """The coordinator builds each Put message only when gRPC asks for the next one."""
    import federated_language as fl

    member = fl.TensorType(np.float32, [64])
    values = _Recording([np.full(64, i, np.float32) for i in range(120)])
    with _devices(None) as (addresses, token):
        backend = GrpcClientsBackend(addresses, token=token, message_bytes=300)
        try:
            real = backend._devices[0].stub
            ahead = []

            class Stub:
                def __init__(self):
                    self.Put = self

                def __call__(self, requests, **kw):
                    taken, sent = [], 0
                    for message in requests:  # each serialized once, as gRPC sends it
                        sent += len(pb.PutRequest.FromString(message).values)
                        ahead.append(values.read - sent)
                        taken.append(message)
                    return real.Put(iter(taken), **kw)

                def __getattr__(self, name):
                    return getattr(real, name)

            backend._devices[0].stub = Stub()
            value = backend.put(member, values)
            backend._devices[0].stub = real
            assert len(ahead) == 120  # 300-byte messages: one client each
            assert max(ahead) <= 1    # never more than one message's worth built ahead
            got = backend.get(value)
            np.testing.assert_array_equal(np.stack(got)[:, 0], np.arange(120))
            assert backend.traffic.payload_down == 120 * 64 * 4
        finally:
            backend.close()


def test_a_round_by_plan_reads_several_clients_arguments_from_the_store(fleet, data):
    import fax_bridge as fb

    @fb.program(clients=CLIENTS)
    def round_(w, bx, by):
        at = fb.federated_broadcast(w)
        loss = fb.federated_map_clients(lambda w, x, y: ((x @ w - y) ** 2).mean(),
                                        (at, bx, by))
        return fb.federated_sum(loss), fb.federated_mean(bx)

    w = np.linspace(-1, 1, FEATURES).astype(np.float32)
    proto = fb.export_tff(round_, w, data["bx"], data["by"],
                          placements=("server", "clients", "clients"))
    refs = (PopulationRef(keys=["bx"]), PopulationRef(keys=["by"]))
    fed, rep_fed = fleet.run(proto, w, data["bx"], data["by"], report=True)
    hosted, rep = fleet.run(proto, w, *refs, report=True)
    ids = rep.participants.array()  # phase by phase on the same devices, reading the store
    phases = interpreter.interpret(
        proto, w, *(PopulationRef(keys=r.keys, client_ids=ids) for r in refs),
        backend=fleet.backend)
    for a, b, c in zip(fed, hosted, phases):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes() == np.asarray(c).tobytes()
    assert rep.payload_down == 2 * w.nbytes  # the broadcast only: no client data sent
    assert rep.rpcs <= 4  # one Round per device (and Loads once)


def test_a_round_refuses_inputs_one_request_per_device_cannot_carry(fleet, data):
    """A round's CLIENTS arguments come all as values or all from the store, named."""
    import fax_bridge as fb

    @fb.program(clients=CLIENTS)
    def round_(w, bx, by):
        at = fb.federated_broadcast(w)
        loss = fb.federated_map_clients(lambda w, x, y: ((x @ w - y) ** 2).mean(),
                                        (at, bx, by))
        return fb.federated_sum(loss)

    w = np.linspace(-1, 1, FEATURES).astype(np.float32)
    proto = fb.export_tff(round_, w, data["bx"], data["by"],
                          placements=("server", "clients", "clients"))
    with pytest.raises(FleetError, match="1 of 2 are PopulationRefs"):
        fleet.run(proto, w, PopulationRef(keys=["bx"]), data["by"])
    with pytest.raises(FleetError, match="name each one's stored arrays"):
        fleet.run(proto, w, PopulationRef(), PopulationRef())


def test_regular_reads_come_stacked_and_equal_the_rows(data):
    # Every client holds as many examples: one block per stored array (`ClientRows`), whose
    # members are exactly the stored rows of the chosen clients, in order.
    from fax_bridge.runtime import population
    from fax_bridge.runtime.backend import ClientRows

    store = population.open_store(data["dir"])
    member_type = federated_language.StructType(
        [(None, federated_language.TensorType(np.float32, [EXAMPLES, FEATURES])),
         (None, federated_language.TensorType(np.float32, [EXAMPLES]))])
    columns = population.plan_columns(store, member_type, ["bx", "by"])
    ids = np.array([5, 0, 9, 5], np.int64)
    got = population.read_members(store, member_type, columns, ids)
    assert isinstance(got, ClientRows) and len(got) == 4
    for member, i in zip(got, ids):
        np.testing.assert_array_equal(member[0], data["bx"][i])
        np.testing.assert_array_equal(member[1], data["by"][i])


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(1, 3), min_size=0, max_size=3), st.lists(
    st.integers(0, 4), min_size=1, max_size=6), st.integers(1, 400), st.data())
def test_rows_bytes_counts_and_caps_as_tensor_bytes_does(tmp_path, example, sizes, cap,
                                                         data):
    """The bytes a cohort's rows take, and the per-client tensor cap, as
    `limits.tensor_bytes` works them out over each client's block (clients without
    examples included), whatever the example shape, the clients' example counts and the
    cap. (A store holds at least one byte: an empty file cannot be mapped.)"""
    from fax_bridge.runtime import limits

    assume(sum(sizes) > 0)
    from fax_bridge.runtime import population as pop

    # One directory per (example shape, sizes); the two parts are named apart, so that
    # shape [2, 3] with sizes [2, 1] and shape [2, 3, 2] with sizes [1] never share one.
    directory = tmp_path / (f"rows_e{'x'.join(map(str, example))}"
                            f"_s{'_'.join(map(str, sizes))}")
    if not directory.exists():
        write_population(str(directory), ({"v": np.zeros([n, *example], np.float32)}
                                          for n in sizes))
    store = pop.open_store(str(directory))
    member = federated_language.TensorType(np.float32, [None, *example])
    columns = pop.plan_columns(store, member, ["v"])
    ids = np.array(data.draw(st.lists(st.integers(0, len(sizes) - 1), min_size=1,
                                      max_size=4)), np.int64)
    biggest = max(sizes[i] for i in ids)
    before = limits.set_limits(max_tensor_bytes=cap)
    try:
        try:
            limits.tensor_bytes([biggest, *example], 4, "one client")
            refused = False
        except ComputationError:
            refused = True
        if refused:
            with pytest.raises(ComputationError, match="stored array 'v' of one client"):
                pop.rows_bytes(store, columns, ids)
        else:
            want = sum(sizes[i] for i in ids) * int(np.prod(example, dtype=np.int64)) * 4
            assert pop.rows_bytes(store, columns, ids) == want
    finally:
        limits.set_limits(max_tensor_bytes=before.max_tensor_bytes)


def _change(path: str, how: str) -> str:
    """Changes a store file on disk as `how` says; returns the words the error must hold."""
    import os
    import time

    with open(path, "rb") as f:
        body = f.read()
    if how == "truncate":
        os.truncate(path, len(body) // 2)
        return f"truncated from {len(body)} to {len(body) // 2} bytes"
    if how == "grow":
        with open(path, "ab") as f:
            f.write(b" " * 16)
        return f"grew from {len(body)} to {len(body) + 16} bytes"
    if how == "replace":  # a new file renamed over the old one, as atomic writers do
        with open(path + ".new", "wb") as f:
            f.write(body)
        os.replace(path + ".new", path)
        return "replaced by another file"
    if how == "remove":
        os.remove(path)
        return "it is gone"
    time.sleep(0.05)  # past the file system's timestamp granularity since opening
    with open(path, "r+b") as f:  # the same size, other bytes
        f.write(bytes(255 - b for b in body[:8]))
    return "rewritten in place"


@settings(max_examples=15, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(how=st.sampled_from(["truncate", "grow", "replace", "remove", "rewrite"]),
       name=st.sampled_from(["x.bin", "bx.bin", "offsets.npy", "population.json"]))
def test_a_store_file_changed_under_a_device_fails_that_read_and_the_device_serves_on(
        tmp_path_factory, how, name):
    """A hosted population's files are read, never mapped: truncating one (which would
    raise SIGBUS in a mapping and kill the device), growing, replacing, removing or
    rewriting it makes each later read of it FAILED_PRECONDITION naming the file and the
    change, while the device keeps answering everything else (reads of the arrays left
    alone too)."""
    import os

    from fax_bridge.fleet import put_messages
    from fax_bridge.rounds import wire

    rng = np.random.default_rng(0)
    xs = rng.normal(size=(8, FEATURES)).astype(np.float32)
    directory = _write(tmp_path_factory.mktemp("changing") / "pop", xs,
                       bx=rng.normal(size=(8, EXAMPLES, FEATURES)).astype(np.float32))
    def reads(member, keys):
        return put_messages.store_reads(1, np.array([5, 2, 3]), 0,
                                        member.to_proto().SerializeToString(), keys, "")

    x = federated_language.TensorType(np.float32, (FEATURES,))
    both = reads(federated_language.StructType(
        [("x", x), ("bx", federated_language.TensorType(np.float32, (EXAMPLES, FEATURES)))]),
        ["x", "bx"])
    with _devices(directory) as (addresses, token):
        metadata = security.call_metadata(token)
        with grpc.insecure_channel(addresses[0]) as channel:
            stub = pb_grpc.DeviceStub(channel)
            assert stub.Put(iter(both), timeout=10, metadata=metadata).num_clients == 3
            stub.Release(pb.ReleaseRequest(handles=[1]), timeout=10, metadata=metadata)
            path = os.path.join(directory, name)
            words = _change(path, how)
            for _ in range(2):  # every later read is refused the same way
                with pytest.raises(grpc.RpcError) as info:
                    stub.Put(iter(both), timeout=10, metadata=metadata)
                assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert path in info.value.details() and words in info.value.details(), \
                    info.value.details()
            if name == "bx.bin":
                assert stub.Put(iter(reads(x, ["x"])), timeout=10,
                                metadata=metadata).num_clients == 3
                stub.Release(pb.ReleaseRequest(handles=[1]), timeout=10, metadata=metadata)
            value = pb.ClientValue(client_id=0, value=wire.to_message(np.float32(1)))
            assert stub.Put(iter([pb.PutRequest(handle=2, values=[value])]), timeout=10,
                            metadata=metadata).num_clients == 1
            health = stub.Health(pb.HealthRequest(), timeout=10, metadata=metadata)
            assert health.status == "SERVING" and health.num_handles == 1


def test_the_local_backend_reads_a_population_rewritten_since_its_last_read(tmp_path):
    import time

    directory = _write(tmp_path / "pop", np.zeros((4, FEATURES), np.float32))
    backend = LocalClientsBackend()
    member = federated_language.TensorType(np.float32, (FEATURES,))
    ref = PopulationRef(directory=directory, keys=["x"])
    assert not np.stack(backend.put_from_store(member, ref, range(4)).members).any()
    time.sleep(0.05)  # past the file system's timestamp granularity
    write_population(directory, ({"x": np.full((1, FEATURES), i, np.float32)}
                                 for i in range(4)), overwrite=True)
    got = np.stack(backend.put_from_store(member, ref, range(4)).members)
    np.testing.assert_array_equal(got[:, 0], np.arange(4))


def test_a_device_process_survives_its_population_file_truncated_under_it(tmp_path):
    """The case that killed devices: rows past the new end of a truncated file (a mapping
    raised SIGBUS there). The device process answers that read FAILED_PRECONDITION
    naming the file, and lives on."""
    import os
    import sys

    from fax_bridge.fleet import put_messages

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))
    import device_flood

    sys.path.pop(0)
    xs = np.arange(1024 * 16, dtype=np.float32).reshape(1024, 16)  # 64 KiB: 16 pages
    directory = _write(tmp_path / "pop", xs)
    member = federated_language.TensorType(np.float32, (16,)).to_proto()
    reads = put_messages.store_reads(1, np.arange(900, 910), 0, member.SerializeToString(),
                                     ["x"], "")
    process = device_flood.Device("--population", directory)
    try:
        with grpc.insecure_channel(process.address) as channel:
            stub = pb_grpc.DeviceStub(channel)
            path = os.path.join(directory, "x.bin")
            os.truncate(path, 4096)
            with pytest.raises(grpc.RpcError) as info:
                stub.Put(iter(reads), timeout=30, metadata=process.metadata)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"{path} changed" in info.value.details()
            assert "truncated from 65536 to 4096 bytes" in info.value.details()
            assert process.proc.poll() is None and process.healthy()
    finally:
        process.close()
