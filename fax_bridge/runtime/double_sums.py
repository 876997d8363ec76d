"""Exact sums held as float64 values: the cheap form of an `exact.ExactSum` when it fits.

Floats of at most 4 bytes (float32, float16, bfloat16) are integer multiples of their
dtype's smallest subnormal, and a float64 sum of n of them is exact when the exponents
of each element's addends span little enough (`float_bits.exact_in_doubles`). Where that
holds for every element of a stack of addends, its partial sum is kept as those float64
values (`DoubleSum`): a device forms it with one float64 sum instead of integer limbs
and sends 8 bytes an element; the coordinator merges two with one addition whose
exactness it checks (the error term of TwoSum is zero), and finishing is one cast.

Whenever the float64 form would lose a bit (a merge whose sum needs more than 53 bits,
non-finite addends, a wide span of exponents), the values move to an `ExactSum` and go
on there. Both forms hold the same exact value, so a result has the same bits whichever
form its partials took and however the clients were split.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import numpy as np

from fax_bridge.errors import AggregationError
from fax_bridge.runtime import exact
from fax_bridge.runtime.exact import ExactSum
from fax_bridge.runtime.float_bits import (all_exact_in_doubles, exact_in_doubles,
                                           signed_zeros, to_odd_float32)


class DoubleSum:
    """The exact sum of addends of a float dtype of at most 4 bytes, as float64 values
    (one per element, an all -0 element as -0.0)."""

    is_float = True

    def __init__(self, dtype: np.dtype, shape: tuple, values: np.ndarray):
        self.dtype = np.dtype(dtype)
        self.shape = tuple(shape)
        self.size = math.prod(self.shape)
        self.values = np.asarray(values, np.float64).reshape(self.size)

    def exact(self) -> ExactSum:
        """The same sum as an `ExactSum` (limbs)."""
        return ExactSum.from_doubles(self.dtype, self.shape, self.values)

    def result(self) -> np.ndarray:
        """The sum rounded once to the dtype (nearest, ties to even)."""
        with np.errstate(over="ignore"):
            return self._rounded()

    def _rounded(self) -> np.ndarray:
        """`result` for a caller that already ignores overflow (np.errstate)."""
        out = self.values
        if self.dtype != np.float32:  # float16, bfloat16: through float32 rounded to odd
            out = to_odd_float32(out)
        return out.astype(self.dtype).reshape(self.shape)


Sum = Union[ExactSum, DoubleSum]


def fits(dtype: np.dtype) -> bool:
    """Whether sums of `dtype` can take the float64 form."""
    dtype = np.dtype(dtype)
    return exact.is_exact_kind(dtype) and dtype.kind not in "iu" and dtype.itemsize <= 4


def _double_values(rows: np.ndarray):
    """The column sums of `rows` ([addends, size]) as float64, or None where one would
    not be exact."""
    count = rows.shape[0]
    totals = np.empty(rows.shape[1], np.float64)
    step = max(1, exact.BLOCK_ELEMENTS // max(1, count))
    for lo in range(0, rows.shape[1], step):
        block = rows[:, lo:lo + step]
        if not all_exact_in_doubles(block):  # one test for the block, else column-wise
            fast, zero, _ = exact_in_doubles(block)
            if not (fast | zero).all():
                return None
        sums = totals[lo:lo + step]
        np.sum(block.astype(np.float64), axis=0, out=sums)
        signed_zeros(block, sums)  # an all -0 element stays -0
    return totals


def sums_of(stacks: Sequence[np.ndarray]) -> list:
    """One sum per stack of addends ([addends, *shape]): a DoubleSum where its float64
    sum is exact, an `ExactSum` otherwise (`exact.sums_of`, which joins those of one
    dtype). Stacks of one dtype and count are tried together (one set of array
    operations), then one by one if that fails."""
    out: list = [None] * len(stacks)
    groups: dict = {}
    for i, stack in enumerate(stacks):
        if fits(stack.dtype) and stack.shape[0]:
            groups.setdefault((stack.dtype, stack.shape[0]), []).append(i)
    for (dtype, count), members in groups.items():
        rows = [stacks[i].reshape(count, -1) for i in members]
        joined = _double_values(rows[0] if len(rows) == 1 else np.concatenate(rows, axis=1))
        start = 0
        for i, part in zip(members, rows):
            values = (joined[start:start + part.shape[1]] if joined is not None
                      else _double_values(part) if len(members) > 1 else None)
            start += part.shape[1]
            if values is not None:
                out[i] = DoubleSum(dtype, stacks[i].shape[1:], values)
    rest = [i for i, sum_ in enumerate(out) if sum_ is None]
    for i, acc in zip(rest, exact.sums_of([stacks[i] for i in rest])):
        out[i] = acc
    return out


def _two_sum_exact(a: np.ndarray, b: np.ndarray) -> Optional[np.ndarray]:
    """a + b where every element's float64 sum is finite and exact (the error term of
    TwoSum is zero), else None."""
    with np.errstate(over="ignore", invalid="ignore"):
        s = a + b
        kept_b = s - a
        error = (a - (s - kept_b)) + (b - kept_b)  # TwoSum: a + b == s + error exactly
    return s if np.isfinite(s).all() and not error.any() else None


def merged_all(intos: Sequence[Sum], others: Sequence[Sum]) -> list:
    """The sum of each pair of partial sums of one tensor (an `into` may be updated and
    returned), the float64-form pairs added together (one set of array operations)
    where every one of their sums is exact."""
    out: list = [None] * len(intos)
    doubles = []
    for i, (a, b) in enumerate(zip(intos, others)):
        if isinstance(a, DoubleSum) and isinstance(b, DoubleSum):
            if a.dtype != b.dtype or a.size != b.size:
                raise AggregationError(
                    f"partials disagree: {a.dtype}{list(a.shape)} vs "
                    f"{b.dtype}{list(b.shape)}")
            doubles.append(i)
    if len(doubles) > 1:
        joined = _two_sum_exact(np.concatenate([intos[i].values for i in doubles]),
                                np.concatenate([others[i].values for i in doubles]))
        if joined is not None:
            start = 0
            for i in doubles:
                size = intos[i].size
                out[i] = DoubleSum(intos[i].dtype, intos[i].shape, joined[start:start + size])
                start += size
    for i, (into, other) in enumerate(zip(intos, others)):
        if out[i] is not None:
            continue
        if i in doubles:
            s = _two_sum_exact(into.values, other.values)
            if s is not None:
                out[i] = DoubleSum(into.dtype, into.shape, s)
                continue
        acc = into.exact() if isinstance(into, DoubleSum) else into
        acc.merge(other.exact() if isinstance(other, DoubleSum) else other)
        out[i] = acc
    return out


def results(sums: Sequence[Sum]) -> list[np.ndarray]:
    """Each sum rounded once to its dtype (`exact.results` for the limbs)."""
    out: list = [None] * len(sums)
    limbs = [i for i, s in enumerate(sums) if not isinstance(s, DoubleSum)]
    for i, value in zip(limbs, exact.results([sums[i] for i in limbs])):
        out[i] = value
    with np.errstate(over="ignore"):  # once for all: entering it costs a microsecond
        for i, s in enumerate(sums):
            if isinstance(s, DoubleSum):
                out[i] = s._rounded()
    return out
