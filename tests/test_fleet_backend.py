"""GrpcClientsBackend against LocalClientsBackend, on real device processes (127.0.0.1)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from fax_bridge.errors import ClientCountError, FleetError, WeightError
import sample_computations as sc
from fax_bridge.fleet.launcher import LocalFleet
from fax_bridge.rounds.policy import RoundPolicy
from fax_bridge.runtime import interpreter
from fax_bridge.runtime.local_backend import LocalClientsBackend

RNG = np.random.default_rng(0)


@pytest.fixture(scope="module")
def fleet2():
    with LocalFleet(devices=2) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def fleet3():
    with LocalFleet(devices=3) as fleet:
        yield fleet


def _local(proto, *args):
    return interpreter.interpret(proto, *args, backend=LocalClientsBackend())


def _run(fleet, proto, *args, path="round"):
    """A round on the fleet (by its split, as `fleet.run` takes it), or phase by phase on
    the same devices (the interpreter over the fleet's backend)."""
    if path == "round":
        return fleet.run(proto, *args)
    return interpreter.interpret(proto, *args, backend=fleet.backend)


def test_health_names_every_device(fleet2):
    answers = fleet2.backend.health()
    assert [a.status for a in answers] == ["SERVING", "SERVING"]
    assert [a.pid for a in answers] == fleet2.pids
    assert {a.protocol for a in answers} == {"fax_bridge.v1"}


@pytest.mark.parametrize("kind", ["sum", "mean", "min", "max"])
def test_map_then_aggregate_equals_local_backend(fleet2, kind):
    proto = sc.scaled_aggregate((4,), kind)
    xs = RNG.integers(-50, 50, size=(9, 4)).astype(np.float32)  # sums exact in any order
    s = np.array([1, -2, 3, 0.5], np.float32)
    np.testing.assert_array_equal(fleet2.run(proto, xs, s), _local(proto, xs, s))
    xs = RNG.normal(size=(9, 4)).astype(np.float32)
    np.testing.assert_allclose(fleet2.run(proto, xs, s), _local(proto, xs, s), rtol=1e-6)


def test_clients_results_and_several_maps_equal_local_backend(fleet2):
    proto = sc.linear_regression_step(features=5, examples=6)
    w = RNG.normal(size=5).astype(np.float32)
    x = RNG.normal(size=(7, 6, 5)).astype(np.float32)
    y = RNG.normal(size=(7, 6)).astype(np.float32)
    got, want = fleet2.run(proto, w, x, y), _local(proto, w, x, y)
    np.testing.assert_array_equal(got["losses"], want["losses"])  # per-client, no reduction
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-6)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)


def test_same_bits_for_any_device_count_by_round_or_by_phases(fleet2, fleet3):
    proto = sc.scaled_aggregate((64,), "mean")
    xs = (RNG.normal(size=(23, 64)) * 10.0 ** RNG.integers(-4, 4, size=(23, 1)))
    xs = xs.astype(np.float32)
    s = RNG.normal(size=64).astype(np.float32)
    results = [_run(fleet, proto, xs, s, path=path)
               for fleet in (fleet2, fleet3) for path in ("round", "phases")]
    assert len({r.tobytes() for r in results}) == 1
    np.testing.assert_allclose(results[0], _local(proto, xs, s), rtol=1e-5)


