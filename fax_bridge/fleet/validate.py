"""Checks of what devices send back, against the types the coordinator expects.

A device may be buggy, out of date or hostile: a fetched member or an aggregate partial
is compared with its federated_language type (structure, dtypes, known dimensions, limb
counts and byte sizes) before the coordinator uses it, and with `reject_nonfinite` NaN
and infinities are refused too. Each failure is a `FleetError` naming the device, the
client or leaf, what was expected and what arrived.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import federated_language
import numpy as np
from federated_language.common_libs import structure

from fax_bridge.errors import FleetError
from fax_bridge.fleet import wire
from fax_bridge.runtime.aggregation import EXTREMES
from fax_bridge.runtime.exact import NONFINITE_FLAGS
from fax_bridge.v1 import device_pb2 as pb

MAX_LIMBS = 256
MAX_BASE_LIMB = 4096


def leaf_types(type_: federated_language.Type) -> list:
    """The TensorTypes of a local type, depth first (the order of partial leaves)."""
    if isinstance(type_, federated_language.TensorType):
        return [type_]
    if isinstance(type_, federated_language.StructType):
        return [leaf for _, t in type_.items() for leaf in leaf_types(t)]
    raise FleetError(f"a clients member of type {type_} is neither a tensor nor a struct")


def _shape_ok(shape: Sequence[int], type_: federated_language.TensorType) -> bool:
    want = list(type_.shape or ())
    return len(shape) == len(want) and all(w is None or w == g for w, g in zip(want, shape))


def _dtype_name(type_: federated_language.TensorType) -> str:
    return _name_of(type_.dtype)


@functools.lru_cache(maxsize=None)
def _name_of(dtype) -> str:
    return np.dtype(dtype).name


def check_tensor(array: np.ndarray, type_: federated_language.TensorType, where: str,
                 reject_nonfinite: bool) -> None:
    """Raises FleetError unless `array` has `type_`'s dtype and shape (and is finite)."""
    if array.dtype.name != _dtype_name(type_) or not _shape_ok(array.shape, type_):
        raise FleetError(f"{where}: expected {type_}, got {array.dtype.name}"
                         f"{list(array.shape)}; the device sent a value of another type")
    if reject_nonfinite and array.dtype.kind in "fc" and not np.all(np.isfinite(array)):
        raise FleetError(f"{where}: the value holds NaN or infinity "
                         "(reject_nonfinite is set)")


def check_member(member, type_: federated_language.Type, where: str,
                 reject_nonfinite: bool = False) -> None:
    """Raises FleetError unless a fetched member has the structure and tensors of `type_`."""
    if isinstance(type_, federated_language.TensorType):
        if isinstance(member, structure.Struct):
            raise FleetError(f"{where}: expected a tensor {type_}, got a struct")
        check_tensor(np.asarray(member), type_, where, reject_nonfinite)
        return
    if isinstance(type_, federated_language.StructType):
        items = list(type_.items())
        if not isinstance(member, structure.Struct) or len(member) != len(items):
            got = (f"a struct of {len(member)} elements" if isinstance(member, structure.Struct)
                   else "a tensor")
            raise FleetError(f"{where}: expected a struct of {len(items)} elements "
                             f"({type_}), got {got}")
        for i, ((_, t), m) in enumerate(zip(items, member)):
            check_member(m, t, f"{where}[{i}]", reject_nonfinite)
        return
    raise FleetError(f"{where}: cannot check a value of type {type_}")


def _check_sum_leaf(leaf: pb.LeafPartial, type_: federated_language.TensorType, where: str,
                    reject_nonfinite: bool) -> None:
    shape = list(leaf.shape)
    if leaf.dtype != _dtype_name(type_) or not _shape_ok(shape, type_):
        raise FleetError(f"{where}: a partial sum of {leaf.dtype[:20]}{shape[:8]} for a "
                         f"tensor {type_}; the device aggregated a value of another type")
    size = math.prod(shape)
    if not 0 <= leaf.num_limbs <= MAX_LIMBS or abs(leaf.base_limb) > MAX_BASE_LIMB:
        raise FleetError(f"{where}: a partial sum with {leaf.num_limbs} limbs from base "
                         f"{leaf.base_limb}; expected at most {MAX_LIMBS} limbs")
    if np.dtype(type_.dtype).kind in "iu" and leaf.num_limbs != 1:
        raise FleetError(f"{where}: an integer partial sum needs one limb, got "
                         f"{leaf.num_limbs}")
    if len(leaf.limbs) != leaf.num_limbs * size * 8:
        raise FleetError(f"{where}: a partial sum of {leaf.num_limbs} limbs x {size} "
                         f"elements should hold {leaf.num_limbs * size * 8} bytes, holds "
                         f"{len(leaf.limbs)}")
    if len(leaf.nonfinite) not in (0, size):
        raise FleetError(f"{where}: {len(leaf.nonfinite)} non-finite flags for {size} "
                         "elements")
    if reject_nonfinite and (np.frombuffer(leaf.nonfinite, np.uint8)
                             & NONFINITE_FLAGS).any():
        raise FleetError(f"{where}: some clients sent NaN or infinity (reject_nonfinite "
                         "is set)")


def check_partial(answer: pb.AggregateResponse, kind: str, value_types: list,
                  weight_types: list, num_clients: int, where: str,
                  reject_nonfinite: bool = False) -> None:
    """Raises FleetError unless an AggregateResponse fits the aggregated value's type."""
    if answer.num_clients != num_clients:
        raise FleetError(f"{where}: a partial over {answer.num_clients} clients; the "
                         f"device holds {num_clients}")
    if len(answer.leaves) != len(value_types):
        raise FleetError(f"{where}: a partial of {len(answer.leaves)} tensors for a value "
                         f"of {len(value_types)}")
    for i, (leaf, t) in enumerate(zip(answer.leaves, value_types)):
        leaf_where = f"{where}, {kind} leaf {i}"
        if kind in EXTREMES:
            array = wire.decode_tensor(leaf.extreme)
            check_tensor(array, t, leaf_where, reject_nonfinite)
        else:
            _check_sum_leaf(leaf, t, leaf_where, reject_nonfinite)
    want_weights = 1 if kind == "weighted_mean" else 0
    if len(answer.weight_leaves) != want_weights:
        raise FleetError(f"{where}: {len(answer.weight_leaves)} weight partials for a "
                         f"{kind}; expected {want_weights}")
    if want_weights:
        weight_t: Optional[federated_language.TensorType] = (
            weight_types[0] if len(weight_types) == 1 else None)
        if weight_t is None:
            raise FleetError(f"{where}: weighted_mean needs one scalar weight type, got "
                             f"{len(weight_types)} tensors")
        scalar = federated_language.TensorType(weight_t.dtype)  # weights travel as scalars
        _check_sum_leaf(answer.weight_leaves[0], scalar, f"{where}, weight",
                        reject_nonfinite)
