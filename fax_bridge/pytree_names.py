"""How the exporter names a pytree's children: one level of jax's flattening, with each
dict key or attribute name as the TFF struct element's name (None when positional).

The exporter's types (`tff/types`), the runtime's values and the checkpoints all name a
pytree's children with `named_children`, so a value written by one is read by another.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

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
