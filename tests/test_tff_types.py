"""Tests for fax_bridge.tff.types: tensor, struct and federated types of JAX pytrees."""

from __future__ import annotations

import collections
import dataclasses

import federated_language
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from federated_language.proto import data_type_pb2

from fax_bridge.errors import ExportError
from fax_bridge.tff import types

S = jax.ShapeDtypeStruct
T = federated_language.TensorType
Pair = collections.namedtuple("Pair", ["w", "b"])


@pytest.mark.parametrize(
    "aval, expected",
    [
        (S((3,), jnp.float32), "float32[3]"),
        (S((), jnp.int32), "int32"),
        (jax.core.ShapedArray((2, 4), jnp.bfloat16), "bfloat16[2,4]"),
        (np.zeros((1, 0), np.uint8), "uint8[1,0]"),
        (jnp.ones((2,), jnp.float16), "float16[2]"),
        (np.float64(1.0), "float64"),
        (((5,), np.bool_), "bool[5]"),
        (1.5, "float32"),
        (7, "int32"),
        (True, "bool"),
    ],
)
def test_tensor_type_strings(aval, expected):
    assert str(types.tensor_type(aval)) == expected


@pytest.mark.parametrize(
    "dtype, proto_dtype",
    [
        (jnp.bool_, data_type_pb2.DT_BOOL),
        (jnp.int8, data_type_pb2.DT_INT8),
        (jnp.int16, data_type_pb2.DT_INT16),
        (jnp.int32, data_type_pb2.DT_INT32),
        (jnp.int64, data_type_pb2.DT_INT64),
        (jnp.uint8, data_type_pb2.DT_UINT8),
        (jnp.uint16, data_type_pb2.DT_UINT16),
        (jnp.uint32, data_type_pb2.DT_UINT32),
        (jnp.uint64, data_type_pb2.DT_UINT64),
        (jnp.float16, data_type_pb2.DT_HALF),
        (jnp.bfloat16, data_type_pb2.DT_BFLOAT16),
        (jnp.float32, data_type_pb2.DT_FLOAT),
        (jnp.float64, data_type_pb2.DT_DOUBLE),
        (jnp.complex64, data_type_pb2.DT_COMPLEX64),
        (jnp.complex128, data_type_pb2.DT_COMPLEX128),
    ],
)
def test_every_supported_dtype_maps_to_tensorflow_numbering(dtype, proto_dtype):
    t = types.tensor_type(S((2,), dtype))
    assert types.is_supported_dtype(dtype)
    assert t.to_proto().tensor.dtype == proto_dtype
    assert t.to_proto().tensor.dims == [2]
    assert federated_language.Type.from_proto(t.to_proto()) == t


def test_tensorflow_dtype_numbers():
    assert data_type_pb2.DT_FLOAT == 1 and data_type_pb2.DT_INT32 == 3


@pytest.mark.parametrize(
    "dtype, name",
    [
        (jnp.float8_e4m3fn, "float8_e4m3fn"),
        (jnp.int4, "int4"),
        (jax.dtypes.float0, "float0"),
        (np.str_, "str"),
    ],
)
def test_unsupported_dtypes_raise_export_error(dtype, name):
    assert not types.is_supported_dtype(dtype)
    with pytest.raises(ExportError, match=name) as info:
        types.tensor_type(S((2,), dtype) if dtype is not np.str_ else ((2,), dtype))
    assert "supported dtypes are" in str(info.value)


def test_unsupported_leaf_is_located_by_path():
    with pytest.raises(ExportError, match=r"\['p'\]\[1\]"):
        types.pytree_type({"p": (S((), jnp.float32), S((), jnp.int4))})


def test_non_array_leaf_raises():
    with pytest.raises(ExportError, match="ShapeDtypeStruct"):
        types.tensor_type("hello")


def test_dict_becomes_named_struct_in_sorted_key_order():
    t = types.pytree_type({"b": S((), jnp.int32), "a": S((3,), jnp.float32)})
    assert str(t) == "<a=float32[3],b=int32>"
    assert t.fields() == ["a", "b"]


def test_nested_tuples_lists_namedtuples_and_none():
    tree = {
        "z": [S((2,), jnp.float32), (S((), jnp.int32),)],
        "m": Pair(w=S((2, 2), jnp.float32), b=S((2,), jnp.float32)),
        "n": None,
    }
    t = types.pytree_type(tree)
    assert str(t) == "<m=<w=float32[2,2],b=float32[2]>,n=<>,z=<float32[2],<int32>>>"
    types.check_flatten_order(tree, t)
    assert federated_language.Type.from_proto(t.to_proto()) == t


def test_single_array_is_a_tensor_type():
    assert isinstance(types.pytree_type(S((4,), jnp.float32)), federated_language.TensorType)


