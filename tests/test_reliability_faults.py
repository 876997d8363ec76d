"""Device faults on a LocalFleet: SIGKILL mid-round, stragglers, restarts, determinism."""

from __future__ import annotations

import signal
import threading

import federated_language as fl
import numpy as np
import pytest
from federated_language.compiler import building_blocks as bb

from fax_bridge.errors import FleetError
from fax_bridge.runtime import interpreter
import sample_computations as sc
from processes import at_round_requests
from fax_bridge.fleet.protocol import partition
from fax_bridge.fleet.launcher import LocalFleet
from fax_bridge.rounds.policy import RoundPolicy, plan_round

RNG = np.random.default_rng(7)


@pytest.fixture(scope="module")
def fleet3():
    with LocalFleet(devices=3, rpc_timeout_s=30.0, probe_timeout_s=1.0) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def fleet1():
    with LocalFleet(devices=1) as fleet:
        yield fleet


def _weighted_mean(shape) -> bytes:
    member = fl.TensorType(np.float32, list(shape))
    param = fl.StructType([("x", sc.clients(member)), ("w", sc.clients(fl.TensorType(np.float32)))])
    arg = bb.Reference("arg", param)
    pair = bb.Struct([bb.Selection(arg, name="x"), bb.Selection(arg, name="w")])
    call = bb.Call(bb.Intrinsic("federated_weighted_mean", fl.FunctionType(
        pair.type_signature, sc.server(member))), pair)
    return bb.Lambda("arg", param, call).to_proto()




def test_every_aggregation_gives_the_same_bits_on_any_device_count(fleet1, fleet3):
    xs = (RNG.normal(size=(17, 33)) * 10.0 ** RNG.integers(-6, 6, size=(17, 1)))
    xs = xs.astype(np.float32)
    w = RNG.uniform(0.1, 9.0, size=17).astype(np.float32)
    s = RNG.normal(size=33).astype(np.float32)
    for kind in ("sum", "mean", "min", "max"):
        proto = sc.scaled_aggregate((33,), kind)
        bits = set()
        for fleet in (fleet1, fleet3):  # by round, and phase by phase on the devices
            bits.add(fleet.run(proto, xs, s).tobytes())
            bits.add(interpreter.interpret(proto, xs, s, backend=fleet.backend).tobytes())
        assert len(bits) == 1, kind
    proto = _weighted_mean((33,))
    results = []
    for fleet in (fleet1, fleet3, fleet3):
        results.append(fleet.run(proto, xs, w))
    assert len({r.tobytes() for r in results}) == 1
    np.testing.assert_allclose(results[0], (xs * w[:, None]).sum(0) / w.sum(), rtol=1e-4)


def test_a_device_killed_mid_round_leaves_the_round_to_the_survivors(fleet3):
    proto = sc.scaled_aggregate((4,), "sum")
    xs = RNG.integers(0, 100, size=(12, 4)).astype(np.float32)
    s = np.ones(4, np.float32)
    policy = RoundPolicy(straggler_delay_s=1.0, min_clients=6, seed=3)
    plan = plan_round(policy, 12, 0)
    blocks = partition(len(plan.participants), 3)
    fleet3.policy, fleet3.next_round = policy, 0
    # Device 1 is stopped as the round makes its Round requests (after the round's
    # Load), so it cannot answer whenever its request comes, and killed once every
    # device's request has gone: mid-round by construction, whatever the machine's speed.
    with at_round_requests(lambda: fleet3.kill_device(1, signal.SIGSTOP),
                           lambda: fleet3.kill_device(1), devices=3) as reached:
        result, rep = fleet3.run(proto, xs, s, report=True)
    assert reached["made"] and reached["sent"] >= 3, reached
    lost = [plan.participants[j] for j in blocks[1]]
    assert sorted(rep.lost_clients) == sorted(lost) and len(rep.lost_devices) == 1
    assert rep.participants == [c for c in plan.participants if c not in lost]
    np.testing.assert_array_equal(result, xs[rep.participants].sum(0))
    assert "lost" in rep.summary()
    # The restarted device takes part in the next round again.
    fleet3.restart_device(1)
    fleet3.policy = RoundPolicy()
    result, rep = fleet3.run(proto, xs, s, report=True)
    assert rep.devices == 3 and not rep.lost_devices
    np.testing.assert_array_equal(result, xs.sum(0))


