"""Tests of fax_bridge.runtime.local_eval: Xla bindings, local compositions, caching, errors."""

import federated_language as fl
import numpy as np
import pytest
from federated_language.common_libs import structure
from federated_language.compiler import building_blocks as bb
from federated_language.proto import computation_pb2

from fax_bridge.errors import ComputationError
from fax_bridge.runtime import grammar, local_eval
from fax_bridge.tff.xla import typed_xla_computation

F32 = np.float32
VEC3 = fl.TensorType(F32, [3])


def _struct(**kw):
    return structure.Struct(list(kw.items()))


def test_xla_parameters_with_names_out_of_sorted_order():
    # Nested names out of sorted order still reach the function by name.
    inner = fl.StructType([("z", F32), ("a", VEC3)])
    param = fl.StructType([("w", inner), ("b", np.int32)])
    comp = typed_xla_computation(lambda w, b: (w["z"] * w["a"], w["a"] - b), param)
    fn = local_eval.compile_local(comp)
    a = np.array([1.0, 2.0, 3.0], F32)
    out = fn(_struct(w=_struct(z=np.float32(2.0), a=a), b=np.int32(1)))
    np.testing.assert_allclose(out[0], 2.0 * a)
    np.testing.assert_allclose(out[1], a - 1)


def test_xla_named_results_and_no_parameter():
    comp = typed_xla_computation(lambda: {"b": np.ones(2, F32), "a": np.int32(7)})
    out = local_eval.compile_local(comp)()
    assert structure.name_list(out) == ["a", "b"]
    assert out.a == 7 and out.a.dtype == np.int32
    np.testing.assert_array_equal(out.b, np.ones(2, F32))


def test_xla_int64_and_float64_round_trip():
    import jax

    with jax.enable_x64(True):
        comp = typed_xla_computation(lambda x, y: (x * 3, y / 2),
                               fl.StructType([(None, np.int64), (None, np.float64)]))
    out = local_eval.compile_local(comp)(
        structure.Struct([(None, np.int64(2**40)), (None, np.float64(1.0))]))
    assert out[0] == 3 * 2**40 and out[0].dtype == np.int64
    assert out[1] == 0.5 and out[1].dtype == np.float64


def test_lambda_block_call_struct_selection_literal_composition():
    # (x -> let sq = square(x), c = 3.0 in <add(<sq, c>), x>[0]) computed locally.
    square = bb.CompiledComputation(typed_xla_computation(lambda x: x * x, VEC3))
    add = bb.CompiledComputation(typed_xla_computation(
        lambda a, c: a + c, fl.StructType([(None, VEC3), (None, F32)])))
    x = bb.Reference("x", VEC3)
    sq = bb.Reference("sq", VEC3)
    c = bb.Reference("c", fl.TensorType(F32))
    body = bb.Block(
        [("sq", bb.Call(square, x)), ("c", bb.Literal(np.float32(3.0), fl.TensorType(F32)))],
        bb.Selection(bb.Struct([bb.Call(add, bb.Struct([sq, c])), x]), index=0),
    )
    fn = local_eval.compile_local(bb.Lambda("x", VEC3, body).to_proto())
    v = np.array([1.0, -2.0, 0.5], F32)
    np.testing.assert_allclose(fn(v), v * v + 3.0)


def test_generic_intrinsics_locally():
    pair = fl.StructType([("a", VEC3), ("n", np.int32)])
    plus = bb.Intrinsic("generic_plus", fl.FunctionType([pair, pair], pair))
    zero = bb.Intrinsic("generic_zero", pair)
    y = bb.Reference("y", pair)
    fn = local_eval.compile_local(
        bb.Lambda("y", pair, bb.Call(plus, bb.Struct([y, bb.Call(plus, bb.Struct([y, zero]))])))
        .to_proto())
    out = fn(_struct(a=np.arange(3, dtype=F32), n=np.int32(4)))
    np.testing.assert_allclose(out.a, 2 * np.arange(3))
    assert out.n == 8 and out.n.dtype == np.int32
    divide = bb.Intrinsic("generic_divide", fl.FunctionType([VEC3, VEC3], VEC3))
    d = local_eval.compile_local(divide.to_proto())
    np.testing.assert_allclose(
        d(structure.Struct([(None, np.ones(3, F32)), (None, np.full(3, 4, F32))])), 0.25)


def test_compiled_once_per_content_hash():
    comp = typed_xla_computation(lambda x: x + 1, VEC3)
    copy = computation_pb2.Computation.FromString(comp.SerializeToString())
    assert local_eval.content_hash(comp) == local_eval.content_hash(copy)
    assert len(local_eval.content_hash(comp)) == 64
    assert local_eval.compile_local(comp) is local_eval.compile_local(copy)


