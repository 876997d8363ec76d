"""Exact sums held as float64 values: the cheap form of an `exact.ExactSum`.

Floats of at most 4 bytes (float32, float16, bfloat16) are integer multiples of their
dtype's smallest subnormal, and a float64 sum of n of them is exact when the exponents
of each element's addends span little enough (`float_bits.exact_in_doubles`). A partial
sum is kept as those float64 values (`DoubleSum`): a device forms it with one float64
sum instead of integer limbs and sends 8 bytes an element; the coordinator merges two
with one addition whose exactness it checks element by element (the error term of
TwoSum is zero), and finishing is one cast.

The elements where the float64 form would lose a bit (addends spread too widely,
non-finite addends, a merge whose sum needs more than 53 bits) are spilled: their
values are 0.0 and their whole sums are kept in limbs, in one `ExactSum` over just
those elements (`DoubleSum.cols`, `DoubleSum.rest`). In large tensors these are a few
elements per million, so the float64 form stays at about 8 bytes an element; where more
than one element in `SPILL_RATIO` would spill, the tensor moves to an `ExactSum` as a
whole. Every form holds the same exact value, so a result has the same bits whichever
forms its partials took and however the clients were split.

Every pass over the elements works through blocks of columns small enough for the
temporaries to stay in cache (`exact.BLOCK_ELEMENTS`), and no stack of addends is copied;
a large stack is summed in spans of columns on one thread per CPU (`threads`).
"""

from __future__ import annotations

import math
import threading
from typing import Optional, Sequence, Union

import numpy as np

from fax_bridge.errors import AggregationError
from fax_bridge.runtime import buffers, exact, threads
from fax_bridge.runtime.exact import ExactSum
from fax_bridge.runtime.float_bits import (block_test, exact_in_doubles, float_params,
                                           signed_zeros, to_odd_float32)

SPILL_RATIO = 64  # at most one element in this many spills to limbs, else all go there
_NO_COLS = np.zeros(0, np.int64)


def most_spilled(size: int) -> int:
    """How many elements of a tensor of `size` elements may spill to limbs."""
    return size // SPILL_RATIO


class DoubleSum:
    """The exact sum of addends of a float dtype of at most 4 bytes, as float64 values
    (one per element, an all -0 element as -0.0), except at the flat positions `cols`
    (ascending; their values are +0.0), whose sums `rest` holds (an `ExactSum` of shape
    `(len(cols),)`)."""

    is_float = True

    def __init__(self, dtype: np.dtype, shape: tuple, values: np.ndarray,
                 cols: Optional[np.ndarray] = None, rest: Optional[ExactSum] = None):
        self.dtype = np.dtype(dtype)
        self.shape = tuple(shape)
        self.size = math.prod(self.shape)
        self.values = np.asarray(values, np.float64).reshape(self.size)
        self.cols = _NO_COLS if cols is None else np.asarray(cols, np.int64)
        self.rest = rest if self.cols.size else None

    def exact(self) -> ExactSum:
        """The same sum as an `ExactSum` (limbs)."""
        values = self.values
        if self.cols.size:  # -0.0 adds nothing and keeps an element's only-(-0) flag
            values = values.copy()
            values[self.cols] = -0.0
        acc = ExactSum.from_doubles(self.dtype, self.shape, values)
        if self.cols.size:
            acc.merge(self.rest.placed(self.shape, self.cols))
        return acc

    def spilled(self, cols: np.ndarray) -> ExactSum:
        """The sums at flat positions `cols` (ascending, holding every one of
        `self.cols`) as one flat `ExactSum`."""
        values = self.values[cols]
        at = np.searchsorted(cols, self.cols)
        values[at] = -0.0
        acc = ExactSum.from_doubles(self.dtype, (cols.size,), values)
        if self.cols.size:
            acc.merge(self.rest.placed((cols.size,), at))
        return acc

    def result(self, into: Optional[np.dtype] = None) -> np.ndarray:
        """The sum rounded once to the dtype (nearest, ties to even), or to `into`
        (float32, for a float16 or bfloat16 sum: `ExactSum.result`)."""
        with np.errstate(over="ignore"):
            return self._rounded(into)

    def _rounded(self, into: Optional[np.dtype] = None) -> np.ndarray:
        """`result` for a caller that already ignores overflow (np.errstate)."""
        into = self.dtype if into is None else np.dtype(into)
        out = self.values
        if into != np.float32:  # float16, bfloat16: through float32 rounded to odd
            out = to_odd_float32(out).astype(into)
        else:  # large ones in spans of blocks on the worker threads
            out = buffers.empty(self.size, np.float32)
            threads.in_spans(self.size, exact.BLOCK_ELEMENTS,
                             lambda lo, hi: _cast_span(self.values, out, lo, hi))
        if self.cols.size:
            out[self.cols] = self.rest.result(into)
        return out.reshape(self.shape)


