"""Exact running sums on the accelerator, of fixed shapes: `exact.ExactSum`'s bits.

A float addend is an integer multiple of its dtype's smallest subnormal (the unit): a
significand of p <= 24 bits at a bit position `pos` of the exponent field. A running sum
(`Acc`) keeps, per element of one flat buffer, signed int32 limbs of 16-bit digits, limb
k weighing 2^(16 * (base + k)) units, where each element's window starts at the digit of
its own lowest addend bit so far (`base`): an element whose addends span a few binades
needs a few limbs whatever the rest of the buffer holds. The number of limbs is fixed
when the sum starts, from the dtype and the number of addends alone (`limbs_for`), so a
program that adds to it compiles once whatever the data: a window of at least
`WINDOW_SPREAD` bits between an element's lowest and highest addend bits (whatever whole
limbs leave: 44 to 59 bits; a float32 sum of up to 4,095 addends holds 6 limbs, 36 bytes
an element with its base, top and flags), or (`full`) the dtype's whole range.
An addend below an element's window moves the window down (its limbs shift up by whole
digits, exactly); an element whose addends spread wider than the window marks the sum
`overflow` (its bits are then not kept), which the caller reads once and, where it is
set, sums again with `full` limbs (the same bits as the host's whatever the data).

`add` takes rows of addends ([rows, size], those of `valid` rows only, each times its row's
weight where given, the product rounded to the dtype as the host rounds it), `merged`
joins two sums, `result` rounds once, to nearest-even, by integer operations, element-wise
throughout (digits picked by selects, not gathers, which are slow on a TPU); non-finite
addends and -0 follow `exact` (NaN if any addend is NaN or both infinities occur, else
the infinity; -0 only if every addend is -0). Every function is traceable: a caller
compiles it into its own program (`device_sums`, `device_rounds`).

Magnitudes (why int32 never overflows): limbs are kept carried (digits in [0, 2^16)
under a signed top limb, which holds the sum's top bits: below 2^15 in magnitude where
the window holds the sum). An addend adds to at most three limbs, each by less than 2^17,
so `BLOCK_ROWS` = 2^13 addends add below 2^30 before the carries are propagated again.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fax_bridge.runtime.device_floats import astype, fields, product
from fax_bridge.runtime.float_bits import float_params

DIGIT_BITS = 16
_DIGIT_MASK = (1 << DIGIT_BITS) - 1
BLOCK_ROWS = 1 << 13  # addends added between carry propagations (module docstring)
WINDOW_SPREAD = 44  # bits between an element's lowest and highest addend bits, at least
_NONE = 1 << 26  # the base of an element with no finite nonzero addend yet


class Acc(NamedTuple):
    """A running exact sum of a flat buffer of `size` elements (a pytree of arrays)."""

    base: jax.Array      # int32 [size]: the window's lowest digit (_NONE: no addend)
    top: jax.Array       # int32 [size]: the highest addend bit position so far, or -1
    limbs: jax.Array     # int32 [limbs, size], carried
    nan: jax.Array       # bool [size]: a NaN was added
    pos_inf: jax.Array   # bool [size]
    neg_inf: jax.Array   # bool [size]
    neg_zero: jax.Array  # bool [size]: every addend so far was -0 (none counts as one)
    overflow: jax.Array  # bool []: an element's addends spread past the window


def max_position(dtype: np.dtype) -> int:
    """The highest bit position (in units) a finite addend's significand starts at."""
    _, nexp, _, _ = float_params(np.dtype(dtype))
    return (1 << nexp) - 3


def count_bits(count: int) -> int:
    """Bits a sum of `count` addends grows by over its largest addend, and a sign."""
    return int(max(1, count)).bit_length() + 1


