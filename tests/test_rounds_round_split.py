"""Round splits: which computations split into one, the same bits as the interpreter and
as the phase-by-phase fleet path, and the round semantics kept on the split path."""

from __future__ import annotations

import dataclasses

import grpc
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import fax_bridge as fb
from fax_bridge.errors import ComputationError, FleetError
from fax_bridge import in_process
from fax_bridge.rounds import round_split as P
from fax_bridge.fleet.launcher import LocalFleet
from fax_bridge.runtime import interpreter, values
from fax_bridge.v1 import device_pb2 as pb
from fax_bridge.v1 import device_pb2_grpc as pb_grpc

N = 6
PLACE = ("server", "clients", "clients")


@fb.program(clients=N)
def _round(params, x, counts):
    at = fb.federated_broadcast(params * 2.0)
    out = fb.federated_map_clients(lambda p, x: (p + x.sum(), (x * p).mean()), (at, x))
    return (fb.federated_weighted_mean(out[0], counts) + params,
            fb.federated_sum(out[1]))


@fb.program(clients=N)
def _two_trips(params, x, counts):
    at = fb.federated_broadcast(params)
    mean = fb.federated_mean(fb.federated_map_clients(lambda p, x: p * x, (at, x)))
    again = fb.federated_broadcast(mean)
    return fb.federated_sum(fb.federated_map_clients(lambda m, x: m + x, (again, x)))


def _args(seed: int = 0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=3).astype(np.float32),
            rng.normal(size=(N, 3)).astype(np.float32),
            rng.uniform(1, 5, size=N).astype(np.float32))


PROTO = fb.export_tff(_round, *_args(), placements=PLACE)


def _bits(result) -> list:
    return [np.asarray(leaf).tobytes() for leaf in fb_leaves(result)]


def fb_leaves(tree):
    import jax

    return jax.tree_util.tree_leaves(tree)


def test_a_round_compiles_to_one_client_part_and_its_aggregations():
    split = P.split_round(PROTO)
    assert split is not None
    assert [(a.kind, a.value_index, a.weight_index) for a in split.aggregations] == \
        [("weighted_mean", 0, 1), ("sum", 2, None)]
    assert len(split.broadcasts) == 1 and len(split.client_inputs) == 2
    assert split.client_part.WhichOneof("computation") == "lambda"


def test_computations_of_another_shape_keep_the_phase_path():
    x = _args()
    assert P.split_round(fb.export_tff(_two_trips, *x, placements=PLACE)) is None

    @fb.program(clients=N)
    def per_client(params, x, counts):  # a CLIENTS result: nothing is aggregated
        return fb.federated_map_clients(lambda p, x: p * x,
                                        (fb.federated_broadcast(params), x))

    assert P.split_round(fb.export_tff(per_client, *x, placements=PLACE)) is None


def _with_map_function(body) -> "P.Computation":
    """PROTO with its per-client function replaced by `Lambda(p) -> body`."""
    from federated_language.compiler import intrinsic_defs

    from fax_bridge.runtime import grammar

    proto = P.Computation()
    proto.CopyFrom(PROTO)
    stack = [proto]
    while stack:
        c = stack.pop()
        call = grammar.intrinsic_call(c)
        if call is not None and call[0] == intrinsic_defs.FEDERATED_MAP.uri:
            fn = c.call.argument.struct.element[0].value
            fn.Clear()
            grammar.lambda_of(fn).parameter_name = "p"
            grammar.lambda_of(fn).result.CopyFrom(body)
            return proto
        stack.extend(grammar.children(c))
    raise AssertionError("PROTO has no federated_map")