_DELICATE = st.sampled_from([0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, 3.4e38, -3.4e38, 0.25])


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["sum", "mean", "min", "max", "weighted_mean"]), st.data())
def test_exact_zeros_and_cancellations_give_in_process_bits_on_any_fleet(
        fleet2, fleet3, kind, data):
    n = data.draw(st.integers(1, 7), label="clients")
    rows = data.draw(st.lists(st.lists(_DELICATE, min_size=2, max_size=2), min_size=n,
                              max_size=n), label="values")
    if data.draw(st.booleans(), label="cancel"):  # e.g. [1, -1, 1, -1]: zero partials
        rows = [r if i % 2 == 0 else [-v for v in rows[i - 1]] for i, r in enumerate(rows)]
    xs = np.array(rows, np.float32)
    if kind == "weighted_mean":
        proto = sc.weighted_mean((2,))
        w = np.array(data.draw(st.lists(st.sampled_from([0.0, 1.0, 2.0]), min_size=n,
                                        max_size=n), label="weights"), np.float32)
        args = (xs, w)
    else:
        proto, args = sc.scaled_aggregate((2,), kind), (xs, np.ones(2, np.float32))
    if kind == "weighted_mean" and not w.any():  # zero total: refused on every path
        with pytest.raises(WeightError, match="sum to zero"):
            _local(proto, *args)
        for fleet in (fleet2, fleet3):
            for path in ("round", "phases"):
                with pytest.raises(WeightError, match="sum to zero"):
                    _run(fleet, proto, *args, path=path)
        return
    want = _local(proto, *args)
    for fleet in (fleet2, fleet3):
        for path in ("round", "phases"):
            got = _run(fleet, proto, *args, path=path)
            assert got.tobytes() == want.tobytes(), (fleet.num_devices, path, got, want)


def test_preaggregation_makes_uplink_scale_with_devices_not_clients(fleet2):
    proto = sc.scaled_aggregate((256,), "sum")
    s = np.ones(256, np.float32)
    up = {}
    for n in (8, 32):
        xs = RNG.integers(0, 4, size=(n, 256)).astype(np.float32)
        _, rep = fleet2.run(proto, xs, s, report=True)
        up[n] = rep.bytes_up
        # each device is named with what computed its answer: XLA, no model
        assert rep.served == {a: {"client_runtime": "xla", "model_sha256": None}
                              for a in fleet2.addresses}
    assert up[32] < 1.5 * up[8]       # one partial per device, whatever the clients
    assert up[32] < 32 * 256 * 4 / 4  # far below every client's result


def test_tensors_above_grpc_default_message_size(fleet2):
    proto = sc.scaled_aggregate((1 << 21,), "sum")  # 8 MiB per client
    xs = RNG.integers(-8, 8, size=(2, 1 << 21)).astype(np.float32)
    s = np.full(1 << 21, 0.5, np.float32)
    want = (xs * s).sum(0)
    got, rep = fleet2.run(proto, xs, s, report=True)
    np.testing.assert_array_equal(got, want)
    assert rep.payload_down >= xs.nbytes
    np.testing.assert_array_equal(_run(fleet2, proto, xs, s, path="phases"), want)


def test_rounds_sample_drop_and_straggle_deterministically(fleet2):
    proto = sc.scaled_aggregate((3,), "sum")
    xs = RNG.integers(0, 100, size=(30, 3)).astype(np.float32)
    s = np.ones(3, np.float32)
    policy = RoundPolicy(cohort_size=12, dropout=0.25, straggler_delay_s=0.004,
                         round_deadline_s=0.006, seed=5)
    reports = []
    for _ in range(2):
        fleet2.policy, fleet2.next_round = policy, 0
        result, rep = fleet2.run(proto, xs, s, report=True)
        np.testing.assert_array_equal(result, xs[rep.participants].sum(0))
        reports.append(rep)
    a, b = reports
    assert (a.cohort, a.dropped, a.late, a.participants) == (
        b.cohort, b.dropped, b.late, b.participants)
    assert len(a.cohort) == 12 and a.dropped and a.late
    fleet2.policy = RoundPolicy(dropout=0.9, min_clients=10, seed=1)
    with pytest.raises(FleetError, match="min_clients=10"):
        fleet2.run(proto, xs, s)
    assert fleet2.last_report.error and "min_clients" in fleet2.last_report.error
    fleet2.policy = RoundPolicy()


def test_device_errors_surface_as_fleet_errors(fleet2):
    import federated_language as fl

    backend = fleet2.backend
    value = backend.put(fl.TensorType(np.float32), [np.float32(1.0)] * 3)
    backend.collect()
    stale = type(value)(backend, 10**9, 3, value.type_signature)  # a handle never placed
    with pytest.raises(FleetError, match="no value with handle"):
        backend.get(stale)