Sum = Union[ExactSum, DoubleSum]


def _cast_span(values: np.ndarray, out: np.ndarray, start: int, stop: int) -> None:
    """`out[start:stop]` = `values[start:stop]` rounded to `out`'s dtype, a block at a
    time (a thread of its own ignores overflow: numpy's error state is per thread)."""
    with np.errstate(over="ignore"):
        for lo in range(start, stop, exact.BLOCK_ELEMENTS):
            hi = min(lo + exact.BLOCK_ELEMENTS, stop)
            np.copyto(out[lo:hi], values[lo:hi], casting="unsafe")


def fits(dtype: np.dtype) -> bool:
    """Whether sums of `dtype` can take the float64 form."""
    dtype = np.dtype(dtype)
    return exact.is_exact_kind(dtype) and dtype.kind not in "iu" and dtype.itemsize <= 4


def _split_values(rows: np.ndarray, most: int, scale: Optional[np.ndarray] = None):
    """(the column sums of `rows` ([addends, size]) as float64, the columns spilled:
    those whose float64 sum would not be exact, their values set to 0.0), or None when
    more than `most` columns would spill. With `scale` (one factor per row, the rows'
    dtype), the addends are the products `rows * scale[:, None]`, each rounded to the
    dtype, made a block at a time. Large stacks are split into spans of columns summed
    on `threads.workers()` threads at once (numpy lets go of the GIL): a column's sum is
    the same whichever thread makes it."""
    count, size = rows.shape
    totals = buffers.empty(size, np.float64)
    step = max(1, exact.BLOCK_ELEMENTS // max(1, count))
    state = _Spill(most)
    found = threads.in_spans(size, step, lambda lo, hi: _split_span(rows, totals, lo, hi,
                                                                    step, scale, state))
    if state.over:
        return None
    spilled = [cols for part in found for cols in part]
    return totals, (np.concatenate(spilled) if spilled else _NO_COLS)


class _Spill:
    """How many columns the spans of one stack have spilled so far, against `most`."""

    def __init__(self, most: int):
        self.most, self.count, self.over = most, 0, False
        self.lock = threading.Lock()

    def add(self, count: int) -> bool:
        """Counts `count` more spilled columns; False once there are too many."""
        with self.lock:
            self.count += count
            self.over |= self.count > self.most
            return not self.over


def _split_span(rows: np.ndarray, totals: np.ndarray, start: int, stop: int, step: int,
                scale: Optional[np.ndarray], state: _Spill) -> list:
    """`_split_values` over the columns [start, stop), a block at a time: their sums
    written into `totals`, the spilled columns returned (a list of ascending arrays);
    stops early once `state` has too many."""
    count = rows.shape[0]
    spilled: list = []
    width = min(step, stop - start)
    # Buffers made once and written over block after block: a new one per block would
    # be freed and faulted in again at every block.
    scratch = np.empty((count, width), float_params(rows.dtype)[3])
    if scale is not None:
        products = np.empty((count, width), rows.dtype)
        by = scale.reshape(count, 1)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        for lo in range(start, stop, step):
            if state.over:
                return spilled
            block = rows[:, lo:min(lo + step, stop)]
            if scale is not None:
                block = np.multiply(block, by, out=products[:, :block.shape[1]])
            sums = totals[lo:lo + block.shape[1]]
            bad = None
            # one test for the block, else column by column
            passed, zeros = block_test(block, scratch[:, :block.shape[1]])
            if not passed:
                fast, zero, _ = exact_in_doubles(block)
                bad = np.flatnonzero(~(fast | zero))
                if not state.add(bad.size):
                    return spilled
            _column_sums(block, sums)
            if zeros:  # an all -0 element stays -0; without zero addends a zero sum is +0
                signed_zeros(block, sums)
            if bad is not None and bad.size:  # spilled: +0.0, their sums kept in limbs
                sums[bad] = 0.0
                spilled.append(bad + lo)
    return spilled


def _column_sums(block: np.ndarray, out: np.ndarray) -> None:
    """`out` = the float64 sums of `block`'s columns (added in any order)."""
    if block.dtype == np.float32:  # cast as it goes: no float64 copy of the block
        np.add.reduce(block, axis=0, dtype=np.float64, out=out)
    else:
        np.sum(block.astype(np.float64), axis=0, out=out)


def _double_values(rows: np.ndarray) -> Optional[np.ndarray]:
    """The column sums of `rows` ([addends, size]) as float64, or None where one would
    not be exact."""
    found = _split_values(rows, 0)
    return None if found is None else found[0]


def _double_sum(stack: np.ndarray, scale: Optional[np.ndarray] = None
                ) -> Optional[DoubleSum]:
    """The sum of a stack of addends ([addends, *shape]; with `scale`, of the products
    `stack[i] * scale[i]` rounded to the dtype) in the float64 form, spilling what it
    must, or None when too many elements would spill."""
    count, shape = stack.shape[0], stack.shape[1:]
    rows = stack.reshape(count, -1)
    found = _split_values(rows, most_spilled(rows.shape[1]), scale)
    if found is None:
        return None
    values, cols = found
    rest = None
    if cols.size:
        rest = ExactSum(stack.dtype, (cols.size,))
        addends = rows[:, cols]
        if scale is not None:
            with np.errstate(over="ignore", under="ignore", invalid="ignore"):
                addends = np.multiply(addends, scale.reshape(count, 1))
        rest.add_many(addends)
    return DoubleSum(stack.dtype, shape, values, cols, rest)


def weighted_sums_of(columns: Sequence[np.ndarray], weights: np.ndarray,
                     overwrite: bool = False) -> list:
    """`sums_of([c * w for c in columns] + [weights])`, each product `columns[j][i] *
    weights[i]` rounded to the column's dtype (the weights cast to it first): the sums
    of the weighted columns, then the sum of the weights. Large columns of the float64
    form have their products made a block at a time as they are summed, never as a
    whole; `overwrite`: the others' products may be written into their columns."""
    out: list = [None] * (len(columns) + 1)
    cast: dict = {}  # the weights in each column dtype, made once
    rest, products = [], []
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):  # as jit does
        for i, c in enumerate(columns):
            if c.dtype not in cast:
                cast[c.dtype] = weights.astype(c.dtype)
            by = cast[c.dtype]
            if fits(c.dtype) and c.shape[0] and c.size > exact.BLOCK_ELEMENTS:
                out[i] = _double_sum(c, by)
                if out[i] is not None:
                    continue
            by = by.reshape((-1,) + (1,) * (c.ndim - 1))
            rest.append(i)
            products.append(np.multiply(c, by, out=c if overwrite else None))
    for i, sum_ in zip(rest + [len(columns)], sums_of(products + [weights])):
        out[i] = sum_
    return out


