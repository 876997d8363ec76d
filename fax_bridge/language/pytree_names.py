"""How the exporter names a pytree's children: one level of jax's flattening, with each
dict key or attribute name as the TFF struct element's name (None when positional).

The exporter's types (`tff/types`), the runtime's values and the checkpoints all name a
pytree's children with `named_children`, so a value written by one is read by another.

A pytree path as a tensor name (a LiteRT signature's, an .npz key): `segments(path)`
gives one text per key (a dict key, an attribute name, an index), `tensor_names` joins
them with "/", keeps each to letters, digits, `_`, `.` and `-`, and makes the names
unique. Inside `recording_aggregands()` each aggregation over clients and each
broadcast notes the paths of its value's leaves (`note_aggregand`, `note_broadcast`),
which the export flattens away; `match_records` finds the records one communication of
the exported round was made of (the exporter merges calls of one kind that share their
weights and depth into one).
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from typing import Any, Iterator, Optional, Sequence

import jax

from fax_bridge.errors import ExportError


def path_str(path: Sequence[Any]) -> str:
    """A key path as jax writes it (`<root>` for the empty path)."""
    return jax.tree_util.keystr(tuple(path)) if path else "<root>"


def children(node: Any) -> Optional[list[tuple[Any, Any]]]:
    """One level of jax's flattening: `[(key, child), ...]`, or None for a leaf."""
    flat, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    if len(flat) == 1 and flat[0][0] == () and flat[0][1] is node:
        return None
    return [(path[0], child) for path, child in flat]


def element_name(key: Any, path: Sequence[Any]) -> Optional[str]:
    """The TFF element name for one jax key entry (None for positional entries)."""
    if isinstance(key, jax.tree_util.DictKey):
        name = key.key
    elif isinstance(key, jax.tree_util.GetAttrKey):
        name = key.name
    else:
        return None
    if not isinstance(name, str) or not name:
        raise ExportError(
            f"dict key {name!r} at {path_str(path)} cannot name a TFF struct element; "
            "use non-empty string keys (or a tuple/list for positional elements)."
        )
    return name


def named_children(node: Any) -> Optional[list[tuple[Optional[str], Any]]]:
    """One level of a pytree as `[(TFF element name or None, child), ...]`; None for a
    leaf. Names follow `tff.types.pytree_type` (dict keys, attribute names; None when positional)."""
    kids = children(node)
    if kids is None:
        return None
    return [(element_name(key, (key,)), child) for key, child in kids]


def segments(path: Sequence[Any]) -> list[str]:
    """One text per entry of a jax key path: a dict key, an attribute name, an index."""
    out = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                out.append(str(getattr(key, attr)))
                break
        else:
            out.append(str(key))
    return out


_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def tensor_names(paths: Sequence[Sequence[str]]) -> list[str]:
    """Each path (a list of segments) as a name: segments joined by "/", every character
    outside letters, digits, `_`, `.` and `-` as `_` (an empty segment is `_`), a name
    already taken given the first free suffix `_2`, `_3`, ... (so the names stay
    distinct and valid as TFLite signature names and .npz keys)."""
    taken: set = set()
    out = []
    for path in paths:
        base = "/".join(_UNSAFE.sub("_", s) or "_" for s in path) or "_"
        name, n = base, 1
        while name in taken:
            n += 1
            name = f"{base}_{n}"
        taken.add(name)
        out.append(name)
    return out


_AGGREGANDS: contextvars.ContextVar = contextvars.ContextVar("aggregand_paths",
                                                             default=None)


def note_aggregand(op: str, paths: Sequence[Sequence[Any]]) -> None:
    """Notes an aggregation's op and its value's leaf paths, inside
    `recording_aggregands` (nothing otherwise)."""
    record = _AGGREGANDS.get()
    if record is not None:
        record.append((op, [segments(p) for p in paths]))


def note_broadcast(paths: Sequence[Sequence[Any]]) -> None:
    """Notes a broadcast's value's leaf paths, inside `recording_aggregands`."""
    note_aggregand("federated_broadcast", paths)


def match_records(records: Sequence[tuple], kind: str, leaves: int,
                  start: int = 0) -> Optional[tuple[list, int]]:
    """(the records that make one communication of `kind` with `leaves` leaves, the
    index after the last of them), or None: the first run of consecutive records of
    that kind from `start` on (records of other kinds skipped, not breaking a run) whose
    leaves add up to `leaves`. `records`: `recording_aggregands`' (op, paths) entries;
    `kind` the op without its `federated_` prefix."""
    mine = [i for i in range(start, len(records))
            if records[i][0].removeprefix("federated_") == kind]
    for a in range(len(mine)):
        total = 0
        for b in range(a, len(mine)):
            total += len(records[mine[b]][1])
            if total == leaves:
                return [records[i] for i in mine[a:b + 1]], mine[b] + 1
            if total > leaves:
                break
    return None


@contextlib.contextmanager
def recording_aggregands() -> Iterator[list]:
    """A list that fills with (op, [the value's leaf paths as segments]) for each
    aggregation over clients and each broadcast traced inside the block, in call order."""
    record: list = []
    token = _AGGREGANDS.set(record)
    try:
        yield record
    finally:
        _AGGREGANDS.reset(token)