def test_a_per_client_function_using_an_outer_name_keeps_the_phase_path():
    """A name the per-client function binds in one place (a Block local) and uses free
    in another is still free: the function needs a value from outside, so no split."""
    from fax_bridge.runtime.grammar import make_reference

    inner = P.Computation()
    inner.block.local.add(name="b", value=make_reference("p"))
    inner.block.result.CopyFrom(make_reference("b"))
    bound_only = P.Computation()
    bound_only.CopyFrom(inner)
    also_free = P.Computation()
    also_free.struct.element.add(value=inner)
    also_free.struct.element.add(value=make_reference("b"))
    assert P.split_round(_with_map_function(bound_only)) is not None
    assert P.split_round(_with_map_function(also_free)) is None


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_the_split_gives_the_interpreters_bits(seed):
    split = P.split_round(PROTO)
    prepared = interpreter.prepare(PROTO)
    arg = values.bind_arguments(prepared.parameter, _args(seed), {}).runtime_value()
    want = interpreter.evaluate(prepared, arg)
    got = values.check_value(in_process.run_in_process(split, arg), prepared.result, "result")
    assert _bits(values.to_pytree(got, prepared.result)) == \
        _bits(values.to_pytree(want, prepared.result))


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, N), st.integers(1, 3))
def test_batched_and_one_by_one_clients_give_the_same_partials(seed, count, cpus):
    """`client_partials` aggregates batched clients from their stacked results (a
    partial per call when the cohort runs as one call per CPU, merged in client order)
    and others from per-client results: the partials are the same bits."""
    from unittest import mock

    from federated_language.common_libs import structure

    from fax_bridge.runtime import aggregation, client_map, threads

    split = P.split_round(PROTO)
    params, x, counts = _args(seed)
    sent = structure.Struct([(None, params * np.float32(2.0))])
    members = [structure.Struct([(None, x[i]), (None, counts[i])]) for i in range(count)]
    specs = [(a.kind, a.value_index, a.weight_index) for a in split.aggregations]
    with mock.patch.object(threads, "workers", return_value=cpus):
        batched = P.client_partials(split.client_part, split.client_part_hash, sent,
                                    members, specs)
    original = client_map.map_clients_stacked
    client_map.map_clients_stacked = lambda *a, **k: None  # every client alone
    try:
        alone = P.client_partials(split.client_part, split.client_part_hash, sent, members,
                                  specs)
    finally:
        client_map.map_clients_stacked = original
    for b, a in zip(batched, alone):
        assert b.count == a.count == count
        assert [v.tobytes() for v in aggregation.finish(b)] == \
            [v.tobytes() for v in aggregation.finish(a)]
    with pytest.raises(ComputationError, match="aggregation inputs at 7"):
        P.client_partials(split.client_part, split.client_part_hash, sent, members,
                          [("sum", 7, None)])


@pytest.fixture(scope="module")
def fleet():
    with LocalFleet(devices=2, cohort_size=5, dropout=0.2, straggler_delay_s=0.05,
                    round_deadline_s=0.08, seed=3) as f:
        yield f


def test_split_and_phase_paths_give_the_same_bits_and_clients(fleet):
    """A round on the fleet (one request per device) has the bits of its participants'
    round phase by phase, on the same devices and in process."""
    args = _args(1)
    reps = []
    for r in range(3):
        fleet.next_round = r
        result, rep = fleet.run(PROTO, *args, report=True)
        reps.append(rep)
        chosen = tuple(a[rep.participants.array()] if i else a for i, a in enumerate(args))
        assert _bits(result) == _bits(interpreter.interpret(PROTO, *chosen,
                                                            backend=fleet.backend))
        assert _bits(result) == _bits(interpreter.interpret(PROTO, *chosen))
        assert rep.rpcs <= 4  # Load once, then one Round each
    assert any(rep.dropped or rep.late for rep in reps)  # dropouts, late ones


def test_min_clients_still_fails_the_round_on_the_split_path(fleet):
    fleet.policy = type(fleet.policy)(cohort_size=5, dropout=0.5, seed=3, min_clients=5)
    try:
        fleet.next_round = 0
        with pytest.raises(FleetError, match="min_clients=5"):
            fleet.run(PROTO, *_args())
    finally:
        fleet.policy = type(fleet.policy)(cohort_size=5, dropout=0.2,
                                          straggler_delay_s=0.05, round_deadline_s=0.08,
                                          seed=3)


