"""Exact sums on the accelerator: `exact.ExactSum`'s bits, computed where the addends are.

A round run on an accelerator (`on_device`) keeps the clients' results there (jax
arrays) and sums them there with 32-bit integers only: TPUs have no float64 and jax's
default has no int64. A float addend is an integer multiple of its dtype's smallest
subnormal (the unit): a significand of p <= 24 bits at a bit position `pos` of the
exponent field. The sum is kept element-wise as signed int32 limbs of 16-bit digits,
limb k weighing 2^(16 * (base + k)) units, where each element's window starts at its
own lowest addend bit (`_window`), so an element whose addends span a few binades takes
3 or 4 limbs whatever the rest of the tensor holds. One reduction read back per dtype
(`_spreads`: the widest window of each tensor) fixes the limb count, bucketed
(`LIMB_BUCKETS`) so that the sums compile for few shapes, and then every tensor of that
dtype is summed in one compiled call (`_float_sums`). A large tensor of a few clients'
rows (`unrolled`: a round of few clients on a large model) is read a row at a time, so
that its whole sum, window, limbs and rounding, is one element-wise pass over the rows;
otherwise each limb is a reduction over the rows. The sum is rounded once, to
nearest-even, by integer operations, element-wise throughout (digits picked by selects,
not gathers, which are slow on a TPU), and non-finite addends and -0 follow `exact`
(NaN if any addend is NaN or both infinities occur, else the infinity; -0 only if every
addend is -0). Hence the result has the same
bits as the host's `ExactSum` for the same addends, whatever the backend's float
arithmetic does with subnormals. Integer sums wrap in their dtype, as the host's do.
A weighted mean's products and a mean's division are integer operations too
(`device_floats`: a TPU flushes subnormals in its float arithmetic).

Magnitudes (why int32 never overflows): an addend adds to at most three limbs, each by
less than 2^17 (a 16-bit low piece shifted by under 16 bits splits into < 2^16 and
< 2^15; the high piece, under 2^8, adds < 2^16 and < 2^7). `BLOCK_ROWS` = 2^13 addends
add below 2^30 to a limb; then carries are propagated (digits back in [0, 2^16), the top
limb signed), and the next block adds to digits below 2^16, so nothing reaches 2^31.

`DeviceColumn` holds one tensor's addends as the batched client calls left them (an
array per call, padding rows after the clients'); `aggregation` merges and finishes
partials made of them (`finish`: sum, mean, weighted_mean). `on_device` says, in one
place, whether a run takes this path.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fax_bridge.errors import AggregationError, ArgumentError, WeightError
from fax_bridge.placements import weights_refusal
from fax_bridge.runtime.device_floats import astype, fields, product, quotient
from fax_bridge.runtime.float_bits import float_params

DIGIT_BITS = 16
_DIGIT_MASK = (1 << DIGIT_BITS) - 1
BLOCK_ROWS = 1 << 13  # addends summed between carry propagations (module docstring)
LIMB_BUCKETS = (2, 3, 4, 6, 8, 12, 16, 20, 24, 32)  # limb counts compiled for
KINDS = ("sum", "mean", "weighted_mean")  # the aggregations finished on the device
ENV_VAR = "FAX_BRIDGE_ON_DEVICE"  # "1": rounds on the device path, "0": on the host


def on_device(requested: Optional[bool] = None) -> bool:
    """Whether a round keeps its values on jax's default device and sums there: as
    `requested` where given (True or False; anything else, a string like "0" among
    them, is refused), else as the environment variable `FAX_BRIDGE_ON_DEVICE` says
    ("1" or "0"), else whenever jax's default backend is not the CPU."""
    if isinstance(requested, (bool, np.bool_)):
        return bool(requested)
    if requested is not None:
        raise ArgumentError(f"on_device={requested!r}: expected True (sum rounds on the "
                            "device), False (on the host) or None (as FAX_BRIDGE_ON_DEVICE "
                            "or the default backend decides)")
    setting = os.environ.get(ENV_VAR, "").strip()
    if setting in ("1", "0"):
        return setting == "1"
    if setting:
        raise ArgumentError(f"{ENV_VAR}={setting!r}: expected 1 (sum rounds on the "
                            "device) or 0 (on the host), or leave it unset")
    return jax.default_backend() != "cpu"


def _float_dtypes() -> tuple:
    return (np.dtype(np.float32), np.dtype(np.float16), np.dtype(jnp.bfloat16))


def supports(dtype: np.dtype) -> bool:
    """Whether `exact_sum` takes addends of `dtype` (floats of at most 4 bytes; the
    integers jax holds as they are)."""
    dtype = np.dtype(dtype)
    if dtype in _float_dtypes():
        return True
    return dtype.kind in "iu" and (dtype.itemsize <= 4 or bool(jax.config.jax_enable_x64))


