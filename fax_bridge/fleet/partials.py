"""Partial aggregates over a set of clients, as devices compute them and the coordinator merges.

A partial holds, per tensor leaf (depth first), an exact sum (`ExactSum`) or a running
minimum/maximum, plus the number of clients it covers; `weighted_mean` also carries the
exact sum of the weights. Merging partials in any grouping gives the same bits, and
`finish` turns the merged partial into the aggregate. The coordinator uses the same code
on fetched per-client values when pre-aggregation is off, so both paths agree exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from fax_bridge.errors import FleetError
from fax_bridge.fleet import wire
from fax_bridge.fleet.exact import ExactSum
from fax_bridge.v1 import device_pb2 as pb

SUM_LIKE = ("sum", "mean", "weighted_mean", "secure_sum_bitwidth")
EXTREMES = {"min": np.minimum, "max": np.maximum}

KIND_TO_ENUM = {
    "sum": pb.SUM,
    "mean": pb.MEAN,
    "weighted_mean": pb.WEIGHTED_MEAN,
    "min": pb.MIN,
    "max": pb.MAX,
    "secure_sum_bitwidth": pb.SECURE_SUM_BITWIDTH,
}
ENUM_TO_KIND = {v: k for k, v in KIND_TO_ENUM.items()}


@dataclasses.dataclass
class Partial:
    """An aggregate in progress over `count` clients."""

    kind: str
    leaves: list  # ExactSum (sum-like kinds) or np.ndarray (min/max), or None when count == 0
    weights: Optional[ExactSum] = None
    count: int = 0


def check_kind(kind: str) -> None:
    """Raises FleetError unless `kind` names a supported aggregation."""
    if kind not in KIND_TO_ENUM:
        raise FleetError(
            f"unknown aggregation {kind!r}; expected one of {sorted(KIND_TO_ENUM)}")


MAX_SECURE_BITWIDTH = 62


def check_bitwidth(members: Sequence, bitwidth) -> None:
    """Raises FleetError unless every member's tensors are integers in [0, 2^bitwidth - 1]."""
    if bitwidth is None:
        raise FleetError("federated_secure_sum_bitwidth needs a bitwidth")
    bits = wire.leaves(bitwidth)
    for member in members:
        flat = wire.leaves(member)
        if len(bits) not in (1, len(flat)):
            raise FleetError(
                f"federated_secure_sum_bitwidth: {len(bits)} bitwidths for a value of "
                f"{len(flat)} tensors; give one overall or one per tensor")
        for i, x in enumerate(flat):
            b = bits[0] if len(bits) == 1 else bits[i]
            if b.shape != () or b.dtype.kind not in "iu" or not 0 <= int(b) <= MAX_SECURE_BITWIDTH:
                raise FleetError(
                    f"federated_secure_sum_bitwidth: a bitwidth must be an integer scalar in "
                    f"[0, {MAX_SECURE_BITWIDTH}], got {b.dtype}{list(b.shape)} {b}")
            if x.dtype.kind not in "iu":
                raise FleetError(f"federated_secure_sum_bitwidth sums integers, got {x.dtype}")
            top = 2 ** int(b) - 1
            if x.size and (int(x.min()) < 0 or int(x.max()) > top):
                raise FleetError(
                    f"federated_secure_sum_bitwidth: a client value lies outside [0, {top}] "
                    f"(min {int(x.min())}, max {int(x.max())}); clip or quantize it on the "
                    "clients first")


def partial_of(kind: str, members: Sequence, weights: Optional[Sequence] = None,
               bitwidth=None) -> Partial:
    """The partial aggregate of per-client `members` (local values), in client order."""
    check_kind(kind)
    if kind == "secure_sum_bitwidth":
        check_bitwidth(members, bitwidth)
    if kind == "weighted_mean":
        if weights is None or len(weights) != len(members):
            raise FleetError(
                "weighted_mean needs one weight per client; got "
                f"{'none' if weights is None else len(weights)} for {len(members)} clients")
    partial = Partial(kind=kind, leaves=[])
    for index, member in enumerate(members):
        flat = wire.leaves(member)
        if kind == "weighted_mean":
            weight = _scalar_weight(weights[index])
            flat = [np.asarray(x * weight.astype(x.dtype), x.dtype) for x in flat]
            if partial.weights is None:
                partial.weights = ExactSum(weight.dtype, weight.shape)
            partial.weights.add(weight)
        _accumulate(partial, flat)
    partial.count = len(members)
    return partial


