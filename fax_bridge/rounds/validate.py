"""Checks of what devices send back, against the types the coordinator expects.

A device may be buggy, out of date or hostile: a fetched member or an aggregate partial
is compared with its federated_language type (structure, dtypes, known dimensions, limb
counts and byte sizes) before the coordinator uses it, and with `reject_nonfinite` NaN
and infinities are refused too. An exact-sum partial must also be one an honest device
could send over its clients: limbs where a sum of that many values can reach, digits in
[0, 2^32) under a top limb no larger than such a sum allows, consistent flags, and a
weighted mean's weights summed to no value below 0 (every client's weight is >= 0). Each
failure is a `FleetError` naming the device, the client or leaf, what was expected and
what arrived.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import federated_language
import numpy as np
from federated_language.common_libs import structure

from fax_bridge.errors import ComputationError, FleetError
from fax_bridge.rounds import partials, wire
from fax_bridge.runtime import double_sums, limits, threads
from fax_bridge.runtime.aggregation import EXTREMES, Partial
from fax_bridge.runtime.float_bits import float_params
from fax_bridge.runtime.exact import (BLOCK_ELEMENTS, LIMB_BITS, NEG_ZERO_FLAG,
                                      NONFINITE_FLAGS, TOP_LIMIT, ExactSum, max_units)

NEG_INF_FLAG = 0b100  # the bit of a wire flag byte that means -inf was added
from fax_bridge.v1 import device_pb2 as pb

_FORGED = ("the device's answer is corrupt or forged; check that it runs this "
           "fax_bridge version, or take it out of the fleet")


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


@functools.lru_cache(maxsize=None)
def _scalar(dtype) -> federated_language.TensorType:
    """The scalar type of `dtype` (weights travel as scalars)."""
    return federated_language.TensorType(dtype)


@functools.lru_cache(maxsize=4096)
def _leaf_spec(type_: federated_language.TensorType) -> tuple:
    """(dtype name, the shape as a tuple or None where a dimension is open, numpy dtype,
    whether its sums may take the float64 form) of a tensor type: what each leaf of
    every round's partials is compared with, worked out once per type."""
    shape = tuple(type_.shape or ())
    dtype = np.dtype(type_.dtype)
    return (wire.dtype_name(type_.dtype), None if None in shape else shape, dtype,
            double_sums.fits(dtype))


def check_tensor(array: np.ndarray, type_: federated_language.TensorType, where: str,
                 reject_nonfinite: bool) -> None:
    """Raises FleetError unless `array` has `type_`'s dtype and shape (and is finite)."""
    if wire.dtype_name(array.dtype) != _leaf_spec(type_)[0] or \
            not _shape_ok(array.shape, type_):
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


@functools.lru_cache(maxsize=1024)
def _honest(dtype: np.dtype, count: int) -> tuple[int, int, bool]:
    """(largest |sum| of `count` addends, highest limb an honest partial reaches, whether
    its top limb is bounded: False where any int64 is honest).

    A float sum's lowest limb lies at 0 or above (addends are whole units); its top limb
    T at t has 2^(32 t) <= |sum|, as compacting leaves |T| >= 2^29 or a single limb.
    Integer sums have one limb at 0; those that may wrap (64-bit, or huge counts) hold
    any int64.
    """
    units = max_units(dtype, max(count, 1))
    if dtype.kind not in "iu":
        return units, (units.bit_length() - 1) // LIMB_BITS, True
    return units, 0, dtype.itemsize < 8 and units < 1 << 63


