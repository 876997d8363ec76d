"""Builds `Xla` local computations from JAX functions, with TFF's binding convention.

`xla_computation(fn, parameter_type)` lowers `fn` with `jax.jit(..., keep_unused=True)`
and wraps the serialized HloModuleProto in a `Computation` whose bindings map the
depth-first tensor order of the TFF types onto jax's flatten order. Used to write runtime
tests and small server-side computations; the exporter has its own path for programs.

Calling convention: a struct parameter is passed as one positional argument per element;
nested named structs become dicts, unnamed ones tuples. Results follow jax's pytree
order: dicts become named structs with sorted keys, tuples/lists unnamed structs.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import federated_language
import jax
import numpy as np
from federated_language.proto import computation_pb2

_HLO_TYPE_URL = "type.googleapis.com/xla.HloModuleProto"


def _specs(type_: federated_language.Type, counter: list[int]):
    """jax arguments for a TFF type, and the same tree with leaves = depth-first index."""
    if isinstance(type_, federated_language.TensorType):
        index = counter[0]
        counter[0] += 1
        return jax.ShapeDtypeStruct(tuple(type_.shape or ()), type_.dtype), index
    if isinstance(type_, federated_language.StructType):
        items = list(type_.items())
        pairs = [_specs(t, counter) for _, t in items]
        if items and all(n for n, _ in items):
            names = [n for n, _ in items]
            return ({n: s for n, (s, _) in zip(names, pairs)},
                    {n: i for n, (_, i) in zip(names, pairs)})
        return tuple(s for s, _ in pairs), tuple(i for _, i in pairs)
    raise TypeError(f"an Xla parameter holds tensors and structs only, not {type_}")


def _binding_from_tree(tree) -> computation_pb2.Xla.Binding:
    """Binding mirroring a tree of ints (tensor indices); dicts keep insertion order."""
    if isinstance(tree, int):
        return computation_pb2.Xla.Binding(
            tensor=computation_pb2.Xla.TensorBinding(index=tree))
    values = tree.values() if isinstance(tree, dict) else tree
    return computation_pb2.Xla.Binding(struct=computation_pb2.Xla.StructBinding(
        element=[_binding_from_tree(v) for v in values]))


def _relabel(tree, mapping: dict[int, int]):
    """The same tree of ints (insertion order kept), each leaf replaced by mapping[leaf]."""
    if isinstance(tree, int):
        return mapping[tree]
    if isinstance(tree, dict):
        return {k: _relabel(v, mapping) for k, v in tree.items()}
    return tuple(_relabel(v, mapping) for v in tree)


def _result_type(tree) -> federated_language.Type:
    if isinstance(tree, dict):
        return federated_language.StructType(
            [(k, _result_type(tree[k])) for k in sorted(tree)])
    if isinstance(tree, (tuple, list)):
        return federated_language.StructType([(None, _result_type(v)) for v in tree])
    return federated_language.TensorType(np.dtype(tree.dtype), tuple(tree.shape))


def _result_indices(tree, counter: list[int]):
    if isinstance(tree, dict):
        return {k: _result_indices(tree[k], counter) for k in sorted(tree)}
    if isinstance(tree, (tuple, list)):
        return tuple(_result_indices(v, counter) for v in tree)
    counter[0] += 1
    return counter[0] - 1


def xla_computation(
        fn: Callable[..., Any], parameter_type: Optional[Any] = None
) -> computation_pb2.Computation:
    """Lowers `fn` to an `Xla` Computation proto taking `parameter_type` (or nothing)."""
    if parameter_type is None:
        args, tff_index_tree = (), ()
    else:
        parameter_type = federated_language.to_type(parameter_type)
        specs, index_tree = _specs(parameter_type, [0])
        if isinstance(parameter_type, federated_language.StructType):
            args = tuple(specs.values()) if isinstance(specs, dict) else specs
            tff_index_tree = (tuple(index_tree.values()) if isinstance(index_tree, dict)
                              else index_tree)
        else:
            args, tff_index_tree = (specs,), (index_tree,)
    lowered = jax.jit(fn, keep_unused=True).lower(*args)
    hlo = lowered.compiler_ir("hlo").as_serialized_hlo_module_proto()
    out_tree = jax.eval_shape(fn, *args)
    # HLO parameter p holds the TFF tensor numbered hlo_order[p].
    hlo_order = jax.tree_util.tree_leaves(tff_index_tree)
    tff_to_hlo = {tff: p for p, tff in enumerate(hlo_order)}
    xla = computation_pb2.Xla(result=_binding_from_tree(_result_indices(out_tree, [0])))
    xla.hlo_module.type_url = _HLO_TYPE_URL
    xla.hlo_module.value = hlo
    if parameter_type is not None:
        xla.parameter.CopyFrom(_binding_from_tree(_relabel(index_tree, tff_to_hlo)))
    fn_type = federated_language.FunctionType(parameter_type, _result_type(out_tree))
    return computation_pb2.Computation(type=fn_type.to_proto(), xla=xla)