def _scalar_weight(weight) -> np.ndarray:
    leaves = wire.leaves(weight)
    if len(leaves) != 1 or leaves[0].size != 1:
        raise FleetError(
            "a weighted_mean weight must be one scalar tensor per client; got "
            f"{[leaf.shape for leaf in leaves]}")
    return leaves[0].reshape(())


def _accumulate(partial: Partial, flat: list[np.ndarray]) -> None:
    if not partial.leaves:
        if partial.kind in EXTREMES:
            partial.leaves = [np.array(x) for x in flat]
            return
        partial.leaves = [ExactSum(x.dtype, x.shape) for x in flat]
    if len(flat) != len(partial.leaves):
        raise FleetError(
            f"clients disagree on the structure of the aggregated value: {len(flat)} vs "
            f"{len(partial.leaves)} tensors")
    if partial.kind in EXTREMES:
        op = EXTREMES[partial.kind]
        for i, x in enumerate(flat):
            if x.shape != partial.leaves[i].shape or x.dtype != partial.leaves[i].dtype:
                raise FleetError(
                    f"clients disagree on a tensor of the {partial.kind}: "
                    f"{partial.leaves[i].dtype}{list(partial.leaves[i].shape)} vs "
                    f"{x.dtype}{list(x.shape)}")
            partial.leaves[i] = op(partial.leaves[i], x)
        return
    for acc, x in zip(partial.leaves, flat):
        acc.add(x)


def merge(into: Partial, other: Partial) -> Partial:
    """Adds `other` (a partial over other clients) into `into`; returns `into`."""
    if other.kind != into.kind:
        raise FleetError(f"cannot merge a {other.kind} partial into a {into.kind} partial")
    if other.count == 0:
        return into
    if into.count == 0:
        into.leaves, into.weights, into.count = other.leaves, other.weights, other.count
        return into
    if len(other.leaves) != len(into.leaves):
        raise FleetError("partials disagree on the number of tensors of the value")
    if into.kind in EXTREMES:
        op = EXTREMES[into.kind]
        into.leaves = [op(a, b) for a, b in zip(into.leaves, other.leaves)]
    else:
        for a, b in zip(into.leaves, other.leaves):
            a.merge(b)
        if into.weights is not None and other.weights is not None:
            into.weights.merge(other.weights)
    into.count += other.count
    return into


def finish(partial: Partial) -> list[np.ndarray]:
    """The aggregate's tensor leaves, depth first."""
    if partial.count == 0:
        raise FleetError(
            f"cannot compute federated {partial.kind} over zero clients; place at least "
            "one client (check the cohort size, dropout and round deadline)")
    kind = partial.kind
    if kind in EXTREMES:
        return [np.array(x) for x in partial.leaves]
    sums = [acc.result() for acc in partial.leaves]
    if kind in ("sum", "secure_sum_bitwidth"):
        return sums
    if kind == "mean":
        return [_divide(s, partial.count) for s in sums]
    total_weight = partial.weights.result()
    return [_divide(s, total_weight) for s in sums]


def _divide(total: np.ndarray, by) -> np.ndarray:
    if total.dtype.kind in "iu":
        raise FleetError(
            f"federated mean and weighted_mean need floating-point values, got {total.dtype}; "
            "cast the clients' values to a float type first")
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.asarray(total / np.asarray(by, total.dtype), total.dtype)


# ---------------------------------------------------------------------------------------
# Wire form


def _leaf_message(leaf, out: pb.LeafPartial) -> None:
    if isinstance(leaf, ExactSum):
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
    size = int(np.prod(shape, dtype=np.int64))
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
        total += len(leaf.limbs) + len(leaf.nonfinite) + len(leaf.extreme.data)
    return total
