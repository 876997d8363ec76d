"""The runtime's one evaluator of the Computation grammar, under each intrinsic table:
local (`compile_local`), at the server (`compile_local(at_server=True)`) and placed
(`interpreter.evaluate`) give every case the same meaning."""

import federated_language as fl
import numpy as np
import pytest
from federated_language.common_libs import structure
from federated_language.compiler import building_blocks as bb
from federated_language.compiler import intrinsic_defs as defs
from federated_language.proto import computation_pb2
from hypothesis import given, settings, strategies as st

from fax_bridge.errors import ComputationError
from fax_bridge.runtime import evaluator, grammar, interpreter, intrinsics, local_eval
from fax_bridge.tff.xla import typed_xla_computation

T = fl.TensorType(np.float32)
AT_SERVER = fl.FederatedType(T, fl.SERVER)
_NAMES = ("a", "b", "c")
_XLA = bb.CompiledComputation(typed_xla_computation(lambda x: x * 2 + 1, T))
_PLUS = bb.Intrinsic(defs.GENERIC_PLUS.uri, fl.FunctionType([T, T], T))
_TABLES = (local_eval.LOCAL, local_eval.AT_SERVER, intrinsics.PLACED)


def _scalar(comp, value):
    """`comp` narrowed to a float32 scalar by selecting first elements."""
    while isinstance(value, structure.Struct):
        comp, value = bb.Selection(comp, index=0), value[0]
    return comp, value


@st.composite
def _expr(draw, env: dict, depth: int = 0):
    """(a local computation over the names of `env`, its value by the grammar's rules),
    using every local case: Literal, Reference, Struct, Selection, Block, Lambda and Call,
    a generic intrinsic and an Xla part; names are rebound and shadowed."""
    kinds = ["literal"] + (["reference"] if env else [])
    if depth < 3:
        kinds += ["struct", "selection", "block", "lambda", "plus", "xla"]
    kind = draw(st.sampled_from(kinds))
    inner = lambda scope=env: draw(_expr(scope, depth + 1))  # noqa: E731
    if kind == "literal":
        v = np.float32(draw(st.integers(-8, 8)))
        return bb.Literal(v, T), v
    if kind == "reference":
        name = draw(st.sampled_from(sorted(env)))
        type_, value = env[name]
        return bb.Reference(name, type_), value
    if kind in ("struct", "selection"):
        parts = [inner() for _ in range(draw(st.integers(1, 3)))]
        struct = bb.Struct([c for c, _ in parts])
        value = structure.Struct([(None, v) for _, v in parts])
        if kind == "struct":
            return struct, value
        i = draw(st.integers(0, len(parts) - 1))
        return bb.Selection(struct, index=i), value[i]
    if kind in ("block", "lambda"):
        name = draw(st.sampled_from(_NAMES))
        bound, bound_value = inner()
        body, value = inner({**env, name: (bound.type_signature, bound_value)})
        if kind == "block":
            return bb.Block([(name, bound)], body), value
        return bb.Call(bb.Lambda(name, bound.type_signature, body), bound), value
    if kind == "plus":
        (a, x), (b, y) = _scalar(*inner()), _scalar(*inner())
        return bb.Call(_PLUS, bb.Struct([a, b])), np.float32(x + y)
    a, x = _scalar(*inner())
    return bb.Call(_XLA, a), np.float32(x * 2 + 1)


def _leaves(value) -> list:
    if isinstance(value, structure.Struct):
        return [leaf for v in value for leaf in _leaves(v)]
    return [np.asarray(value).tolist()]


@settings(max_examples=40, deadline=None, database=None)
@given(st.data())
def test_every_local_case_means_the_same_under_each_table(data):
    """One body, three ways: a local Lambda (table LOCAL), and the same Lambda applied
    at the server by `federated_apply` (AT_SERVER, and PLACED through the interpreter);
    each gives the value the grammar's rules give."""
    x = np.float32(data.draw(st.integers(-4, 4)))
    body, expected = data.draw(_expr({"p": (T, x)}))
    local = bb.Lambda("p", T, body)
    server = bb.Lambda("s", AT_SERVER, bb.Call(
        bb.Intrinsic(defs.FEDERATED_APPLY.uri, fl.FunctionType(
            [local.type_signature, AT_SERVER],
            fl.FederatedType(body.type_signature, fl.SERVER))),
        bb.Struct([local, bb.Reference("s", AT_SERVER)])))
    got = [local_eval.compile_local(local.to_proto())(x),
           local_eval.compile_local(server.to_proto(), at_server=True)(x),
           interpreter.evaluate(server.to_proto(), x)]
    for value in got:
        assert _leaves(value) == _leaves(expected)


