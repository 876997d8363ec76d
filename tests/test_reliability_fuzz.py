"""Fuzzing the proto interpreter and the device RPCs: only our own errors, never a hang
or a crash.

Each target runs `FAX_BRIDGE_FUZZ_EXAMPLES` cases (default 60, the fast subset of the
test suite); `tools/fuzz.py` runs the long campaign. Hypothesis' per-case deadline turns
a hang into a failure; device RPCs also carry gRPC deadlines. Mutated HLO modules
(`tools/hlo_fuzz.py`) run in worker processes, so a crash is seen as one:
`FAX_BRIDGE_HLO_FUZZ_CASES` mutations per entry point (default 156, 12 per byte class),
from a fresh seed each run (`FAX_BRIDGE_HLO_FUZZ_SEED` fixes it).
"""

from __future__ import annotations

import datetime
import hashlib
import os
import random
import sys

import grpc
import numpy as np
import pytest
from federated_language.proto import computation_pb2
from hypothesis import HealthCheck, given, settings, strategies as st

from fax_bridge.errors import FaxBridgeError, HloModuleError
import sample_computations as sc
from fax_bridge.fleet import device, device_process, security
from fax_bridge.rounds import wire
from fax_bridge.runtime import interpreter, intrinsics, limits, local_eval
from fax_bridge.runtime.backend import leaves
from fax_bridge.runtime.local_backend import LocalClientsBackend
from fax_bridge.v1 import device_pb2 as pb

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))
import hlo_fuzz  # noqa: E402  (tools/, not a package)

sys.path.pop(0)

EXAMPLES = int(os.environ.get("FAX_BRIDGE_FUZZ_EXAMPLES", "60"))
HLO_CASES = int(os.environ.get("FAX_BRIDGE_HLO_FUZZ_CASES", "156"))
FUZZ = settings(max_examples=EXAMPLES, deadline=datetime.timedelta(seconds=20),
                suppress_health_check=list(HealthCheck), database=None, derandomize=False)
TOKEN = security.new_token()

SEEDS = [sc.scaled_aggregate((3,), "sum").SerializeToString(),
         sc.scaled_aggregate((2,), "max").SerializeToString(),
         sc.linear_regression_step(features=2, examples=3).SerializeToString()]
ARGS = [(np.ones((3, 3), np.float32), np.ones(3, np.float32)),
        (np.ones((3, 2), np.float32), np.ones(2, np.float32)),
        (np.zeros(2, np.float32), np.ones((3, 3, 2), np.float32), np.ones((3, 3), np.float32))]


@st.composite
def mutated(draw, seeds=SEEDS):
    index = draw(st.integers(0, len(seeds) - 1))
    data = bytearray(seeds[index])
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "splice"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[at] = draw(st.integers(0, 255))
        elif op == "cut":
            data = data[:at] + data[at + draw(st.integers(1, 64)):]
        elif op == "insert":
            data = data[:at] + draw(st.binary(max_size=16)) + data[at:]
        else:
            data = data[:at] + bytes(seeds[draw(st.integers(0, len(seeds) - 1))][at:at + 40])
    return index, bytes(data)


# What each seed computes on its ARGS, written out in numpy: scaled_aggregate's sum and
# max of x * s, and one least-squares step from w = 0 on all-ones data (residual -1,
# gradient -2 a feature, learning rate 0.1), leaves in jax's order (loss, losses, w).
SEED_RESULTS = [
    [np.sum(ARGS[0][0] * ARGS[0][1], axis=0)],
    [np.max(ARGS[1][0] * ARGS[1][1], axis=0)],
    [np.float32(1.0), np.ones(3, np.float32), np.full(2, 0.2, np.float32)]]

# The interpreter's catch-all for an error it did not name (an internal exception
# wrapped): a refusal that says what was wrong never takes this form.
_UNNAMED = "could not be interpreted ("


def _check_refusal(error: FaxBridgeError) -> None:
    """A refusal says what was wrong: a message, never the catch-all wrapping an
    internal exception (a KeyError or an IndexError of the interpreter's own)."""
    message = str(error)
    assert message.strip(), f"{type(error).__name__} with no message"
    assert _UNNAMED not in message, message


def _leaves(value) -> list:
    import jax

    return jax.tree_util.tree_leaves(value)