def sums_of(stacks: Sequence[np.ndarray]) -> list:
    """One sum per stack of addends ([addends, *shape]): a DoubleSum where the float64
    form holds it (spilling a few elements at most), an `ExactSum` otherwise
    (`exact.sums_of`, which joins those of one dtype). Small stacks of one dtype and
    count are tried together (one set of array operations), then one by one if that
    fails; large ones go alone (joining them would copy them)."""
    out: list = [None] * len(stacks)
    groups: dict = {}
    for i, stack in enumerate(stacks):
        if not (fits(stack.dtype) and stack.shape[0]):
            continue
        if stack.size <= exact.BLOCK_ELEMENTS:
            groups.setdefault((stack.dtype, stack.shape[0]), []).append(i)
        else:
            out[i] = _double_sum(stack)
    for (dtype, count), members in groups.items():
        rows = [stacks[i].reshape(count, -1) for i in members]
        joined = (_double_values(np.concatenate(rows, axis=1)) if len(rows) > 1
                  else None)
        start = 0
        for i, part in zip(members, rows):
            if joined is not None:
                out[i] = DoubleSum(dtype, stacks[i].shape[1:],
                                   joined[start:start + part.shape[1]])
            else:
                out[i] = _double_sum(stacks[i])
            start += part.shape[1]
    rest = [i for i, sum_ in enumerate(out) if sum_ is None]
    for i, acc in zip(rest, exact.sums_of([stacks[i] for i in rest])):
        out[i] = acc
    return out