def _check_sum_leaf(leaf: pb.LeafPartial, type_: federated_language.TensorType, where: str,
                    reject_nonfinite: bool, count: int,
                    pending: Optional[list] = None, top: Optional[int] = None,
                    nonnegative: bool = False, rounded: bool = False) -> tuple:
    """Checks one leaf of an exact-sum partial; returns (the sum it holds, its payload
    bytes). A float64-form leaf's values are appended to `pending` (checked with the
    others of their dtype by `check_pending`) when it is given, checked here otherwise.
    `top`: the largest value one client may add (a secure sum's bound), so the sum lies
    in [0, count * top]. `nonnegative`: a sum of addends >= 0 (a weighted mean's
    weights), so no element is below 0 nor -inf. `rounded`: the round asked for
    rounded partials (an `addend` may then stand for more than one client's float
    values)."""
    if leaf.addend.dtype:
        return _check_addend(leaf, type_, where, reject_nonfinite, count, top, rounded,
                             nonnegative)
    name, want, dtype, fits = _leaf_spec(type_)
    shape = tuple(leaf.shape)
    if leaf.dtype != name or (shape != want if want is not None
                              else not _shape_ok(shape, type_)):
        raise FleetError(f"{where}: a partial sum of {leaf.dtype[:20]}{list(shape[:8])} "
                         f"for a tensor {type_}; the device aggregated a value of another "
                         "type")
    if want is None:  # the device chose those dimensions
        try:
            limits.tensor_bytes(shape, dtype.itemsize, f"{where}: a partial sum")
        except ComputationError as e:
            raise FleetError(str(e)) from None
    size = math.prod(shape)
    units = _honest(dtype, count)[0]
    doubles = leaf.doubles  # read once: each read copies the bytes
    if doubles:
        spilled = leaf.spilled
        values = _doubles_of(leaf, doubles, dtype, fits, size, where, bool(spilled))
        if nonnegative and size and np.minimum.reduce(values, axis=None) < 0:
            _negative(where, float(np.minimum.reduce(values, axis=None)))
        if pending is None:
            _check_double_values(values, dtype, units, where)
        else:
            pending.append((values, dtype, units, where))
        if not spilled:
            return double_sums.DoubleSum(dtype, shape, values), len(doubles)
        cols = _spilled_of(spilled, values, size, where)
        rest, limb_bytes = _check_limbs_leaf(leaf, dtype, (cols.size,), where,
                                             reject_nonfinite, count, None, nonnegative)
        return (double_sums.DoubleSum(dtype, shape, values, cols, rest),
                len(doubles) + len(spilled) + limb_bytes)
    return _check_limbs_leaf(leaf, dtype, shape, where, reject_nonfinite, count, top,
                             nonnegative)


def _negative(where: str, least) -> None:
    raise FleetError(f"{where}: a partial sum of weights holds {least}; a weighted mean's "
                     f"weights are >= 0 on every client, so an honest partial of them is "
                     f"too; {_FORGED}")


def _check_addend(leaf: pb.LeafPartial, type_: federated_language.TensorType, where: str,
                  reject_nonfinite: bool, count: int, top: Optional[int],
                  rounded: bool, nonnegative: bool = False) -> tuple:
    """A partial sent as one addend in the value's own dtype (`partials.to_message`):
    one client's addend, or in a round of rounded partials a float sum rounded once;
    returns (the exact sum of that addend, its payload bytes)."""
    if leaf.dtype or len(leaf.shape) or leaf.num_limbs or leaf.base_limb or leaf.limbs \
            or leaf.nonfinite or leaf.doubles or leaf.spilled:
        raise FleetError(f"{where}: a partial sent both as an addend and in another form; "
                         f"devices send one form; {_FORGED}")
    array = wire.decode_tensor(leaf.addend)
    check_tensor(array, type_, where, reject_nonfinite)
    float_sum = array.dtype.kind == "f" or double_sums.fits(array.dtype)
    if count < 1 or (count > 1 and not (rounded and float_sum)):
        raise FleetError(f"{where}: a partial over {count} clients sent as one addend; "
                         "devices send that for one client, or for float sums in a round "
                         f"of rounded partials; {_FORGED}")
    if top is not None and array.size and (int(array.min()) < 0 or int(array.max()) > top):
        raise FleetError(f"{where}: a secure sum's addend holds {int(array.min())} .. "
                         f"{int(array.max())}; one client within the bound keeps it in "
                         f"[0, {top}]; {_FORGED}")
    if nonnegative and array.size and np.minimum.reduce(array, axis=None) < 0:
        _negative(where, np.minimum.reduce(array, axis=None))
    return partials.sum_of_addend(np.asarray(array)), array.nbytes


