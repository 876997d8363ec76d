"""Exact, order-independent sums of float and integer arrays.

A float sum is kept as a fixed-point integer: element-wise, a stack of signed 64-bit
limbs, limb k weighing 2^(32 * (base + k)) units of the dtype's smallest subnormal.
Adding a float is exact (its 24- or 53-bit significand lands in two or three limbs),
adding two accumulators is exact, so any grouping of the same addends gives the same
integer, and `result()` rounds it once, to nearest-even. Hence the sum of a clients
value has the same bits whichever devices computed which partial sums. Integer sums
wrap modulo 2^64 and are cast to the dtype at the end (modular addition is exact too).
As in IEEE arithmetic, a sum whose addends are all -0 is -0; any other zero sum is +0.

Two shortcuts keep the cost per call low and change no result: floats of at most 4 bytes
are first summed in float64 wherever that sum is provably exact (then enter the limbs as
one addend per element), and dtypes of at most 24 significant bits are rounded through
a float64 rounded to odd, which the final cast rounds once more without double rounding.

Magnitudes (why int64 never overflows): compacting leaves digits in [0, 2^32) under a
signed top limb of magnitude < 2^61 (a fold adds a top < 2^29 times 2^32), and at most
2^24 addends of < 2^33 per limb follow before the next compaction, so every limb at rest
lies below 2^61 + 2^57 (< 2^62). Two accumulators therefore add below 2^62 + 2^58, with
room for the carries (< 2^32) that compacting their sum propagates: `merge` adds one
partial and compacts (three stacks would still fit, four could pass 2^63). A stack from
elsewhere (`from_limbs`) holding a limb of 2^61 or more is carried exactly first, so the
bound holds whatever int64 limbs arrive.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from fax_bridge.errors import AggregationError
from fax_bridge.runtime.float_bits import (exact_in_doubles, float_params,
                                           to_odd_float32)

LIMB_BITS = 32
# what a mean of float16 or bfloat16 values is divided in: their sum is rounded to it, the
# quotient rounded once to the values' dtype (`aggregation.finish`)
WIDE = np.dtype(np.float32)
_MASK = np.int64((1 << LIMB_BITS) - 1)
_FOLD_LIMIT = 1 << 29  # a top limb below this folds into the one beneath it
TOP_LIMIT = 1 << 61  # every limb of a compacted stack (`to_limbs`) is smaller in magnitude
_COMPACT_EVERY = 1 << 24  # adds between carry propagations (limbs stay far below 2^63)
BLOCK_ELEMENTS = 1 << 17  # addend elements handled at once (temporaries stay in cache)
NONFINITE_FLAGS = 0b111  # the bits of a wire flag byte that mean NaN, +inf or -inf
NEG_ZERO_FLAG = 0b1000  # the bit of a wire flag byte that means only -0 was added
_FLAG_BITS = np.array([[1], [2], [4], [8]], np.uint8)  # NaN, +inf, -inf, only -0


def is_exact_kind(dtype: np.dtype) -> bool:
    """Whether `sum` of this dtype is supported (floats and integers)."""
    return dtype.kind in "fiu" or dtype.name == "bfloat16"


def max_units(dtype: np.dtype, count: int) -> int:
    """The largest magnitude a sum of `count` finite addends of `dtype` can have: for
    floats in units of the smallest subnormal (the limbs' unit), for integers as is."""
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return count * max(int(info.max), -int(info.min))
    p, nexp, emin_sub, _ = float_params(dtype)
    emax = (1 << (nexp - 1)) - 1
    return count * (((1 << p) - 1) << (emax - (p - 1) - emin_sub))  # count * largest finite


class ExactSum:
    """Running exact sum of arrays of one dtype and shape."""

    def __init__(self, dtype: np.dtype, shape: tuple[int, ...]):
        self.dtype = np.dtype(dtype)
        self.shape = tuple(shape)
        self.size = math.prod(self.shape)
        self.is_float = self.dtype.kind not in "iu"
        if not is_exact_kind(self.dtype):
            raise AggregationError(
                f"cannot sum tensors of dtype {self.dtype}; federated sums take integer "
                "or floating-point tensors")
        self.base = 0
        self.pending = 0
        self.limbs = np.zeros((0 if self.is_float else 1, self.size), np.int64)
        # Non-finite addends: NaN, +inf, -inf seen per element; and the elements whose
        # every addend so far was -0 (a sum of no addends counts as one). Rows of one
        # array, each updated on its own.
        flags = np.zeros((4, self.size), bool) if self.is_float else [None] * 4
        if self.is_float:
            flags[3] = True
        self.nan, self.pos_inf, self.neg_inf, self.neg_zero = flags

    # -- adding -------------------------------------------------------------------

    def add(self, array: np.ndarray) -> None:
        """Adds one addend of this accumulator's dtype and shape."""
        array = np.asarray(array)
        self.add_many(array.reshape((1,) + array.shape))

    def add_many(self, stack: np.ndarray) -> None:
        """Adds `stack[0]`, `stack[1]`, ...: addends of this dtype and shape, at once."""
        stack = np.asarray(stack)
        if stack.shape[1:] != self.shape or stack.dtype != self.dtype:
            raise AggregationError(
                f"summed members disagree: expected {self.dtype}{list(self.shape)}, got "
                f"{stack.dtype}{list(stack.shape[1:])}; every client must hold the same "
                "type")
        rows = stack.reshape((stack.shape[0], self.size))
        if not self.is_float:
            self.limbs[0] += rows.astype(np.int64).sum(axis=0)  # wraps modulo 2^64
            return
        for lo in range(0, rows.shape[0], _COMPACT_EVERY):
            chunk = rows[lo:lo + _COMPACT_EVERY]
            if self.pending + chunk.shape[0] > _COMPACT_EVERY:
                self.compact()
            self._add_float(chunk)
            self.pending += chunk.shape[0]

    def _add_float(self, rows: np.ndarray) -> None:
        """Adds each row of `rows` ([addends, size]); limbs grow by < 2^33 per addend.

        Works through blocks of columns small enough for the temporaries to stay in cache.
        Floats of at most 4 bytes are summed in float64 where that is exact, the rest of
        the columns go through the limbs addend by addend.
        """
        step = max(1, BLOCK_ELEMENTS // max(1, rows.shape[0]))
        for lo in range(0, self.size, step):
            block, cols = rows[:, lo:lo + step], slice(lo, lo + step)
            if self.dtype.itemsize <= 4:
                rest = self._add_in_doubles(block, lo)
                if rest is None:
                    continue
                block, cols = block[:, rest], lo + rest
            self._add_block(block, cols)

    def _add_in_doubles(self, rows: np.ndarray, lo: int) -> Optional[np.ndarray]:
        """Adds the columns of `rows` (columns lo.. of the value) whose float64 sum is
        exact (`exact_in_doubles`), as one addend each; returns the columns left
        (indices into rows) or None."""
        fast, zero, negative_zero = exact_in_doubles(rows)
        neg_zero = self.neg_zero[lo:lo + rows.shape[1]]  # a view: updated in place
        neg_zero &= negative_zero  # an element stays -0 only while every addend is -0
        if fast.any():
            every = bool(fast.all())
            with np.errstate(invalid="ignore", over="ignore"):
                total = (rows if every else rows[:, fast]).astype(np.float64).sum(axis=0)
            where = np.arange(rows.shape[1]) if every else np.flatnonzero(fast)
            self._add_doubles(total, lo + where)
        rest = ~(fast | zero)
        return np.flatnonzero(rest) if rest.any() else None

    def _add_doubles(self, values: np.ndarray, cols: np.ndarray) -> None:
        """Adds float64 `values` that are integer multiples of the smallest subnormal of
        the dtype (exactly), one per column `cols`; each limb grows by < 2^33."""
        _, _, emin_sub, _ = float_params(self.dtype)
        live = values != 0
        if not live.all():
            values, cols = values[live], cols[live]
        if not values.size:  # nothing to add (an empty tensor too)
            return
        frac, expo = np.frexp(values)
        mant = np.ldexp(frac, 53).astype(np.int64)  # signed, |mant| < 2^53
        pos = expo.astype(np.int64) - (53 + emin_sub)  # of mant's lowest bit, in units
        if pos.min() < 0:  # an integer: the bits below the unit are zeros
            mant = mant >> np.clip(-pos, 0, 63)
            pos = np.maximum(pos, 0)
        idx, off = pos // LIMB_BITS, pos % LIMB_BITS
        first = int(idx.min())
        self._cover(first, int(idx.max()) + 3)
        if not self.limbs.flags.c_contiguous:
            self.limbs = np.ascontiguousarray(self.limbs)
        flat = self.limbs.reshape(-1)  # a view: 1-d indexing is the fast kind
        at = (idx - self.base) * self.size + cols
        low = (mant & _MASK) << off  # < 2^63
        high = (mant >> LIMB_BITS) << off  # signed, |high| < 2^52
        flat[at] += low & _MASK
        at += self.size
        flat[at] += (low >> LIMB_BITS) + (high & _MASK)
        at += self.size
        flat[at] += high >> LIMB_BITS

    def _add_block(self, rows: np.ndarray, cols: slice) -> None:
        p, nexp, _, uint = float_params(self.dtype)
        bits = rows.view(uint).astype(np.uint64)
        nbits = 8 * self.dtype.itemsize
        sign = (bits >> np.uint64(nbits - 1)).astype(bool)
        expo = ((bits >> np.uint64(p - 1)) & np.uint64((1 << nexp) - 1)).astype(np.int64)
        frac = (bits & np.uint64((1 << (p - 1)) - 1)).astype(np.int64)
        self.neg_zero[cols] &= (bits == np.uint64(1 << (nbits - 1))).all(axis=0)
        special = expo == (1 << nexp) - 1
        if special.any():
            self.nan[cols] |= (special & (frac != 0)).any(axis=0)
            self.pos_inf[cols] |= (special & (frac == 0) & ~sign).any(axis=0)
            self.neg_inf[cols] |= (special & (frac == 0) & sign).any(axis=0)
        normal = expo > 0
        mant = np.where(normal, frac | (1 << (p - 1)), frac)
        mant[special] = 0
        live = mant != 0
        if not live.any():
            return
        pos = np.where(normal, expo - 1, 0)
        idx = pos // LIMB_BITS
        off = pos % LIMB_BITS
        starts = idx[live]
        first = int(starts.min())
        present = first + np.flatnonzero(np.bincount(starts - first))  # limbs addends start in
        pieces = (p + LIMB_BITS - 1) // LIMB_BITS
        self._cover(int(present[0]), int(present[-1]) + pieces + 1)
        signs = np.where(sign, -1, 1)
        for j in range(pieces):
            shifted = ((mant >> (LIMB_BITS * j)) & _MASK) << off  # < 2^63
            low = (shifted & _MASK) * signs
            high = (shifted >> LIMB_BITS) * signs
            for start in present:  # zero addends add nothing wherever they would land
                row = int(start) - self.base + j
                if len(present) == 1:
                    self.limbs[row, cols] += low.sum(axis=0)
                    self.limbs[row + 1, cols] += high.sum(axis=0)
                else:
                    here = idx == start
                    self.limbs[row, cols] += np.where(here, low, 0).sum(axis=0)
                    self.limbs[row + 1, cols] += np.where(here, high, 0).sum(axis=0)

    def _cover(self, lo: int, hi: int) -> None:
        """Grows the limb stack so limbs [lo, hi) exist."""
        if self.limbs.shape[0] == 0:
            self.base = lo
            self.limbs = np.zeros((hi - lo, self.size), np.int64)
            return
        top = self.base + self.limbs.shape[0]
        below = max(0, self.base - lo)
        above = max(0, hi - top)
        if below or above:
            grown = np.zeros((below + self.limbs.shape[0] + above, self.size), np.int64)
            grown[below:below + self.limbs.shape[0]] = self.limbs
            self.limbs = grown
            self.base -= below

    def merge(self, other: "ExactSum") -> None:
        """Adds another accumulator (a partial sum) of the same dtype and shape.

        Both stacks' limbs lie below 2^61 + 2^57 (see the module's magnitudes), so their
        sum and its carries fit in int64; compacting it restores the bound for the next.
        """
        if other.dtype != self.dtype or other.shape != self.shape:
            raise AggregationError(
                f"partial sums disagree: {self.dtype}{list(self.shape)} vs "
                f"{other.dtype}{list(other.shape)}")
        if not self.is_float:
            self.limbs[0] += other.limbs[0]
            return
        self.nan |= other.nan
        self.pos_inf |= other.pos_inf
        self.neg_inf |= other.neg_inf
        self.neg_zero &= other.neg_zero
        if other.limbs.shape[0] == 0:
            return
        self._cover(other.base, other.base + other.limbs.shape[0])  # compact adds the carry
        start = other.base - self.base
        self.limbs[start:start + other.limbs.shape[0]] += other.limbs
        self.compact()

    # -- normal form --------------------------------------------------------------

    def compact(self) -> None:
        """Propagates carries and drops limbs that hold nothing (the value is unchanged)."""
        self.pending = 0
        if not self.is_float or self.limbs.shape[0] == 0:
            return
        limbs = _normalize(self.limbs)
        base = self.base
        # Bottom limbs that are zero everywhere carry no information.
        live_rows = limbs.any(axis=1)
        if not live_rows.any():
            self.limbs = np.zeros((0, self.size), np.int64)
            return
        first = int(live_rows.argmax())
        limbs = limbs[first:]
        base += first
        # Fold small top limbs down (digits below the top stay in [0, 2^32)).
        while limbs.shape[0] > 1 and (np.abs(limbs[-1]) < _FOLD_LIMIT).all():
            limbs[-2] = limbs[-2] + (limbs[-1] << LIMB_BITS)
            limbs = limbs[:-1]
        self.limbs = np.ascontiguousarray(limbs)
        self.base = base

    # -- result -------------------------------------------------------------------

    def result(self, into: Optional[np.dtype] = None) -> np.ndarray:
        """The sum, rounded once to the dtype (nearest, ties to even); with `into`
        (float32, for a float16 or bfloat16 sum), rounded once to that wider dtype."""
        if not self.is_float:
            return self.limbs[0].astype(self.dtype).reshape(self.shape)
        into = self.dtype if into is None else np.dtype(into)
        out = (self._round_to_odd(into) if float_params(self.dtype)[0] <= 24
               else self._round())
        out[self.neg_zero] = -0.0
        out = np.where(self.nan | (self.pos_inf & self.neg_inf), np.nan,
                       np.where(self.pos_inf, np.inf, np.where(self.neg_inf, -np.inf, out)))
        with np.errstate(over="ignore"):
            return out.astype(into).reshape(self.shape)

    def _round_to_odd(self, into: Optional[np.dtype] = None) -> np.ndarray:
        """The finite part rounded to odd with at least 33 significant bits, as float64
        (float32 with 24 for bfloat16), for dtypes of at most 24 significant bits.

        Rounding to odd (truncate, then set the lowest bit if anything was dropped) with
        at least two bits more than the dtype keeps the information rounding to nearest
        needs, so the cast to the dtype that follows rounds once, correctly.
        """
        _, _, emin_sub, _ = float_params(self.dtype)
        if self.limbs.shape[0] == 0:
            return np.zeros(self.size, np.float64)
        step = max(1, BLOCK_ELEMENTS // self.limbs.shape[0])  # temporaries stay in cache
        out = np.concatenate([_round_block_to_odd(self.limbs[:, lo:lo + step], self.base,
                                                  emin_sub)
                              for lo in range(0, self.size, step)])
        if (into or self.dtype).name == "bfloat16":  # a cast from float64 rounds twice
            out = to_odd_float32(out)
        return out

    def _round(self) -> np.ndarray:
        """The finite part as float64 values exactly representable in the dtype."""
        p, _, emin_sub, _ = float_params(self.dtype)
        if self.limbs.shape[0] == 0:
            return np.zeros(self.size, np.float64)
        limbs = _normalize(self.limbs)
        negative = limbs[-1] < 0
        limbs = _normalize(np.where(negative, -limbs, limbs))  # magnitudes, digits >= 0
        n = limbs.shape[0]
        nz = limbs != 0
        zero = ~nz.any(axis=0)
        top = n - 1 - np.argmax(nz[::-1], axis=0)  # highest nonzero digit
        cols = np.arange(self.size)

        def digit(k: np.ndarray) -> np.ndarray:
            return np.where(k >= 0, limbs[np.clip(k, 0, n - 1), cols], 0).astype(np.uint64)

        w2, w1, w0 = digit(top), digit(top - 1), digit(top - 2)
        seen = np.logical_or.accumulate(nz, axis=0)
        below = top - 3
        sticky = np.where(below >= 0, seen[np.clip(below, 0, n - 1), cols], False)
        bitlen = np.frexp(w2.astype(np.float64))[1].astype(np.int64)  # 1..32
        s = (LIMB_BITS - bitlen).astype(np.uint64)
        sig = (((w2 << np.uint64(32)) | w1) << s) | (w0 >> (np.uint64(32) - s))
        lost = w0 & ((np.uint64(1) << (np.uint64(32) - s)) - np.uint64(1))
        sticky = sticky | (lost != 0)
        # sig (64 significant bits) has lsb exponent e_lsb, in real terms.
        e_lsb = LIMB_BITS * (top - 1 + self.base) - s.astype(np.int64) + emin_sub
        e_msb = e_lsb + 63
        ulp = np.maximum(e_msb - (p - 1), emin_sub)
        drop = ulp - e_lsb  # >= 64 - p
        d = np.clip(drop, 1, 63).astype(np.uint64)
        q = np.where(drop >= 64, np.uint64(0), sig >> d)
        rem = np.where(drop >= 64, np.where(drop == 64, sig, np.uint64(0)),
                       sig & ((np.uint64(1) << d) - np.uint64(1)))
        half = np.where(drop == 64, np.uint64(1 << 63),
                        np.where(drop > 64, np.uint64(1), np.uint64(1) << (d - np.uint64(1))))
        up = (rem > half) | ((rem == half) & (sticky | ((q & np.uint64(1)) == 1)))
        q = q + up.astype(np.uint64)
        with np.errstate(over="ignore"):
            magnitude = np.ldexp(q.astype(np.float64), ulp.astype(np.int32))
        magnitude[zero] = 0.0
        return np.where(negative, -magnitude, magnitude)

    # -- wire form ----------------------------------------------------------------

    def to_limbs(self) -> tuple[int, np.ndarray, Optional[np.ndarray]]:
        """(base limb, limbs [num_limbs, *shape], non-finite flags or None), compacted.

        The flags are one uint8 per element: bit 0 NaN, bit 1 +inf, bit 2 -inf seen,
        bit 3 only -0 added. A partial with no limbs (every element sums to exactly zero)
        is valid.
        """
        self.compact()
        limbs = self.limbs.reshape((self.limbs.shape[0],) + self.shape)
        flags = None
        if self.is_float and (self.nan.any() or self.pos_inf.any() or self.neg_inf.any()
                              or self.neg_zero.any()):
            flags = (self.nan.astype(np.uint8) | (self.pos_inf.astype(np.uint8) << 1)
                     | (self.neg_inf.astype(np.uint8) << 2)
                     | (self.neg_zero.astype(np.uint8) << 3))
        return self.base, limbs, flags

    @classmethod
    def from_limbs(cls, dtype: np.dtype, shape: tuple[int, ...], base: int,
                   limbs: np.ndarray, flags: Optional[np.ndarray] = None) -> "ExactSum":
        """An accumulator holding a partial made by `to_limbs` (e.g. on a device).

        Any int64 limbs denote a value; a float stack that is not in the compact form's
        range (a limb of magnitude 2^61 or more) is carried exactly before it is kept.
        """
        acc = cls(dtype, shape)
        acc.base = int(base)
        limbs = np.array(limbs, np.int64)
        # [num_limbs, *shape] or [num_limbs, size]; num_limbs may be 0 (an all-zero sum).
        acc.limbs = limbs.reshape((limbs.shape[0] if limbs.ndim > 1 else -1, acc.size))
        if not acc.is_float and acc.limbs.shape[0] != 1:
            raise AggregationError(f"an integer partial sum has one limb, got {acc.limbs.shape[0]}")
        if acc.is_float and acc.limbs.size and (
                np.maximum.reduce(acc.limbs, axis=None) >= TOP_LIMIT
                or np.minimum.reduce(acc.limbs, axis=None) <= -TOP_LIMIT):
            acc.limbs = _carry_exactly(acc.limbs)
            acc.compact()
        if flags is not None and acc.is_float:
            flags = np.asarray(flags, np.uint8).reshape(1, -1)
            acc.nan, acc.pos_inf, acc.neg_inf, acc.neg_zero = (flags & _FLAG_BITS) != 0
        elif acc.is_float:
            acc.neg_zero[:] = False
        return acc


    def placed(self, shape: tuple[int, ...], cols: np.ndarray) -> "ExactSum":
        """A float accumulator of `shape` holding this one's elements at the flat
        positions `cols` (one per element, distinct) and no addends elsewhere."""
        out = ExactSum(self.dtype, shape)
        for flag in ("nan", "pos_inf", "neg_inf", "neg_zero"):
            getattr(out, flag)[cols] = getattr(self, flag)
        if self.limbs.shape[0]:
            out.base = self.base
            out.limbs = np.zeros((self.limbs.shape[0], out.size), np.int64)
            out.limbs[:, cols] = self.limbs
        return out

    @classmethod
    def from_doubles(cls, dtype: np.dtype, shape: tuple[int, ...],
                     values: np.ndarray) -> "ExactSum":
        """An accumulator holding finite float64 `values` that are whole multiples of
        the dtype's smallest subnormal (a `double_sums.DoubleSum`); -0.0 stays -0."""
        acc = cls(dtype, shape)
        values = np.asarray(values, np.float64).reshape(acc.size)
        acc.neg_zero = (values == 0) & np.signbit(values)
        acc._add_doubles(values, np.arange(acc.size))
        return acc


def sums_of(stacks: Sequence[np.ndarray]) -> list[ExactSum]:
    """One accumulator per stack of addends ([addends, *shape]) holding its sum. Float
    stacks of one dtype and count are added as one (fewer, larger array operations);
    their accumulators then hold columns of a shared limb stack (views of disjoint
    columns, so adding into one never touches another)."""
    out: list = [None] * len(stacks)
    groups: dict = {}
    for i, stack in enumerate(stacks):
        if is_exact_kind(stack.dtype) and stack.dtype.kind not in "iu":
            groups.setdefault((stack.dtype, stack.shape[0]), []).append(i)
    joined_members = {i for members in groups.values() if len(members) > 1 for i in members}
    for i, stack in enumerate(stacks):
        if i not in joined_members:
            out[i] = ExactSum(stack.dtype, stack.shape[1:])
            out[i].add_many(stack)
    for (dtype, count), members in groups.items():
        if len(members) < 2:
            continue
        joined = ExactSum(dtype, (sum(math.prod(stacks[i].shape[1:]) for i in members),))
        joined.add_many(np.concatenate([stacks[i].reshape(count, -1) for i in members],
                                       axis=1))
        joined.compact()
        start = 0
        for i in members:
            acc = out[i] = ExactSum(dtype, stacks[i].shape[1:])
            cols = slice(start, start + acc.size)
            acc.base, acc.limbs = joined.base, joined.limbs[:, cols]
            acc.nan, acc.pos_inf = joined.nan[cols], joined.pos_inf[cols]
            acc.neg_inf, acc.neg_zero = joined.neg_inf[cols], joined.neg_zero[cols]
            start += acc.size
    return out


def results(accs: Sequence[ExactSum], wide: bool = False) -> list[np.ndarray]:
    """`[acc.result() for acc in accs]`, with the float sums of one dtype rounded together:
    one set of array operations over all their elements instead of one per accumulator.
    With `wide`, float16 and bfloat16 sums are rounded to float32 instead (`WIDE`)."""
    out: list = [None] * len(accs)
    groups: dict = {}
    for i, acc in enumerate(accs):
        if acc.is_float:
            groups.setdefault(acc.dtype, []).append(i)
        else:
            out[i] = acc.result()
    for dtype, members in groups.items():
        into = WIDE if wide and dtype.itemsize < WIDE.itemsize else None
        if len(members) == 1:
            out[members[0]] = accs[members[0]].result(into)
            continue
        flat = _joined([accs[i] for i in members]).result(into)
        start = 0
        for i in members:
            out[i] = flat[start:start + accs[i].size].reshape(accs[i].shape)
            start += accs[i].size
    return out


def _joined(accs: list[ExactSum]) -> ExactSum:
    """One flat float accumulator holding the elements of `accs` (one dtype), in order."""
    sizes = [acc.size for acc in accs]
    joined = ExactSum(accs[0].dtype, (sum(sizes),))
    live = [acc for acc in accs if acc.limbs.shape[0]]
    if live:
        joined.base = min(acc.base for acc in live)
        rows = max(acc.base + acc.limbs.shape[0] for acc in live) - joined.base
        joined.limbs = np.zeros((rows, joined.size), np.int64)
        start = 0
        for acc, size in zip(accs, sizes):
            if acc.limbs.shape[0]:
                first = acc.base - joined.base
                joined.limbs[first:first + acc.limbs.shape[0], start:start + size] = acc.limbs
            start += size
    for flag in ("nan", "pos_inf", "neg_inf", "neg_zero"):
        setattr(joined, flag, np.concatenate([getattr(acc, flag) for acc in accs]))
    return joined


def _round_block_to_odd(limbs: np.ndarray, base: int, emin_sub: int) -> np.ndarray:
    """`ExactSum._round_to_odd` for the columns of a stack of limbs (at least one)."""
    signed = _normalize(limbs)
    negative = signed[-1] < 0
    digits = _normalize(np.where(negative, -signed, signed), below=2)  # magnitudes
    rows, size = digits.shape
    nz = digits != 0
    row = np.arange(rows, dtype=np.int16)[:, None]  # (max/min over rows are fast)
    top = np.where(nz, row, 2).max(axis=0).astype(np.int64)  # highest nonzero, 2 if none
    sticky = np.where(nz, row, rows).min(axis=0) < top - 2  # a digit below the three read
    at = top * size + np.arange(size)
    flat = digits.reshape(-1)
    w2, w1, w0 = flat[at].view(np.uint64), flat[at - size].view(np.uint64), flat[at - 2 * size]
    window = (w2 << np.uint64(LIMB_BITS)) | w1  # 33 to 64 bits (or 0: a zero sum)
    shift = np.where(w2 >> np.uint64(53 - LIMB_BITS) != 0, np.uint64(11), np.uint64(0))
    dropped = window & ((np.uint64(1) << shift) - np.uint64(1))
    odd = ((dropped != 0) | (w0 != 0) | sticky) & (w2 != 0)  # w2 is 0 for a zero sum
    sig = (window >> shift) | odd.astype(np.uint64)  # at most 53 bits: exact in float64
    scale = LIMB_BITS * (top - 3 + base) + emin_sub + shift.astype(np.int64)
    with np.errstate(over="ignore"):
        magnitude = np.ldexp(sig.astype(np.float64), scale.astype(np.int32))
    return np.where(negative, -magnitude, magnitude)


def _normalize(limbs: np.ndarray, below: int = 0) -> np.ndarray:
    """Carry-propagates: rows 0..n-1 of the result lie in [0, 2^32), row n is signed.

    With `below`, that many zero rows come first (the result's rows shift up by it).
    """
    out = np.zeros((below + limbs.shape[0] + 1, limbs.shape[1]), np.int64)
    if not limbs.shape[0]:
        return out
    carry = limbs[0] >> LIMB_BITS
    out[below] = limbs[0] & _MASK
    for k in range(1, limbs.shape[0]):
        total = limbs[k] + carry
        out[below + k] = total & _MASK
        carry = total >> LIMB_BITS
    out[-1] = carry
    return out


def _carry_exactly(limbs: np.ndarray) -> np.ndarray:
    """`_normalize` for limbs of any int64 values (it needs room for the carries): each
    limb's high half is carried apart from its low half, so no sum exceeds 2^33."""
    out = np.zeros((limbs.shape[0] + 1, limbs.shape[1]), np.int64)
    carry = np.zeros(limbs.shape[1], np.int64)
    for k in range(limbs.shape[0]):
        low = (limbs[k] & _MASK) + carry
        out[k] = low & _MASK
        carry = (limbs[k] >> LIMB_BITS) + (low >> LIMB_BITS)
    out[-1] = carry
    return out