def _send(stub, method: str, messages: list, **kwargs):
    """A round request as a `Round` stream, or as one `RoundOnce` call of its message."""
    if method == "RoundOnce":
        (message,) = messages
        return stub.RoundOnce(message, **kwargs)
    return stub.Round(iter(messages), **kwargs)


ROUND_METHODS = ["Round", "RoundOnce"]


@pytest.mark.parametrize("method", ROUND_METHODS)
def test_a_round_without_the_fleet_token_is_refused(fleet, method):
    with grpc.insecure_channel(fleet.addresses[0]) as channel:
        with pytest.raises(grpc.RpcError) as info:
            _send(pb_grpc.DeviceStub(channel), method, [pb.RoundRequest()], timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "fleet token" in info.value.details()


@pytest.mark.parametrize("method", ROUND_METHODS)
def test_a_round_naming_a_client_part_never_loaded_is_refused(fleet, method):
    from fax_bridge.fleet import security

    with grpc.insecure_channel(fleet.addresses[0]) as channel:
        with pytest.raises(grpc.RpcError) as info:
            _send(pb_grpc.DeviceStub(channel), method,
                  [pb.RoundRequest(computation_hash="0" * 64)], timeout=10,
                  metadata=security.call_metadata(fleet._token))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "not loaded" in info.value.details()


@settings(max_examples=20, deadline=None)
@given(kind=st.sampled_from(["sum", "mean", "min", "max", "weighted_mean"]),
       shape=st.sampled_from([(), (3,), (2, 2)]), clients=st.integers(1, 7),
       seed=st.integers(0, 2**31 - 1), cpus=st.integers(1, 3))
def test_every_split_aggregation_gives_the_interpreters_bits(kind, shape, clients, seed,
                                                            cpus):
    """Each kind over the split, its clients run as one call per CPU (partials of the
    calls merged) or as one: the interpreter's bits."""
    from unittest import mock

    import sample_computations as sc

    from fax_bridge.runtime import threads

    rng = np.random.default_rng(seed)
    x = list(rng.normal(size=(clients, *shape)).astype(np.float32))
    if kind == "weighted_mean":
        proto = sc.weighted_mean(shape)
        other = list(rng.uniform(0.5, 3, size=clients).astype(np.float32))
    else:
        proto = sc.scaled_aggregate(shape, kind)
        other = rng.normal(size=shape).astype(np.float32)
    split = P.split_round(proto)
    assert split is not None and [a.kind for a in split.aggregations] == [kind]
    prepared = interpreter.prepare(proto)
    arg = values.check_value(values.bind_arguments(prepared.parameter, (x, other), {})
                             .runtime_value(), prepared.parameter)
    want = interpreter.evaluate(prepared, arg)
    with mock.patch.object(threads, "workers", return_value=cpus):
        got = values.check_value(in_process.run_in_process(split, arg), prepared.result,
                                 "result")
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


@pytest.fixture(scope="module")
def capped():
    from fax_bridge.fleet import device, device_process, security

    token = security.new_token()
    servicer = device.DeviceServicer("plan", max_stored_bytes=1 << 20, max_clients=100,
                                     max_delay_seconds=2.0)
    server, port = device_process.start_server("127.0.0.1:0", servicer, token=token)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield pb_grpc.DeviceStub(channel), security.call_metadata(token)
    channel.close()
    server.stop(None)


def _round_messages(split, key, members, delay=0.0):
    from federated_language.common_libs import structure

    from fax_bridge.rounds import partials, wire

    head = pb.RoundRequest(computation_hash=key, delay_seconds=delay)
    head.broadcast.CopyFrom(wire.to_message(structure.Struct([(None, np.ones(3, np.float32))])))
    for agg in split.aggregations:
        spec = head.aggregations.add(kind=partials.KIND_TO_ENUM[agg.kind],
                                     value_index=agg.value_index)
        if agg.weight_index is not None:
            spec.weight_index = agg.weight_index
    for c, member in enumerate(members):
        item = head.values.add(client_id=c)
        wire.encode_value(member, item.value)
    return [head]


@pytest.mark.parametrize("method", ROUND_METHODS)
def test_a_device_bounds_round_requests_and_keeps_serving(capped, method):
    from federated_language.common_libs import structure

    stub, md = capped
    split = P.split_round(PROTO)
    data = split.client_part.SerializeToString(deterministic=True)
    stub.Load(pb.LoadRequest(computation_hash=split.client_part_hash, computation=data),
              timeout=30, metadata=md)
    member = structure.Struct([(None, np.ones(3, np.float32)), (None, np.float32(2.0))])
    for members, delay, code in (([member] * 101, 0.0, grpc.StatusCode.RESOURCE_EXHAUSTED),
                                 ([member] * 2, float("nan"),
                                  grpc.StatusCode.INVALID_ARGUMENT),
                                 ([member] * 2, 5.0, grpc.StatusCode.INVALID_ARGUMENT)):
        with pytest.raises(grpc.RpcError) as info:
            _send(stub, method, _round_messages(split, split.client_part_hash, members, delay),
                  timeout=30, metadata=md)
        assert info.value.code() == code
    answer = _send(stub, method, _round_messages(split, split.client_part_hash, [member] * 3),
                   timeout=30, metadata=md)
    assert answer.num_clients == 3 and len(answer.partials) == 2
    assert [p.num_clients for p in answer.partials] == [3, 3]
    other = "RoundOnce" if method == "Round" else "Round"  # the same round, other shape
    again = _send(stub, other, _round_messages(split, split.client_part_hash, [member] * 3),
                  timeout=30, metadata=md)
    assert again.num_clients == 3 and list(again.partials) == list(answer.partials)


@pytest.mark.parametrize("method", ROUND_METHODS)
def test_a_hostile_round_request_gets_a_clear_error_and_the_device_keeps_serving(capped,
                                                                                method):
    from federated_language.common_libs import structure

    stub, md = capped
    split = P.split_round(PROTO)
    data = split.client_part.SerializeToString(deterministic=True)
    stub.Load(pb.LoadRequest(computation_hash=split.client_part_hash, computation=data),
              timeout=30, metadata=md)
    value = pb.ClientValue(client_id=0)
    value.value.tensor.dtype = "float32"
    value.value.tensor.shape.extend([1 << 40])  # claims far more elements than it holds
    member = structure.Struct([(None, np.ones(3, np.float32)), (None, np.float32(2.0))])
    head = _round_messages(split, split.client_part_hash, [member])[0]
    bad_kind = pb.RoundRequest()
    bad_kind.CopyFrom(head)
    bad_kind.aggregations[0].kind = 99
    no_bound = pb.RoundRequest()
    no_bound.CopyFrom(head)
    no_bound.aggregations[1].kind = pb.SECURE_SUM  # a secure sum with no bound
    bad_index = pb.RoundRequest()
    bad_index.CopyFrom(head)
    bad_index.aggregations[1].value_index = 7
    for request, code, match in (
            (pb.RoundRequest(computation_hash=split.client_part_hash, values=[value]),
             grpc.StatusCode.INVALID_ARGUMENT, "the shape is likely corrupt"),
            (bad_kind, grpc.StatusCode.INVALID_ARGUMENT, "cannot run in a round split"),
            (no_bound, grpc.StatusCode.INVALID_ARGUMENT, "must carry a bound"),
            (bad_index, grpc.StatusCode.INVALID_ARGUMENT, "index 7 is out of range"),
            (pb.RoundRequest(computation_hash=split.client_part_hash,
                             from_store=pb.StoreRead(population_ids=[0])),
             grpc.StatusCode.FAILED_PRECONDITION, "hosts no population")):
        with pytest.raises(grpc.RpcError) as info:
            _send(stub, method, [request], timeout=30, metadata=md)
        assert info.value.code() == code, info.value.details()
        assert info.value.details().startswith("plan: ") and match in info.value.details()
    assert stub.Health(pb.HealthRequest(), timeout=10, metadata=md).status == "SERVING"


@pytest.mark.parametrize("method", ROUND_METHODS)
def test_bytes_that_are_no_round_request_are_refused(fleet, method):
    from fax_bridge.fleet import security

    path = f"/fax_bridge.v1.Device/{method}"
    body = b"\x0a\xff\xff\xff\xff\x0f"  # a field whose length runs past the end
    with grpc.insecure_channel(fleet.addresses[0]) as channel:
        with pytest.raises(grpc.RpcError) as info:
            if method == "RoundOnce":
                channel.unary_unary(path)(body, timeout=10,
                                          metadata=security.call_metadata(fleet._token))
            else:
                channel.stream_unary(path)(iter([body]), timeout=10,
                                           metadata=security.call_metadata(fleet._token))
        stub = pb_grpc.DeviceStub(channel)
        assert stub.Health(pb.HealthRequest(), timeout=10,
                           metadata=security.call_metadata(fleet._token)).status == "SERVING"
    assert info.value.code() == grpc.StatusCode.INTERNAL  # gRPC's own answer, either shape
    assert "deserializing request" in info.value.details()


class _Recorder:
    """A device stub that records the name of each round method called on it."""

    def __init__(self, stub, calls: list):
        self._stub, self._calls = stub, calls

    def __getattr__(self, name):
        if name.startswith("Round"):
            self._calls.append(name)
        return getattr(self._stub, name)


def test_rounds_of_one_message_go_unary_with_the_streamed_rounds_bits_and_counts(fleet):
    """A device's round request of one message goes by RoundOnce; streamed by Round
    instead (as to a device without RoundOnce) it gives the same bits and the same
    counts; a cohort cut into several messages per device still streams."""
    backend = fleet.backend
    args = _args(4)
    fleet.next_round = 1
    fleet.run(PROTO, *args)  # the client part is loaded from here on
    stubs = [d.stub for d in backend._devices]
    got = {}
    try:
        for mode in ("once", "stream", "several"):
            calls = []
            for device in backend._devices:
                device.stub = _Recorder(device.stub, calls)
                device.missing = {"RoundOnce"} if mode == "stream" else set()
            backend.message_bytes = 1 if mode == "several" else 4 << 20
            fleet.next_round = 1
            result, rep = fleet.run(PROTO, *args, report=True)
            got[mode] = (_bits(result), list(rep.participants), rep.bytes_down, rep.bytes_up,
                         rep.payload_down, rep.payload_up, rep.rpcs, sorted(calls))
            for device, stub in zip(backend._devices, stubs):
                device.stub = stub
    finally:
        for device, stub in zip(backend._devices, stubs):
            device.stub, device.missing = stub, set()
        backend.message_bytes = 4 << 20
    assert got["once"][-1] == ["RoundOnce", "RoundOnce"]
    assert got["stream"][-1] == ["Round", "Round"]
    assert got["once"][:-1] == got["stream"][:-1] and got["once"][6] == 2
    several = got["several"]
    assert "Round" in several[-1] and several[:2] == got["once"][:2]
    assert several[2] > got["once"][2] and several[4] == got["once"][4]  # same payload


def test_a_device_without_round_once_gets_the_same_round_streamed(capped):
    """A device from before RoundOnce answers UNIMPLEMENTED: the coordinator sends the
    same message as a Round stream, counts both calls, and streams from then on."""
    from federated_language.common_libs import structure

    from fax_bridge.fleet import coordinator, device, device_process, put_messages, security
    from fax_bridge.fleet.protocol import wire_size

    class Older(device.DeviceServicer):
        RoundOnce = pb_grpc.DeviceServicer.RoundOnce

    token = security.new_token()
    server, port = device_process.start_server("127.0.0.1:0", Older("older"), token=token)
    backend = coordinator.GrpcClientsBackend([f"127.0.0.1:{port}"], token=token)
    stub, md = capped
    try:
        split = P.split_round(PROTO)
        key = backend.ensure_loaded(split.client_part, [0])
        stub.Load(pb.LoadRequest(computation_hash=key, computation=split.client_part
                                 .SerializeToString(deterministic=True)),
                  timeout=30, metadata=md)
        member = structure.Struct([(None, np.ones(3, np.float32)), (None, np.float32(2.0))])
        (message,) = _round_messages(split, key, [member] * 3)
        want = stub.RoundOnce(message, timeout=30, metadata=md)
        for resent in (1, 0):
            before = dataclasses.replace(backend.traffic)
            answer = backend.call_each(
                "Round", {0: put_messages.stream(iter([message]), "Round")}, once="RoundOnce")
            spent = backend.traffic - before
            assert list(answer[0].partials) == list(want.partials)
            assert spent.rpcs == 1 + resent and backend._devices[0].missing == {"RoundOnce"}
            assert spent.bytes_down == (1 + resent) * wire_size(message)
    finally:
        backend.close()
        server.stop(None)


@pytest.mark.parametrize("messages", [1, 2])
def test_a_failed_round_names_the_rpc_it_went_by(fleet, messages):
    """A one-message round goes by the unary RoundOnce, a longer one by the Round stream;
    a device's refusal names the RPC called, on the device and at the coordinator."""
    from fax_bridge.fleet import put_messages

    head = pb.RoundRequest(computation_hash="0" * 64)  # never loaded
    stream = put_messages.stream(iter([head] * messages), "Round")
    with pytest.raises(FleetError) as info:
        fleet.backend.call_each("Round", {0: stream}, once="RoundOnce")
    called = "RoundOnce" if messages == 1 else "Round"
    assert f"{called} failed" in str(info.value)
    assert f"{called}: " in str(info.value) and "not loaded" in str(info.value)


def test_a_resumed_run_loop_on_the_split_path_gives_the_straight_runs_bits(fleet, tmp_path):
    w0, x, counts = _args(2)

    def loop(rounds, folder=None):
        return fleet.run_loop(PROTO, w0, rounds, lambda r: (x + r, counts),
                              next_state=lambda out: out[0], checkpoint_dir=folder)

    straight = loop(4)
    loop(2, tmp_path)  # stops after round 1, as a killed coordinator would
    resumed = loop(4, tmp_path)
    assert np.asarray(resumed).tobytes() == np.asarray(straight).tobytes()


def test_round_streams_make_each_message_when_grpc_asks_for_it():
    """A round fed by the coordinator holds at most one message per device at a time."""
    from types import SimpleNamespace

    from fax_bridge.fleet import grpc_transport

    class Recording(list):
        read = 0

        def __getitem__(self, i):
            Recording.read = max(Recording.read, i + 1)
            return list.__getitem__(self, i)

    column = Recording(np.full(64, i, np.float32) for i in range(40))
    backend = SimpleNamespace(message_bytes=300)  # one client per message
    streams = grpc_transport._streams(backend, None, [column], [(3, range(10, 40))],
                                   lambda index: pb.RoundRequest(computation_hash="h"))
    ahead, ids = [], []
    for data in streams[3]:  # each message as gRPC sends it, serialized
        ids.extend(v.client_id for v in pb.RoundRequest.FromString(data).values)
        ahead.append(Recording.read - (10 + len(ids)))
    assert ids == list(range(10, 40)) and max(ahead) <= 1  # the next client at most
    assert streams[3].messages == 30 and streams[3].payload == 30 * 64 * 4
