"""What each aggregation over clients means, computed exactly: the one owner of the rules.

Both clients backends aggregate with this module: the in-process one over all members
at once, the gRPC one as partials that each device builds over its own clients and the
coordinator merges in client order. Sums are exact (`exact.ExactSum`, or its float64
form `double_sums.DoubleSum` where that is exact) and rounded once, so a result has the
same bits however the clients are split, in process or on a fleet.

Kinds (as TFF's reference semantics state them):
- sum, min, max: elementwise over clients.
- mean: sum / number of clients. weighted_mean: sum(w_i * x_i) / sum(w_i), with the
  scalar weight of each client broadcast over its value (each product rounded to the
  value's dtype, then summed exactly). Both need floating-point values; float16 and
  bfloat16 sums (and weight totals) are rounded to float32, divided there and the
  quotient rounded once to the dtype, so a mean of identical values is that value. A weighted
  mean's weights must be >= 0 (checked where each client's weight is: in process, or
  on the device that holds it) and must not sum to zero (checked when the partials
  meet): `WeightError` otherwise, the rule of `placements.weights_refusal`.
- secure_sum_bitwidth: the plain sum of integer values, each of which must lie in
  [0, 2**bitwidth - 1] (bitwidth at most MAX_SECURE_BITWIDTH, one scalar overall or
  one per tensor). The bitwidth bounds the inputs; the sum is not reduced modulo.
- secure_sum: the same with each value in [0, max_input] (passed where the bitwidth
  goes: `bitwidth` carries the bound of either secure kind).
  Both keep the values' dtype, so `check_secure_fits` refuses a secure sum whose clients
  at the bound's top would overflow it, before any value is read.

Where a round runs on the accelerator (`device_sums.on_device`), a sum-like partial may
hold its clients' running sums there, as one `device_sums.DeviceSums` (its one leaf;
`device_partial`, `device_sums_partial`): merged by joining them, finished by
`device_sums.finish` with the same bits.

A partial over no clients is valid (it merges as nothing). Finished, it follows TFF's
reference semantics, where `federated_sum` is a reduction that starts at `generic_zero`:
a sum or secure sum over zero clients is the zero of its member type (`finish` is given
that type, which it knows when there are no members), while a mean, weighted mean, min
or max over zero clients has no value and is refused (`empty_refusal`, which a round's
policy also applies before a round that may have no clients runs: `rounds.engine`).
Every refusal raises `AggregationError`; on a fleet, one found on a device reaches the
coordinator as a FleetError naming the device and carrying the same message.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Sequence

import federated_language
import numpy as np
from federated_language.common_libs import structure

from fax_bridge.errors import AggregationError, ComputationError, WeightError
from fax_bridge.language.placements import aggregate_refusal, secure_sum_refusal, weights_refusal
from fax_bridge.language.primitive_facts import AGGREGATION_KINDS
from fax_bridge.runtime import device_sums, exact, threads
from fax_bridge.runtime.backend import LocalValue, from_leaves, leaves, unflatten_like
from fax_bridge.runtime.local_eval import zeros_of_type
from fax_bridge.runtime.double_sums import (Sum, merged_all, results, sums_of,
                                           weighted_sums_of)

KINDS = tuple(AGGREGATION_KINDS.values())  # sum, mean, weighted_mean, min, max, secure
SUM_LIKE = ("sum", "mean", "weighted_mean", "secure_sum_bitwidth", "secure_sum")
EXTREMES = {"min": np.minimum, "max": np.maximum}
# Kinds whose value over zero clients is the zero of the member type; the others have none.
ZERO_OVER_NONE = ("sum", "secure_sum_bitwidth", "secure_sum")
_NO_VALUE_WHY = {"mean": "it divides by the number of clients",
                 "weighted_mean": "it divides by the clients' total weight",
                 "min": "no client gives a value to take the least of",
                 "max": "no client gives a value to take the greatest of"}
MAX_SECURE_BITWIDTH = 62


@dataclasses.dataclass
class Partial:
    """An aggregate in progress over `count` clients.

    `leaves` holds, per tensor of the value (depth first), an exact sum (`ExactSum` or
    `DoubleSum`, sum-like kinds) or the running extreme (min, max), or one
    `device_sums.DeviceSums` for all of them (sums on the device); it is empty while
    `count` is 0.
    """

    kind: str
    leaves: list
    weights: Optional[Sum] = None
    count: int = 0


def empty_refusal(kind: str) -> Optional[str]:
    """Why an aggregation of `kind` has no value over zero clients (None: it has one,
    the zero of its member type), in the words errors use."""
    why = _NO_VALUE_WHY.get(kind)
    return None if why is None else (f"federated_{kind} has no value over zero clients "
                                     f"({why})")


def check_kind(kind: str) -> None:
    """Raises AggregationError unless `kind` names a supported aggregation."""
    if kind not in KINDS:
        raise AggregationError(f"unknown aggregation {kind!r}; expected one of {list(KINDS)}")


def _bounds(bound: LocalValue, count: int, what: str) -> list[np.ndarray]:
    """One bound per tensor of a value of `count` tensors: given once, or once per tensor."""
    flat = leaves(bound)
    if len(flat) not in (1, count):
        raise AggregationError(
            f"{what}: {len(flat)} bounds for a value of {count} tensors; give one overall "
            "or one per tensor")
    return flat * count if len(flat) == 1 and count != 1 else flat


@dataclasses.dataclass(frozen=True)
class _SecureRange:
    """How a secure sum bounds each client's values: [0, top(bound)]."""

    what: str
    name: str
    bound_ok: Callable[[int], bool]
    bad_bound: str
    top: Callable[[int], int]
    shown: Callable[[int, int], str]
    fix: str


