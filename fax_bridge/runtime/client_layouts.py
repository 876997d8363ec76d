"""Clients' local values as (layout, leaves), the form `client_map` batches them in.

A value's layout is its tree (Struct names and nesting, each tensor leaf's shape and
dtype); clients whose members share one layout stack leaf by leaf along a leading
clients axis (`layouts`, `Source`), and one client's result is rebuilt around its
leaves (`build`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import numpy as np
from federated_language.common_libs import structure

from fax_bridge.errors import ComputationError
from fax_bridge.runtime import hlo
from fax_bridge.runtime.backend import ClientRows, LocalValue

NO_SHARED = object()  # `shared` when the computation takes the member alone


def layout(value: LocalValue, leaves: list, lead: int = 0) -> Any:
    """The value's tree (Struct names and nesting, leaf shapes and dtypes), its leaves
    appended to `leaves`; None when a leaf is not a tensor jax can take as it is.
    `lead`: leading axes left out of the shapes (1: the tree of one row of stacked
    members)."""
    if isinstance(value, structure.Struct):
        names, trees = [], []
        for name, member in structure.iter_elements(value):
            tree = layout(member, leaves, lead)
            if tree is None:
                return None
            names.append(name)
            trees.append(tree)
        return ("struct", tuple(names), tuple(trees))
    arr = value if isinstance(value, jax.Array) else np.asarray(value)  # kept where it is
    if not jax_takes(np.dtype(arr.dtype)):
        return None
    leaves.append(arr)
    # the dtype itself: the `.str` of bfloat16 reads back as a void type
    return ("tensor", tuple(arr.shape[lead:]), np.dtype(arr.dtype))


def jax_takes(dtype: np.dtype) -> bool:
    """Whether jax passes a `dtype` array through unchanged (no 64-bit narrowing)."""
    if dtype.kind not in "biufc" and dtype.name != "bfloat16" or not dtype.isnative:
        return False
    wide = dtype.itemsize == 8 and dtype.kind != "c" or dtype.itemsize == 16
    return not wide or bool(jax.config.jax_enable_x64)


def build(tree: Any, leaves) -> LocalValue:
    """The value of `tree` around `leaves` (an iterator)."""
    if tree[0] == "struct":
        return structure.Struct([(n, build(t, leaves)) for n, t in zip(tree[1], tree[2])])
    return next(leaves)


def result_layout(value: LocalValue, leaves: list) -> Any:
    """`layout` of a traced result (tracers or constants among its leaves)."""
    if isinstance(value, structure.Struct):
        names, trees = [], []
        for name, member in structure.iter_elements(value):
            names.append(name)
            trees.append(result_layout(member, leaves))
        return ("struct", tuple(names), tuple(trees))
    if not hlo.is_traced(value):
        value = np.asarray(value)
        if not jax_takes(value.dtype):
            raise ComputationError(f"a result leaf of dtype {value.dtype} cannot be batched")
    leaves.append(value)
    return ("tensor",)


def layouts(members: Sequence[LocalValue], shared: Any) -> Optional[tuple]:
    """(shared tree, member tree, shared leaves, the members' leaves as a `Source`) when
    every member has the first one's layout; None otherwise."""
    shared_leaves: list = []
    shared_tree = None
    if shared is not NO_SHARED:
        shared_tree = layout(shared, shared_leaves)
        if shared_tree is None:
            return None
    if isinstance(members, ClientRows):
        member_tree = layout(members.stacked, [], lead=1)
        if member_tree is None or not members.columns:
            return None
        return shared_tree, member_tree, shared_leaves, Source(members.columns, None)
    columns: list = []
    member_tree = None
    for member in members:
        leaves: list = []
        tree = layout(member, leaves)
        if tree is None or not leaves or member_tree is not None and tree != member_tree:
            return None
        member_tree = tree
        columns.append(leaves)
    return shared_tree, member_tree, shared_leaves, Source(None, columns, fixed_leaves_of(columns))


def fixed_leaves_of(columns: list) -> Optional[tuple]:
    """Which leaves are the very same array in every member (a broadcast value zipped
    into each client's member), or None when none is or all are: those run as shared
    inputs of the batched call, not stacked once per client."""
    if len(columns) < 2:
        return None
    first = columns[0]
    fixed = tuple(all(c[j] is first[j] for c in columns[1:]) for j in range(len(first)))
    return fixed if any(fixed) and not all(fixed) else None


class Source:
    """The members' leaves, a bucket of rows at a time: `stacked` (clients on axis 0,
    from `ClientRows`: sliced, no copy) or `columns` (each member's leaves: stacked per call,
    so at most one call's rows are copied at once). Padding rows repeat the first.
    `fixed`: which of the members' leaves are one array shared by all (`fixed_leaves_of`); they
    are not stacked, the call takes them once (`fixed_leaves`)."""

    def __init__(self, stacked: Optional[list], columns: Optional[list],
                 fixed: Optional[tuple] = None):
        self.stacked, self.columns, self.fixed = stacked, columns, fixed
        self.count = int(stacked[0].shape[0]) if stacked is not None else len(columns)

    def row_bytes(self) -> int:
        """The bytes of one row of the stacked inputs (a padding row's)."""
        if self.stacked is not None:
            return sum(leaf.nbytes // max(1, leaf.shape[0]) for leaf in self.stacked)
        return sum(np.asarray(leaf).nbytes for j, leaf in enumerate(self.columns[0])
                   if self.fixed is None or not self.fixed[j])

    def fixed_leaves(self) -> list:
        if self.fixed is None:
            return []
        return [leaf for leaf, f in zip(self.columns[0], self.fixed) if f]

    def chunk(self, start: int, stop: int, rows: int) -> list:
        """Members [start, stop), padded to `rows`."""
        if self.stacked is None:
            part = self.columns[start:stop]
            part = part + [part[0]] * (rows - len(part))
            return [np.stack([c[j] for c in part]) for j in range(len(part[0]))
                    if self.fixed is None or not self.fixed[j]]
        out = []
        for leaf in self.stacked:
            leaf = leaf[start:stop]
            if leaf.shape[0] < rows:
                leaf = np.concatenate([leaf, np.repeat(leaf[:1], rows - leaf.shape[0], 0)])
            out.append(leaf)
        return out