def test_too_few_survivors_fail_the_round_with_a_fleet_error(fleet3):
    proto = sc.scaled_aggregate((4,), "sum")
    xs = np.ones((9, 4), np.float32)
    s = np.ones(4, np.float32)
    fleet3.kill_device(0)
    fleet3.policy = RoundPolicy(min_clients=8)
    try:
        with pytest.raises(FleetError, match="min_clients=8"):
            fleet3.run(proto, xs, s)
        assert fleet3.last_report.lost_clients == [0, 1, 2]
    finally:
        fleet3.restart_device(0)
        fleet3.policy = RoundPolicy()
    np.testing.assert_array_equal(fleet3.run(proto, xs, s), np.full(4, 9.0))


def test_a_hung_device_misses_the_deadline_and_is_dropped(fleet3):
    proto = sc.scaled_aggregate((4,), "sum")
    xs = RNG.integers(0, 100, size=(9, 4)).astype(np.float32)
    s = np.ones(4, np.float32)
    backend_timeout = fleet3.rpc_timeout_s
    fleet3.rpc_timeout_s = 2.0
    fleet3.backend.rpc_timeout_s = 2.0
    fleet3.kill_device(2, signal.SIGSTOP)
    try:
        result, rep = fleet3.run(proto, xs, s, report=True)
    finally:
        fleet3.kill_device(2, signal.SIGCONT)
        fleet3.rpc_timeout_s = backend_timeout
    assert rep.lost_clients == [6, 7, 8] and rep.participants == list(range(6))
    np.testing.assert_array_equal(result, xs[:6].sum(0))
    fleet3.restart_device(2)
    fleet3.backend.rpc_timeout_s = backend_timeout
    np.testing.assert_array_equal(fleet3.run(proto, xs, s), xs.sum(0))


def test_calls_to_several_devices_name_every_lost_one_and_count_every_call(fleet3):
    """call_each makes the last device's call in the calling thread and the others on
    the pool: a lost device is reported the same either way, all of them together."""
    from fax_bridge.fleet.pool import DeviceLostError
    from fax_bridge.v1 import device_pb2 as pb

    backend = fleet3.backend
    threads = {}

    class Spy:
        def __init__(self, index, stub):
            self._index, self._stub = index, stub

        def __getattr__(self, name):
            def call(*args, **kwargs):
                threads[self._index] = threading.current_thread()
                return getattr(self._stub, name)(*args, **kwargs)

            return call

    stubs = [d.stub for d in backend._devices]
    for index, device in enumerate(backend._devices):
        device.stub = Spy(index, device.stub)
    try:
        before = backend.traffic.rpcs
        answers = backend.call_each("Health", {d: pb.HealthRequest() for d in range(3)})
        assert [a.status for a in answers.values()] == ["SERVING"] * 3
        assert threads[2] is threading.current_thread()
        assert threading.current_thread() not in (threads[0], threads[1])
        fleet3.kill_device(0)
        fleet3.kill_device(2)
        with pytest.raises(DeviceLostError) as info:
            backend.call_each("Health", {d: pb.HealthRequest() for d in range(3)})
        assert info.value.devices == [0, 2] and backend.traffic.rpcs == before + 6
        assert "device 0 at" in str(info.value) and "device 2 at" in str(info.value)
    finally:
        for device, stub in zip(backend._devices, stubs):
            device.stub = stub
        fleet3.restart_device(0)
        fleet3.restart_device(2)
    assert fleet3.run(sc.scaled_aggregate((4,), "sum"), np.ones((6, 4), np.float32),
                      np.ones(4, np.float32)).tolist() == [6.0] * 4
