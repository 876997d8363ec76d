"""Device resource bounds under hostile requests on 127.0.0.1: authentication before
bodies, client-id and byte caps (Map results included), bounded delays, connection caps
and prompt shutdown. Small floods here; `make fuzz` runs tools/device_flood.py larger."""

from __future__ import annotations

import math
import os
import sys
import time

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from fax_bridge.fleet import device, device_process, security
from fax_bridge.rounds import wire
from fax_bridge.v1 import device_pb2 as pb
from fax_bridge.v1 import device_pb2_grpc as pb_grpc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import device_flood  # noqa: E402

sys.path.pop(0)
TOKEN = security.new_token()
MD = security.call_metadata(TOKEN)
_NEAR_TOKEN = TOKEN[:-1] + ("1" if TOKEN.endswith("0") else "0")  # wrong in its last digit
MB = 1 << 20


@pytest.fixture(scope="module")
def stub():
    servicer = device.DeviceServicer("limits", max_stored_bytes=4 * MB, max_clients=1000,
                                     max_delay_seconds=2.0, max_call_seconds=30.0)
    server, port = device_process.start_server("127.0.0.1:0", servicer, token=TOKEN,
                                       max_concurrent_calls=8, max_connections=16)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[
        ("grpc.max_send_message_length", 64 * MB)])
    yield pb_grpc.DeviceStub(channel)
    channel.close()
    server.stop(None)


_METHODS = ["Health", "Load", "Broadcast", "Map", "Zip", "Aggregate", "Release", "Fetch"]


@st.composite
def _hostile(draw):
    kind = draw(st.sampled_from(["unauthenticated", "ids", "range", "delay", "bytes"]))
    if kind == "unauthenticated":
        token = draw(st.sampled_from([None, "", "x" * 64, _NEAR_TOKEN]))
        return kind, draw(st.sampled_from(_METHODS)), token, draw(st.integers(0, 8 * MB))
    if kind == "ids":
        return kind, "Broadcast", TOKEN, draw(st.integers(1001, 200_000))
    if kind == "range":  # a range costs the request nothing: the cap still holds
        return kind, "Broadcast", TOKEN, draw(st.integers(1001, 1 << 62))
    if kind == "delay":
        return kind, "Map", TOKEN, draw(st.sampled_from(
            [math.nan, math.inf, -1.0, 2.5, 1e9, -math.inf]))
    return kind, "Broadcast", TOKEN, draw(st.integers(4 * MB, 16 * MB))


def _call(stub, method, request, metadata):
    call = getattr(stub, method)
    if method == "Fetch":
        return list(call(request, timeout=30, metadata=metadata))
    return call(request, timeout=30, metadata=metadata)


@settings(max_examples=40, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_hostile())
def test_hostile_requests_are_refused_by_their_bound_and_the_device_keeps_serving(stub, case):
    kind, method, token, size = case
    metadata = security.call_metadata(token) if token else ()
    if kind == "unauthenticated":
        payload = pb.Tensor(dtype="uint8", shape=[size], data=b"\0" * size)
        request = {"Broadcast": pb.BroadcastRequest(handle=1, value=pb.Value(tensor=payload)),
                   "Load": pb.LoadRequest(computation_hash="h", computation=b"\0" * size)}.get(
            method) or getattr(pb, {"Fetch": "FetchRequest"}.get(method, f"{method}Request"))()
        want = grpc.StatusCode.UNAUTHENTICATED
    elif kind == "ids":
        request = pb.BroadcastRequest(handle=2, value=wire.to_message(np.float32(1)),
                                      client_ids=range(size))
        want = grpc.StatusCode.RESOURCE_EXHAUSTED
    elif kind == "range":
        request = pb.BroadcastRequest(handle=2, value=wire.to_message(np.float32(1)),
                                      client_range=pb.ClientRange(start=7, stop=7 + size))
        want = grpc.StatusCode.RESOURCE_EXHAUSTED
    elif kind == "delay":
        request = pb.MapRequest(computation_hash="nothing", arg=1, result=3,
                                delay_seconds=size)
        want = grpc.StatusCode.INVALID_ARGUMENT
    else:
        request = pb.BroadcastRequest(handle=4, value=pb.Value(tensor=pb.Tensor(
            dtype="uint8", shape=[size], data=b"\0" * size)), client_ids=[0])
        want = grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as info:
        _call(stub, method, request, metadata)
    assert info.value.code() == want, info.value.details()
    assert stub.Health(pb.HealthRequest(), timeout=10, metadata=MD).status == "SERVING"