_SECURE = {
    "secure_sum_bitwidth": _SecureRange(
        "federated_secure_sum_bitwidth", "bitwidth",
        lambda b: 0 <= b <= MAX_SECURE_BITWIDTH,
        f"a bitwidth must be an integer scalar in [0, {MAX_SECURE_BITWIDTH}]",
        lambda b: 2 ** b - 1, lambda b, hi: f"[0, 2**{b} - 1] = [0, {hi}]",
        "clip or quantize it on the clients first"),
    "secure_sum": _SecureRange(
        "federated_secure_sum", "max_input", lambda m: m >= 0,
        "max_input must be an integer scalar >= 0", lambda m: m,
        lambda m, hi: f"[0, max_input] = [0, {hi}]", "clip the values on the clients first"),
}


def secure_sum_words(kind: str) -> tuple[str, str]:
    """(the intrinsic's name, its bound's name) of a secure sum kind, as messages name
    them: ("federated_secure_sum_bitwidth", "bitwidth") or ("federated_secure_sum",
    "max_input")."""
    spec = _SECURE[kind]
    return spec.what, spec.name


def secure_bounds(kind: str, bound: Optional[LocalValue], count: int) -> list[int]:
    """The largest value one client may give each of a value's `count` tensors in a
    secure sum of `kind` (2**bitwidth - 1, or max_input); AggregationError unless the
    bound is an integer scalar (once, or once per tensor) of the kind's range."""
    spec = _SECURE[kind]
    if bound is None:
        raise AggregationError(f"{spec.what} needs a {spec.name}")
    out = []
    for b in _bounds(bound, count, spec.what):
        if b.shape != () or b.dtype.kind not in "iu" or not spec.bound_ok(int(b)):
            raise AggregationError(f"{spec.what}: {spec.bad_bound}, got "
                                   f"{b.dtype}{list(b.shape)} {b}")
        out.append(spec.top(int(b)))
    return out


def check_secure_fits(kind: str, bound: Optional[LocalValue], dtypes: Sequence[np.dtype],
                      clients: int) -> None:
    """AggregationError unless `clients` values at the bound's top sum in each tensor's
    dtype (`dtypes`, depth first): the rule jit and export apply when a program is
    traced (`placements.secure_sum_refusal`), for protos written anywhere."""
    spec = _SECURE[kind]
    bounds = _bounds(bound, len(dtypes), spec.what) if bound is not None else []
    for dtype, top, b in zip(dtypes, secure_bounds(kind, bound, len(dtypes)), bounds):
        refusal = secure_sum_refusal(spec.what, spec.name, int(b), top, clients, dtype)
        if refusal:
            raise AggregationError(refusal)