def test_secure_sum_bitwidth_checks_the_range_on_devices(fleet2):
    import federated_language as fl

    backend = fleet2.backend
    members = [np.array([1, 2], np.int32), np.array([3, 7], np.int32), np.array([0, 5], np.int32)]
    value = backend.put(fl.TensorType(np.int32, [2]), members)
    np.testing.assert_array_equal(
        backend.aggregate(value, "secure_sum_bitwidth", bitwidth=np.int32(3)), [4, 14])
    # Found on a device: a FleetError naming it.
    with pytest.raises(FleetError, match=r"outside \[0, 2\*\*2 - 1\] = \[0, 3\]"):
        backend.aggregate(value, "secure_sum_bitwidth", bitwidth=np.int32(2))


def test_eval_at_clients_without_clients_arguments(fleet2):
    import federated_language as fl
    from federated_language.compiler import building_blocks as bb

    from fax_bridge.tff.xla import typed_xla_computation

    f32 = fl.TensorType(np.float32, [2])
    const = bb.CompiledComputation(typed_xla_computation(lambda: np.array([1.5, -2.0], np.float32)))
    evaluated = bb.Call(bb.Intrinsic("federated_eval_at_clients", fl.FunctionType(
        const.type_signature, sc.clients(f32))), const)
    total = bb.Call(bb.Intrinsic("federated_sum", fl.FunctionType(
        sc.clients(f32), sc.server(f32))), evaluated)
    proto = bb.Lambda(None, None, total).to_proto()
    got, rep = fleet2.run(proto, num_clients=5, report=True)
    np.testing.assert_array_equal(got, [7.5, -10.0])
    assert rep.participants == [0, 1, 2, 3, 4]


def _server_only(broadcast: bool):
    """float32@SERVER -> float32@SERVER: x * 2 at the server, or the sum of a broadcast."""
    import federated_language as fl
    from federated_language.compiler import building_blocks as bb

    from fax_bridge.tff.xla import typed_xla_computation

    t = fl.TensorType(np.float32)
    arg = bb.Reference("x", sc.server(t))
    if broadcast:
        spread = bb.Call(bb.Intrinsic("federated_broadcast", fl.FunctionType(
            sc.server(t), sc.clients(t, all_equal=True))), arg)
        body = bb.Call(bb.Intrinsic("federated_sum", fl.FunctionType(
            sc.clients(t), sc.server(t))), spread)
    else:
        double = bb.CompiledComputation(typed_xla_computation(lambda x: x * 2, t))
        body = bb.Call(bb.Intrinsic("federated_apply", fl.FunctionType(
            [double.type_signature, sc.server(t)], sc.server(t))), bb.Struct([double, arg]))
    return bb.Lambda("x", sc.server(t), body).to_proto()


def test_a_computation_that_places_nothing_at_clients_needs_no_client_count(fleet2, tmp_path):
    from fax_bridge.fleet.run_cli import run_file

    proto = _server_only(broadcast=False)
    assert _local(proto, np.float32(3)) == 6.0
    got, rep = fleet2.run(proto, np.float32(3), report=True)
    assert got == 6.0 and rep.participants == []
    (tmp_path / "c.pb").write_bytes(proto.SerializeToString())
    np.savez(tmp_path / "in.npz", arg=np.float32(3))
    out, _ = run_file(str(tmp_path / "c.pb"), str(tmp_path / "in.npz"), devices=1)
    assert sorted(out) == ["result"] and out["result"] == 6.0
    needs = _server_only(broadcast=True)
    for run in (lambda: _local(needs, np.float32(1)), lambda: fleet2.run(needs, np.float32(1))):
        with pytest.raises(ClientCountError, match="--clients N"):
            run()
    assert fleet2.run(needs, np.float32(1), num_clients=3) == 3.0
