"""Bit-level facts about float dtypes that exact sums build on.

`float_params` gives a dtype's significand and exponent widths and the weight of its
smallest subnormal; `exact_in_doubles` says for which columns of a stack of addends
(floats of at most 4 bytes) a float64 sum is exact; `to_odd_float32` rounds float64
values to odd at float32's precision, so a later cast to a narrower dtype rounds once.
"""

from __future__ import annotations

import functools
from typing import Optional

import numpy as np

from fax_bridge.errors import AggregationError


@functools.lru_cache(maxsize=None)
def float_params(dtype: np.dtype) -> tuple[int, int, int, type]:
    """(significand bits p, exponent bits, lowest exponent of a subnormal lsb, uint view)."""
    if dtype.name == "bfloat16":
        import ml_dtypes

        info = ml_dtypes.finfo(dtype)
    else:
        info = np.finfo(dtype)
    uint = {2: np.uint16, 4: np.uint32, 8: np.uint64}.get(dtype.itemsize)
    if uint is None:
        raise AggregationError(f"exact sums do not support {dtype} ({dtype.itemsize}-byte floats)")
    return info.nmant + 1, info.nexp, int(info.minexp) - info.nmant, uint


def exact_in_doubles(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For addends `rows` ([n, size]) of a float dtype of at most 4 bytes, per column:
    (its float64 sum is exact and nonzero-bearing, every addend is +-0, every addend is
    -0).

    A float of p significant bits with exponent field E is an integer multiple of the
    smallest subnormal: its highest bit lies at most at max(E, 1) + p - 2 and its lowest
    at least at max(E - 1, 0). Summing n of them in float64 (in any order) is exact when
    the highest bit of the largest magnitude and the lowest possible bit of the smallest
    nonzero one, plus ceil(log2 n) bits of growth, span at most 53. NaN and inf are never
    fast (they go the general way).
    """
    p, nexp, _, uint = float_params(rows.dtype)
    bits = rows.view(uint)
    sign_bit = uint(1 << (8 * rows.dtype.itemsize - 1))
    mag = bits & (sign_bit - uint(1))
    hi = mag.max(axis=0)
    low = (mag - uint(1)).min(axis=0) + uint(1)  # zeros wrap to the top, then to 0
    e_hi = (hi >> uint(p - 1)).astype(np.int32)
    e_lo = (low >> uint(p - 1)).astype(np.int32)
    zero = hi == 0
    fast = _sums_fit(e_hi, e_lo, p, nexp, rows.shape[0]) & ~zero
    negative_zero = zero.copy()
    if zero.any():  # the zero columns alone: in a block that failed, usually a few
        negative_zero[zero] = _all_of_sign_minus(rows[:, zero])
    return fast, zero, negative_zero


def _all_of_sign_minus(rows: np.ndarray) -> np.ndarray:
    """Per column of `rows`: whether every addend has its sign bit set (-0 included): as
    unsigned integers, none lies below -0's bits. One reduction of the columns. In a
    column of zeros, or one whose sum is zero, that is: every addend is -0 (addends of
    one sign never cancel)."""
    _, _, _, uint = float_params(rows.dtype)
    sign_bit = uint(1 << (8 * rows.dtype.itemsize - 1))
    return np.minimum.reduce(rows.view(uint), axis=0) >= sign_bit


def _sums_fit(e_hi, e_lo, p: int, nexp: int, n: int):
    """Whether n addends whose largest magnitude has exponent field `e_hi` and whose
    smallest nonzero one has `e_lo` (arrays or ints) sum exactly in float64, finite."""
    span = np.maximum(e_hi, 1) - np.maximum(e_lo - 1, 0) + (p - 1 + (n - 1).bit_length())
    return (span <= 53) & (e_hi < (1 << nexp) - 1)


def block_test(rows: np.ndarray, scratch: Optional[np.ndarray] = None) -> tuple[bool, bool]:
    """For a block of addends `rows` ([n, size], a float dtype of at most 4 bytes):
    (every column has an exact float64 sum or holds only +-0, some addend is +-0).

    One test for the whole block (`exact_in_doubles` says which columns pass, column by
    column), from its largest and smallest nonzero magnitude: columns span at most what
    the block spans, so a block that passes passes column by column; one that fails may
    still pass that way. Without zeros, four reductions of the bits find both, nothing
    written: as unsigned integers the floats of sign + order by magnitude below those of
    sign -, which order by magnitude above them; as signed integers, the reverse. A
    block holding a zero finds its smallest nonzero magnitude in `scratch` (an array of
    `rows`' shape and the dtype's unsigned view, written over; a caller testing many
    blocks keeps one, so no block allocates)."""
    if not rows.size:
        return True, False
    p, nexp, _, uint = float_params(rows.dtype)
    width = 8 * rows.dtype.itemsize
    sign = 1 << (width - 1)
    bits, signed = rows.view(uint), rows.view(_SIGNED[rows.dtype.itemsize])
    low_u = int(np.minimum.reduce(bits, axis=None))    # least of sign +, if any
    low_s = int(np.minimum.reduce(signed, axis=None))  # least of sign -, if any
    least = min(low_u if low_u < sign else sign, low_s + sign if low_s < 0 else sign)
    high_u = int(np.maximum.reduce(bits, axis=None))   # greatest of sign -, if any
    high_s = int(np.maximum.reduce(signed, axis=None))  # greatest of sign +, if any
    hi = max(high_s if high_s >= 0 else 0, high_u - sign if high_u >= sign else 0)
    zeros = least == 0
    if zeros:
        mag = np.bitwise_and(bits, uint(sign - 1), out=scratch)
        np.subtract(mag, uint(1), out=mag)  # zeros wrap to the top
        least = (int(np.minimum.reduce(mag, axis=None)) + 1) & ((1 << width) - 1)  # 0: all zero
    return bool(_sums_fit(hi >> (p - 1), least >> (p - 1), p, nexp, rows.shape[0])), zeros


_SIGNED = {2: np.int16, 4: np.int32}


def signed_zeros(rows: np.ndarray, sums: np.ndarray) -> None:
    """Sets `sums` (float64 column sums of `rows`, in any order, rounded or not) to -0.0
    where every addend is -0 and to +0.0 elsewhere it is zero (numpy may add -0 + -0 as
    +0): a zero sum's addends are all -0 when all are of sign - (`_all_of_sign_minus`,
    one reduction of the block's columns, where picking the zero columns out first cost
    more once many columns were zero, as an embedding's unused rows are)."""
    zero = sums == 0
    if zero.any():
        sums[zero] = np.where(_all_of_sign_minus(rows)[zero], -0.0, 0.0)


def to_odd_float32(values: np.ndarray) -> np.ndarray:
    """float64 values rounded to odd at float32's precision and range (as float32)."""
    with np.errstate(over="ignore"):
        near = values.astype(np.float32)
    inexact = near.astype(np.float64) != values
    even = (near.view(np.uint32) & np.uint32(1)) == 0
    step = inexact & even  # the odd neighbour lies toward the value
    toward = np.where(values[step] > near[step], np.float32(np.inf), np.float32(-np.inf))
    near[step] = np.nextafter(near[step], toward)
    return near