def _same_bits(a, b) -> bool:
    """The same leaves: arrays of one dtype, shape and bytes; anything else equal."""
    def same(x, y) -> bool:
        if not isinstance(x, (np.ndarray, np.generic, int, float, bool)):
            return type(x) is type(y) and x == y
        x, y = np.asarray(x), np.asarray(y)
        return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()

    left, right = _leaves(a), _leaves(b)
    return len(left) == len(right) and all(same(x, y) for x, y in zip(left, right))


def _check_mutated_run(index: int, data: bytes) -> None:
    """One mutated proto: refused by name, or run; a run of the seed's own computation
    (bytes that parse to it) gives the seed's numpy result, and any other run gives the
    round engine's bits (`run_computation`, a second path) on the same arguments."""
    try:
        got = interpreter.interpret(data, *ARGS[index], backend=LocalClientsBackend())
    except FaxBridgeError as e:
        _check_refusal(e)
        return
    seed = computation_pb2.Computation.FromString(SEEDS[index])
    if computation_pb2.Computation.FromString(data) == seed:
        want = SEED_RESULTS[index]
        assert len(_leaves(got)) == len(want)
        for g, w in zip(_leaves(got), want):
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-6)
        return
    from fax_bridge.in_process import run_computation

    assert _same_bits(got, run_computation(data, *ARGS[index]))


def test_mutated_run_checks_fail_on_a_wrong_answer(monkeypatch):
    # The seed unchanged runs; with the interpreter answering wrongly (or refusing
    # without naming what was wrong) the checks fail.
    _check_mutated_run(0, SEEDS[0])
    real = interpreter.interpret
    monkeypatch.setattr(interpreter, "interpret",
                        lambda *a, **k: [np.asarray(x) + 1 for x in _leaves(real(*a, **k))])
    with pytest.raises(AssertionError):
        _check_mutated_run(0, SEEDS[0])
    with pytest.raises(AssertionError):
        _check_refusal(FaxBridgeError(f"the computation {_UNNAMED}KeyError: 'x')"))


@FUZZ
@given(mutated())
def test_fuzz_interpreter_on_mutated_protos(case):
    _check_mutated_run(*case)


_URIS = list(intrinsics.SUPPORTED_INTRINSICS) + ["federated_teleport", "", "sequence_map"]
_dims = st.lists(st.sampled_from([0, 1, 2, 3, 1 << 40, -1]), max_size=3)


@st.composite
def _type(draw, depth=0):
    t = computation_pb2.Computation().type.__class__()
    kinds = ["tensor", "struct", "federated", "function"][:2 + (depth < 2) * 2]
    kind = draw(st.sampled_from(kinds))
    if kind == "tensor":
        t.tensor.dtype = draw(st.sampled_from([1, 3, 9, 10, 0, 77]))
        t.tensor.dims[:] = draw(_dims)
    elif kind == "struct":
        for _ in range(draw(st.integers(0, 2))):
            e = t.struct.element.add()
            e.name = draw(st.sampled_from(["", "x", "s"]))
            e.value.CopyFrom(draw(_type(depth + 1)))
    elif kind == "federated":
        t.federated.placement.value.uri = draw(st.sampled_from(["clients", "server", "moon"]))
        t.federated.all_equal = draw(st.booleans())
        t.federated.member.CopyFrom(draw(_type(depth + 1)))
    else:
        t.function.parameter.CopyFrom(draw(_type(depth + 1)))
        t.function.result.CopyFrom(draw(_type(depth + 1)))
    return t


@st.composite
def _comp(draw, depth=0):
    c = computation_pb2.Computation()
    if draw(st.booleans()):
        c.type.CopyFrom(draw(_type()))
    leaves = ["reference", "intrinsic", "placement", "literal", "data"]
    kinds = leaves + (["call", "lambda", "block", "struct", "selection"] if depth < 3 else [])
    kind = draw(st.sampled_from(kinds))
    name = draw(st.sampled_from(["arg", "x", "y", ""]))
    if kind == "reference":
        c.reference.name = name
    elif kind == "intrinsic":
        c.intrinsic.uri = draw(st.sampled_from(_URIS))
    elif kind == "placement":
        c.placement.uri = draw(st.sampled_from(["clients", "server", "moon"]))
    elif kind == "literal":
        c.literal.value.dtype = draw(st.sampled_from([1, 3, 0]))
        c.literal.value.shape.dim[:] = draw(_dims)
        c.literal.value.float32_list.value[:] = draw(st.lists(st.floats(width=32), max_size=4))
    elif kind == "data":
        c.data.uri = name
    elif kind == "call":
        c.call.function.CopyFrom(draw(_comp(depth + 1)))
        if draw(st.booleans()):
            c.call.argument.CopyFrom(draw(_comp(depth + 1)))
    elif kind == "lambda":
        getattr(c, "lambda").parameter_name = name
        getattr(c, "lambda").result.CopyFrom(draw(_comp(depth + 1)))
    elif kind == "block":
        local = c.block.local.add()
        local.name = name
        local.value.CopyFrom(draw(_comp(depth + 1)))
        c.block.result.CopyFrom(draw(_comp(depth + 1)))
    elif kind == "struct":
        for _ in range(draw(st.integers(0, 2))):
            c.struct.element.add().value.CopyFrom(draw(_comp(depth + 1)))
    else:
        c.selection.source.CopyFrom(draw(_comp(depth + 1)))
        c.selection.index = draw(st.integers(-1, 3))
    return c


