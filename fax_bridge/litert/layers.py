"""Layers written with ops LiteRT has builtins for, that XLA computes bit for bit alike.

`jax.random` draws its bits with threefry on uint32 (and, for counters, uint64) words,
whose shifts and adds LiteRT has no kernels for, so a client part that calls it is
refused. `dropout(key, rate, x)` draws its mask from an int32 key with int32 multiplies,
xors and arithmetic shifts only (a counter-based hash of the key and each element's
position), which XLA and LiteRT compute identically (two's complement wrap-around): a
LiteRT client drops the same elements as XLA. Pass the key in the client's data (one
per client) and vary it per step (`key + step`).

Max pools need no helper: the converter path rewrites their gradient
(`side_rewrites.select_and_scatter`), and embeddings may stay index gathers (the scatter
of their gradient is fixed in the flatbuffer) or be one-hot products.

Example:
    >>> import jax.numpy as jnp
    >>> from fax_bridge.litert import layers
    >>> x = jnp.ones((2, 4), jnp.float32)
    >>> y = layers.dropout(jnp.int32(7), 0.5, x)
    >>> sorted({float(v) for v in y.ravel()}) <= [0.0, 2.0]
    True
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fax_bridge.errors import ArgumentError

_GOLDEN = np.int32(-1640531527)   # 0x9E3779B9 as int32
_M1 = np.int32(0x7FEB352D)
_M2 = np.int32(-2073549173)       # 0x846CA68B as int32


def _shift(h, k: int):
    return jax.lax.shift_right_arithmetic(h, jnp.int32(k))


def _logical_shift(h, k: int):
    """`h >>> k` (zeros shifted in) for 2 <= k <= 31 with the ops LiteRT has: the
    arithmetic shift with its k copies of the sign bit cleared by a xor."""
    return _shift(h, k) ^ (_shift(h, 31) * np.int32(2 ** (32 - k)))


def _mix(h):
    """An int32 -> int32 bijection that spreads every input bit over the word (the
    xor-shift-multiply finalizer of a 32-bit hash)."""
    h = h ^ _logical_shift(h, 16)
    h = h * _M1
    h = h ^ _logical_shift(h, 15)
    h = h * _M2
    return h ^ _logical_shift(h, 16)


def uniform(key, shape: tuple) -> jax.Array:
    """float32 values in [0, 1) of `shape`, multiples of 2^-24, from an int32 `key`
    (any shape: all its elements are mixed in)."""
    key = jnp.asarray(key)
    if key.dtype != jnp.int32:
        raise ArgumentError(f"a LiteRT dropout key is int32, got {key.dtype}: pass the key "
                            "as int32 (np.int32 seeds, one per client, in the client's data)")
    h = jnp.int32(0)
    for word in key.reshape(-1):
        h = _mix(h ^ word) + _GOLDEN
    count = int(np.prod(shape, dtype=np.int64))
    if count >= 2**31:
        raise ArgumentError(f"dropout over {count} elements: at most 2^31 - 1 per call")
    position = jnp.arange(count, dtype=jnp.int32).reshape(shape)
    bits = _mix(_mix(position * _GOLDEN ^ h) + h)
    return (_shift(bits, 8).astype(jnp.float32) + 8388608.0) * np.float32(2.0 ** -24)


def dropout(key, rate: float, x: jax.Array) -> jax.Array:
    """`x` with each element zeroed with probability `rate` and the rest scaled by
    1 / (1 - rate); the mask drawn from the int32 `key` (module docstring)."""
    if not 0.0 <= float(rate) < 1.0:
        raise ArgumentError(f"dropout rate {rate}: a rate is in [0, 1)")
    if float(rate) == 0.0:
        return x
    keep = uniform(key, tuple(x.shape)) >= np.float32(rate)
    return jnp.where(keep, x / np.asarray(1.0 - rate, x.dtype), jnp.zeros_like(x))
