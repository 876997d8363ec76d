"""Float arithmetic by integer operations: numpy's bits on any jax backend.

The device path (`device_sums`) must give the host's bits, but a TPU flushes subnormal
floats to zero in its arithmetic and conversions, and its division may be an ulp off.
So the few float operations of an aggregation that are not sums (a weighted mean's
products, a mean's division, the casts between a value's dtype and float32) take their
operands apart into significands and exponents (`fields`, from the bit patterns), form
the exact result in 32-bit integers and round it once, to nearest, ties to even
(`_encoded`). Zeros, infinities and NaN are classified from the bits too, never
computed by the backend (an infinity times a subnormal is an infinity, which a
flushing multiply makes NaN).

Each function takes jax arrays and mirrors numpy: `astype` is `x.astype(dtype)`,
`product` and `quotient` are float32 `a * b` and `a / b`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fax_bridge.runtime.float_bits import float_params

with np.errstate(invalid="ignore"):  # the NaN this host's float32 operations make
    _INF32 = np.array([np.inf], np.float32)
    _MADE_NAN32 = int((_INF32 / _INF32).view(np.uint32)[0])


def fields(x: jax.Array) -> tuple:
    """(pos, mant, negative, nan, +inf, -inf, is -0) of floats x: x is -1^negative *
    mant * 2^pos units (the dtype's smallest subnormal); mant is 0 for zeros and
    non-finite values."""
    dtype = np.dtype(x.dtype)
    p, nexp, _, _ = float_params(dtype)
    nbits = 8 * dtype.itemsize
    uint = jnp.uint32 if nbits == 32 else jnp.uint16
    bits = lax.bitcast_convert_type(x, uint).astype(jnp.uint32)
    negative = (bits >> (nbits - 1)) != 0
    expo = ((bits >> (p - 1)) & ((1 << nexp) - 1)).astype(jnp.int32)
    frac = (bits & ((1 << (p - 1)) - 1)).astype(jnp.int32)
    special = expo == (1 << nexp) - 1
    normal = expo > 0
    mant = jnp.where(special, 0, jnp.where(normal, frac | (1 << (p - 1)), frac))
    pos = jnp.maximum(expo - 1, 0)
    infinite = special & (frac == 0)
    return (pos, mant, negative, special & (frac != 0), infinite & ~negative,
            infinite & negative, bits == jnp.uint32(1 << (nbits - 1)))


def _shr(x: jax.Array, s: jax.Array) -> jax.Array:
    """x >> s for uint32 x and shifts s >= 0 (0 from 32 on)."""
    return jnp.where(s >= 32, jnp.uint32(0), x >> jnp.clip(s, 0, 31).astype(jnp.uint32))


def _shl(x: jax.Array, s: jax.Array) -> jax.Array:
    """x << s for uint32 x and shifts s >= 0 (0 from 32 on)."""
    return jnp.where(s >= 32, jnp.uint32(0), x << jnp.clip(s, 0, 31).astype(jnp.uint32))


def _low_word(h, l, d) -> jax.Array:
    """The low 32 bits of (h * 2^32 + l) >> d, for 0 <= d < 64."""
    return jnp.where(d < 32, _shr(l, d) | _shl(h, 32 - d), _shr(h, d - 32))


def _encoded(h, l, e, dtype: np.dtype) -> jax.Array:
    """The bits (uint32, sign clear) of (h * 2^32 + l) * 2^e units of `dtype` (h, l
    uint32 not both 0, e int32), rounded to nearest, ties to even; past the largest
    finite value, the infinity."""
    p, nexp, _, _ = float_params(np.dtype(dtype))
    msb = jnp.where(h != 0, 63 - lax.clz(h), 31 - lax.clz(l)).astype(jnp.int32)
    ulp = jnp.maximum(msb + e - (p - 1), 0)  # the result's last bit, in units
    drop = ulp - e  # bits of the significand below it
    d = jnp.clip(drop, 1, 63)
    q = _low_word(h, l, d)
    half = _low_word(h, l, d - 1) & 1
    k = d - 1  # the bits below the rounding bit: are any set?
    low_mask = jnp.where(k >= 32, jnp.uint32(0xFFFFFFFF),
                         _shl(jnp.uint32(1), k) - jnp.uint32(1))
    high_mask = jnp.where(k > 32, _shl(jnp.uint32(1), k - 32) - jnp.uint32(1),
                          jnp.uint32(0))
    sticky = ((l & low_mask) != 0) | ((h & high_mask) != 0)
    rounded = q + (half & (sticky | ((q & 1) != 0)).astype(jnp.uint32))
    exact = _shl(l, -drop)  # drop <= 0: the significand fits, h is 0
    mant = jnp.where(drop <= 0, exact, rounded)
    top = (1 << nexp) - 1
    encoded = (jnp.minimum(ulp, top).astype(jnp.uint32) << (p - 1)) + mant
    return jnp.minimum(encoded, jnp.uint32(top << (p - 1)))


def _signed(bits, negative, dtype: np.dtype) -> jax.Array:
    """uint32 bits with the sign set where `negative`, as floats of `dtype`."""
    dtype = np.dtype(dtype)
    nbits = 8 * dtype.itemsize
    bits = bits | jnp.where(negative, jnp.uint32(1 << (nbits - 1)), jnp.uint32(0))
    uint = jnp.uint32 if nbits == 32 else jnp.uint16
    return lax.bitcast_convert_type(bits.astype(uint), dtype)


def _special_bits(dtype: np.dtype) -> tuple:
    """(the infinity's bits, a quiet NaN's bits) of `dtype`."""
    p, nexp, _, _ = float_params(np.dtype(dtype))
    inf = ((1 << nexp) - 1) << (p - 1)
    return jnp.uint32(inf), jnp.uint32(inf | (1 << (p - 2)))


def astype(x: jax.Array, dtype) -> jax.Array:
    """`x.astype(dtype)` to a float dtype of at most 4 bytes, from one of those or an
    integer, rounded as numpy rounds, subnormals kept."""
    dtype = np.dtype(dtype)
    if np.dtype(x.dtype) == dtype:
        return x
    if np.dtype(x.dtype).kind in "biu":  # integers round alike everywhere
        return x.astype(dtype)
    pos, mant, negative, nan, pos_inf, neg_inf, _ = fields(x)
    shift = float_params(np.dtype(x.dtype))[2] - float_params(dtype)[2]
    finite = _encoded(jnp.zeros_like(mant, jnp.uint32), mant.astype(jnp.uint32),
                      pos + shift, dtype)
    inf, quiet = _special_bits(dtype)
    bits = jnp.where(nan, quiet, jnp.where(pos_inf | neg_inf, inf,
                                           jnp.where(mant == 0, jnp.uint32(0), finite)))
    return _signed(bits, negative, dtype)


def product(a: jax.Array, b: jax.Array) -> jax.Array:
    """a * b for float32 arrays (broadcast), rounded as numpy rounds."""
    pa, ma, na, nan_a, pinf_a, ninf_a, _ = fields(a)
    pb, mb, nb, nan_b, pinf_b, ninf_b, _ = fields(b)
    inf_a, inf_b = pinf_a | ninf_a, pinf_b | ninf_b
    zero_a = (ma == 0) & ~nan_a & ~inf_a
    zero_b = (mb == 0) & ~nan_b & ~inf_b
    # ma * mb (up to 48 bits) from 12-bit halves: m = p2 * 2^24 + p1 * 2^12 + p0.
    a1, a0 = ma >> 12, ma & 0xFFF
    b1, b0 = mb >> 12, mb & 0xFFF
    p0, p1, p2 = a0 * b0, a0 * b1 + a1 * b0, a1 * b1
    low = p0 + ((p1 & 0xFFF) << 12)
    high = p2 + (p1 >> 12) + (low >> 24)  # m = high * 2^24 + (low mod 2^24)
    l = (low & 0xFFFFFF).astype(jnp.uint32) | ((high & 0xFF).astype(jnp.uint32) << 24)
    h = (high >> 8).astype(jnp.uint32)
    unit = float_params(np.dtype(np.float32))[2]  # a * b = m * 2^(pa + pb + unit) units
    finite = _encoded(h, l, pa + pb + unit, np.dtype(np.float32))
    inf, quiet = _special_bits(np.dtype(np.float32))
    nan = nan_a | nan_b | (inf_a & zero_b) | (inf_b & zero_a)
    bits = jnp.where(nan, quiet, jnp.where(
        inf_a | inf_b, inf, jnp.where(zero_a | zero_b, jnp.uint32(0), finite)))
    return _result(bits, na, nb, nan_a, nan_b, nan)


def _result(bits, na, nb, nan_a, nan_b, nan) -> jax.Array:
    """The float32 result of magnitude `bits`: its sign a NaN operand's (numpy passes
    the first NaN on), else whether the operands' signs differ; a NaN made of numbers
    (inf * 0, inf / inf, 0 / 0) is the host's own (its sign differs between hosts)."""
    out = _signed(bits, jnp.where(nan_a, na, jnp.where(nan_b, nb, na ^ nb)),
                  np.dtype(np.float32))
    made = nan & ~nan_a & ~nan_b
    return jnp.where(made, lax.bitcast_convert_type(jnp.uint32(_MADE_NAN32), jnp.float32),
                     out)