def limbs_for(dtype: np.dtype, count: int, full: bool = False) -> int:
    """Limbs of a sum of `count` addends of `dtype`: a window of at least `WINDOW_SPREAD`
    bits between an element's lowest and highest addend bits (or its dtype's whole range,
    if `full` or narrower), its significand's bits, a digit's alignment and the carries;
    the window is whatever the whole limbs leave (`add` checks against them)."""
    p = float_params(np.dtype(dtype))[0]
    spread = max_position(dtype) if full else min(WINDOW_SPREAD, max_position(dtype))
    return -(-(spread + p + DIGIT_BITS - 1 + count_bits(count)) // DIGIT_BITS)


def empty(size: int, limbs: int) -> Acc:
    """The sum of no addends (traceable)."""
    none = jnp.zeros(size, bool)
    return Acc(jnp.full(size, _NONE, jnp.int32), jnp.full(size, -1, jnp.int32),
               jnp.zeros((limbs, size), jnp.int32), none, none, none,
               jnp.ones(size, bool), jnp.zeros((), bool))


def carried(limbs) -> list:
    """Carries propagated through limbs (a list of [size] arrays, or [n, size]): digits
    in [0, 2^16) under a signed top limb, as a list (element-wise: it fuses)."""
    out, carry = [], jnp.int32(0)
    limbs = list(limbs)
    for limb in limbs[:-1]:
        total = limb + carry
        out.append(total & _DIGIT_MASK)
        carry = total >> DIGIT_BITS
    return out + [limbs[-1] + carry]


def _shifted(limbs: jax.Array, by: jax.Array) -> list:
    """Carried limbs ([n, size]) moved up by `by` (>= 0, per element) whole digits: the
    same value over a window `by` digits lower, carried. The new top limb is the signed
    value of the digits from there up: modulo 2^32 (int32 arithmetic wraps), only the
    two lowest of them count, and where the value fits the window that is its exact
    value (a value that does not fit is lost: the caller's `overflow` says so). Built
    limb by limb from element-wise selects, which fuse: no stack is written per
    distance."""
    n = limbs.shape[0]
    rows = [limbs[i] for i in range(n)]
    out = []
    for j in range(n):
        limb = rows[j]
        for t in range(1, j + 1):
            moved = rows[j - t] if j < n - 1 else rows[j - t] + (rows[j - t + 1] << DIGIT_BITS)
            limb = jnp.where(by == t, moved, limb)
        out.append(jnp.where(by > j, jnp.zeros_like(limb), limb) if j < n - 1 else limb)
    return out


def _fits(top, base, p: int, bits: int, limbs: int) -> jax.Array:
    """Whether a sum of addends whose highest bit lies at `top` fits the window."""
    return (top < 0) | (top + p + bits - DIGIT_BITS * base <= DIGIT_BITS * limbs)


def _block_limbs(pos, mant, negative, live, base, limbs: int) -> list:
    """The limbs (`limbs` arrays [size]) of one block's addends ([rows, size]; each limb below
    2^30 in magnitude)."""
    off = jnp.where(live, pos - DIGIT_BITS * base, 0)
    idx, shift = off >> 4, off & 15
    low, high = (mant & _DIGIT_MASK) << shift, (mant >> DIGIT_BITS) << shift
    sign = jnp.where(live, jnp.where(negative, -1, 1), 0)
    pieces = ((low & _DIGIT_MASK) * sign,
              ((low >> DIGIT_BITS) + (high & _DIGIT_MASK)) * sign,
              (high >> DIGIT_BITS) * sign)
    # One reduction over the rows per limb, each fusing with the selects that feed it
    # (a [rows, limbs, size] stack of the pieces would be written out whole).
    return [jnp.sum(sum(jnp.where(idx == k - j, piece, 0)
                        for j, piece in enumerate(pieces) if k - j >= 0), axis=0)
            for k in range(limbs)]


def weighted(rows: jax.Array, weights: jax.Array) -> jax.Array:
    """Each row times its weight ([rows] or [rows, 1]), as the host computes a weighted
    mean's products: the weight cast to the rows' dtype, both to float32, the product
    rounded to the dtype."""
    by = astype(astype(weights.reshape((rows.shape[0], 1)), rows.dtype), np.float32)
    return astype(product(astype(rows, np.float32), by), rows.dtype)


def add(acc: Acc, rows: jax.Array, valid: jax.Array, count: int) -> Acc:
    """`acc` plus the `valid` rows of `rows` ([rows, size] floats; `valid`: bool
    [rows]); `count`: the most addends this sum ever takes (the limbs' carries)."""
    dtype = np.dtype(rows.dtype)
    p = float_params(dtype)[0]
    limbs = acc.limbs.shape[0]
    for start in range(0, rows.shape[0], BLOCK_ROWS):
        block = rows[start:start + BLOCK_ROWS]
        ok = valid[start:start + BLOCK_ROWS][:, None]
        pos, mant, negative, is_nan, is_pos_inf, is_neg_inf, is_neg_zero = fields(block)
        live = ok & (mant != 0)
        lowest = jnp.min(jnp.where(live, pos, DIGIT_BITS * _NONE), axis=0)
        base = jnp.minimum(acc.base, lowest >> 4)
        top = jnp.maximum(acc.top, jnp.max(jnp.where(live, pos, -1), axis=0))
        moved = _shifted(acc.limbs, jnp.where(acc.base < _NONE, acc.base - base, 0))
        added = _block_limbs(pos, mant, negative, live, base[None], limbs)
        acc = Acc(base, top, jnp.stack(carried([a + b for a, b in zip(moved, added)])),
                  acc.nan | jnp.any(ok & is_nan, axis=0),
                  acc.pos_inf | jnp.any(ok & is_pos_inf, axis=0),
                  acc.neg_inf | jnp.any(ok & is_neg_inf, axis=0),
                  acc.neg_zero & jnp.all(~ok | is_neg_zero, axis=0),
                  acc.overflow | ~jnp.all(_fits(top, base, p, count_bits(count), limbs)))
    return acc


def merged(a: Acc, b: Acc, dtype: np.dtype, count: int) -> Acc:
    """The sum of both (of one dtype, size and limb count)."""
    p = float_params(np.dtype(dtype))[0]
    base = jnp.minimum(a.base, b.base)
    top = jnp.maximum(a.top, b.top)

    def moved(x: Acc) -> list:
        return _shifted(x.limbs, jnp.where(x.base < _NONE, x.base - base, 0))

    limbs = jnp.stack(carried([x + y for x, y in zip(moved(a), moved(b))]))
    fits = jnp.all(_fits(top, base, p, count_bits(count), limbs.shape[0]))
    return Acc(base, top, limbs, a.nan | b.nan, a.pos_inf | b.pos_inf,
               a.neg_inf | b.neg_inf, a.neg_zero & b.neg_zero,
               a.overflow | b.overflow | ~fits)


def result(acc: Acc, dtype: np.dtype, into: Optional[np.dtype] = None) -> jax.Array:
    """The sum of addends of `dtype`, rounded once to `dtype`, or to `into` (float32,
    for a float16 or bfloat16 sum) (flat; `ExactSum.result`'s bits unless
    `acc.overflow`)."""
    dtype = np.dtype(dtype)
    into = dtype if into is None else np.dtype(into)
    base = jnp.where(acc.base < _NONE, acc.base, 0)
    bits = _rounded(acc.limbs, base, dtype, into)
    bits = _specials(bits, acc.nan, acc.pos_inf, acc.neg_inf, acc.neg_zero, into)
    uint = jnp.uint32 if into.itemsize == 4 else jnp.uint16
    return lax.bitcast_convert_type(bits.astype(uint), into)


def _pick(digits: list, at: jax.Array) -> jax.Array:
    """digits[at[e]][e] for every element e, by selects (a gather is slow on a TPU)."""
    out = jnp.zeros_like(digits[0])
    for k, digit in enumerate(digits):
        out = jnp.where(at == k, digit, out)
    return out


def _rounded(limbs: jax.Array, base: jax.Array, dtype: np.dtype,
             into: np.dtype) -> jax.Array:
    """The bits (uint32) of the finite sum held by carried `limbs` ([n, size], limb k
    weighing 2^(16 * (base + k)) units of `dtype`, `base` per element), rounded to
    nearest `into` (`dtype` or a wider float), ties to even (an overflow gives the
    infinity). Element-wise throughout: it fuses into one pass."""
    p, nexp, into_lsb, _ = float_params(into)
    offset = float_params(dtype)[2] - into_lsb  # dtype's unit in units of `into`'s
    negative = limbs[-1] < 0
    magnitude = carried([jnp.where(negative, -limbs[k], limbs[k])
                         for k in range(limbs.shape[0])])
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
    ulp = jnp.maximum(msb + offset - (p - 1), 0)  # the result's last bit, in into's units
    below = ulp - offset - DIGIT_BITS * low - 1  # the rounding bit, from the window's bottom
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
    return encoded | jnp.where(negative, jnp.uint32(1 << (8 * into.itemsize - 1)),
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


def flat_rows(tensors: list) -> jax.Array:
    """[rows, size] of tensors of one dtype that share their leading axis (rows), each
    flattened, side by side: one buffer whose sum compiles as one, however many there
    are."""
    rows = tensors[0].shape[0]
    flat = [t.reshape((rows, -1)) for t in tensors]
    return flat[0] if len(flat) == 1 else jnp.concatenate(flat, axis=1)


def split(flat: jax.Array, shapes: list) -> list:
    """`flat_rows`'s inverse for one row: the tensors of `shapes`."""
    out, start = [], 0
    for shape in shapes:
        size = math.prod(shape)
        out.append(flat[start:start + size].reshape(shape))
        start += size
    return out


def least_weight(rows: jax.Array, valid: jax.Array,
                 least: Optional[tuple] = None) -> tuple:
    """(the smallest float32 key, whether a NaN was seen) over the `valid` rows of
    weights, after `least` (a previous answer): keys order float32 bits as the floats
    (a negative subnormal weight is negative, where a flushing backend would see zero)."""
    flat = astype(rows.reshape((rows.shape[0], -1)), np.float32)
    ok = valid[:, None]
    bits = lax.bitcast_convert_type(flat, jnp.int32)
    key = jnp.where(bits < 0, -(bits & 0x7FFFFFFF), bits)  # -0 just below +0
    nan = jnp.any(ok & fields(flat)[3])
    low = jnp.min(jnp.where(ok, key, 0x7F800000))
    if least is not None:
        low, nan = jnp.minimum(low, least[0]), nan | least[1]
    return low, nan


def weight_of_key(key: jax.Array, nan: jax.Array) -> jax.Array:
    """The float32 weight `least_weight`'s key stands for (NaN if one was seen)."""
    bits = jnp.where(key < 0, (-key) | jnp.int32(-0x80000000), key)
    return jnp.where(nan, jnp.float32(jnp.nan), lax.bitcast_convert_type(bits, jnp.float32))