def _checked_sum(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(a + b in float64, the positions where that sum is not exact or not finite: the
    error term of TwoSum is not zero there). Large arrays are added in spans of blocks
    on the worker threads (`threads`) at once."""
    out = buffers.empty(a.size, np.float64)
    found = threads.in_spans(a.size, exact.BLOCK_ELEMENTS,
                             lambda lo, hi: _checked_span(a, b, out, lo, hi))
    bad = [cols for part in found for cols in part]
    return out, (np.concatenate(bad) if bad else _NO_COLS)


def _checked_span(a: np.ndarray, b: np.ndarray, out: np.ndarray, start: int,
                  stop: int) -> list:
    """`_checked_sum` over the positions [start, stop), a block at a time, into `out`;
    the inexact positions found (a list of ascending arrays)."""
    step = exact.BLOCK_ELEMENTS
    u, v = np.empty(min(step, stop - start)), np.empty(min(step, stop - start))
    bad = []
    with np.errstate(over="ignore", invalid="ignore"):
        for lo in range(start, stop, step):
            hi = min(lo + step, stop)
            x, y, s = a[lo:hi], b[lo:hi], out[lo:hi]
            e, f = u[:s.size], v[:s.size]
            np.add(x, y, out=s)
            np.subtract(s, x, out=e)  # y's part of s
            np.subtract(s, e, out=f)  # x's part of s
            np.subtract(x, f, out=f)
            np.subtract(y, e, out=e)
            np.add(e, f, out=e)  # TwoSum: x + y == s + e exactly (NaN once s overflows)
            if e.any():
                bad.append(np.flatnonzero(e) + lo)
    return bad


def _merged(a: DoubleSum, b: DoubleSum) -> Sum:
    """a + b: a DoubleSum, its inexact elements spilled (joining those spilled before),
    or an ExactSum when too many would be."""
    total, bad = _checked_sum(a.values, b.values)
    if not (bad.size or a.cols.size or b.cols.size):
        return DoubleSum(a.dtype, a.shape, total)
    cols = np.union1d(np.union1d(a.cols, b.cols), bad)
    if cols.size > most_spilled(a.size):
        acc = a.exact()
        acc.merge(b.exact())
        return acc
    rest = a.spilled(cols)
    rest.merge(b.spilled(cols))
    total[cols] = 0.0
    return DoubleSum(a.dtype, a.shape, total, cols, rest)


def merged_all(intos: Sequence[Sum], others: Sequence[Sum]) -> list:
    """The sum of each pair of partial sums of one tensor (an `into` may be updated and
    returned). Small float64-form pairs without spilled elements are added together
    (one set of array operations) when every one of their sums is exact."""
    out: list = [None] * len(intos)
    small = []
    for i, (a, b) in enumerate(zip(intos, others)):
        if isinstance(a, DoubleSum) and isinstance(b, DoubleSum):
            if a.dtype != b.dtype or a.size != b.size:
                raise AggregationError(
                    f"partials disagree: {a.dtype}{list(a.shape)} vs "
                    f"{b.dtype}{list(b.shape)}")
            if a.size <= exact.BLOCK_ELEMENTS and not (a.cols.size or b.cols.size):
                small.append(i)
    if len(small) > 1:
        joined, bad = _checked_sum(np.concatenate([intos[i].values for i in small]),
                                   np.concatenate([others[i].values for i in small]))
        if not bad.size:
            start = 0
            for i in small:
                size = intos[i].size
                out[i] = DoubleSum(intos[i].dtype, intos[i].shape, joined[start:start + size])
                start += size
    for i, (into, other) in enumerate(zip(intos, others)):
        if out[i] is not None:
            continue
        if isinstance(into, DoubleSum) and isinstance(other, DoubleSum):
            out[i] = _merged(into, other)
            continue
        acc = into.exact() if isinstance(into, DoubleSum) else into
        acc.merge(other.exact() if isinstance(other, DoubleSum) else other)
        out[i] = acc
    return out


def results(sums: Sequence[Sum], wide: bool = False) -> list[np.ndarray]:
    """Each sum rounded once to its dtype (`exact.results` for the limbs); with `wide`,
    float16 and bfloat16 sums to float32 (`exact.WIDE`) instead."""
    out: list = [None] * len(sums)
    limbs = [i for i, s in enumerate(sums) if not isinstance(s, DoubleSum)]
    for i, value in zip(limbs, exact.results([sums[i] for i in limbs], wide)):
        out[i] = value
    with np.errstate(over="ignore"):  # once for all: entering it costs a microsecond
        for i, s in enumerate(sums):
            if isinstance(s, DoubleSum):
                out[i] = s._rounded(exact.WIDE if wide and s.dtype.itemsize < 4 else None)
    return out
