"""Partial aggregates on the wire: `runtime.aggregation.Partial` as an AggregateResponse.

Devices build partials over their own clients with `runtime.aggregation.partial_of` and
send them with `to_message`; the coordinator reads them with `validate.check_partial`
(which checks each leaf, then decodes it with `leaf_from_message`) and merges them in
client order. `from_message` decodes a trusted message. Exact sums travel as their
integer limbs, or as float64 values where those hold them exactly (`doubles`, with the
few elements whose float64 sum would not be exact as limbs beside them, `spilled`), so
nothing is rounded before the coordinator finishes the aggregate. A partial over one
client travels as that client's addend in its own dtype (`addend`: 4 bytes an element
for float32, half the doubles), from which the receiver builds the same exact sum
(`sum_of_addend`); with `rounded=True` (a round of rounded partials) every sum-like
partial of floats of 4 bytes or more travels so, its exact sum rounded once to the
dtype (float16 and bfloat16 sums travel exact: they round once, at the end). With a
`shared_memory.Writer`, `to_message` puts the large bytes fields in a shared-memory
segment instead (their `*_at` spans set, the fields empty).
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from fax_bridge.rounds import wire
from fax_bridge.runtime.aggregation import EXTREMES, Partial
from fax_bridge.runtime.double_sums import DoubleSum, results, sums_of
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


def _limbs_message(acc: ExactSum, out: pb.LeafPartial, shared=None) -> None:
    base, limbs, flags = acc.to_limbs()
    out.base_limb = base
    out.num_limbs = limbs.shape[0]
    wire.put_bytes(out, "limbs", np.ascontiguousarray(limbs, "<i8"), shared)
    if flags is not None:
        wire.put_bytes(out, "nonfinite", np.ascontiguousarray(flags, np.uint8), shared)


def leaf_message(leaf, out: pb.LeafPartial, shared=None) -> None:
    """Writes one leaf of a partial in its exact form into `out`: an extreme's tensor,
    or a sum's float64 values (`doubles`, with `spilled` limbs) or its limbs."""
    if isinstance(leaf, DoubleSum):
        out.dtype = wire.dtype_name(leaf.dtype)
        out.shape.extend(leaf.shape)
        wire.put_bytes(out, "doubles", np.ascontiguousarray(leaf.values, "<f8"), shared)
        if leaf.cols.size:
            wire.put_bytes(out, "spilled", np.ascontiguousarray(leaf.cols, "<i8"), shared)
            _limbs_message(leaf.rest, out, shared)
    elif isinstance(leaf, ExactSum):
        out.dtype = wire.dtype_name(leaf.dtype)
        out.shape.extend(leaf.shape)
        _limbs_message(leaf, out, shared)
    else:
        wire.encode_tensor(leaf, out.extreme, shared)


def sum_of_addend(addend: np.ndarray):
    """The exact sum (`DoubleSum` or `ExactSum`) whose one addend is `addend`: what a
    device would have sent for its one client, built by the receiver."""
    return sums_of([addend.reshape((1,) + addend.shape)])[0]


def leaf_from_message(kind: str, message: pb.LeafPartial, doubles: Optional[bytes] = None,
                      limbs: bytes = b"", flags: bytes = b"", spilled: bytes = b""):
    """One leaf of a partial: an extreme's array, a `DoubleSum` or an `ExactSum`.
    `doubles`, `limbs`, `flags`, `spilled`: the leaf's bytes fields when the caller has
    read them already (each read of a bytes field copies it); None reads them here."""
    if kind in EXTREMES:
        return np.array(wire.decode_tensor(message.extreme))
    if message.addend.dtype:
        return sum_of_addend(wire.decode_tensor(message.addend))
    dtype = wire.dtype_from_name(message.dtype)
    shape = tuple(message.shape)
    if doubles is None:
        doubles, limbs, flags = message.doubles, message.limbs, message.nonfinite
        spilled = message.spilled
    if doubles:  # read-only over the bytes: every merge makes new arrays
        values = np.frombuffer(doubles, "<f8")
        if not spilled:
            return DoubleSum(dtype, shape, values)
        cols = np.frombuffer(spilled, "<i8")
        rest = _limbs_of(dtype, (cols.size,), message, limbs, flags)
        return DoubleSum(dtype, shape, values, cols, rest)
    return _limbs_of(dtype, shape, message, limbs, flags)


def _limbs_of(dtype: np.dtype, shape: tuple, message: pb.LeafPartial, limbs: bytes,
              flags: bytes) -> ExactSum:
    size = math.prod(shape)
    # Explicit sizes: an all-zero sum has no limbs, and (0, -1) is no valid shape.
    rows = np.frombuffer(limbs, "<i8").reshape((message.num_limbs, size))
    return ExactSum.from_limbs(dtype, shape, message.base_limb, rows,
                               np.frombuffer(flags, np.uint8) if flags else None)


def _rounds_alone(total) -> bool:
    """Whether a round of rounded partials sends `total` rounded to its dtype: a float
    sum of at least 4 bytes. A float16/bfloat16 sum is accumulated in float32 or wider
    and rounded once, after a mean's division: rounding each holder's sum to float16
    would round it once per holder, so it travels exact."""
    return total.is_float and np.dtype(total.dtype).itemsize >= 4


def to_message(partial: Partial, out: Optional[pb.AggregateResponse] = None,
               shared=None, rounded: bool = False) -> pb.AggregateResponse:
    """The partial as an `AggregateResponse`: written into `out` (an empty one, e.g.
    a new element of a repeated field, so nothing is copied) or a new message. `shared`:
    a `shared_memory.Writer` that takes the large bytes fields (their spans are set).
    A sum-like partial over one client, or over any number of float values of 4 bytes
    or more with `rounded`, travels as `addend`s: each exact sum rounded once to its
    dtype (for one client, exactly its addend; integer sums are never rounded, nor
    float16/bfloat16 ones over several clients)."""
    if out is None:
        out = pb.AggregateResponse()
    out.num_clients = partial.count
    sums = [*partial.leaves] + ([] if partial.weights is None else [partial.weights])
    if partial.kind not in EXTREMES and sums and (partial.count == 1 or (
            rounded and all(_rounds_alone(s) for s in sums))):
        found = results(sums)  # rounded together: one pass per dtype
        for i, value in enumerate(found):
            leaf = out.leaves.add() if i < len(partial.leaves) else out.weight_leaves.add()
            wire.encode_tensor(value, leaf.addend, shared)
        return out
    for leaf in partial.leaves:
        leaf_message(leaf, out.leaves.add(), shared)
    if partial.weights is not None:
        leaf_message(partial.weights, out.weight_leaves.add(), shared)
    return out


def from_message(kind: str, message: pb.AggregateResponse) -> Partial:
    """The partial an `AggregateResponse` holds."""
    leaves = [leaf_from_message(kind, m) for m in message.leaves]
    weights = (leaf_from_message("sum", message.weight_leaves[0])
               if len(message.weight_leaves) else None)
    return Partial(kind=kind, leaves=leaves, weights=weights, count=message.num_clients)