def _check_limbs_leaf(leaf: pb.LeafPartial, dtype: np.dtype, shape: tuple, where: str,
                      reject_nonfinite: bool, count: int, top: Optional[int],
                      nonnegative: bool = False) -> tuple:
    """Checks the limbs of a sum of `shape` (the leaf's, or its spilled elements');
    returns (the `ExactSum` they hold, their payload bytes). `nonnegative`: as in
    `_check_sum_leaf` (the top limb, digits below it being >= 0, has the sum's sign)."""
    size = math.prod(shape)
    units, last, bounded = _honest(dtype, count)
    is_int = dtype.kind in "iu"
    num, base = leaf.num_limbs, leaf.base_limb
    if not (0 <= base <= last and 0 <= num <= last + 1 - base) or (is_int and num != 1):
        raise FleetError(
            f"{where}: a partial sum with {num} limbs from limb {base}; a sum of {count} "
            f"{dtype} values has " + ("one limb at 0" if is_int else
                                      f"limbs between 0 and {last}") + f"; {_FORGED}")
    data = leaf.limbs  # read once: each read copies the bytes
    if len(data) != num * size * 8:
        raise FleetError(f"{where}: a partial sum of {num} limbs x {size} "
                         f"elements should hold {num * size * 8} bytes, holds {len(data)}")
    flag_bytes = leaf.nonfinite
    if len(flag_bytes) not in ((0,) if is_int else (0, size)):
        raise FleetError(f"{where}: {len(flag_bytes)} non-finite flags for {size} "
                         f"{dtype} elements; expected {'none' if is_int else f'0 or {size}'}")
    rows = np.frombuffer(data, "<i8").reshape((num, size))
    if num and size:
        _check_limbs(rows, dtype, count, units >> (LIMB_BITS * (base + num - 1)), bounded,
                     where)
        if top is not None and is_int:
            _check_secure_sum(rows[0], count * top, where)
        if nonnegative and int(np.minimum.reduce(rows[-1])) < 0:
            _negative(where, "a negative sum")
    if flag_bytes:
        _check_flags(np.frombuffer(flag_bytes, np.uint8), rows, where, reject_nonfinite)
        if nonnegative and (np.frombuffer(flag_bytes, np.uint8) & NEG_INF_FLAG).any():
            _negative(where, "-inf")
    acc = ExactSum.from_limbs(dtype, shape, base, rows,
                              np.frombuffer(flag_bytes, np.uint8) if flag_bytes else None)
    return acc, len(data) + len(flag_bytes)


def _spilled_of(data: bytes, values: np.ndarray, size: int, where: str) -> np.ndarray:
    """The positions of a float64-form sum's spilled elements, once checked: ascending,
    within the tensor, no more than a device spills, each one's value +0.0."""
    count = len(data) // 8
    if len(data) % 8 or not 0 < count <= double_sums.most_spilled(size):
        raise FleetError(f"{where}: {len(data)} bytes of spilled positions for a sum of "
                         f"{size} elements; devices send whole int64 positions, at most "
                         f"{double_sums.most_spilled(size)}; {_FORGED}")
    cols = np.frombuffer(data, "<i8")
    at = values[np.clip(cols, 0, max(size - 1, 0))]
    if int(cols[0]) < 0 or int(cols[-1]) >= size or (count > 1 and (
            np.diff(cols) <= 0).any()) or at.any() or np.signbit(at).any():
        raise FleetError(f"{where}: a partial sum's spilled positions are not ascending "
                         f"positions within its {size} elements whose float64 values are "
                         f"+0.0; {_FORGED}")
    return cols


def _doubles_of(leaf: pb.LeafPartial, data: bytes, dtype: np.dtype, fits: bool,
                size: int, where: str, spilled: bool) -> np.ndarray:
    """A sum sent as float64 values (only for floats of at most 4 bytes, one value per
    element, with limbs only for `spilled` elements; `fits`: whether `dtype` is one):
    those values, once the form is checked."""
    if not fits:
        raise FleetError(f"{where}: a {dtype} sum sent as float64 values; devices send "
                         f"those only for floats of at most 4 bytes; {_FORGED}")
    if not spilled and (leaf.num_limbs or leaf.base_limb or leaf.limbs or leaf.nonfinite):
        raise FleetError(f"{where}: a partial sum sent both as float64 values and as "
                         f"limbs; devices send one form; {_FORGED}")
    if len(data) != size * 8:
        raise FleetError(f"{where}: a partial sum of {size} float64 values should hold "
                         f"{size * 8} bytes, holds {len(data)}")
    return np.frombuffer(data, "<f8")


_MAGNITUDE = np.uint64((1 << 63) - 1)


