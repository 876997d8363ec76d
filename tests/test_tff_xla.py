"""Tests for fax_bridge.tff.xla: JAX functions as TFF Xla computations, run from the proto.

Every computation built here is read back with federated_language's building blocks
and its HLO module is executed, feeding tensors in parameter-binding order and
reading results by result-binding index, then compared with calling the function.
"""

from __future__ import annotations

import collections

import federated_language
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from federated_language.compiler import building_blocks
from jax._src.lib import xla_client

from fax_bridge.errors import ExportError
from fax_bridge.tff import types, xla

S = jax.ShapeDtypeStruct
Pair = collections.namedtuple("Pair", ["w", "b"])


# --- running an HloModuleProto on jax 0.10.2 (test-only helper) -----------------------

def _run_hlo(hlo_bytes: bytes, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Compiles serialized HLO via StableHLO on the CPU backend; flat inputs → flat outputs."""
    stablehlo = xla_client._xla.mlir.hlo_to_stablehlo(hlo_bytes)
    backend = jax.extend.backend.get_backend("cpu")
    device = backend.local_devices()[0]
    exe = backend.compile_and_load(
        stablehlo, xla_client.DeviceList((device,)), xla_client.CompileOptions()
    )
    buffers = [jax.device_put(np.asarray(x), device) for x in inputs]
    outs = exe.execute_sharded(buffers).disassemble_into_single_device_arrays()
    return [np.asarray(o[0]) for o in outs]


def _assemble(tff_type, b, flat_outputs):
    """Rebuilds a nested list/array value from HLO outputs following a result binding."""
    kind = b.WhichOneof("binding")
    if kind == "tensor":
        return flat_outputs[b.tensor.index]
    return [
        _assemble(element_type, element_binding, flat_outputs)
        for (_, element_type), element_binding in zip(tff_type.items(), b.struct.element)
    ]


def _run_computation(comp, arg=None):
    """Runs an Xla computation proto on a pytree argument; returns nested lists of arrays."""
    block = building_blocks.ComputationBuildingBlock.from_proto(comp)
    fn_type = block.type_signature
    inputs: list[np.ndarray] = []
    if arg is not None:
        leaves = jax.tree_util.tree_leaves(arg)  # jax order == TFF depth-first order
        indices = xla.binding_indices(comp.xla.parameter)
        assert sorted(indices) == list(range(len(leaves)))
        inputs = [None] * len(leaves)
        for leaf, index in zip(leaves, indices):
            inputs[index] = np.asarray(leaf)
    outs = _run_hlo(xla.hlo_module_bytes(comp), inputs)
    return _assemble(fn_type.result, comp.xla.result, outs)


def _expected_nested(tff_type, value):
    """The python result of a function, as nested lists in TFF element order."""
    if isinstance(tff_type, federated_language.StructType):
        children = [c for _, c in jax.tree_util.tree_flatten_with_path(
            value, is_leaf=lambda x: x is not value)[0]]
        return [_expected_nested(t, c) for (_, t), c in zip(tff_type.items(), children)]
    return np.asarray(value)


def _assert_runs_like(comp, fn, arg=None):
    block = building_blocks.ComputationBuildingBlock.from_proto(comp)
    got = _run_computation(comp, arg)
    want = _expected_nested(block.type_signature.result, fn(arg) if arg is not None else fn())
    flat_got, flat_want = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    assert len(flat_got) == len(flat_want)
    for g, w in zip(flat_got, flat_want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-6)


def _signature(comp) -> str:
    return str(building_blocks.ComputationBuildingBlock.from_proto(comp).type_signature)


# --- tests ----------------------------------------------------------------------------

def _nested_fn(x):
    # Same-shaped leaves with distinct coefficients: any binding mix-up changes results.
    a, (b, c) = x["a"], x["b"]
    return {
        "total": a - 2.0 * b + 3.0 * c + x["n"]["k"].astype(jnp.float32),
        "parts": (a * c, x["n"]["k"] + 1),
    }


NESTED_AVALS = {
    "b": (S((2,), jnp.float32), S((2,), jnp.float32)),
    "a": S((2,), jnp.float32),
    "n": {"k": S((2,), jnp.int32)},
}
NESTED_VALUE = {
    "b": (np.array([1.0, 2.0], np.float32), np.array([10.0, 20.0], np.float32)),
    "a": np.array([100.0, 200.0], np.float32),
    "n": {"k": np.array([5, 7], np.int32)},
}


def test_nested_dict_tuple_signature_and_proto_fields():
    comp = xla.xla_computation(_nested_fn, NESTED_AVALS)
    assert _signature(comp) == (
        "(<a=float32[2],b=<float32[2],float32[2]>,n=<k=int32[2]>> -> "
        "<parts=<float32[2],int32[2]>,total=float32[2]>)"
    )
    assert comp.WhichOneof("computation") == "xla"
    assert comp.xla.hlo_module.type_url == "type.googleapis.com/xla.HloModuleProto"
    assert xla.binding_indices(comp.xla.parameter) == [0, 1, 2, 3]
    assert xla.binding_indices(comp.xla.result) == [0, 1, 2]
    # The binding nests exactly like the type.
    p = comp.xla.parameter
    assert [e.WhichOneof("binding") for e in p.struct.element] == ["tensor", "struct", "struct"]
    assert p.struct.element[1].struct.element[1].tensor.index == 2
    assert p.struct.element[2].struct.element[0].tensor.index == 3


def test_nested_dict_tuple_executes_with_binding_order():
    comp = xla.xla_computation(_nested_fn, NESTED_AVALS)
    _assert_runs_like(comp, _nested_fn, NESTED_VALUE)


def test_hlo_entry_parameters_follow_flatten_order():
    comp = xla.xla_computation(_nested_fn, NESTED_AVALS)
    hlo = xla_client.XlaComputation(xla.hlo_module_bytes(comp))
    params = hlo.program_shape().parameter_shapes()
    assert [str(p) for p in params] == ["f32[2]{0}"] * 3 + ["s32[2]{0}"]
    text = hlo.as_hlo_text()
    # jax names each HLO parameter after its argument path (x['b'][1] -> x__b___1_).
    numbered = {}
    for line in text.splitlines():
        if "parameter(" in line and line.strip().startswith("x_"):
            name = line.split("=")[0].strip().rsplit(".", 1)[0]
            numbered[int(line.split("parameter(")[1].split(")")[0])] = name
    assert [numbered[i] for i in range(4)] == ["x__a__", "x__b___0_", "x__b___1_", "x__n____k__"]


def test_unused_arguments_keep_their_parameters():
    avals = {"used": S((3,), jnp.float32), "unused": S((2,), jnp.int32)}
    fn = lambda x: x["used"] * 2.0
    comp = xla.xla_computation(fn, avals)
    assert _signature(comp) == "(<unused=int32[2],used=float32[3]> -> float32[3])"
    value = {"used": np.arange(3, dtype=np.float32), "unused": np.array([4, 5], np.int32)}
    _assert_runs_like(comp, fn, value)


@pytest.mark.parametrize("size", [3, 256, 4096])
def test_arrays_the_function_closes_over_are_in_the_module(size):
    """A closed-over array, however large, is a constant of the module, never one more
    parameter (jax 0.12 passes those over 1 KiB to a jitted function as arguments)."""
    table = np.arange(size, dtype=np.float32)
    fn = lambda x: x + jnp.asarray(table)  # noqa: E731
    comp = xla.xla_computation(fn, S((size,), jnp.float32))
    assert _signature(comp) == f"(float32[{size}] -> float32[{size}])"
    _assert_runs_like(comp, fn, np.full(size, 0.5, np.float32))


def test_zero_argument_constant():
    fn = lambda: {"c": jnp.arange(4, dtype=jnp.float32) * 0.5, "n": jnp.int32(3)}
    comp = xla.xla_computation(fn)
    assert _signature(comp) == "( -> <c=float32[4],n=int32>)"
    assert not comp.xla.HasField("parameter")
    assert not comp.type.function.HasField("parameter")
    _assert_runs_like(comp, fn)


def test_scalar_result_and_scalar_argument():
    fn = lambda x: x * x + 1.0
    comp = xla.xla_computation(fn, S((), jnp.float32))
    assert _signature(comp) == "(float32 -> float32)"
    assert comp.xla.parameter.WhichOneof("binding") == "tensor"
    assert comp.xla.result.tensor.index == 0
    _assert_runs_like(comp, fn, np.float32(3.0))


def test_single_tensor_in_a_struct_result():
    fn = lambda x: (x["v"] + 1,)
    comp = xla.xla_computation(fn, {"v": S((2,), jnp.int32)})
    assert _signature(comp) == "(<v=int32[2]> -> <int32[2]>)"
    assert comp.xla.result.WhichOneof("binding") == "struct"
    _assert_runs_like(comp, fn, {"v": np.array([1, 2], np.int32)})


def test_several_positional_arguments_via_a_tuple():
    def f(w, x, y):
        return w @ x - y

    avals = (S((2, 3), jnp.float32), S((3,), jnp.float32), S((2,), jnp.float32))
    comp = xla.xla_computation(lambda args: f(*args), avals)
    assert _signature(comp) == "(<float32[2,3],float32[3],float32[2]> -> float32[2])"
    value = (
        np.arange(6, dtype=np.float32).reshape(2, 3),
        np.ones(3, np.float32),
        np.array([1.0, -1.0], np.float32),
    )
    _assert_runs_like(comp, lambda args: f(*args), value)


def test_namedtuple_argument_and_mixed_dtypes():
    fn = lambda p: {"y": jnp.where(p.b, p.w, -p.w), "count": jnp.sum(p.b.astype(jnp.int32))}
    comp = xla.xla_computation(fn, Pair(w=S((3,), jnp.float32), b=S((3,), jnp.bool_)))
    assert _signature(comp) == "(<w=float32[3],b=bool[3]> -> <count=int32,y=float32[3]>)"
    value = Pair(w=np.array([1.0, 2.0, 3.0], np.float32), b=np.array([True, False, True]))
    _assert_runs_like(comp, fn, value)


def test_closed_jaxpr_with_flat_invars():
    def f(x, y):
        return x * 2.0 - y, jnp.sum(y)

    cj = jax.make_jaxpr(f)(jnp.ones(3), jnp.ones(3))
    assert isinstance(cj, jax.extend.core.ClosedJaxpr)
    avals = {"x": S((3,), jnp.float32), "y": S((3,), jnp.float32)}
    comp = xla.xla_computation(cj, avals)
    assert _signature(comp) == "(<x=float32[3],y=float32[3]> -> <float32[3],float32>)"
    value = {
        "x": np.array([1.0, 2.0, 3.0], np.float32),
        "y": np.array([0.5, 0.0, -1.0], np.float32),
    }
    _assert_runs_like(comp, lambda v: f(v["x"], v["y"]), value)


def test_closed_jaxpr_single_output_and_result_type_override():
    cj = jax.make_jaxpr(lambda x: x + 1.0)(jnp.ones(2))
    plain = xla.xla_computation(cj, (S((2,), jnp.float32),))
    assert _signature(plain) == "(<float32[2]> -> float32[2])"
    named = types.pytree_type({"out": S((2,), jnp.float32)})
    comp = xla.xla_computation(cj, (S((2,), jnp.float32),), result_type=named)
    assert _signature(comp) == "(<float32[2]> -> <out=float32[2]>)"
    value = (np.array([1.0, 5.0], np.float32),)
    _assert_runs_like(comp, lambda args: {"out": args[0] + 1.0}, value)


def test_closed_jaxpr_arity_mismatch():
    cj = jax.make_jaxpr(lambda x, y: x + y)(1.0, 2.0)
    with pytest.raises(ExportError, match="one aval per jaxpr invar"):
        xla.xla_computation(cj, (S((), jnp.float32),))


def test_parameter_type_override_is_checked():
    avals = {"a": S((), jnp.float32), "b": S((), jnp.int32)}
    swapped = federated_language.StructType(
        [
            ("b", federated_language.TensorType(np.int32)),
            ("a", federated_language.TensorType(np.float32)),
        ]
    )
    with pytest.raises(ExportError, match="flatten order"):
        xla.xla_computation(lambda x: x["a"], avals, parameter_type=swapped)
    unnamed = federated_language.StructType(
        [federated_language.TensorType(np.float32), federated_language.TensorType(np.int32)]
    )
    comp = xla.xla_computation(lambda x: x["a"], avals, parameter_type=unnamed)
    assert _signature(comp) == "(<float32,int32> -> float32)"


def test_parameter_type_without_argument_is_rejected():
    with pytest.raises(ExportError, match="without argument"):
        xla.xla_computation(lambda: 1.0, parameter_type=federated_language.TensorType(np.float32))


def test_64_bit_types_without_x64_are_reported():
    with pytest.raises(ExportError, match="jax_enable_x64"):
        xla.xla_computation(lambda x: x, S((2,), jnp.float64))


def test_bfloat16_round_trips():
    fn = lambda x: x * 2
    comp = xla.xla_computation(fn, S((2,), jnp.bfloat16))
    assert _signature(comp) == "(bfloat16[2] -> bfloat16[2])"
    _assert_runs_like(comp, fn, np.array([1.5, -3.0], jnp.bfloat16))


def test_unsupported_dtypes_are_export_errors():
    with pytest.raises(ExportError, match="float8_e4m3fn"):
        xla.xla_computation(lambda x: x, S((2,), jnp.float8_e4m3fn))
    with pytest.raises(ExportError, match="int4"):
        xla.xla_computation(lambda x: x.astype(jnp.int4), S((2,), jnp.int32))


def test_non_array_results_and_failing_functions():
    with pytest.raises(ExportError, match="lowering"):
        xla.xla_computation(lambda x: x @ x, S((2, 3), jnp.float32))
    with pytest.raises(ExportError, match="callable"):
        xla.xla_computation(42, S((), jnp.float32))


def test_proto_bytes_round_trip():
    comp = xla.xla_computation(_nested_fn, NESTED_AVALS)
    again = type(comp).FromString(comp.SerializeToString())
    assert again == comp
    _assert_runs_like(again, _nested_fn, NESTED_VALUE)


def test_binding_rejects_placed_types():
    with pytest.raises(ExportError, match="tensors and structs"):
        xla.binding(types.federated(S((), jnp.float32), "clients"))


# --- literals -------------------------------------------------------------------------

@pytest.mark.parametrize(
    "value, type_str",
    [
        (1.5, "float32"),
        (3, "int32"),
        (True, "bool"),
        (np.float64(2.5), "float64"),
        (np.int64(-4), "int64"),
        (jnp.float32(0.25), "float32"),
        (np.array(1.0, jnp.bfloat16), "bfloat16"),
    ],
)
def test_scalar_constants_become_literals(value, type_str):
    comp = xla.literal_or_none(value)
    assert comp is not None and comp.WhichOneof("computation") == "literal"
    block = building_blocks.ComputationBuildingBlock.from_proto(comp)
    assert isinstance(block, building_blocks.Literal)
    assert str(block.type_signature) == type_str
    expected = np.asarray(value)
    np.testing.assert_array_equal(np.asarray(block.value, dtype=expected.dtype), expected)


def test_literal_proto_layout():
    comp = xla.literal_or_none(np.float32(1.5))
    assert comp.type.tensor.dtype == 1
    assert list(comp.literal.value.float32_list.value) == [1.5]
    assert comp.literal.value.shape.dim == []


def test_arrays_and_non_constants_are_not_literals():
    assert xla.literal_or_none(np.ones(3, np.float32)) is None
    small = xla.literal_or_none(np.ones(3, np.float32), max_elements=3)
    small_block = building_blocks.ComputationBuildingBlock.from_proto(small)
    assert str(small_block.type_signature) == "float32[3]"
    assert xla.literal_or_none("text") is None
    assert xla.literal_or_none(np.zeros((), jnp.float8_e4m3fn)) is None
    assert xla.literal_or_none(2 ** 40) is None
    seen = []

    @jax.jit
    def traced(x):
        seen.append(xla.literal_or_none(x))
        return x

    traced(1.0)
    assert seen == [None]


def test_64_bit_types_with_x64_enabled():
    fn = lambda x: {"d": x["d"] * 2.0, "i": x["i"] - 1}
    avals = {"d": S((2,), jnp.float64), "i": S((), jnp.int64)}
    with jax.enable_x64(True):
        comp = xla.xla_computation(fn, avals)
        assert _signature(comp) == "(<d=float64[2],i=int64> -> <d=float64[2],i=int64>)"
        _assert_runs_like(comp, fn, {"d": np.array([0.1, 0.2]), "i": np.int64(2**40)})


def test_execution_detects_a_wrong_binding():
    comp = xla.xla_computation(_nested_fn, NESTED_AVALS)
    broken = type(comp).FromString(comp.SerializeToString())
    b_struct = broken.xla.parameter.struct.element[1].struct
    b_struct.element[0].tensor.index, b_struct.element[1].tensor.index = 2, 1
    with pytest.raises(AssertionError):
        _assert_runs_like(broken, _nested_fn, NESTED_VALUE)


def test_exports_are_byte_identical_across_calls():
    import jax.numpy as jnp
    from fax_bridge.tff.xla import xla_computation

    def double(x):
        return x * 2.0

    spec = jax.ShapeDtypeStruct((3,), jnp.float32)
    a = xla_computation(double, spec).SerializeToString()
    b = xla_computation(double, spec).SerializeToString()
    assert a == b  # no per-process module counter in the bytes