def test_broadcast_client_ranges_are_stored_as_their_clients_or_refused(stub):
    value = wire.to_message(np.float32(2))
    stub.Broadcast(pb.BroadcastRequest(handle=11, value=value,
                                       client_range=pb.ClientRange(start=3, stop=6)),
                   timeout=10, metadata=MD)
    got = _call(stub, "Fetch", pb.FetchRequest(handle=11), MD)
    assert [item.client_id for m in got for item in m.values] == [3, 4, 5]
    for bad in (pb.BroadcastRequest(handle=12, value=value,
                                    client_range=pb.ClientRange(start=5, stop=4)),
                pb.BroadcastRequest(handle=12, value=value,
                                    client_range=pb.ClientRange(start=-1, stop=4)),
                pb.BroadcastRequest(handle=12, value=value, client_ids=[0],
                                    client_range=pb.ClientRange(start=0, stop=1))):
        with pytest.raises(grpc.RpcError) as info:
            stub.Broadcast(bad, timeout=10, metadata=MD)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "client_range" in info.value.details()
    stub.Release(pb.ReleaseRequest(handles=[11]), timeout=10, metadata=MD)


def test_an_unauthenticated_flood_is_refused_before_its_bodies_are_read():
    result = device_flood.unauthenticated_flood(size_mb=24, concurrent=4)
    assert result["codes"] == ["UNAUTHENTICATED"] and result["healthy_after"]
    # 96 MB were sent; reading them would grow the device by at least that much
    assert result["peak_rss_mb"] - result["before"]["rss_mb"] < 48, result


def test_map_results_count_against_the_stored_bytes_cap_as_they_are_computed():
    result = device_flood.map_outputs(clients=20_000, max_stored_mb=1)
    assert result["code"] == "RESOURCE_EXHAUSTED" and result["healthy_after"], result


def test_silent_connections_are_capped_and_do_not_stall_an_open_channel():
    result = device_flood.idle_connections(count=300, max_connections=32)
    assert result["established_channel_served"], result
    assert result["during"]["fds"] <= result["before"]["fds"] + 32 + 8, result
    assert result["ok"], result


def test_sigterm_ends_a_device_whose_workers_all_sleep_in_map_delays():
    result = device_flood.sigterm_during_delays(workers=2)
    assert result["exited"], result


@pytest.mark.parametrize("method", ["Put", "Round"])
def test_client_streams_refuse_mixed_or_empty_streams(stub, method):
    """Put and Round read their clients the same way: values or from_store reads, never
    both, and at least one message (and Put one handle); the device keeps serving."""
    request = pb.PutRequest if method == "Put" else pb.RoundRequest
    value = pb.ClientValue(client_id=0)
    wire.encode_value(np.float32(1.0), value.value)
    read = pb.StoreRead(population_ids=[0])
    streams = {
        "mixes client values and from_store": [request(values=[value]),
                                               request(from_store=read)],
        "sent no message": [],
    }
    if method == "Put":
        streams["mixes handles 5 and 6"] = [pb.PutRequest(handle=5, values=[value]),
                                            pb.PutRequest(handle=6, values=[value])]
    for match, messages in streams.items():
        with pytest.raises(grpc.RpcError) as info:
            getattr(stub, method)(iter(messages), timeout=10, metadata=MD)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert match in info.value.details()
    assert stub.Health(pb.HealthRequest(), timeout=10, metadata=MD).status == "SERVING"