@FUZZ
@given(_comp(), st.sampled_from([None, 0, 3]))
def test_fuzz_interpreter_on_generated_trees(comp, num_clients):
    # Refused by name, or run: a run's result holds the value the tree computes, the
    # same when evaluated again from its bytes (nothing carried over between runs).
    try:
        got = interpreter.evaluate(comp, None, LocalClientsBackend(), num_clients=num_clients)
    except FaxBridgeError as e:
        _check_refusal(e)
        return
    again = interpreter.evaluate(comp.SerializeToString(), None, LocalClientsBackend(),
                                 num_clients=num_clients)
    assert _same_bits(got, again)
    if comp.WhichOneof("computation") == "literal":  # its value, read here with numpy
        value = comp.literal.value
        # float32 values (an int32 literal runs only when it holds none: values in
        # another kind's list are refused), of the dtype the literal declares
        declared = {1: np.float32, 3: np.int32}[value.dtype]
        want = np.asarray(value.float32_list.value, declared).reshape(value.shape.dim)
        assert _same_bits(np.asarray(got), want)


# ---------------------------------------------------------------------------------------
# Sharing-heavy protos: tiny protos whose values (x_{i+1} = <x_i, x_i>) or calls
# (f_{i+1} = () -> <f_i(), f_i()>) double at every level. Sharing must stay sharing; the
# call blow-up is refused by `max_eval_steps`, lowered here so a refusal comes fast.

_F32 = computation_pb2.Computation().type.__class__()
_F32.tensor.dtype = 1
_BOUND_ERRORS = ("FAX_BRIDGE_MAX_EVAL_STEPS", "FAX_BRIDGE_MAX_PROTO_BYTES",
                 "declares its result")


def _ref(name):
    c = computation_pb2.Computation()
    c.reference.name = name
    return c


def _one():
    c = computation_pb2.Computation()
    c.type.CopyFrom(_F32)
    c.literal.value.dtype = 1
    c.literal.value.shape.SetInParent()
    c.literal.value.float32_list.value[:] = [1.0]
    return c


def _thunk(result, result_type=None):
    c = computation_pb2.Computation()
    if result_type is not None:
        c.type.function.result.CopyFrom(result_type)
    getattr(c, "lambda").result.CopyFrom(result)
    return c


def _select_first(source, depth):
    for _ in range(depth):
        outer = computation_pb2.Computation()
        outer.selection.source.CopyFrom(source)
        outer.selection.index = 0
        source = outer
    return source


@st.composite
def _sharing(draw):
    """(proto, use, expected): a chain of Block locals each referring to earlier ones."""
    calls = draw(st.booleans())
    n = draw(st.integers(1, 64))
    block = computation_pb2.Computation()
    first = block.block.local.add()
    first.name = "x0"
    first.value.CopyFrom(_thunk(_one()) if calls else _one())
    depth = [0]
    for i in range(1, n + 1):
        refs = [draw(st.integers(max(0, i - 3), i - 1)) for _ in range(draw(st.integers(1, 3)))]
        struct = computation_pb2.Computation()
        for j in refs:
            element = struct.struct.element.add()
            if calls:
                element.value.call.function.CopyFrom(_ref(f"x{j}"))
            else:
                element.value.CopyFrom(_ref(f"x{j}"))
        local = block.block.local.add()
        local.name = f"x{i}"
        local.value.CopyFrom(_thunk(struct) if calls else struct)
        depth.append(depth[refs[0]] + 1)
    top = _ref(f"x{n}")
    if calls:
        called = computation_pb2.Computation()
        called.call.function.CopyFrom(top)
        top = called
    use = draw(st.sampled_from(["select", "whole", "plus"] if not calls else ["select"]))
    if use == "plus":  # an untyped generic_plus inside a local function: 2 at every leaf
        plus = computation_pb2.Computation()
        plus.call.function.intrinsic.uri = "generic_plus"
        for _ in range(2):
            plus.call.argument.struct.element.add().value.CopyFrom(top)
        top = plus
    if use in ("select", "plus"):
        top = _select_first(top, depth[n])
    block.block.result.CopyFrom(top)
    return _thunk(block, _F32), use, 2.0 if use == "plus" else 1.0