def _check_double_values(values: np.ndarray, dtype: np.dtype, units: int,
                         where: str) -> None:
    """Each value finite, a whole number of the dtype's smallest subnormal and at most
    what the device's addends reach (`units` of them).

    Works on the values' bits, a block at a time: positive float64 values order as
    their bits do (NaN above infinity), so one maximum checks finiteness and the bound;
    a value of at least 2^52 units is a whole number of them, so only values below that
    (the smallest nonzero magnitude says whether there are any) are looked at one by one.
    """
    emin_sub = float_params(dtype)[2]
    with np.errstate(over="ignore"):
        limit = np.float64(math.ldexp(float(units), emin_sub)).view(np.uint64)
    whole = np.float64(math.ldexp(1.0, emin_sub + 52)).view(np.uint64)
    bits = values.view(np.uint64)
    step = BLOCK_ELEMENTS
    mag = np.empty(min(step, bits.size), np.uint64)
    for lo in range(0, bits.size, step):
        block = bits[lo:lo + step]
        m = mag[:block.size]
        np.bitwise_and(block, _MAGNITUDE, out=m)
        ok = m.max() <= limit
        np.subtract(m, np.uint64(1), out=m)  # zeros wrap to the top
        if ok and m.min() < whole - np.uint64(1):  # a nonzero value below 2^52 units
            small = values[lo:lo + step]
            small = small[(np.abs(small) < np.float64(math.ldexp(1.0, emin_sub + 52)))]
            scaled = np.ldexp(small, -emin_sub)  # in units of the smallest subnormal
            ok = bool((scaled == np.floor(scaled)).all())
        if not ok:
            raise FleetError(f"{where}: a partial sum's float64 values are not finite "
                             f"whole multiples of {dtype}'s smallest subnormal within what "
                             f"the device's clients can add up to; {_FORGED}")


def check_pending(pending: list) -> None:
    """`_check_double_values` of the leaves `check_partial` set aside, one set of array
    operations per dtype and bound for the small ones (large ones go alone: joining
    would copy them; each in spans of blocks on the worker threads, `threads.in_spans`);
    a failing group is checked leaf by leaf, so the error names the leaf."""
    groups: dict = {}
    for values, dtype, units, where in pending:
        if values.size > BLOCK_ELEMENTS:  # in spans of blocks on the worker threads
            threads.in_spans(values.size, BLOCK_ELEMENTS, lambda lo, hi: _check_double_values(
                values[lo:hi], dtype, units, where))
        else:
            groups.setdefault((dtype, units), []).append((values, dtype, units, where))
    for (dtype, units), entries in groups.items():
        if len(entries) > 1:
            try:
                _check_double_values(np.concatenate([e[0] for e in entries]), dtype, units,
                                     entries[0][3])
                continue
            except FleetError:
                pass
        for values, _, _, where in entries:
            _check_double_values(values, dtype, units, where)


def _check_limbs(rows: np.ndarray, dtype: np.dtype, count: int, most: int, bounded: bool,
                 where: str) -> None:
    """Digits below the top in [0, 2^32); the top T within what the sum allows: with
    0 <= digits below < 2^(32 t) and |sum| <= units, -(most + 1) <= T <= most for
    most = units >> 32 t, and |T| < TOP_LIMIT as compacting leaves it (integers: T is
    the sum, in count times the dtype's range)."""
    if rows.shape[0] > 1 and int(np.maximum.reduce(rows[:-1].view(np.uint64),
                                                   axis=None)) >> LIMB_BITS:
        raise FleetError(f"{where}: a partial sum's limbs below the top lie outside "
                         f"[0, 2^{LIMB_BITS}); devices send them carried; {_FORGED}")
    if not bounded:
        return
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        high, low = max(count, 1) * int(info.max), max(count, 1) * int(info.min)
    else:
        high, low = min(most, TOP_LIMIT - 1), -min(most + 1, TOP_LIMIT - 1)
    top = rows[-1]
    if int(np.maximum.reduce(top)) > high or int(np.minimum.reduce(top)) < low:
        raise FleetError(
            f"{where}: a partial sum's top limb holds {int(top.min())} .. {int(top.max())}; "
            f"a sum of {count} {dtype} values keeps it in [{low}, {high}]; {_FORGED}")