@st.composite
def _id_chunks(draw):
    """Client ids cut into a stream's messages, with some ids repeated (or none)."""
    ids = draw(st.lists(st.integers(0, 1 << 40), min_size=1, max_size=12, unique=True))
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(ids)))
        ids.insert(at, draw(st.sampled_from(ids)))
    cuts = sorted(draw(st.lists(st.integers(1, len(ids)), max_size=3)))
    bounds = [0, *cuts, len(ids)]
    return ids, [ids[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


@settings(max_examples=25, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_id_chunks(), method=st.sampled_from(["Put", "Round", "Broadcast"]))
def test_a_value_naming_a_client_twice_is_refused_naming_the_id(stub, case, method):
    """Within one message or across a stream's messages: a repeated client id would count
    that client's data twice, so Put, Round and Broadcast refuse it before anything runs."""
    ids, chunks = case
    seen, repeated = set(), set()
    for i in ids:
        (repeated if i in seen else seen).add(i)

    def values(chunk):
        out = []
        for i in chunk:
            item = pb.ClientValue(client_id=i)
            wire.encode_value(np.float32(i % 7), item.value)
            out.append(item)
        return out

    if method == "Broadcast":
        call = lambda: stub.Broadcast(pb.BroadcastRequest(
            handle=40, value=wire.to_message(np.float32(1)), client_ids=ids),
            timeout=10, metadata=MD)
    else:
        request = pb.PutRequest if method == "Put" else pb.RoundRequest
        extra = {"handle": 40} if method == "Put" else {}
        call = lambda: getattr(stub, method)(
            iter([request(values=values(c), **extra) for c in chunks]), timeout=10,
            metadata=MD)
    if repeated:
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        first = min(repeated)
        assert f"names client id {first} {ids.count(first)} times" in info.value.details()
    elif method == "Round":
        # Distinct ids pass the check; this Round then fails on what it lacks (no
        # computation was loaded), not on its ids.
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert "names client id" not in info.value.details()
        assert "computation" in info.value.details()
    else:  # Put and Broadcast hold a value for each client under the handle
        answer = call()
        if method == "Put":
            assert answer.num_clients == len(ids)
        assert stub.Health(pb.HealthRequest(), timeout=10, metadata=MD).num_handles == 1
        stub.Release(pb.ReleaseRequest(handles=[40]), timeout=10, metadata=MD)
    assert stub.Health(pb.HealthRequest(), timeout=10, metadata=MD).num_handles == 0


_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # + SETTINGS


def test_health_is_answered_beside_hundreds_of_idle_connections_and_stalled_streams(
        monkeypatch):
    """300 loopback connections that never make a call (half silent since connecting,
    half idle after the HTTP/2 preface) and as many never-sending Put streams as the
    device admits (twice what it runs at once): a new caller's Health is still answered,
    one more call is refused by the cap, and the stalled streams keep no call out once
    they end."""
    import socket
    import threading

    device_process.raise_fd_limit()  # the test process holds both ends of every socket
    gates, init = [], device_process.CallGate.__init__

    def recording(self, *args, **kwargs):  # the server's gate, to see what it admitted
        init(self, *args, **kwargs)
        gates.append(self)

    monkeypatch.setattr(device_process.CallGate, "__init__", recording)
    servicer = device.DeviceServicer("idle")
    server, port = device_process.start_server("127.0.0.1:0", servicer, max_workers=2,
                                               max_concurrent_calls=4, token=TOKEN)
    address, sockets, release = f"127.0.0.1:{port}", [], threading.Event()

    def never_sends():  # a request stream that sends nothing until released
        release.wait(30)
        yield from ()

    try:
        for i in range(300):
            sockets.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            if i % 2:
                sockets[-1].sendall(_PREFACE)
        with grpc.insecure_channel(address) as busy:
            stalled = [pb_grpc.DeviceStub(busy).Put.future(never_sends(), timeout=30,
                                                           metadata=MD) for _ in range(4)]
            # all four admitted before one more call is tried (on a loaded machine a
            # call sent now could reach the gate before the last stream and take its place)
            admitted_by = time.monotonic() + 20
            while gates[0].in_progress < 4 and time.monotonic() < admitted_by:
                threading.Event().wait(0.02)
            assert gates[0].in_progress == 4, [call.done() for call in stalled]
            with grpc.insecure_channel(address) as channel:  # a new connection
                stub = pb_grpc.DeviceStub(channel)
                answer = stub.Health(pb.HealthRequest(), timeout=10, metadata=MD)
                assert answer.status == "SERVING"
                refused, tries = None, 0
                while refused is None and tries < 100:
                    try:
                        stub.Release(pb.ReleaseRequest(handles=[1]), timeout=10, metadata=MD)
                    except grpc.RpcError as e:
                        # a deadline on a loaded machine is no answer: ask again
                        if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                            refused = e
                    tries += 1
                    threading.Event().wait(0.05)
                assert refused is not None
                assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "4 calls are in progress" in refused.details()
                release.set()
                for call in stalled:
                    with pytest.raises(grpc.RpcError, match="sent no message"):
                        call.result(timeout=30)
                stub.Release(pb.ReleaseRequest(handles=[1]), timeout=10, metadata=MD)
    finally:
        release.set()
        for s in sockets:
            s.close()
        server.stop(None)


def test_memory_of_large_requests_goes_back_to_the_system_after_the_call():
    """A device's resident memory returns near where it was after each 100 MB call,
    refused or not (before, glibc kept the freed receive buffers: +107 MB after one
    refused 100 MB Load, +160 MB after a Put and Release of 100 MB more)."""
    import hashlib
    import time

    body = bytes(range(256)) * (100 * MB // 256)
    value = pb.ClientValue(client_id=0)
    wire.encode_value(np.frombuffer(body, np.uint8), value.value)
    calls = {
        "Load, not a computation": lambda s, md: s.Load(pb.LoadRequest(
            computation_hash=hashlib.sha256(body).hexdigest(), computation=body),
            timeout=120, metadata=md),
        "Put, then Release": lambda s, md: (
            s.Put(iter([pb.PutRequest(handle=1, values=[value])]), timeout=120, metadata=md),
            s.Release(pb.ReleaseRequest(handles=[1]), timeout=10, metadata=md)),
    }
    flood = device_flood.Device()
    try:
        with device_flood._channel(flood.address) as channel:
            stub = flood.stub(channel)
            stub.Health(pb.HealthRequest(), timeout=10, metadata=flood.metadata)
            baseline = flood.status("VmRSS")
            for what, call in calls.items():
                try:
                    call(stub, flood.metadata)
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, e.details())
                waited = time.monotonic()  # memory goes back beside the call: wait for it
                while (flood.status("VmRSS") - baseline >= 40 * MB
                       and time.monotonic() - waited < 20):
                    time.sleep(0.1)
                after = flood.status("VmRSS")
                assert after - baseline < 40 * MB, (what, baseline / MB, after / MB)
    finally:
        flood.close()