def test_data_and_placement_have_meanings_only_where_values_are_placed():
    pair = fl.StructType([T, T])
    uses_data = evaluator.Computation(type=fl.FunctionType(T, pair).to_proto())
    lam = grammar.lambda_of(uses_data)
    lam.parameter_name = "p"
    lam.result.type.CopyFrom(pair.to_proto())
    lam.result.struct.element.add(value=bb.Reference("p", T).to_proto())
    lam.result.struct.element.add().value.CopyFrom(evaluator.Computation(
        type=T.to_proto(), data=computation_pb2.Data(uri="input://w")))
    for table in (local_eval.LOCAL, local_eval.AT_SERVER):
        with pytest.raises(ComputationError, match="cannot hold a `data` computation"):
            evaluator.compile_node(uses_data, table)
    got = interpreter.evaluate(uses_data, np.float32(1), data={"input://w": np.float32(2)})
    assert _leaves(got) == [1.0, 2.0]
    placement = bb.Block([("where", bb.Placement(fl.SERVER))], bb.Literal(np.float32(3), T))
    with pytest.raises(ComputationError, match="cannot hold a `placement` computation"):
        local_eval.evaluate_local(placement.to_proto())
    assert float(interpreter.evaluate(placement.to_proto())) == 3.0


@pytest.mark.parametrize("table", _TABLES, ids=lambda t: t.name)
def test_each_table_refuses_unbound_names_and_unknown_intrinsics_before_running(table):
    """Compiling walks the whole proto: an unbound name or an intrinsic the table does
    not know is refused even inside a Lambda that is never called."""
    unbound = bb.Block([("f", bb.Lambda("x", T, bb.Reference("y", T)))],
                       bb.Literal(np.float32(0), T))
    with pytest.raises(ComputationError, match="unbound name `y`"):
        evaluator.compile_node(unbound.to_proto(), table)
    sum_type = fl.FunctionType(fl.FederatedType(T, fl.CLIENTS), AT_SERVER)
    unknown = bb.Block([("f", bb.Intrinsic("federated_frobnicate", sum_type))],
                       bb.Literal(np.float32(0), T))
    with pytest.raises(ComputationError, match="federated_frobnicate"):
        evaluator.compile_node(unknown.to_proto(), table)


def test_the_tables_know_the_intrinsics_their_modules_define():
    assert set(local_eval.LOCAL.intrinsics) == set(local_eval.GENERIC_URIS)
    assert set(local_eval.AT_SERVER.intrinsics) == (
        set(local_eval.GENERIC_URIS) | local_eval.SERVER_LOCAL_URIS)
    assert set(intrinsics.PLACED.intrinsics) == set(intrinsics.SUPPORTED_INTRINSICS)


def test_tensorflow_parts_are_refused_under_every_table():
    """The tests above evaluate every other case of the proto; TensorFlow parts, which
    `grammar.case` refuses for every reader, are refused by name."""
    tf = fl.FunctionType(None, T).to_proto()
    comp = evaluator.Computation(type=tf)
    comp.tensorflow.SetInParent()
    for table in _TABLES:
        with pytest.raises(ComputationError, match="TensorFlow"):
            evaluator.compile_node(comp, table)


@pytest.mark.parametrize("dtype,kind,values", [
    (3, "float32_list", [0.0]),        # an int32 literal of float32 values
    (1, "int32_list", [1, 2]),         # a float32 literal of int32 values
    (10, "float32_list", [1.0]),       # a bool literal of float32 values
])
def test_a_literal_whose_values_are_in_another_kinds_list_is_refused(dtype, kind, values):
    from federated_language.proto import computation_pb2

    from fax_bridge.runtime import evaluator

    literal = computation_pb2.Literal()
    literal.value.dtype = dtype
    literal.value.shape.dim[:] = [len(values)]
    getattr(literal.value, kind).value[:] = values
    with pytest.raises(ComputationError, match=f"holds its values in {kind}; put them in"):
        evaluator.read_literal(literal)