@dataclasses.dataclass
class DeviceColumn:
    """One tensor's addends on the device: `parts[i]` ([rows, *shape]) holds
    `counts[i]` addends in its first rows (the rest is padding, never read)."""

    parts: list
    counts: list

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.parts[0].dtype)

    @property
    def shape(self) -> tuple:
        return tuple(self.parts[0].shape[1:])

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def joined(self, other: "DeviceColumn") -> "DeviceColumn":
        """The addends of both, this one's first."""
        if other.dtype != self.dtype or other.shape != self.shape:
            raise AggregationError(
                f"partial sums disagree: {self.dtype}{list(self.shape)} vs "
                f"{other.dtype}{list(other.shape)}")
        return DeviceColumn(self.parts + other.parts, self.counts + other.counts)


# -- the exact sum ------------------------------------------------------------------------


def exact_sum(column: DeviceColumn) -> jax.Array:
    """The sum of the column's addends, rounded once to their dtype (`ExactSum`'s bits)."""
    return exact_sums([column])[0]


def exact_sums(columns: Sequence[DeviceColumn],
               weights: Optional[DeviceColumn] = None) -> list:
    """`exact_sum` of each column: the float columns of one dtype in one compiled call,
    after one read back of how many limbs they need (`_spreads`). With `weights` (a
    column of one weight a client, its parts holding the columns' rows), the sums of
    each client's value times its weight, the product rounded to the value's dtype
    (computed as the rows are read: no copy of the products)."""
    out: list = [None] * len(columns)
    floats: dict = {}
    for i, column in enumerate(columns):
        dtype = column.dtype
        if not supports(dtype):
            raise AggregationError(f"the device sums no tensors of dtype {dtype}; sum them "
                                   "on the host (on_device=False)")
        if dtype.kind in "iu" and weights is None:
            out[i] = _integer_sum(tuple(column.parts), _counts(column))
        else:
            floats.setdefault(dtype, []).append(i)
    for dtype, at in floats.items():
        group = [columns[i] for i in at]
        parts = tuple(tuple(c.parts) for c in group)
        counts = tuple(_counts(c) for c in group)
        scale = None if weights is None else tuple(weights.parts)
        spreads = jax.device_get(_spreads(parts, counts, scale))
        limbs = max(_limb_count(dtype, int(s), c.count) for s, c in zip(spreads, group))
        unroll = tuple(unrolled(sum(x.shape[0] for x in c.parts), limbs, c.size)
                       for c in group)
        for i, total in zip(at, _float_sums(parts, counts, scale, limbs=limbs,
                                            unroll=unroll)):
            out[i] = total
    return out


def _counts(column: DeviceColumn) -> tuple:
    return tuple(jnp.int32(c) for c in column.counts)


