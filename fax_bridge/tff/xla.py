"""Local computations as TFF `Xla` protos: a JAX function lowered to an HloModuleProto.

Argument convention of `xla_computation`:

* `fn` is a callable of ONE argument, the pytree `arg_avals` (a dict, tuple, single
  array...), and returns a pytree of arrays.  With `arg_avals=None` it takes no
  argument at all and the computation has no parameter (`( -> T)`); constants are
  such computations.  A function of several positional arguments is lowered by
  passing `lambda args: f(*args)` with a tuple of avals; its parameter is then an
  unnamed struct.
* `fn` may instead be a `jax.extend.core.ClosedJaxpr`.  Its invars take the leaves of
  `arg_avals` in jax's flatten order; its outvars form the result: the single tensor
  when there is one outvar, otherwise an unnamed struct of them (pass `result_type`
  for any other grouping of the same tensors).

Binding convention (TFF's): the tensors of the parameter type are numbered 0, 1, ...
depth-first and tensor `i` is HLO entry parameter `i`; the result's tensors, numbered
the same way, are the elements of the HLO result tuple in order (a single-tensor
result is the HLO result itself).  Depth-first over our TFF types is jax's flatten
order, which is the order jax gives the HLO parameters and results; both are checked
against the HLO module's entry signature.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import federated_language
import jax
import jax.extend.core
import numpy as np
from federated_language.proto import computation_pb2
from google.protobuf import any_pb2

from fax_bridge.errors import ExportError
from fax_bridge.language import jax_compat
from fax_bridge.runtime.hlo import HLO_MODULE_TYPE_URL, custom_calls
from fax_bridge.runtime import grammar
from fax_bridge.tff import types as tff_types

__all__ = [
    "HLO_MODULE_TYPE_URL",
    "binding",
    "binding_indices",
    "hlo_module_bytes",
    "literal_or_none",
    "typed_xla_computation",
    "xla_computation",
]

LocalFn = Union[Callable[..., Any], jax.extend.core.ClosedJaxpr]


_HLO_MODULE_ID_FIELD = 5  # HloModuleProto.id: a per-process counter, not content


def without_module_id(module: bytes) -> bytes:
    """The serialized HloModuleProto with its top-level `id` field dropped.

    jax numbers modules with a process-wide counter; without it the same program always
    exports to the same bytes (stable content hashes and caches). Works on the protobuf
    wire format directly: field 5 is a varint at the top level of the message.
    """
    out = bytearray()
    pos, n = 0, len(module)

    def varint(at: int) -> tuple[int, int]:
        value, shift = 0, 0
        while True:
            b = module[at]
            value |= (b & 0x7F) << shift
            at += 1
            if not b & 0x80:
                return value, at
            shift += 7

    while pos < n:
        start = pos
        key, pos = varint(pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = varint(pos)
        elif wire == 1:
            pos += 8
        elif wire == 2:
            length, pos = varint(pos)
            pos += length
        elif wire == 5:
            pos += 4
        else:
            return module  # groups are not used by HloModuleProto; leave it untouched
        if not (field == _HLO_MODULE_ID_FIELD and wire == 0):
            out += module[start:pos]
    return bytes(out)


def binding(tff_type: federated_language.Type, start: int = 0) -> computation_pb2.Xla.Binding:
    """The `Xla.Binding` numbering the tensors of `tff_type` depth-first from `start`."""
    counter = [start]

    def build(t: federated_language.Type) -> computation_pb2.Xla.Binding:
        if isinstance(t, federated_language.StructType):
            return computation_pb2.Xla.Binding(
                struct=computation_pb2.Xla.StructBinding(
                    element=[build(element) for _, element in t.items()]
                )
            )
        if isinstance(t, federated_language.TensorType):
            index = counter[0]
            counter[0] += 1
            return computation_pb2.Xla.Binding(
                tensor=computation_pb2.Xla.TensorBinding(index=index)
            )
        raise ExportError(
            f"an Xla computation can only take and return tensors and structs of "
            f"tensors, not {t}; keep placed and functional values outside local "
            "computations."
        )

    return build(tff_type)


def binding_indices(b: computation_pb2.Xla.Binding) -> list[int]:
    """The tensor indices of a binding, depth-first (what `binding` numbered 0, 1, ...)."""
    kind = b.WhichOneof("binding")
    if kind == "tensor":
        return [b.tensor.index]
    if kind == "struct":
        return [i for element in b.struct.element for i in binding_indices(element)]
    return []


def hlo_module_bytes(comp: computation_pb2.Computation) -> bytes:
    """The serialized HloModuleProto inside an Xla computation proto."""
    if grammar.which(comp) != "xla":
        raise ExportError(
            f"expected an Xla computation, found a {comp.WhichOneof('computation')!r} one."
        )
    if comp.xla.hlo_module.type_url != HLO_MODULE_TYPE_URL:
        raise ExportError(
            f"the Xla computation's hlo_module has type URL "
            f"{comp.xla.hlo_module.type_url!r}; expected {HLO_MODULE_TYPE_URL!r}."
        )
    return comp.xla.hlo_module.value


def _spec(leaf: Any, where: str) -> jax.ShapeDtypeStruct:
    t = tff_types.tensor_type(leaf, where=where)
    return jax.ShapeDtypeStruct(tuple(t.shape), t.dtype)


def _specs(arg_avals: Any) -> Any:
    flat, treedef = jax.tree_util.tree_flatten_with_path(arg_avals)
    leaves = [_spec(leaf, f" at argument{jax.tree_util.keystr(path)}") for path, leaf in flat]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _as_callable(fn: LocalFn) -> Callable[..., Any]:
    if isinstance(fn, jax.extend.core.ClosedJaxpr):
        run = jax.extend.core.jaxpr_as_fun(fn)
        n_in = len(fn.in_avals)

        def call(*maybe_arg: Any) -> Any:
            leaves = jax.tree_util.tree_leaves(maybe_arg[0]) if maybe_arg else []
            if len(leaves) != n_in:
                raise ExportError(
                    f"the jaxpr takes {n_in} inputs but the argument avals have "
                    f"{len(leaves)} leaves; pass one aval per jaxpr invar."
                )
            outs = run(*leaves)
            return outs[0] if len(outs) == 1 else tuple(outs)

        return call
    if not callable(fn):
        raise ExportError(
            f"xla_computation needs a callable or a ClosedJaxpr, got {type(fn).__name__}."
        )
    return fn


def _shape_leaves(shape: Any) -> list[Any]:
    if shape.is_tuple():
        return [s for sub in shape.tuple_shapes() for s in _shape_leaves(sub)]
    return [shape]


def _check_against_hlo(
    what: str,
    hlo_shapes: list[Any],
    tff_type: federated_language.Type,
) -> None:
    """Tensor `i` of `tff_type` (depth-first) must have HLO shape `hlo_shapes[i]`."""
    tensors = tff_types.leaves_with_paths(tff_type)
    if len(tensors) != len(hlo_shapes):
        raise ExportError(
            f"the HLO module has {len(hlo_shapes)} {what} tensors but the TFF type "
            f"{tff_type} has {len(tensors)}; functions with ordered side effects "
            "(e.g. jax.debug.print with ordered=True) add token values and cannot be "
            "exported."
        )
    for i, (leaf, shape) in enumerate(zip(tensors, hlo_shapes)):
        t = leaf.type
        same = (
            shape.is_array()
            and tuple(shape.dimensions()) == tuple(t.shape)
            and np.dtype(shape.numpy_dtype()) == t.dtype
        )
        if not same:
            raise ExportError(
                f"HLO {what} {i} is {shape} but tensor {i} of the TFF type {tff_type} is "
                f"{t}. If the TFF type has 64-bit dtypes, enable jax_enable_x64 "
                "(jax otherwise lowers them as 32-bit) or cast the values to 32 bits."
            )


def _refuse_custom_calls(lowered) -> None:
    """ExportError naming each custom call (native code outside the HLO) and its line."""
    try:
        calls = custom_calls(lowered.compiler_ir("stablehlo"))
    except Exception as e:  # reading the lowered module must not mask the real problem
        raise ExportError(f"cannot inspect the lowered local computation: {e}") from e
    if calls:
        listed = "; ".join(str(c) for c in calls)
        raise ExportError(
            f"the local computation lowers to {len(calls)} custom call(s): {listed}. A custom "
            "call is native code outside the HLO (LAPACK kernels behind jnp.linalg "
            "decompositions and solves, python callbacks behind jax.debug.print and "
            "pure_callback); devices refuse them, so they cannot be exported. Remove the "
            "operation from the federated function (e.g. solve with an iterative method "
            "written in jnp, drop debug prints)."
        )


def xla_computation(
    fn: LocalFn,
    arg_avals: Any = None,
    *,
    parameter_type: Optional[federated_language.Type] = None,
    result_type: Optional[federated_language.Type] = None,
) -> computation_pb2.Computation:
    """Lowers `fn` to HLO and wraps it as a TFF `Computation` with an `xla` body.

    See the module docstring for the argument and binding conventions.  Leaves of
    `arg_avals` are anything `types.tensor_type` accepts (ShapeDtypeStructs, avals,
    arrays).  `parameter_type` / `result_type` override the types derived from the
    pytrees; their tensors, depth-first, must match the pytrees' leaves in jax's
    flatten order, else `ExportError`.
    """
    has_arg = arg_avals is not None
    if not has_arg and parameter_type is not None:
        raise ExportError(
            "parameter_type was given for a computation without argument; pass the "
            "argument avals too, or drop parameter_type."
        )
    call = _as_callable(fn)
    if has_arg:
        specs = _specs(arg_avals)
        if parameter_type is None:
            parameter_type = tff_types.pytree_type(specs)
        else:
            tff_types.check_flatten_order(specs, parameter_type)
        lower_args: tuple = (specs,)
    else:
        lower_args = ()

    try:
        lowered = jax_compat.lower_embedded(jax.jit(call, keep_unused=True), *lower_args)
    except ExportError:
        raise
    except Exception as e:
        raise ExportError(
            f"lowering the local computation to HLO failed: {type(e).__name__}: {e}"
        ) from e

    _refuse_custom_calls(lowered)
    out_info = lowered.out_info
    try:
        out_specs = jax.tree_util.tree_map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), out_info
        )
    except AttributeError as e:
        raise ExportError("the local computation must return a pytree of arrays.") from e
    if result_type is None:
        result_type = tff_types.pytree_type(out_specs)
    else:
        tff_types.check_flatten_order(out_specs, result_type)

    hlo = lowered.compiler_ir("hlo")
    program_shape = hlo.program_shape()
    if parameter_type is not None:
        _check_against_hlo("parameter", list(program_shape.parameter_shapes()), parameter_type)
    elif program_shape.parameter_shapes():
        raise ExportError(
            "the HLO module of a computation without argument has parameters; this "
            "happens with ordered side effects, which cannot be exported."
        )
    _check_against_hlo("result", _shape_leaves(program_shape.result_shape()), result_type)

    xla_pb = computation_pb2.Xla(
        hlo_module=any_pb2.Any(
            type_url=HLO_MODULE_TYPE_URL,
            value=without_module_id(hlo.as_serialized_hlo_module_proto()),
        ),
        result=binding(result_type),
    )
    if parameter_type is not None:
        xla_pb.parameter.CopyFrom(binding(parameter_type))
    function_type = federated_language.FunctionType(parameter_type, result_type)
    return computation_pb2.Computation(type=function_type.to_proto(), xla=xla_pb)


def typed_xla_computation(fn: Callable[..., Any],
                          parameter_type: Optional[Any] = None) -> computation_pb2.Computation:
    """`xla_computation` for a function written against a TFF parameter type.

    `fn` takes one positional argument per element of a struct `parameter_type` (the
    value itself for any other type, nothing without one); nested named structs arrive
    as dicts in the type's element order, unnamed ones as tuples. The binding is
    depth-first over the type whatever its element names, and the result type follows
    jax's pytree order (dicts as named structs with sorted keys).
    """
    if parameter_type is None:
        return xla_computation(fn)
    parameter_type = federated_language.to_type(parameter_type)
    top_struct = isinstance(parameter_type, federated_language.StructType)

    def call(tree: Any) -> Any:
        arg = _as_named(tree, parameter_type)
        return fn(*arg.values()) if top_struct and isinstance(arg, dict) else (
            fn(*arg) if top_struct else fn(arg))

    return xla_computation(call, _positional_specs(parameter_type),
                           parameter_type=parameter_type)


def _positional_specs(type_: federated_language.Type) -> Any:
    """Avals of a TFF type as nested tuples, so jax's order is the type's depth-first one."""
    if isinstance(type_, federated_language.StructType):
        return tuple(_positional_specs(t) for _, t in type_.items())
    if isinstance(type_, federated_language.TensorType):
        return jax.ShapeDtypeStruct(tuple(type_.shape or ()), type_.dtype)
    raise ExportError(f"an Xla parameter holds tensors and structs only, not {type_}")


def _as_named(tree: Any, type_: federated_language.Type) -> Any:
    if not isinstance(type_, federated_language.StructType):
        return tree
    items = list(type_.items())
    children = [_as_named(v, t) for v, (_, t) in zip(tree, items)]
    if items and all(n for n, _ in items):
        return {n: c for (n, _), c in zip(items, children)}
    return tuple(children)


def literal_or_none(value: Any, *, max_elements: int = 1) -> Optional[computation_pb2.Computation]:
    """A TFF `Literal` computation for a small concrete constant, else None.

    A constant becomes a Literal when it is concrete (not a tracer), of a dtype TFF
    can hold and has at most `max_elements` elements (by default: scalars).  For
    anything else this returns None and the constant belongs inside an HLO module.
    Python scalars are typed as jax types them (float32, int32, bool).
    """
    if isinstance(value, jax.core.Tracer):
        return None
    if isinstance(value, (np.ndarray, np.generic, jax.Array)):
        value = np.asarray(value)
    elif isinstance(value, (bool, int, float, complex)):
        try:
            value = np.asarray(jax.numpy.asarray(value))
        except (OverflowError, TypeError):
            return None
    else:
        return None
    if not tff_types.is_supported_dtype(value.dtype) or value.size > max_elements:
        return None
    tensor = federated_language.TensorType(value.dtype, value.shape)
    return federated_language.framework.Literal(value, tensor).to_proto()
