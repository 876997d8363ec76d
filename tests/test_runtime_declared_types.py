"""declared_types: a computation proto's declared types must be those of what it computes
(placements included), checked before it runs."""

import federated_language as fl
import numpy as np
import pytest
from federated_language.compiler import building_blocks as bb
from hypothesis import given, settings, strategies as st

from fax_bridge.errors import ComputationError, DeclaredTypeError
import sample_computations as sc
from fax_bridge.runtime import declared_types, interpreter, run_computation

F32 = fl.TensorType(np.float32)
_TYPES = {"f32": F32, "f32@SERVER": fl.FederatedType(F32, fl.SERVER),
          "{f32}@CLIENTS": fl.FederatedType(F32, fl.CLIENTS),
          "f32@CLIENTS": fl.FederatedType(F32, fl.CLIENTS, all_equal=True),
          "<f32>": fl.StructType([F32])}


def _literal():
    return bb.Literal(np.float32(3.0), F32).to_proto(), (), "f32"


def _identity():
    return bb.Lambda("x", F32, bb.Reference("x", F32)).to_proto(), (np.float32(2.0),), "f32"


def _block():
    body = bb.Block([("y", bb.Literal(np.float32(1.0), F32))], bb.Reference("y", F32))
    return bb.Lambda("x", F32, body).to_proto(), (np.float32(2.0),), "f32"


def _server_sum():
    return sc.scaled_aggregate((), "sum"), (np.ones(4, np.float32), np.float32(1.0)), \
        "f32@SERVER"


@settings(max_examples=25, deadline=None)
@given(make=st.sampled_from([_literal, _identity, _block, _server_sum]),
       declared=st.sampled_from(sorted(_TYPES)))
def test_a_declared_type_other_than_the_body_s_is_refused(make, declared):
    """Each kind of body, its value's type declared as one of a few types that differ in
    placement or structure: it runs when the declaration is the body's type, else
    DeclaredTypeError before any value is computed."""
    proto, args, truth = make()
    lied = type(proto)()
    lied.CopyFrom(proto)
    if proto.type.WhichOneof("type") == "function":  # the result a function declares
        lied.type.function.result.CopyFrom(_TYPES[declared].to_proto())
    else:
        lied.type.CopyFrom(_TYPES[declared].to_proto())
    if declared == truth:
        run_computation(lied, *args)
        return
    with pytest.raises(DeclaredTypeError, match="declares"):
        run_computation(lied, *args)
    assert issubclass(DeclaredTypeError, ComputationError)


def test_a_local_part_declaring_a_placed_type_is_refused_at_any_depth():
    inner = bb.Literal(np.float32(1.0), F32).to_proto()
    inner.type.CopyFrom(_TYPES["f32@SERVER"].to_proto())
    outer = bb.Lambda("x", F32, bb.Reference("x", F32)).to_proto()
    block = bb.Block([("y", bb.Literal(np.float32(1.0), F32))],
                     bb.Reference("x", F32))
    proto = bb.Lambda("x", F32, block).to_proto()
    getattr(proto, "lambda").result.block.local[0].value.CopyFrom(inner)
    with pytest.raises(DeclaredTypeError, match="literal part .* type float32@SERVER"):
        interpreter.prepare(proto)
    interpreter.prepare(outer)  # honest: passes, and again from the cache
    declared_types.check(outer, fl.Type.from_proto(outer.type))