def _check_secure_sum(sums: np.ndarray, most: int, where: str) -> None:
    """A secure sum's partial: each element in [0, most], what `count` clients within the
    bound reach (an int64 wraps past 2^63 - 1, so larger bounds are not checked)."""
    if most >= 1 << 63:
        return
    if int(sums.min()) < 0 or int(sums.max()) > most:
        raise FleetError(
            f"{where}: a secure sum's partial holds {int(sums.min())} .. {int(sums.max())};"
            f" its clients, each within the bound, keep it in [0, {most}]; {_FORGED}")


def _check_flags(flags: np.ndarray, rows: np.ndarray, where: str,
                 reject_nonfinite: bool) -> None:
    """Non-finite flags: known bits, -0 only where nothing else was seen and the sum is 0."""
    neg_zero = (flags & NEG_ZERO_FLAG) != 0
    if flags.max() > NONFINITE_FLAGS | NEG_ZERO_FLAG or (neg_zero & (
            (flags & NONFINITE_FLAGS) != 0)).any() or (neg_zero.any() and rows.size
                                                        and rows[:, neg_zero].any()):
        raise FleetError(f"{where}: a partial sum's non-finite flags are inconsistent "
                         f"(unknown bits, or 'only -0 added' beside other addends); "
                         f"{_FORGED}")
    if reject_nonfinite and (flags & NONFINITE_FLAGS).any():
        raise FleetError(f"{where}: some clients sent NaN or infinity (reject_nonfinite "
                         "is set)")


def check_partial(answer: pb.AggregateResponse, kind: str, value_types: list,
                  weight_types: list, num_clients: int, where: str,
                  reject_nonfinite: bool = False,
                  tops: Optional[Sequence[int]] = None,
                  pending: Optional[list] = None,
                  rounded: bool = False) -> tuple[Partial, int]:
    """Raises FleetError unless an AggregateResponse fits the aggregated value's type and
    could come from an honest device holding `num_clients` clients; returns (the partial
    it holds, its payload bytes). `tops`: for a secure sum, the largest value one client
    may add to each leaf (`aggregation.secure_bounds`). `pending`: a list that keeps the
    checks of float64-form values for the caller's one `check_pending(pending)` over
    several answers, which must pass before the partials are used; without it they run
    here. `rounded`: the round asked for rounded partials (`partials.to_message`)."""
    if answer.num_clients != num_clients:
        raise FleetError(f"{where}: a partial over {answer.num_clients} clients; the "
                         f"device holds {num_clients}")
    if len(answer.leaves) != len(value_types):
        raise FleetError(f"{where}: a partial of {len(answer.leaves)} tensors for a value "
                         f"of {len(value_types)}")
    mine = pending is None
    if mine:
        pending = []  # float64-form leaves, checked together by dtype
    leaves, payload = [], 0
    for i, (leaf, t) in enumerate(zip(answer.leaves, value_types)):
        leaf_where = f"{where}, {kind} leaf {i}"
        if kind in EXTREMES:
            array = wire.decode_tensor(leaf.extreme)
            check_tensor(array, t, leaf_where, reject_nonfinite)
            leaves.append(np.array(array))
            payload += array.nbytes  # decode_tensor checked it is the data's length
        else:
            value, size = _check_sum_leaf(leaf, t, leaf_where, reject_nonfinite, num_clients,
                                          pending, None if tops is None else tops[i],
                                          rounded=rounded)
            leaves.append(value)
            payload += size
    want_weights = 1 if kind == "weighted_mean" else 0
    if len(answer.weight_leaves) != want_weights:
        raise FleetError(f"{where}: {len(answer.weight_leaves)} weight partials for a "
                         f"{kind}; expected {want_weights}")
    weights = None
    if want_weights:
        weight_t: Optional[federated_language.TensorType] = (
            weight_types[0] if len(weight_types) == 1 else None)
        if weight_t is None:
            raise FleetError(f"{where}: weighted_mean needs one scalar weight type, got "
                             f"{len(weight_types)} tensors")
        weights, size = _check_sum_leaf(answer.weight_leaves[0], _scalar(weight_t.dtype),
                                        f"{where}, weight", reject_nonfinite, num_clients,
                                        pending, None, nonnegative=True, rounded=rounded)
        payload += size
    if mine:
        check_pending(pending)
    return Partial(kind=kind, leaves=leaves, weights=weights, count=num_clients), payload
