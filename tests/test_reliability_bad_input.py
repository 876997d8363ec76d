"""Hostile or broken input: each gives a named error and the next request still works."""

from __future__ import annotations

import hashlib

import federated_language as fl
import grpc
import jax
import numpy as np
import pytest
from federated_language.proto import computation_pb2
from google.protobuf import any_pb2

from fax_bridge.errors import ComputationError, FleetError
from fax_bridge.fleet import device, device_process, security
from fax_bridge.rounds import partials, wire
import sample_computations as sc
from fax_bridge.runtime import aggregation
from fax_bridge.fleet.coordinator import GrpcClientsBackend
from fax_bridge.runtime import interpreter
from fax_bridge.tff import xla as tff_xla
from fax_bridge.v1 import device_pb2 as pb
from fax_bridge.v1 import device_pb2_grpc as pb_grpc

TOKEN = security.new_token()
PROTO = sc.scaled_aggregate((3,), "sum")
MEMBERS = sc.scaled_aggregate((3,), "members")
XS, S = np.ones((4, 3), np.float32), np.ones(3, np.float32)


class LyingDevice(device.DeviceServicer):
    """Answers with whatever `mode` says instead of the truth."""

    mode = "honest"

    def Fetch(self, request, context):
        for message in super().Fetch(request, context):
            if self.mode == "wrong_shape":
                for item in message.values:
                    item.value.CopyFrom(wire.to_message(np.zeros(5, np.float32)))
            elif self.mode == "nan":
                for item in message.values:
                    item.value.CopyFrom(wire.to_message(np.full(3, np.nan, np.float32)))
            yield message

    def Aggregate(self, request, context):
        answer = super().Aggregate(request, context)
        if self.mode in ("nan", "bad_limbs", "huge_limbs"):  # lies told in the limbs form
            answer.leaves[0].CopyFrom(_as_limbs(answer.leaves[0]))
        if self.mode == "wrong_shape":
            answer.leaves[0].shape[:] = [7]
        elif self.mode == "nan":
            answer.leaves[0].nonfinite = bytes([1, 0, 0])
        elif self.mode == "bad_limbs":
            answer.leaves[0].num_limbs = 10**6
        elif self.mode == "huge_limbs":  # in range for int64, far beyond any sum of 2 values
            limbs = np.frombuffer(answer.leaves[0].limbs, "<i8").copy()
            limbs[-1] = 2**62
            answer.leaves[0].limbs = limbs.tobytes()
        elif self.mode == "huge_doubles":  # whole units, but beyond what 2 values add up to
            answer.leaves[0].doubles = np.full(3, 1e39, "<f8").tobytes()
        return answer


def _as_limbs(leaf: pb.LeafPartial) -> pb.LeafPartial:
    """A float64-form sum leaf as the same sum in limbs."""
    sent = partials.from_message("sum", pb.AggregateResponse(leaves=[leaf], num_clients=1))
    out = pb.LeafPartial()
    partials.leaf_message(sent.leaves[0].exact(), out)
    return out


@pytest.fixture(scope="module")
def devices():
    liar = LyingDevice("liar")
    servers, addresses = [], []
    for servicer in (device.DeviceServicer("good", max_stored_bytes=1 << 20), liar):
        srv, port = device_process.start_server("127.0.0.1:0", servicer, token=TOKEN)
        servers.append(srv)
        addresses.append(f"127.0.0.1:{port}")
    yield addresses, liar
    for srv in servers:
        srv.stop(None)


def _works(backend, by_partials: bool = True) -> None:
    """A sum over the backend's devices (their partials), or with `by_partials=False` every
    client's own value brought back (members)."""
    if by_partials:
        np.testing.assert_array_equal(interpreter.interpret(PROTO, XS, S, backend=backend),
                                      [4.0, 4.0, 4.0])
    else:
        np.testing.assert_array_equal(
            interpreter.interpret(MEMBERS, XS, S, backend=backend), XS * S)