def _check_range(kind: str, members: Sequence[LocalValue],
                 bound: Optional[LocalValue]) -> None:
    """The shared check of the secure sums: every member's tensors are integers in
    [0, top(bound)], and each bound is an integer scalar of the kind's range."""
    spec = _SECURE[kind]
    if bound is None:
        raise AggregationError(f"{spec.what} needs a {spec.name}")
    ranges: dict = {}  # tensors per member -> [(bound, top)] per tensor, checked once
    for member in members:
        flat = leaves(member)
        if len(flat) not in ranges:
            tops = secure_bounds(kind, bound, len(flat))
            ranges[len(flat)] = [(int(b), hi) for b, hi in
                                 zip(_bounds(bound, len(flat), spec.what), tops)]
        for x, (b, hi) in zip(flat, ranges[len(flat)]):
            if x.dtype.kind not in "iu":
                raise AggregationError(f"{spec.what} sums integers, got {x.dtype}")
            if x.size and (int(x.min()) < 0 or int(x.max()) > hi):
                raise AggregationError(
                    f"{spec.what}: a client value lies outside {spec.shown(b, hi)} "
                    f"(min {int(x.min())}, max {int(x.max())}); {spec.fix}")


def check_bitwidth(members: Sequence[LocalValue], bitwidth: Optional[LocalValue]) -> None:
    """Raises AggregationError unless every member's tensors are integers in
    [0, 2**bitwidth - 1] and each bitwidth is an integer scalar in [0, MAX_SECURE_BITWIDTH]."""
    _check_range("secure_sum_bitwidth", members, bitwidth)


def check_max_input(members: Sequence[LocalValue], max_input: Optional[LocalValue]) -> None:
    """Raises AggregationError unless every member's tensors are integers in
    [0, max_input] (`federated_secure_sum`'s range; max_input an integer scalar)."""
    _check_range("secure_sum", members, max_input)


def _scalar_weight(weight: LocalValue) -> np.ndarray:
    flat = leaves(weight)
    if len(flat) != 1 or flat[0].size != 1:
        raise AggregationError(
            "a weighted_mean weight must be one scalar tensor per client; got "
            f"{[leaf.shape for leaf in flat]}")
    return flat[0].reshape(())


def partial_of(kind: str, members: Sequence[LocalValue],
               weights: Optional[Sequence[LocalValue]] = None,
               bitwidth: Optional[LocalValue] = None) -> Partial:
    """The partial aggregate of per-client `members` (local values), in client order."""
    check_kind(kind)
    if kind == "secure_sum_bitwidth":
        check_bitwidth(members, bitwidth)
    if kind == "secure_sum":
        check_max_input(members, bitwidth)
    if kind == "weighted_mean" and (weights is None or len(weights) != len(members)):
        raise AggregationError(
            "weighted_mean needs one weight per client; got "
            f"{'none' if weights is None else len(weights)} for {len(members)} clients")
    columns = _columns(members)
    _refuse(kind, columns)
    w = (np.stack([_scalar_weight(x) for x in weights])
         if kind == "weighted_mean" and members else None)
    return _partial(kind, columns, len(members), w)


def partial_of_columns(kind: str, columns: Sequence[np.ndarray], count: int,
                       weights: Optional[Sequence[np.ndarray]] = None,
                       bitwidth: Optional[LocalValue] = None) -> Partial:
    """`partial_of` of clients' values given stacked: `columns[j]` holds tensor j of
    every client's value on a leading axis of `count` (client order), `weights` (for
    weighted_mean) the clients' weight tensor likewise, `bitwidth` a secure sum's bound
    (as `partial_of`'s). The columns are only read."""
    check_kind(kind)
    for column in columns:
        if column.shape[:1] != (count,):
            raise AggregationError(
                f"a column of shape {list(column.shape)} does not hold {count} clients")
    if kind in _SECURE and count:
        member = structure.Struct([(None, c) for c in columns])  # all clients at once
        _check_range(kind, [member], bitwidth)
    elif kind in _SECURE:
        secure_bounds(kind, bitwidth, len(columns))
    w = None
    if kind == "weighted_mean":
        if weights is None or len(weights) != 1 or weights[0].shape[:1] != (count,) \
                or math.prod(weights[0].shape[1:]) != 1:
            raise AggregationError(
                "a weighted_mean weight must be one scalar tensor per client; got "
                f"{'none' if weights is None else [list(c.shape[1:]) for c in weights]}")
        w = weights[0].reshape(count)
    _refuse(kind, columns)
    return _partial(kind, list(columns), count, w, fresh=False)


