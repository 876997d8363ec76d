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
"""

from __future__ import annotations

import collections
import threading
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
