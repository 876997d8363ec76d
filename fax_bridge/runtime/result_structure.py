"""The pytree structure of a program's results, as jit returns them, on every other path.

A TFF type knows only named and unnamed structs, so a result read back from the runtime
or a fleet has the generic structure of `values.to_pytree`: dicts where every element is
named, tuples otherwise, `()` for an empty struct. The program's own output treedef
(NamedTuples, dataclasses and other registered nodes such as optax states, None, lists,
empty containers) is known when it is traced: `export_computation` records it for the
proto object it builds (`keep_structure`), `interpreter.prepare` finds it again
(`kept_structure`), and `with_structure` rebuilds each result with it. A proto read
from a file, copied or built elsewhere carries no treedef: its results keep the generic
structure (`interpreter.prepare(proto, structure=treedef)` supplies one).

A treedef written down for another process (a Flower app's `round.json`) goes through
`structure_to_json` / `structure_from_json` (schema `STRUCTURE_FORMAT`): dicts, lists,
tuples and None come back exactly; a NamedTuple, dataclass or other registered node
comes back as its class only where the reading process has already imported the class's
module (looked up by module and qualified name in `sys.modules`, each name in the
module's or class's own `__dict__`, so no lazy-import hook runs: the text never makes
anything be imported) and registered it, and where its auxiliary data was plain (None,
bool, int, float, str and tuples or lists of them). Any other node comes back as a tuple
of its children in jax's flattening order. The text is read as untrusted input: its
size and depth are bounded and nothing in it is executed.
"""

from __future__ import annotations

import collections
import sys
import threading
import types
from typing import Any, Optional

import jax

from fax_bridge.errors import ArgumentError, ComputationError

Pytree = Any


def _generic_leaves(tree: Pytree, out: list) -> list:
    """The tensors of a generic pytree (`to_pytree` without a structure) in type order."""
    if isinstance(tree, dict):
        for child in tree.values():  # insertion order: the type's element order
            _generic_leaves(child, out)
    elif isinstance(tree, tuple):
        for child in tree:
            _generic_leaves(child, out)
    else:
        out.append(tree)
    return out


def checked_structure(structure: Any) -> Any:
    """`structure` if it is a jax treedef (or None); else an ArgumentError saying how."""
    if structure is not None and not isinstance(structure, jax.tree_util.PyTreeDef):
        raise ArgumentError(
            f"structure must be a jax treedef, e.g. jax.tree.structure(jit_result), got "
            f"{type(structure).__name__}")
    return structure


def with_structure(generic: Pytree, structure: Any) -> Pytree:
    """A generic result pytree rebuilt with the jax treedef `structure`.

    The exporter numbers a program's outputs in jax's flattening order (dict keys
    sorted, NamedTuple and dataclass fields in declaration order, None holding
    nothing), and the result type lists its tensors depth-first in that order, so the
    generic result's tensors, taken in type order, are the treedef's leaves.
    """
    leaves = _generic_leaves(generic, [])
    if len(leaves) != structure.num_leaves:
        raise ComputationError(
            f"the result holds {len(leaves)} tensors but the program's output structure "
            f"{structure} has {structure.num_leaves} leaves; the structure belongs to "
            "another program")
    return jax.tree_util.tree_unflatten(structure, leaves)


# Output treedefs of protos exported in this process, by the proto object itself. Proto
# messages take no attributes and no weak references, so the last few exports are held.
_KEPT_STRUCTURES: "collections.OrderedDict[int, tuple[Any, Any]]" = \
    collections.OrderedDict()
_KEPT_LIMIT = 32
_kept_lock = threading.Lock()


def keep_structure(proto: Any, structure: Any) -> None:
    """Records the jax treedef of the output of the program `proto` was exported from.

    Runs of that very proto object (`run_computation`, `LocalFleet.run`, `run_loop`,
    parity) then return results with that structure. The last 32 protos are kept.
    """
    with _kept_lock:
        _KEPT_STRUCTURES.pop(id(proto), None)
        _KEPT_STRUCTURES[id(proto)] = (proto, structure)
        while len(_KEPT_STRUCTURES) > _KEPT_LIMIT:
            _KEPT_STRUCTURES.popitem(last=False)


def kept_structure(proto: Any) -> Optional[Any]:
    """The output treedef `keep_structure` recorded for this proto object, or None."""
    with _kept_lock:
        hit = _KEPT_STRUCTURES.get(id(proto))
    return hit[1] if hit is not None and hit[0] is proto else None


# `structure_to_json`'s schema: {"format": 1, "tree": NODE}; NODE is "*" (a leaf), null
# (None) or {"type": "tuple" | "list" | "dict" | "MODULE:QUALNAME", "data": AUX (absent:
# none), "opaque": true (aux data not written: read as a tuple), "children": [NODE...]};
# AUX is a JSON scalar, {"tuple": [AUX...]} or {"list": [AUX...]}.
# 1 (2026-12): first version.
STRUCTURE_FORMAT = 1
_MAX_NODES = 1_000_000
_MAX_DEPTH = 200
_MAX_AUX_DEPTH = 32
# the JSON nesting a written structure may reach: two levels a node ({"children": [...]})
# and two a level of auxiliary data ({"tuple": [...]})
MAX_JSON_DEPTH = 2 * (_MAX_DEPTH + 1) + 2 * (_MAX_AUX_DEPTH + 1) + 4
_BUILTIN = {tuple: "tuple", list: "list", dict: "dict"}
_OPAQUE = object()


