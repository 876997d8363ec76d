"""Reductions over client values, in a fixed client order, with partial results.

Each aggregation kind of `backend.AGGREGATIONS` is a partial state that can be built
from any contiguous run of clients (`accumulate`), combined in client order (`merge`)
and turned into the server value (`finalize`). A backend whose clients live on several
devices accumulates per device and merges on the coordinator; `reduce` does all three.

Definitions (as TFF's reference semantics state them):
- sum, min, max: elementwise over clients.
- mean: sum / number of clients. weighted_mean: sum(w_i * x_i) / sum(w_i), with the
  scalar weight of each client broadcast over its value.
- secure_sum_bitwidth: the plain sum of integer values, each of which must lie in
  [0, 2**bitwidth - 1] (bitwidth at most 62, one scalar per tensor or one overall).
  The bitwidth bounds the inputs; the result is not reduced modulo 2**bitwidth.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import numpy as np
from federated_language.common_libs import structure

from fax_bridge.errors import ComputationError

LocalValue = Any
MAX_SECURE_BITWIDTH = 62
KINDS = ("sum", "mean", "weighted_mean", "min", "max", "secure_sum_bitwidth")


@dataclasses.dataclass
class Partial:
    """A reduction over some clients: `total` and, for means, the summed `weight`."""

    kind: str
    total: LocalValue
    weight: Optional[LocalValue] = None
    count: int = 0


def _map(fn, *values):
    first = values[0]
    if isinstance(first, structure.Struct):
        names = structure.name_list_with_nones(first)
        return structure.Struct(
            [(n, _map(fn, *[v[i] for v in values])) for i, n in enumerate(names)])
    return fn(*values)


def _map_with_bitwidth(fn, value, bitwidth):
    if isinstance(value, structure.Struct):
        names = structure.name_list_with_nones(value)
        if isinstance(bitwidth, structure.Struct):
            if len(bitwidth) != len(value):
                raise ComputationError(
                    f"federated_secure_sum_bitwidth: the bitwidth struct has "
                    f"{len(bitwidth)} elements, the value {len(value)}")
            return structure.Struct([(n, _map_with_bitwidth(fn, v, b))
                                     for n, v, b in zip(names, value, bitwidth)])
        return structure.Struct(
            [(n, _map_with_bitwidth(fn, v, bitwidth)) for n, v in zip(names, value)])
    if isinstance(bitwidth, structure.Struct):
        raise ComputationError(
            "federated_secure_sum_bitwidth: a struct of bitwidths for a single tensor")
    return fn(value, bitwidth)


def _check_in_range(value, bitwidth):
    bits = np.asarray(bitwidth)
    if bits.shape != () or bits.dtype.kind not in "iu":
        raise ComputationError(
            f"federated_secure_sum_bitwidth: each bitwidth must be an integer scalar, got "
            f"{bits.dtype}{list(bits.shape)}")
    bits = int(bits)
    if not 0 <= bits <= MAX_SECURE_BITWIDTH:
        raise ComputationError(
            f"federated_secure_sum_bitwidth: bitwidth {bits} is outside [0, "
            f"{MAX_SECURE_BITWIDTH}]")
    arr = np.asarray(value)
    if arr.dtype.kind not in "iu":
        raise ComputationError(
            f"federated_secure_sum_bitwidth sums integers, got {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 2**bits - 1):
        raise ComputationError(
            f"federated_secure_sum_bitwidth: a client value lies outside [0, "
            f"2**{bits} - 1] = [0, {2**bits - 1}] (min {int(arr.min())}, max "
            f"{int(arr.max())}); clip or quantize it on the clients first")
    return arr


def _weight_scalar(weight) -> np.ndarray:
    w = np.asarray(weight)
    if w.shape != ():
        raise ComputationError(
            f"federated_weighted_mean needs a scalar weight per client, got shape "
            f"{list(w.shape)}")
    return w


def accumulate(kind: str, members: Sequence[LocalValue],
               weights: Optional[Sequence[LocalValue]] = None,
               bitwidth: Optional[LocalValue] = None) -> Partial:
    """The partial reduction of `members` (client order), for aggregation `kind`."""
    if kind not in KINDS:
        raise ComputationError(f"unknown aggregation `{kind}`; expected one of {KINDS}")
    if not members:
        raise ComputationError(f"cannot take the {kind} of zero clients")
    if kind == "weighted_mean":
        if weights is None or len(weights) != len(members):
            raise ComputationError("federated_weighted_mean needs one weight per client")
        total = None
        weight = None
        for x, w in zip(members, weights):
            w = _weight_scalar(w)
            term = _map(lambda a: np.asarray(a) * w.astype(np.asarray(a).dtype), x)
            total = term if total is None else _map(np.add, total, term)
            weight = w if weight is None else weight + w
        return Partial(kind, total, weight, len(members))
    if kind == "secure_sum_bitwidth":
        if bitwidth is None:
            raise ComputationError("federated_secure_sum_bitwidth needs a bitwidth")
        members = [_map_with_bitwidth(_check_in_range, m, bitwidth) for m in members]
    op = {"min": np.minimum, "max": np.maximum}.get(kind, np.add)
    total = _map(np.asarray, members[0])
    for m in members[1:]:
        total = _map(lambda a, b: op(a, b).astype(a.dtype), total, m)
    return Partial(kind, total, None, len(members))


def merge(partials: Sequence[Partial]) -> Partial:
    """Combines partial reductions of consecutive client runs, in the given order."""
    if not partials:
        raise ComputationError("cannot merge zero partial reductions")
    kind = partials[0].kind
    op = {"min": np.minimum, "max": np.maximum}.get(kind, np.add)
    out = partials[0]
    for p in partials[1:]:
        if p.kind != kind:
            raise ComputationError(f"cannot merge a {p.kind} partial into a {kind} one")
        total = _map(lambda a, b: op(a, b).astype(np.asarray(a).dtype), out.total, p.total)
        weight = None if out.weight is None else out.weight + p.weight
        out = Partial(kind, total, weight, out.count + p.count)
    return out


def finalize(partial: Partial) -> LocalValue:
    """The server value of a complete reduction."""
    if partial.kind == "mean":
        n = partial.count
        return _map(lambda a: _divide(a, n, "federated_mean"), partial.total)
    if partial.kind == "weighted_mean":
        w = partial.weight
        return _map(lambda a: _divide(a, w, "federated_weighted_mean"), partial.total)
    return partial.total


def _divide(a, d, what: str):
    a = np.asarray(a)
    if a.dtype.kind not in "fc":
        raise ComputationError(f"{what} needs floating-point values, got {a.dtype}")
    with np.errstate(divide="ignore", invalid="ignore"):
        return (a / np.asarray(d).astype(a.dtype)).astype(a.dtype)


def reduce(kind: str, members: Sequence[LocalValue],
           weights: Optional[Sequence[LocalValue]] = None,
           bitwidth: Optional[LocalValue] = None) -> LocalValue:
    """The aggregate of `members` over clients (accumulate then finalize)."""
    return finalize(accumulate(kind, members, weights, bitwidth))
