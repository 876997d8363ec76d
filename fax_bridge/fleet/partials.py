"""Partial aggregates on the wire: `runtime.aggregation.Partial` as an AggregateResponse.

Devices build partials over their own clients with `runtime.aggregation.partial_of` and
send them with `to_message`; the coordinator reads them with `from_message` (after
`validate.check_partial`) and merges them in client order. Exact sums travel as their
integer limbs, or as float64 values where those hold them exactly (`doubles`), so
nothing is rounded before the coordinator finishes the aggregate.
"""

from __future__ import annotations

import math

import numpy as np

from fax_bridge.fleet import wire
from fax_bridge.runtime.aggregation import EXTREMES, Partial
from fax_bridge.runtime.double_sums import DoubleSum
from fax_bridge.runtime.exact import ExactSum
from fax_bridge.v1 import device_pb2 as pb

KIND_TO_ENUM = {
    "sum": pb.SUM,
    "mean": pb.MEAN,
    "weighted_mean": pb.WEIGHTED_MEAN,
    "min": pb.MIN,
    "max": pb.MAX,
    "secure_sum_bitwidth": pb.SECURE_SUM_BITWIDTH,
    "secure_sum": pb.SECURE_SUM,
}
ENUM_TO_KIND = {v: k for k, v in KIND_TO_ENUM.items()}


# ---------------------------------------------------------------------------------------
# Wire form


def _leaf_message(leaf, out: pb.LeafPartial) -> None:
    if isinstance(leaf, DoubleSum):
        out.dtype = leaf.dtype.name
        out.shape.extend(leaf.shape)
        out.doubles = np.ascontiguousarray(leaf.values, "<f8").tobytes()
    elif isinstance(leaf, ExactSum):
        base, limbs, flags = leaf.to_limbs()
        out.dtype = leaf.dtype.name
        out.shape.extend(leaf.shape)
        out.base_limb = base
        out.num_limbs = limbs.shape[0]
        out.limbs = np.ascontiguousarray(limbs, "<i8").tobytes()
        if flags is not None:
            out.nonfinite = flags.tobytes()
    else:
        wire.encode_tensor(leaf, out.extreme)


def _leaf_from_message(kind: str, message: pb.LeafPartial):
    if kind in EXTREMES:
        return np.array(wire.decode_tensor(message.extreme))
    dtype = wire.dtype_from_name(message.dtype)
    shape = tuple(message.shape)
    doubles = message.doubles  # read once: each read copies the bytes
    if doubles:
        return DoubleSum(dtype, shape, np.frombuffer(doubles, "<f8").copy())
    size = math.prod(shape)
    # Explicit sizes: an all-zero sum has no limbs, and (0, -1) is no valid shape.
    limbs = np.frombuffer(message.limbs, "<i8").reshape((message.num_limbs, size))
    flags = np.frombuffer(message.nonfinite, np.uint8) if message.nonfinite else None
    return ExactSum.from_limbs(dtype, shape, message.base_limb, limbs, flags)


def to_message(partial: Partial) -> pb.AggregateResponse:
    """The partial as an `AggregateResponse`."""
    out = pb.AggregateResponse(num_clients=partial.count)
    for leaf in partial.leaves:
        _leaf_message(leaf, out.leaves.add())
    if partial.weights is not None:
        _leaf_message(partial.weights, out.weight_leaves.add())
    return out


def from_message(kind: str, message: pb.AggregateResponse) -> Partial:
    """The partial an `AggregateResponse` holds."""
    leaves = [_leaf_from_message(kind, m) for m in message.leaves]
    weights = (_leaf_from_message("sum", message.weight_leaves[0])
               if len(message.weight_leaves) else None)
    return Partial(kind=kind, leaves=leaves, weights=weights, count=message.num_clients)


def payload_bytes(message: pb.AggregateResponse) -> int:
    """Bytes of array data inside an `AggregateResponse`."""
    total = 0
    for leaf in list(message.leaves) + list(message.weight_leaves):
        total += (len(leaf.limbs) + len(leaf.nonfinite) + len(leaf.doubles)
                  + len(leaf.extreme.data))
    return total