def _unpacked(bits: jax.Array) -> tuple:
    """(significand with its leading bit at bit 23, the exponent of that bit) of finite
    nonzero float32 bits; subnormals are normalized."""
    expo = ((bits >> 23) & 0xFF).astype(jnp.int32)
    frac = bits & 0x7FFFFF
    mant = jnp.where(expo > 0, frac | 0x800000, frac)
    lead = lax.clz(mant).astype(jnp.int32) - 8
    return mant << lead.astype(jnp.uint32), jnp.maximum(expo, 1) - 127 - lead


def quotient(a: jax.Array, b: jax.Array) -> jax.Array:
    """a / b for float32 arrays, rounded as numpy rounds (restoring division)."""
    a_bits = lax.bitcast_convert_type(a, jnp.uint32)
    b_bits = lax.bitcast_convert_type(b, jnp.uint32)
    _, ma_, na, nan_a, pinf_a, ninf_a, _ = fields(a)
    _, mb_, nb, nan_b, pinf_b, ninf_b, _ = fields(b)
    inf_a, inf_b = pinf_a | ninf_a, pinf_b | ninf_b
    zero_a = (ma_ == 0) & ~nan_a & ~inf_a
    zero_b = (mb_ == 0) & ~nan_b & ~inf_b
    plain = (ma_ != 0) & (mb_ != 0)
    safe = jnp.uint32(0x3F800000)  # 1.0 where a special case decides
    ma, ea = _unpacked(jnp.where(plain, a_bits, safe))
    mb, eb = _unpacked(jnp.where(plain, b_bits, safe))
    smaller = ma < mb
    rest = jnp.where(smaller, ma << 1, ma)  # now rest / mb lies in [1, 2)
    expo = ea - eb - smaller.astype(jnp.int32)
    q = jnp.zeros_like(rest)
    for _ in range(26):  # 26 bits of rest / mb; rest < 2^26
        bit = rest >= mb
        q = (q << 1) | bit.astype(jnp.uint32)
        rest = jnp.where(bit, rest - mb, rest) << 1
    # q * 2^(expo - 25); in units of 2^-149 its last bit lies at expo + 124.
    ulp = jnp.maximum(expo + 126, 0)
    drop = jnp.minimum(ulp - expo - 124, 27).astype(jnp.uint32)
    mant = q >> drop
    half = (q >> (drop - 1)) & 1
    sticky = ((q & ((jnp.uint32(1) << (drop - 1)) - 1)) != 0) | (rest != 0)
    mant = mant + (half & (sticky | ((mant & 1) != 0))).astype(jnp.uint32)
    encoded = jnp.minimum((jnp.minimum(ulp, 255).astype(jnp.uint32) << 23) + mant,
                          jnp.uint32(0x7F800000))
    inf, quiet = _special_bits(np.dtype(np.float32))
    nan = nan_a | nan_b | (inf_a & inf_b) | (zero_a & zero_b)
    bits = jnp.where(nan, quiet, jnp.where(
        inf_a | zero_b, inf, jnp.where(zero_a | inf_b, jnp.uint32(0), encoded)))
    return _result(bits, na, nb, nan_a, nan_b, nan)