def _limb_count(dtype: np.dtype, spread: int, count: int) -> int:
    """The bucketed number of limbs holding, at every element, a sum of `count` addends
    whose highest bit lies below `spread` + p above the bottom of the element's window
    (`_window`; spread < 0: no finite nonzero addend anywhere)."""
    if spread < 0:
        return 0
    p = float_params(dtype)[0]
    top = spread + p + int(max(1, count)).bit_length() + 1  # the sum's bits, and a sign
    needed = -(-top // DIGIT_BITS) + 1
    for size in LIMB_BUCKETS:
        if size >= needed:
            return size
    raise AggregationError(f"a sum of {count} addends needs {needed} limbs, more than "
                           f"{LIMB_BUCKETS[-1]}; sum fewer addends at once")


# A column of at most UNROLL_ROWS rows summed over at most UNROLL_LIMBS limbs is read a
# row at a time (`_slabs`): the sum is then one element-wise pass, reading each row
# once. Its program grows with rows x limbs (compile time, a second or so per tensor),
# so it is kept for tensors of at least UNROLL_SIZE elements, where the passes cost;
# elsewhere the rows are reduced, a pass over them for every limb and flag.
UNROLL_ROWS, UNROLL_LIMBS, UNROLL_SIZE = 8, 8, 1 << 16


def unrolled(rows: int, limbs: int, size: int) -> bool:
    """Whether a column of `rows` rows (padding included) and `size` elements a row,
    summed over `limbs` limbs, is read a row at a time."""
    return rows <= UNROLL_ROWS and limbs <= UNROLL_LIMBS and size >= UNROLL_SIZE


def _slabs(parts: tuple, counts: tuple, scale: Optional[tuple], unroll: bool) -> list:
    """The parts' rows (times the rows of `scale`'s parts, rounded to their dtype, where
    given) as [(slab [rows, size], which of them hold addends [rows, 1])]: one slab per
    row if `unroll`, so that a sum over a slab's rows is an element-wise add fusing with
    what computes and consumes it; else slabs of at most `BLOCK_ROWS` rows (carries
    propagated between them)."""
    out = []
    step = 1 if unroll else BLOCK_ROWS
    for part, (x, count) in enumerate(zip(parts, counts)):
        flat = x.reshape((x.shape[0], -1))
        if scale is not None:  # as the host: the weight cast to the dtype, a float32
            by = astype(astype(scale[part].reshape((x.shape[0], 1)), flat.dtype),
                        np.float32)
            flat = astype(product(astype(flat, np.float32), by), flat.dtype)
        valid = (jnp.arange(x.shape[0]) < count)[:, None]
        out += [(flat[start:start + step], valid[start:start + step])
                for start in range(0, x.shape[0], step)]
    return out


_NONE = 1 << 30  # the lowest position of an element with no finite nonzero addend


def _window(parts: tuple, counts: tuple, scale: Optional[tuple], unroll: bool) -> tuple:
    """Per element: the digit its window starts at (`base`: the lowest bit position of
    its finite nonzero addends, over 16) and the highest such position (-1: none)."""
    lo = hi = None
    for flat, valid in _slabs(parts, counts, scale, unroll):
        pos, mant = fields(flat)[:2]
        live = valid & (mant != 0)
        least = jnp.min(jnp.where(live, pos, _NONE), axis=0)
        most = jnp.max(jnp.where(live, pos, -1), axis=0)
        lo = least if lo is None else jnp.minimum(lo, least)
        hi = most if hi is None else jnp.maximum(hi, most)
    return jnp.where(hi < 0, 0, lo >> 4), hi


@jax.jit
def _spreads(columns: tuple, counts: tuple, scale: Optional[tuple]) -> jax.Array:
    """Per column: the largest distance, over its elements, from the bottom of an
    element's window to its highest addend bit (-1 when no element has a finite
    nonzero addend)."""
    out = []
    for parts, n in zip(columns, counts):
        base, hi = _window(parts, n, scale, sum(x.shape[0] for x in parts) <= UNROLL_ROWS)
        out.append(jnp.max(jnp.where(hi < 0, -1, hi - DIGIT_BITS * base), initial=-1))
    return jnp.stack(out)


def _carried(limbs: list) -> list:
    """Carries propagated: digits in [0, 2^16) under a signed top limb."""
    out, carry = [], jnp.int32(0)
    for limb in limbs[:-1]:
        total = limb + carry
        out.append(total & _DIGIT_MASK)
        carry = total >> DIGIT_BITS
    return out + [limbs[-1] + carry]


def _block_limbs(pos, mant, negative, live, base, limbs: int) -> list:
    """The limbs of one block's addends (each limb below 2^30 in magnitude)."""
    off = jnp.where(live, pos - DIGIT_BITS * base, 0)
    idx, shift = off >> 4, off & 15
    low, high = (mant & _DIGIT_MASK) << shift, (mant >> DIGIT_BITS) << shift
    sign = jnp.where(live, jnp.where(negative, -1, 1), 0)
    pieces = ((low & _DIGIT_MASK) * sign,
              ((low >> DIGIT_BITS) + (high & _DIGIT_MASK)) * sign,
              (high >> DIGIT_BITS) * sign)
    return [sum(jnp.sum(jnp.where(idx == k - j, piece, 0), axis=0)
                for j, piece in enumerate(pieces) if k - j >= 0) for k in range(limbs)]


@functools.partial(jax.jit, static_argnames=("limbs", "unroll"))
def _float_sums(columns: tuple, counts: tuple, scale: Optional[tuple], limbs: int,
                unroll: tuple) -> list:
    """Each column's exact sum (of its rows times `scale`'s, where given), over `limbs`
    limbs an element from its own window; the i-th read a row at a time where
    `unroll[i]`."""
    return [_float_sum(parts, n, scale, limbs, u).reshape(parts[0].shape[1:])
            for parts, n, u in zip(columns, counts, unroll)]


def _float_sum(parts: tuple, counts: tuple, scale: Optional[tuple], limbs: int,
               unroll: bool) -> jax.Array:
    dtype = np.dtype(parts[0].dtype)
    size = math.prod(parts[0].shape[1:])
    base = _window(parts, counts, scale, unroll)[0][None, :]
    acc = [jnp.zeros(size, jnp.int32) for _ in range(limbs)]
    nan = pos_inf = neg_inf = jnp.zeros(size, bool)
    neg_zero = jnp.ones(size, bool)
    pending = 0  # rows added since the last carry propagation
    for block, ok in _slabs(parts, counts, scale, unroll):
        pos, mant, negative, is_nan, is_pos_inf, is_neg_inf, is_neg_zero = fields(block)
        nan |= jnp.any(ok & is_nan, axis=0)
        pos_inf |= jnp.any(ok & is_pos_inf, axis=0)
        neg_inf |= jnp.any(ok & is_neg_inf, axis=0)
        neg_zero &= jnp.all(~ok | is_neg_zero, axis=0)
        if limbs:
            if pending + block.shape[0] > BLOCK_ROWS:
                acc, pending = _carried(acc), 0
            live = ok & (mant != 0)
            added = _block_limbs(pos, mant, negative, live, base, limbs)
            acc = [a + b for a, b in zip(acc, added)]
            pending += block.shape[0]
    bits = _rounded(_carried(acc), base[0], dtype) if limbs else jnp.zeros(size, jnp.uint32)
    bits = _specials(bits, nan, pos_inf, neg_inf, neg_zero, dtype)
    nbits = 8 * dtype.itemsize
    uint = jnp.uint32 if nbits == 32 else jnp.uint16
    return lax.bitcast_convert_type(bits.astype(uint), dtype)


def _pick(digits: list, at: jax.Array) -> jax.Array:
    """digits[at[e]][e] for every element e, by selects (a gather is slow on a TPU)."""
    out = jnp.zeros_like(digits[0])
    for k, digit in enumerate(digits):
        out = jnp.where(at == k, digit, out)
    return out


def _rounded(limbs: list, base: jax.Array, dtype: np.dtype) -> jax.Array:
    """The bits (uint32) of the finite sum held by carried `limbs` (limb k weighing
    2^(16 * (base + k)) units, `base` per element), rounded to nearest, ties to even (an
    overflow gives the infinity). Element-wise throughout: it fuses into one pass."""
    p, nexp, _, _ = float_params(dtype)
    negative = limbs[-1] < 0
    magnitude = _carried([jnp.where(negative, -limb, limb) for limb in limbs])
    zero = jnp.zeros_like(magnitude[0])
    # Two zero digits below (the rounding reads up to 32 bits under the result's last
    # bit) and two above (three digits are read from there): digit k weighs
    # 2^(16 * (low + k)) units.
    digits = [zero, zero, *magnitude, zero, zero]
    low = base - 2
    top = jnp.full_like(zero, -1)
    for k, digit in enumerate(digits):
        top = jnp.where(digit != 0, k, top)
    is_zero = top < 0
    top = jnp.maximum(top, 0)
    head = _pick(digits, top)
    msb = DIGIT_BITS * (top + low) + (31 - lax.clz(head))  # the sum's highest bit, in units
    ulp = jnp.maximum(msb - (p - 1), 0)  # the result's last bit
    below = ulp - DIGIT_BITS * low - 1  # the rounding bit, from the window's bottom
    first, shift = below >> 4, (below & 15).astype(jnp.uint32)
    last = len(digits) - 1
    a, b, c = (_pick(digits, jnp.minimum(first + j, last)).astype(jnp.uint32)
               for j in range(3))
    window = (a >> shift) | (b << (16 - shift)) | jnp.where(
        shift == 0, jnp.uint32(0), c << jnp.minimum(32 - shift, 31))
    window &= jnp.uint32((1 << (p + 2)) - 1)
    half, q = window & 1, window >> 1
    lower = jnp.zeros(zero.shape, bool)  # a nonzero digit below digit `first`
    for k, digit in enumerate(digits):
        lower |= (digit != 0) & (k < first)
    sticky = ((a & ((jnp.uint32(1) << shift) - 1)) != 0) | lower
    q = q + (half & (sticky | ((q & 1) != 0))).astype(jnp.uint32)
    top_exponent = (1 << nexp) - 1
    encoded = (jnp.minimum(ulp, top_exponent).astype(jnp.uint32) << (p - 1)) + q
    encoded = jnp.minimum(encoded, jnp.uint32(top_exponent << (p - 1)))  # overflow: inf
    encoded = jnp.where(is_zero, jnp.uint32(0), encoded)
    return encoded | jnp.where(negative, jnp.uint32(1 << (8 * dtype.itemsize - 1)),
                               jnp.uint32(0))


def _specials(bits, nan, pos_inf, neg_inf, neg_zero, dtype: np.dtype) -> jax.Array:
    """`ExactSum.result`'s rules for -0 and non-finite addends, on result bits."""
    p, nexp, _, uint = float_params(dtype)
    sign = 1 << (8 * dtype.itemsize - 1)
    inf = ((1 << nexp) - 1) << (p - 1)
    quiet_nan = int(np.array(np.nan).astype(dtype).view(uint))  # the host's NaN
    bits = jnp.where(neg_zero, jnp.uint32(sign), bits)
    return jnp.where(nan | (pos_inf & neg_inf), jnp.uint32(quiet_nan),
                     jnp.where(pos_inf, jnp.uint32(inf),
                               jnp.where(neg_inf, jnp.uint32(inf | sign), bits)))


@jax.jit
def _integer_sum(parts: tuple, counts: tuple) -> jax.Array:
    """The wrapped sum of integer addends, in their dtype."""
    total = jnp.zeros(parts[0].shape[1:], parts[0].dtype)
    for x, count in zip(parts, counts):
        valid = (jnp.arange(x.shape[0]) < count).reshape((-1,) + (1,) * (x.ndim - 1))
        total = total + jnp.sum(jnp.where(valid, x, 0), axis=0, dtype=x.dtype)
    return total


# -- finishing an aggregation ---------------------------------------------------------------


def finish(kind: str, columns: Sequence[DeviceColumn], weights: Optional[DeviceColumn],
           count: int) -> list:
    """The aggregate's tensors (jax arrays, depth first) of `kind` (one of `KINDS`) over
    `count` clients' addends, as `aggregation.finish` computes them on the host: exact
    sums rounded once, a mean divided by the clients, a weighted mean's products
    rounded to the value's dtype before they are summed."""
    if kind == "sum":
        return exact_sums(columns)
    if kind == "mean":
        for c in columns:
            _check_divisible(c.dtype)
        return _divide_all(tuple(exact_sums(columns)),
                           tuple(np.asarray(count, c.dtype) for c in columns))
    least = float(jax.device_get(_least(tuple(weights.parts), _counts(weights))))
    refusal = weights_refusal(least, False)  # each client's weight, as the host checks
    if refusal:
        raise WeightError(refusal)
    by = exact_sum(weights)
    total = by.reshape(())
    refusal = weights_refusal(float(total), not bool(total))
    if refusal:
        raise WeightError(refusal)
    for c in columns:
        _check_divisible(c.dtype)
    return _divide_all(tuple(exact_sums(columns, weights)),
                       tuple(_cast(total, c.dtype) for c in columns))


def _check_divisible(dtype: np.dtype) -> None:
    if np.dtype(dtype).kind in "iub":
        raise AggregationError(
            f"federated mean and weighted_mean need floating-point values, got {dtype}; "
            "cast the clients' values to a float type first")


@jax.jit
def _divide_all(totals: tuple, bys: tuple) -> list:
    """`_divide` of each total by its divisor, in one compiled call."""
    return [_divide(t, b) for t, b in zip(totals, bys)]


@jax.jit
def _divide(total: jax.Array, by: jax.Array) -> jax.Array:
    """total / by in total's dtype, as numpy divides on the host: the float32 quotient,
    rounded to the dtype (`device_floats`: the bits whatever the backend's float
    arithmetic does)."""
    quotient_ = quotient(astype(total, np.float32),
                         jnp.broadcast_to(astype(by, np.float32), total.shape))
    return astype(quotient_, total.dtype)


@functools.partial(jax.jit, static_argnums=1)
def _cast(x: jax.Array, dtype: np.dtype) -> jax.Array:
    return astype(x, dtype)


@jax.jit
def _least(parts: tuple, counts: tuple) -> jax.Array:
    """The smallest weight over the parts' clients (NaN if one is NaN), compared as
    integers that order float32 bits as the floats (a negative subnormal weight is
    negative here too, where a flushing backend would see zero)."""
    least, nan = jnp.int32(0x7F800000), jnp.bool_(False)  # +inf's key
    for w, count in zip(parts, counts):
        flat = astype(w.reshape((w.shape[0], -1)), np.float32)
        valid = (jnp.arange(w.shape[0]) < count)[:, None]
        bits = lax.bitcast_convert_type(flat, jnp.int32)
        key = jnp.where(bits < 0, -(bits & 0x7FFFFFFF), bits)  # -0 just below +0
        nan |= jnp.any(valid & (fields(flat)[3]))
        least = jnp.minimum(least, jnp.min(jnp.where(valid, key, 0x7F800000)))
    bits = jnp.where(least < 0, (-least) | jnp.int32(-0x80000000), least)
    return jnp.where(nan, jnp.float32(jnp.nan), lax.bitcast_convert_type(bits, jnp.float32))