def device_partial(kind: str, columns: Sequence[Sequence], counts: Sequence[int],
                   weights: Optional[Sequence] = None) -> Partial:
    """The partial of a sum-like `kind` (`device_sums.KINDS`) over clients' tensors left
    on the device by batched calls: `columns[j][i]` is tensor j of call i's results,
    whose first `counts[i]` rows are its clients (client order), `weights[i]` those
    clients' weights (weighted_mean); summed there (`device_sums.partial_of`)."""
    if kind not in device_sums.KINDS:
        raise AggregationError(f"the device finishes {list(device_sums.KINDS)}, not {kind!r}")
    count = sum(counts)
    leaves = [device_sums.DeviceColumn(list(parts), list(counts)) for parts in columns]
    for leaf in leaves:
        refusal = aggregate_refusal(f"federated_{kind}", leaf.dtype)
        if refusal:
            raise AggregationError(refusal)
    w = None
    if kind == "weighted_mean":
        if weights is None or any(math.prod(x.shape[1:]) != 1 for x in weights):
            raise AggregationError("a weighted_mean weight must be one scalar tensor per "
                                   "client")
        w = device_sums.DeviceColumn(list(weights), list(counts))
    if not count:
        return Partial(kind=kind, leaves=[])
    return device_sums_partial(device_sums.partial_of(kind, leaves, w))


def device_sums_partial(sums: device_sums.DeviceSums) -> Partial:
    """The partial held by running sums on the device (`device_sums.DeviceSums`: its
    one leaf)."""
    return Partial(kind=sums.kind, leaves=[sums] if sums.count else [], count=sums.count)


def _partial(kind: str, columns: list, count: int, w: Optional[np.ndarray],
             fresh: bool = True) -> Partial:
    """The partial of `count` clients' stacked tensors (`fresh`: the columns are this
    call's own, so weighted products may overwrite them)."""
    partial = Partial(kind=kind, leaves=[], count=count)
    if not count:
        return partial
    extreme = EXTREMES.get(kind)
    if extreme is not None:
        partial.leaves = [extreme.reduce(column, axis=0) for column in columns]
        return partial
    if kind != "weighted_mean":
        partial.leaves = sums_of(columns)
        return partial
    refusal = weights_refusal(float(w.min()), False)  # each client's, where it is held
    if refusal:
        raise WeightError(refusal)
    # each product rounded to the value's dtype, summed with the weights' sum
    *partial.leaves, partial.weights = weighted_sums_of(columns, w, overwrite=fresh)
    return partial


def _refuse(kind: str, columns: Sequence[np.ndarray]) -> None:
    """The rule jit and export apply when a program is traced (an integer mean, ...)."""
    for column in columns:
        refusal = aggregate_refusal(f"federated_{kind}", column.dtype)
        if refusal:
            raise AggregationError(refusal)


def _columns(members: Sequence[LocalValue]) -> list[np.ndarray]:
    """Per tensor of the value, the clients' tensors stacked (client order on axis 0)."""
    flat = [leaves(m) for m in members]
    if not flat:
        return []
    first = flat[0]
    for other in flat[1:]:
        if len(other) != len(first):
            raise AggregationError(
                f"clients disagree on the structure of the aggregated value: {len(other)} "
                f"vs {len(first)} tensors")
        for a, b in zip(first, other):
            if a.shape != b.shape or a.dtype != b.dtype:
                raise AggregationError(
                    f"clients disagree on a tensor of the aggregated value: "
                    f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}; every client "
                    "must hold the same type")
    return [np.stack([m[i] for m in flat]) for i in range(len(first))]


def merge(into: Partial, other: Partial) -> Partial:
    """Adds `other` (a partial over the clients after `into`'s) into `into`; returns it."""
    if other.kind != into.kind:
        raise AggregationError(f"cannot merge a {other.kind} partial into a {into.kind} one")
    if other.count == 0:
        return into
    if into.count == 0:
        into.leaves, into.weights, into.count = other.leaves, other.weights, other.count
        return into
    extreme = EXTREMES.get(into.kind)
    on_device = [isinstance(p.leaves[0], device_sums.DeviceSums) if p.leaves else None
                 for p in (into, other)]
    if on_device[0] != on_device[1]:
        raise AggregationError("cannot merge a partial held on the device with one held "
                               "on the host; run every part of the round on one of them")
    if len(other.leaves) != len(into.leaves):
        raise AggregationError("partials disagree on the number of tensors of the value")
    if on_device[0]:
        into.leaves = [into.leaves[0].joined(other.leaves[0])]
    elif extreme is not None:
        into.leaves = [extreme(a, b) for a, b in zip(into.leaves, other.leaves)]
    else:
        if into.weights is not None and other.weights is not None:
            *into.leaves, into.weights = merged_all([*into.leaves, into.weights],
                                                    [*other.leaves, other.weights])
        else:
            into.leaves = merged_all(into.leaves, other.leaves)
    into.count += other.count
    return into