def test_corrupt_protos_and_bad_arguments_name_the_problem():
    data = PROTO.SerializeToString()
    with pytest.raises(ComputationError, match="not a serialized Computation"):
        interpreter.interpret(data[: len(data) // 2], XS, S)
    unknown = computation_pb2.Computation()
    unknown.CopyFrom(PROTO)
    getattr(unknown, "lambda").result.call.function.intrinsic.uri = "federated_teleport"
    with pytest.raises(ComputationError, match="federated_teleport"):
        interpreter.interpret(unknown, XS, S)
    with pytest.raises(ComputationError, match=r"expected shape \[3\]"):
        interpreter.interpret(PROTO, np.ones((4, 5), np.float32), S)
    with pytest.raises(ComputationError, match="expected dtype float32"):
        interpreter.interpret(PROTO, XS, np.ones(3, np.complex64))
    with pytest.raises(ComputationError, match="takes 2 arguments"):
        interpreter.interpret(PROTO, XS)
    huge = computation_pb2.Computation()
    huge.CopyFrom(PROTO)
    huge.type.function.parameter.struct.element[0].value.federated.member.tensor.dims[:] = [
        1 << 40]
    with pytest.raises(ComputationError, match="above the cap"):
        interpreter.interpret(huge, XS, S)
    np.testing.assert_array_equal(interpreter.interpret(PROTO, XS, S), [4.0] * 3)


def _xla_with_custom_call(target: str) -> computation_pb2.Computation:
    """A per-client function f32[3] -> f32[3] whose HLO calls native code `target`."""
    spec = jax.ShapeDtypeStruct((3,), np.float32)
    hlo_bytes = jax.jit(lambda x: jax.ffi.ffi_call(target, spec)(x)).lower(spec).compiler_ir(
        "hlo").as_serialized_hlo_module_proto()
    t = fl.TensorType(np.float32, [3])
    return computation_pb2.Computation(
        type=fl.FunctionType(t, t).to_proto(),
        xla=computation_pb2.Xla(
            hlo_module=any_pb2.Any(type_url=tff_xla.HLO_MODULE_TYPE_URL, value=hlo_bytes),
            parameter=tff_xla.binding(t), result=tff_xla.binding(t)))


def test_devices_refuse_custom_calls_before_running_them(devices):
    (good, _), _ = devices
    metadata = security.call_metadata(TOKEN)
    with grpc.insecure_channel(good) as channel:
        stub = pb_grpc.DeviceStub(channel)
        for target in ("lapack_sgetrf_ffi", "xla_ffi_python_cpu_callback"):
            data = _xla_with_custom_call(target).SerializeToString()
            request = pb.LoadRequest(computation_hash=hashlib.sha256(data).hexdigest(),
                                     computation=data)
            with pytest.raises(grpc.RpcError) as info:
                stub.Load(request, timeout=30, metadata=metadata)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"custom call `{target}`" in info.value.details()
        assert stub.Health(pb.HealthRequest(), timeout=10, metadata=metadata).status == "SERVING"


def test_a_device_refuses_code_under_another_computations_hash(devices):
    """Devices outlive coordinators: bytes must hash to the name later Maps will use."""
    (good, _), _ = devices
    metadata = security.call_metadata(TOKEN)
    fn = _xla_with_custom_call("lapack_sgetrf_ffi")  # refused anyway once parsed
    real = sc.scaled_aggregate((3,), "sum")
    with grpc.insecure_channel(good) as channel:
        stub = pb_grpc.DeviceStub(channel)
        for key in ("h", hashlib.sha256(real.SerializeToString()).hexdigest()):
            with pytest.raises(grpc.RpcError) as info:
                stub.Load(pb.LoadRequest(computation_hash=key,
                                         computation=fn.SerializeToString()),
                          timeout=30, metadata=metadata)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "is not the sha256 of the computation's bytes" in info.value.details()


def test_absurd_wire_tensors_are_refused_before_allocating():
    for shape, data in (([1 << 40], b""), ([1 << 32, 1 << 32], b""), ([-1], b""),
                        ([2], b"\0" * 7)):
        with pytest.raises(FleetError, match="cap|negative|bytes but holds"):
            wire.decode_tensor(pb.Tensor(dtype="float32", shape=shape, data=data))
    for dtype in ("object", "U4", "float32,int32", "M8"):
        with pytest.raises(FleetError, match="unknown tensor dtype"):
            wire.decode_tensor(pb.Tensor(dtype=dtype, shape=[1], data=b"\0" * 4))


def test_a_device_refuses_garbage_and_keeps_serving(devices):
    (good, _), _ = devices
    metadata = security.call_metadata(TOKEN)
    with grpc.insecure_channel(good) as channel:
        stub = pb_grpc.DeviceStub(channel)
        cases = [
            ("Load", pb.LoadRequest(computation_hash="x", computation=b"\xff\x00garbage")),
            ("Load", pb.LoadRequest(computation_hash="y",
                                    computation=PROTO.SerializeToString())),  # federated
            ("Broadcast", pb.BroadcastRequest(handle=5, value=pb.Value(tensor=pb.Tensor(
                dtype="float32", shape=[1 << 40])), client_ids=[0])),
            ("Aggregate", pb.AggregateRequest(value=1, kind=99)),
            ("Map", pb.MapRequest(computation_hash="nope", arg=1, result=2)),
            ("Broadcast", pb.BroadcastRequest(handle=6, value=pb.Value(tensor=pb.Tensor(
                dtype="uint8", shape=[2 << 20], data=b"\0" * (2 << 20))), client_ids=[0])),
        ]
        codes = []
        for method, request in cases:
            with pytest.raises(grpc.RpcError) as info:
                getattr(stub, method)(request, timeout=30, metadata=metadata)
            codes.append(info.value.code())
            assert info.value.details()  # a message naming the problem
        assert grpc.StatusCode.INTERNAL not in codes
        assert codes[-1] == grpc.StatusCode.RESOURCE_EXHAUSTED  # over max_stored_bytes
        assert stub.Health(pb.HealthRequest(), timeout=10, metadata=metadata).status == "SERVING"
    with GrpcClientsBackend([good], token=TOKEN) as backend:
        _works(backend)


@pytest.mark.parametrize("mode,by_partials,pattern", [
    ("wrong_shape", False, r"expected float32\[3\], got float32\[5\]"),
    ("wrong_shape", True, r"partial sum of float32\[7\]"),
    ("bad_limbs", True, "limbs"),
    ("huge_limbs", True, "sum leaf 0: a partial sum's top limb holds .* forged"),
    ("huge_doubles", True, "sum leaf 0: a partial sum's float64 values .* forged"),
    ("nan", False, "NaN"),
    ("nan", True, "NaN"),
])
def test_lying_devices_are_caught_and_named(devices, mode, by_partials, pattern):
    addresses, liar = devices
    with GrpcClientsBackend(addresses, token=TOKEN, reject_nonfinite=True) as backend:
        liar.mode = mode
        try:
            with pytest.raises(FleetError, match=pattern) as info:
                _works(backend, by_partials=by_partials)
            assert "device 1" in str(info.value)
        finally:
            liar.mode = "honest"
        _works(backend, by_partials=by_partials)


def test_partials_are_checked_against_the_type():
    member = fl.TensorType(np.float32, [3])
    two = [np.ones(3, np.float32), np.full(3, 0.5, np.float32)]
    answer = partials.to_message(aggregation.partial_of("sum", two))
    from fax_bridge.rounds import validate

    validate.check_partial(answer, "sum", [member], [], 2, "d")
    with pytest.raises(FleetError, match="over 2 clients; the device holds 3"):
        validate.check_partial(answer, "sum", [member], [], 3, "d")
    answer.leaves[0].doubles = answer.leaves[0].doubles[:-8]
    with pytest.raises(FleetError, match="should hold"):
        validate.check_partial(answer, "sum", [member], [], 2, "d")
    answer = partials.to_message(aggregation.partial_of("sum", two))
    answer.leaves[0].CopyFrom(_as_limbs(answer.leaves[0]))
    validate.check_partial(answer, "sum", [member], [], 2, "d")
    answer.leaves[0].limbs = answer.leaves[0].limbs[:-8]
    with pytest.raises(FleetError, match="should hold"):
        validate.check_partial(answer, "sum", [member], [], 2, "d")
    one = partials.to_message(aggregation.partial_of("sum", two[:1]))  # one client's addend
    validate.check_partial(one, "sum", [member], [], 1, "d")
    with pytest.raises(FleetError, match="a partial over 1 clients; the device holds 2"):
        validate.check_partial(one, "sum", [member], [], 2, "d")