def test_ordered_dict_keeps_jax_insertion_order():
    tree = collections.OrderedDict([("y", S((), jnp.float32)), ("x", S((2,), jnp.float32))])
    t = types.pytree_type(tree)
    assert str(t) == "<y=float32,x=float32[2]>"
    types.check_flatten_order(tree, t)


def test_registered_dataclass_becomes_named_struct():
    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Model:
        scale: object
        bias: object

    tree = Model(scale=S((), jnp.float32), bias=S((3,), jnp.float32))
    t = types.pytree_type(tree)
    assert str(t) == "<scale=float32,bias=float32[3]>"
    types.check_flatten_order(tree, t)


@pytest.mark.parametrize(
    "tree, match",
    [
        ({1: S((), jnp.float32)}, "string keys"),
        ({"": S((), jnp.float32)}, "string keys"),
        ({"items": S((), jnp.float32)}, "reserves"),
    ],
)
def test_bad_struct_names_raise(tree, match):
    with pytest.raises(ExportError, match=match):
        types.pytree_type(tree)


def test_leaves_with_paths_is_depth_first():
    tree = {"b": (S((), jnp.int32), S((2,), jnp.float32)), "a": S((1,), jnp.float32)}
    t = types.pytree_type(tree)
    leaves = types.leaves_with_paths(t)
    assert [leaf.index_path for leaf in leaves] == [(0,), (1, 0), (1, 1)]
    assert [leaf.name_path for leaf in leaves] == [("a",), ("b", None), ("b", None)]
    assert [str(leaf.type) for leaf in leaves] == ["float32[1]", "int32", "float32[2]"]


def test_leaves_with_paths_of_a_tensor_and_of_placed_leaves():
    assert types.leaves_with_paths(types.tensor_type(1.0)) == [
        types.TensorLeaf((), (), federated_language.TensorType(np.float32))
    ]
    t = federated_language.StructType(
        [("x", types.federated(S((), jnp.float32), "clients"))]
    )
    (leaf,) = types.leaves_with_paths(t)
    assert isinstance(leaf.type, federated_language.FederatedType)


def test_check_flatten_order_rejects_reordered_struct():
    tree = {"a": S((), jnp.float32), "b": S((), jnp.int32)}
    swapped = federated_language.StructType(
        [("b", T(np.int32)), ("a", T(np.float32))]
    )
    with pytest.raises(ExportError, match="flatten order"):
        types.check_flatten_order(tree, swapped)


def test_check_flatten_order_rejects_wrong_names_and_counts():
    tree = {"a": S((), jnp.float32), "b": S((), jnp.float32)}
    renamed = federated_language.StructType(
        [("b", T(np.float32)), ("a", T(np.float32))]
    )
    with pytest.raises(ExportError, match="element 'b'"):
        types.check_flatten_order(tree, renamed)
    with pytest.raises(ExportError, match="2 leaves"):
        types.check_flatten_order(tree, federated_language.TensorType(np.float32))


def test_check_flatten_order_accepts_unnamed_struct_for_a_dict():
    """An unnamed struct lines up with a dict by position, in jax's order (sorted keys,
    not the dict's insertion order): that order is accepted, the other refused."""
    tree = {"b": S((2,), jnp.float32), "a": S((), jnp.float32)}
    scalar, vector = (federated_language.TensorType(np.float32),
                      federated_language.TensorType(np.float32, [2]))
    assert types.check_flatten_order(tree, federated_language.StructType([scalar, vector])) \
        is None
    with pytest.raises(ExportError, match=r"leaf 0 at \['a'\] is float32 but tensor 0"):
        types.check_flatten_order(tree, federated_language.StructType([vector, scalar]))


def test_federated_types_and_defaults():
    member = {"w": S((3,), jnp.float32)}
    at_clients = types.federated(member, "clients")
    at_server = types.federated(types.tensor_type(1.0), "SERVER")
    assert str(at_clients) == "{<w=float32[3]>}@CLIENTS"
    assert at_clients.all_equal is False
    assert str(at_server) == "float32@SERVER"
    assert at_server.all_equal is True
    equal = types.federated(member, federated_language.CLIENTS, all_equal=True)
    assert str(equal) == "<w=float32[3]>@CLIENTS"
    assert federated_language.Type.from_proto(at_clients.to_proto()) == at_clients


def test_struct_of_placed_values_prints_like_tff():
    t = types.pytree_type(
        {
            "x": types.federated(S((), jnp.float32), "clients"),
            "s": types.federated(S((), jnp.float32), "server"),
        }
    )
    assert str(t) == "<s=float32@SERVER,x={float32}@CLIENTS>"


def test_federated_rejects_bad_placement_and_nesting():
    with pytest.raises(ExportError, match="'server' or 'clients'"):
        types.federated(S((), jnp.float32), "device")
    inner = types.federated(S((), jnp.float32), "clients")
    with pytest.raises(ExportError, match="Place only tensors"):
        types.federated(inner, "server")