def test_unbound_reference_is_reported():
    lam = computation_pb2.Computation(type=fl.FunctionType(F32, F32).to_proto())
    getattr(lam, "lambda").parameter_name = "x"
    getattr(lam, "lambda").result.reference.name = "nope"
    with pytest.raises(ComputationError, match="unbound name `nope`"):
        local_eval.compile_local(lam)


def test_federated_intrinsic_is_not_local():
    t = fl.FederatedType(F32, fl.CLIENTS)
    comp = bb.Intrinsic("federated_sum", fl.FunctionType(t, fl.FederatedType(F32, fl.SERVER)))
    with pytest.raises(ComputationError, match="federated_sum"):
        local_eval.compile_local(comp.to_proto())


def test_bad_hlo_payloads_are_reported():
    comp = typed_xla_computation(lambda x: x + 1, VEC3)
    wrong_url = computation_pb2.Computation()
    wrong_url.CopyFrom(comp)
    wrong_url.xla.hlo_module.type_url = "type.googleapis.com/something.Else"
    with pytest.raises(ComputationError, match="HloModuleProto"):
        local_eval.compile_local(wrong_url)
    garbage = computation_pb2.Computation()
    garbage.CopyFrom(comp)
    garbage.xla.hlo_module.value = b"not an hlo module"
    with pytest.raises(ComputationError, match="HloModuleProto"):
        local_eval.compile_local(garbage)


def test_argument_shape_and_dtype_mismatch():
    fn = local_eval.compile_local(typed_xla_computation(lambda x: x + 1, VEC3))
    with pytest.raises(ComputationError, match=r"expected float32\[3\].*\[4\]"):
        fn(np.zeros(4, F32))
    with pytest.raises(ComputationError, match="dtype"):
        fn(np.array(["a", "b", "c"]))
    with pytest.raises(ComputationError, match="expected a tensor"):
        fn(structure.Struct([(None, np.zeros(3, F32))]))


def test_non_functional_computation_is_rejected():
    lit = bb.Literal(np.float32(1.0), fl.TensorType(F32)).to_proto()
    with pytest.raises(ComputationError, match="functional"):
        local_eval.compile_local(lit)
    with pytest.raises(ComputationError, match="Computation proto"):
        local_eval.compile_local(b"bytes")


def _every_computation(message):
    """Every Computation message nested in `message`, by protobuf reflection alone."""
    found = [message] if isinstance(message, computation_pb2.Computation) else []
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        for item in (value if field.is_repeated else [value]):
            if hasattr(item, "ListFields"):
                found.extend(_every_computation(item))
    return found


def test_children_reach_every_nested_computation():
    """Walking `children` visits exactly the Computation messages a proto holds (except
    inside Xla, whose module is not a Computation), for programs using every case."""
    import jax.numpy as jnp

    import fax_bridge as fb

    @fb.program(clients=3)
    def round_(w, x, weights):
        wc = fb.federated_broadcast(w)
        d = fb.federated_map_clients(lambda a, b: {"p": a * b, "q": b.sum()}, (wc, x))
        return fb.federated_weighted_mean(d, weights), fb.federated_sum(x) + w.sum()

    proto = fb.export_tff(round_, jnp.ones(2), jnp.ones((3, 2)), jnp.ones(3),
                          placements=("server", "clients", "clients"))
    seen, stack = [], [proto]
    while stack:
        c = stack.pop()
        seen.append(c)
        stack.extend(grammar.children(c))
    assert sorted(c.SerializeToString() for c in seen) == sorted(
        c.SerializeToString() for c in _every_computation(proto))
    kinds = {c.WhichOneof("computation") for c in seen}
    assert {"lambda", "block", "call", "intrinsic", "reference", "xla"} <= kinds


@pytest.mark.parametrize("depth", [150, 400])
def test_types_nested_past_the_parsers_limit_are_a_clear_error(depth):
    """A Type proto built in memory can nest deeper than protobuf parses back; reading it
    is a ComputationError naming the nesting, as a proto too deep for the converter is."""
    from federated_language.proto import computation_pb2

    type_proto = computation_pb2.Type()
    inner = type_proto
    for _ in range(depth):
        inner = inner.struct.element.add().value
    inner.tensor.dtype = 1
    with pytest.raises(ComputationError, match="nested too deeply"):
        local_eval.parse_type(type_proto)