@pytest.fixture
def small_step_cap():
    before = limits.set_limits(max_eval_steps=2_000)
    yield
    limits.set_limits(max_eval_steps=before.max_eval_steps)


@FUZZ
@given(_sharing())
def test_fuzz_sharing_heavy_protos_stay_linear_or_are_refused_by_a_stated_bound(
        small_step_cap, case):
    proto, use, expected = case
    runners = [lambda: local_eval.compile_local(proto)()]
    if use != "plus":  # the interpreter requires typed intrinsics
        runners.append(lambda: interpreter.evaluate(proto, None, LocalClientsBackend()))
    for run in runners:
        try:
            got = run()
        except FaxBridgeError as e:
            assert use == "whole" or "FAX_BRIDGE_MAX_EVAL_STEPS" in str(e), e
            assert any(bound in str(e) for bound in _BOUND_ERRORS), e
            continue
        assert use != "whole" or run is runners[0]  # the interpreter checks the result type
        if use != "whole":
            assert float(np.asarray(got)) == expected


# ---------------------------------------------------------------------------------------
# Device RPCs over gRPC: raw bytes, and well-formed requests with hostile contents.

_METHODS = {"Health": "uu", "Load": "uu", "Broadcast": "uu", "Map": "uu", "Zip": "uu",
            "Aggregate": "uu", "Release": "uu", "Fetch": "us", "Put": "su"}
# gRPC's own answer to undecodable request bytes, not a failure of the device's code.
_GRPC_DECODE_ERROR = "Exception deserializing request"


@pytest.fixture(scope="module")
def channel():
    servicer = device.DeviceServicer("fuzz", max_stored_bytes=64 << 20)
    srv, port = device_process.start_server("127.0.0.1:0", servicer, token=TOKEN,
                                    max_message_bytes=16 << 20)
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield ch
    ch.close()
    srv.stop(None)


def _call(channel, method: str, payload: bytes):
    path = f"/fax_bridge.v1.Device/{method}"
    shape = _METHODS[method]
    ident = dict(request_serializer=None, response_deserializer=None)
    kw = dict(timeout=10, metadata=security.call_metadata(TOKEN))
    if shape == "uu":
        return channel.unary_unary(path, **ident)(payload, **kw)
    if shape == "us":
        return list(channel.unary_stream(path, **ident)(payload, **kw))
    return channel.stream_unary(path, **ident)(iter([payload, payload]), **kw)


def _check_device(channel, method: str, payload: bytes) -> None:
    try:
        _call(channel, method, payload)
    except grpc.RpcError as e:
        code, details = e.code(), e.details() or ""
        assert code != grpc.StatusCode.DEADLINE_EXCEEDED, f"{method} hung"
        assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) or (
            _GRPC_DECODE_ERROR in details), f"{method}: {code} {details}"
    health = _call(channel, "Health", b"")
    assert pb.HealthResponse.FromString(health).status == "SERVING"


_tensor = st.builds(
    lambda dtype, shape, data: pb.Tensor(dtype=dtype, shape=shape, data=data),
    st.sampled_from(["float32", "int32", "bool", "bfloat16", "object", "float32,int8", "x"]),
    st.lists(st.sampled_from([0, 1, 2, 3, 1 << 40, -5]), max_size=3),
    st.binary(max_size=24))
_value = st.recursive(st.builds(lambda t: pb.Value(tensor=t), _tensor),
                      lambda inner: st.builds(
                          lambda vs: pb.Value(struct=pb.Struct(
                              elements=[pb.Element(value=v) for v in vs])),
                          st.lists(inner, max_size=3)),
                      max_leaves=4)