def _aux_to_json(value: Any, depth: int = 0) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)) and type(value) in (tuple, list) and \
            depth < _MAX_AUX_DEPTH:
        items = [_aux_to_json(v, depth + 1) for v in value]
        if all(i is not _OPAQUE for i in items):
            return {type(value).__name__: items}
    return _OPAQUE


def _aux_from_json(value: Any, depth: int = 0) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict) and len(value) == 1 and depth < _MAX_AUX_DEPTH:
        (kind, items), = value.items()
        if kind in ("tuple", "list") and isinstance(items, list):
            made = [_aux_from_json(v, depth + 1) for v in items]
            return tuple(made) if kind == "tuple" else made
    raise ValueError(f"result structure: auxiliary data {str(value)[:80]} is not of the "
                     "schema")


def structure_to_json(structure: Any) -> dict:
    """A jax treedef as JSON-able data (`STRUCTURE_FORMAT`), for `structure_from_json`."""
    checked_structure(structure)

    def node(tree) -> Any:
        data = tree.node_data()
        if data is None:
            return "*"
        kind, aux = data
        if kind is type(None):
            return None
        out: dict = {"type": _BUILTIN.get(kind) or
                     f"{kind.__module__}:{kind.__qualname__}"}
        if aux is not None:
            encoded = _aux_to_json(aux)
            if encoded is _OPAQUE:
                out["opaque"] = True
            else:
                out["data"] = encoded
        out["children"] = [node(c) for c in tree.children()]
        return out

    return {"format": STRUCTURE_FORMAT, "tree": node(structure)}


def _registered_class(name: str) -> Optional[type]:
    """The class `MODULE:QUALNAME` names, from a module already imported, or None.

    Each name is looked up in the `__dict__` of the module or class that holds it,
    never with `getattr`: a module's `__getattr__` (a package's lazy imports) or a lazy
    module's loader would import what the text names."""
    module_name, _, qualname = name.partition(":")
    found: Any = sys.modules.get(module_name)
    if not isinstance(found, types.ModuleType):
        return None
    for part in qualname.split("."):
        if not part.isidentifier():
            return None
        try:
            space = object.__getattribute__(found, "__dict__")  # never a hook
        except AttributeError:
            return None
        found = space.get(part) if isinstance(space, (dict, types.MappingProxyType)) \
            else None
        if found is None:
            return None
    return found if isinstance(found, type) else None


def _distinct_keys(keys: Any, count: int) -> bool:
    """Whether `keys` are `count` keys a dict can hold apart: hashable, and no two equal
    as dict keys (1, 1.0 and True are one key), else a dict would drop children."""
    if not isinstance(keys, list) or len(keys) != count:
        return False
    try:
        return len(set(keys)) == count
    except TypeError:  # a list among them
        return False


def structure_from_json(data: Any) -> Any:
    """The treedef `structure_to_json` wrote (module docstring: which nodes come back as
    their class, and which as tuples). ValueError where `data` is not of the schema."""
    if not isinstance(data, dict) or type(data.get("format")) is not int or \
            data["format"] != STRUCTURE_FORMAT:
        raise ValueError(f"result structure of format {str(data)[:40]}, expected "
                         f"{{'format': {STRUCTURE_FORMAT}, ...}}")
    registry = jax.tree_util.default_registry
    make = jax.tree_util.PyTreeDef.from_node_data_and_children
    count = [0]

    def node(entry: Any, depth: int) -> Any:
        count[0] += 1
        if count[0] > _MAX_NODES or depth > _MAX_DEPTH:
            raise ValueError(f"result structure over {_MAX_NODES} nodes or "
                             f"{_MAX_DEPTH} levels deep")
        if entry == "*":
            return jax.tree_util.tree_structure(0)
        if entry is None:
            return jax.tree_util.tree_structure(None)
        if not (isinstance(entry, dict) and isinstance(entry.get("type"), str)
                and isinstance(entry.get("children"), list)):
            raise ValueError(f"result structure: node {str(entry)[:80]} is not of the "
                             "schema")
        children = [node(c, depth + 1) for c in entry["children"]]
        name = entry["type"]
        aux = _aux_from_json(entry["data"]) if "data" in entry else None
        kind = {v: k for k, v in _BUILTIN.items()}.get(name)
        if kind is dict:
            if not _distinct_keys(aux, len(children)):
                raise ValueError(f"result structure: a dict node's keys {str(aux)[:80]} "
                                 "are not one distinct key a child")
        elif kind is None and not entry.get("opaque"):
            kind = _registered_class(name)
        if kind is not None:
            try:
                return make(registry, (kind, aux), children)
            except (RuntimeError, TypeError, ValueError):
                pass  # not registered here, or other aux data: a tuple (docstring)
        return make(registry, (tuple, None), children)

    return node(data.get("tree"), 0)
