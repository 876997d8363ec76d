"""4-bit E3M0 quantization with codes packed two per byte (Streaming DiLoCo's wire format).

A code is 4 bits: bit 3 the sign, bits 0-2 an exponent code c; c = 0 is zero and
c in 1..7 stands for `scale * 2**(c - 7)`, `scale` = max |x| of the tensor (one float32
per tensor). A magnitude rounds to the nearer of its two neighbouring levels (a value
in [2**k, 2**(k+1)) goes up from 1.5 * 2**k), and to zero below 2**-7 of the scale,
half the smallest level. Two codes share a byte:
element 2i in the low nibble, element 2i + 1 in the high one, so a tensor of n values
travels as ceil(n / 2) bytes plus its 4-byte scale.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

LEVELS = 7               # non-zero magnitudes scale * 2**e, e in -6..0 (code 1..7)
MIN_EXP = -(LEVELS - 1)
SCALE_BYTES = 4          # one float32 scale per tensor


def encode(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """4-bit codes (uint8 in [0, 16), shape of `x`) and the float32 scale of `x`."""
    x = jnp.asarray(x, jnp.float32)
    scale = jnp.max(jnp.abs(x)) if x.size else jnp.float32(0.0)
    safe = jnp.where(scale > 0, scale, 1.0)
    r = jnp.abs(x) / safe
    tiny = jnp.float32(2.0 ** (MIN_EXP - 1))                # midpoint of 0 and the smallest level
    k = jnp.floor(jnp.log2(jnp.maximum(r, tiny)))
    mant = r / jnp.exp2(k)                                   # in [1, 2)
    e = jnp.clip(k + (mant >= 1.5), MIN_EXP, 0)
    code = jnp.where((r >= tiny) & (scale > 0), e - MIN_EXP + 1, 0).astype(jnp.int32)
    sign = (x < 0).astype(jnp.int32) * 8  # bit 3; int32 arithmetic: LiteRT's builtins
    #                                       have no uint8 shifts, ORs or comparisons
    return (code + sign).astype(jnp.uint8), scale.astype(jnp.float32)


def decode(codes: jax.Array, scale: jax.Array) -> jax.Array:
    """Inverse of `encode` (up to the rounding it did)."""
    codes = jnp.asarray(codes).astype(jnp.int32) % 16
    c = codes % 8
    mag = jnp.where(c > 0, jnp.exp2((c - 1 + MIN_EXP).astype(jnp.float32)), 0.0)
    sign = jnp.where(codes >= 8, -1.0, 1.0)
    return (sign * mag * scale).astype(jnp.float32)


def quantize(x: jax.Array) -> jax.Array:
    """`x` rounded to the E3M0 grid (what a receiver decodes), same shape and dtype."""
    codes, scale = encode(x)
    return decode(codes, scale).astype(jnp.asarray(x).dtype)


def pack(codes: jax.Array) -> jax.Array:
    """4-bit codes of any shape -> uint8[ceil(n / 2)], two codes per byte."""
    flat = jnp.ravel(codes).astype(jnp.int32) % 16
    if flat.size % 2:
        flat = jnp.concatenate([flat, jnp.zeros((1,), jnp.int32)])
    pairs = flat.reshape(-1, 2)
    return (pairs[:, 0] + pairs[:, 1] * 16).astype(jnp.uint8)


def unpack(packed: jax.Array, shape: Sequence[int]) -> jax.Array:
    """Inverse of `pack` for a tensor of `shape`."""
    n = int(np.prod(shape))
    packed = jnp.asarray(packed).astype(jnp.int32)
    both = jnp.stack([packed % 16, packed // 16], axis=-1).reshape(-1)
    return both[:n].reshape(tuple(shape)).astype(jnp.uint8)


def encode_packed(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(packed codes uint8[ceil(n / 2)], float32 scale): what a quantized tensor sends."""
    codes, scale = encode(x)
    return pack(codes), scale


def decode_packed(packed: jax.Array, scale: jax.Array, shape: Sequence[int]) -> jax.Array:
    """The float32 tensor of `shape` that `encode_packed` sent."""
    return decode(unpack(packed, shape), scale)


def packed_bytes(shape: Sequence[int]) -> int:
    """Bytes of one encoded tensor of `shape`: packed codes plus its scale."""
    return -(-int(np.prod(shape)) // 2) + SCALE_BYTES