_handle = st.integers(0, 4)
_requests = st.one_of(
    st.tuples(st.just("Broadcast"), st.builds(
        lambda h, v, ids: pb.BroadcastRequest(handle=h, value=v, client_ids=ids),
        _handle, _value, st.lists(st.integers(-2, 3), max_size=3))),
    st.tuples(st.just("Put"), st.builds(
        lambda h, v: pb.PutRequest(handle=h, values=[pb.ClientValue(client_id=0, value=v)]),
        _handle, _value)),
    st.tuples(st.just("Aggregate"), st.builds(
        lambda v, k, w, b: pb.AggregateRequest(value=v, kind=k, weights=w, bitwidth=b),
        _handle, st.integers(0, 8), _handle, _value)),
    st.tuples(st.just("Zip"), st.builds(
        lambda hs, r: pb.ZipRequest(fields=[pb.ZipField(handle=h) for h in hs], result=r),
        st.lists(_handle, max_size=3), _handle)),
    st.tuples(st.just("Fetch"), st.builds(lambda h, m: pb.FetchRequest(
        handle=h, max_message_bytes=m), _handle, st.integers(-5, 100))),
    st.tuples(st.just("Release"), st.builds(lambda hs: pb.ReleaseRequest(handles=hs),
                                            st.lists(_handle, max_size=3))),
    # Named by their real hash, so the mutated bytes reach the parser and compiler.
    st.tuples(st.just("Load"), st.builds(lambda c: pb.LoadRequest(
        computation_hash=hashlib.sha256(c).hexdigest(), computation=c),
        mutated().map(lambda m: m[1]))),
)


@FUZZ
@given(_requests)
def test_fuzz_device_requests(channel, request_case):
    method, request = request_case
    _check_device(channel, method, request.SerializeToString())


@FUZZ
@given(st.sampled_from(sorted(_METHODS)), st.binary(max_size=200))
def test_fuzz_device_raw_bytes(channel, method, payload):
    _check_device(channel, method, payload)


@FUZZ
@given(_value)
def test_fuzz_wire_decoding(value):
    try:
        decoded = wire.decode_value(value)
    except FaxBridgeError:
        return
    again = wire.decode_value(wire.to_message(decoded))
    assert [x.tobytes() for x in leaves(again)] == [
        x.tobytes() for x in leaves(decoded)]


# ---------------------------------------------------------------------------------------
# Mutated HLO modules through run_computation and a device's Load, crashes detected.

def test_a_module_that_crashed_xla_is_a_named_error_at_run_and_at_load():
    from fax_bridge.v1 import hlo_module_pb2

    proto = computation_pb2.Computation.FromString(SEEDS[2])
    part = hlo_fuzz.xla_parts(proto)[0]
    module = hlo_module_pb2.Module.FromString(part.xla.hlo_module.value)
    module.host_program_shape.result.tuple_shapes.add(element_type=11, dimensions=[2])
    part.xla.hlo_module.value = module.SerializeToString()  # XLA: a CHECK failure
    with pytest.raises(HloModuleError, match="HloModuleProto `jit_.*host program shape"):
        interpreter.interpret(proto.SerializeToString(), *ARGS[2],
                                    backend=LocalClientsBackend())
    data = part.SerializeToString()
    request = pb.LoadRequest(computation_hash=hashlib.sha256(data).hexdigest(),
                             computation=data)
    with pytest.raises(hlo_fuzz.Aborted) as info:
        device.DeviceServicer("fuzz").Load(request, hlo_fuzz.Context())
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "HloModuleError" in str(info.value) and "host program shape" in str(info.value)


@pytest.mark.parametrize("target", ["run", "load"])
def test_mutated_hlo_modules_crash_no_entry_point(target):
    seed = int(os.environ.get("FAX_BRIDGE_HLO_FUZZ_SEED", random.randrange(1 << 30)))
    report = hlo_fuzz.run(target, HLO_CASES, seed=seed)
    assert not report.crashes and not report.unexpected, report.summary()
    assert report.tried == HLO_CASES and set(report.by_class) == set(hlo_fuzz.CLASSES)


def test_the_hlo_fuzzer_sees_a_crash_as_one():
    # Case 94 of seed 0 (a tuple shape one element too long) kills XLA's bare import.
    report = hlo_fuzz.run("convert", 2, seed=0, start=94)
    assert report.crashes == [(94, "tuple_length", "killed by SIGABRT")], report.summary()
    assert report.tried == 2  # the next case ran in a fresh worker