def finish(partial: Partial, member_type: Optional[federated_language.Type] = None
           ) -> list[np.ndarray]:
    """The aggregate's tensor leaves, depth first. `member_type`: the aggregated value's
    type (its clients' member type), which gives a sum over zero clients its value, the
    zero of that type; over zero clients, a kind with no value (`empty_refusal`) raises
    AggregationError naming it and the fix."""
    if partial.count == 0:
        return _over_no_clients(partial.kind, member_type)
    if partial.kind in EXTREMES:
        return [np.array(x) for x in partial.leaves]
    if partial.leaves and isinstance(partial.leaves[0], device_sums.DeviceSums):
        return device_sums.finish(partial.leaves[0])
    if partial.kind in ("sum", "secure_sum_bitwidth", "secure_sum"):
        return results(partial.leaves)
    # float16/bfloat16 sums rounded to float32 and divided there, then rounded once more
    dtypes = [acc.dtype for acc in partial.leaves]
    if partial.kind == "mean":
        sums, by = results(partial.leaves, wide=True), partial.count
    else:  # rounded together
        *sums, by = results([*partial.leaves, partial.weights], wide=True)
        refusal = weights_refusal(float(by), not by)  # the total, where all meet
        if refusal:
            raise WeightError(refusal)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # once for all
        return [_divide(s, by).astype(dtype, copy=False) for s, dtype in zip(sums, dtypes)]


def _divide(total: np.ndarray, by) -> np.ndarray:
    """`total / by` in `total`'s dtype, written over `total` (a sum `results` made for
    this call alone: no second array of the model's size); the caller ignores division
    by zero."""
    if total.dtype.kind in "iub":
        raise AggregationError(
            f"federated mean and weighted_mean need floating-point values, got "
            f"{total.dtype}; cast the clients' values to a float type first")
    by = np.asarray(by, total.dtype)
    if not total.flags.c_contiguous:
        return np.divide(total, by, out=total)
    flat = total.reshape(-1)  # a view of `total`

    def divide(start: int, stop: int) -> None:  # large ones on the worker threads
        with np.errstate(divide="ignore", invalid="ignore"):  # numpy's is per thread
            np.divide(flat[start:stop], by, out=flat[start:stop])

    threads.in_spans(flat.size, exact.BLOCK_ELEMENTS, divide)
    return total


def _over_no_clients(kind: str, member_type: Optional[federated_language.Type]
                     ) -> list[np.ndarray]:
    """`finish` of a partial over zero clients: the zero of `member_type` (a sum), or
    the refusal of a kind that has no value there."""
    check_kind(kind)
    refusal = empty_refusal(kind)
    if refusal:
        raise AggregationError(
            f"{refusal}; run it over at least one client (in rounds: RoundPolicy("
            "min_clients=1) or more), or aggregate with federated_sum, whose value over "
            "no clients is the zero of its type")
    if member_type is None:
        raise AggregationError(
            f"federated_{kind} over zero clients is the zero of the value's type, which "
            "was not given; place at least one client")
    try:
        return leaves(zeros_of_type(member_type))
    except ComputationError as e:
        raise AggregationError(f"federated_{kind} over zero clients is the zero of its "
                               f"member type {member_type}, which has none: {e}") from None


def reduce(kind: str, members: Sequence[LocalValue],
           weights: Optional[Sequence[LocalValue]] = None,
           bitwidth: Optional[LocalValue] = None,
           member_type: Optional[federated_language.Type] = None) -> LocalValue:
    """The aggregate of `members` over clients, nested like each member (over no
    members: `finish`'s value of `member_type`, the clients' member type)."""
    if not members:
        return from_leaves(member_type, _over_no_clients(kind, member_type))
    return unflatten_like(members[0], finish(partial_of(kind, members, weights, bitwidth)))
