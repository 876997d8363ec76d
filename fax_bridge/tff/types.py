"""TFF types for JAX values: tensors, pytrees as structs, and placed (federated) types.

Pytrees map onto `federated_language` types one level at a time, following jax's own
flattening: a dict (sorted keys), a namedtuple or a registered dataclass becomes a
`StructType` with named elements, a tuple or list one with unnamed elements, `None` the
empty struct `<>`, and an array leaf a `TensorType`.  Because each struct lists its
elements in the order jax flattens them, a depth-first walk over the TFF type visits
the tensors in exactly jax's leaf order; `check_flatten_order` asserts it.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence, Union

import federated_language
import jax
import numpy as np

from fax_bridge.errors import ExportError
from fax_bridge.language.pytree_names import children as _children
from fax_bridge.language.pytree_names import element_name as _element_name
from fax_bridge.language.pytree_names import named_children  # noqa: F401 (re-exported)
from fax_bridge.language.pytree_names import path_str as _path_str

__all__ = [
    "TensorLeaf",
    "check_flatten_order",
    "dtype_of",
    "federated",
    "is_supported_dtype",
    "leaves_with_paths",
    "placement_literal",
    "pytree_type",
    "tensor_type",
]

# Dtypes jax can produce that a TFF `TensorType` (federated_language 0.5.4) can hold.
# Strings are representable in TFF but never appear as XLA values, so they are left out.
_SUPPORTED_DTYPES: frozenset[np.dtype] = frozenset(
    np.dtype(d)
    for d in (
        np.bool_,
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.uint8,
        np.uint16,
        np.uint32,
        np.uint64,
        np.float16,
        np.float32,
        np.float64,
        np.complex64,
        np.complex128,
        jax.numpy.bfloat16,
    )
)

_PLACEMENTS = {
    "server": federated_language.SERVER,
    "clients": federated_language.CLIENTS,
}


def is_supported_dtype(dtype: Any) -> bool:
    """Whether values of `dtype` can be typed (and exported) as a TFF tensor."""
    try:
        return np.dtype(dtype) in _SUPPORTED_DTYPES
    except TypeError:
        return False


def dtype_of(dtype: Any, *, where: str = "") -> np.dtype:
    """Normalizes a numpy/jax dtype and raises `ExportError` if TFF cannot hold it."""
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise ExportError(f"{dtype!r}{where} is not a dtype; pass a numpy or jax dtype.") from e
    if dt not in _SUPPORTED_DTYPES:
        supported = ", ".join(sorted(d.name for d in _SUPPORTED_DTYPES))
        raise ExportError(
            f"dtype {dt.name}{where} has no TFF tensor type in federated_language "
            f"{federated_language.__version__}; supported dtypes are {supported}. "
            "Cast the value (e.g. x.astype(jnp.float32)) before it crosses a placement "
            "or leaves the program. (float0 values are tangents of integer inputs: "
            "differentiate with respect to float inputs only.)"
        )
    return dt


def tensor_type(aval: Any, *, where: str = "") -> federated_language.TensorType:
    """The `TensorType` of an array-like leaf.

    `aval` is anything with `.shape` and `.dtype` (`jax.ShapeDtypeStruct`,
    `jax.core.ShapedArray`, numpy or jax arrays, numpy scalars), or a
    `(shape, dtype)` pair.  Python scalars are typed as jax would (bool, int32, float32,
    complex64 without x64).  `where` is added to error messages to locate the leaf.
    """
    if isinstance(aval, federated_language.TensorType):
        return aval
    if isinstance(aval, tuple) and len(aval) == 2 and not hasattr(aval, "dtype"):
        shape, dtype = aval
    elif hasattr(aval, "shape") and hasattr(aval, "dtype"):
        shape, dtype = aval.shape, aval.dtype
    elif isinstance(aval, (bool, int, float, complex)):
        arr = jax.numpy.asarray(aval)
        shape, dtype = arr.shape, arr.dtype
    else:
        raise ExportError(
            f"cannot type {type(aval).__name__} {aval!r}{where} as a TFF tensor; pass an "
            "array, a jax.ShapeDtypeStruct or a (shape, dtype) pair."
        )
    try:
        dims = tuple(int(d) for d in shape)
    except TypeError as e:
        raise ExportError(
            f"shape {shape!r}{where} is not static; TFF export needs concrete shapes, so "
            "avoid shape polymorphism in exported programs."
        ) from e
    return federated_language.TensorType(dtype_of(dtype, where=where), dims)


def pytree_type(tree: Any) -> federated_language.Type:
    """The TFF type of a pytree of avals (see the module docstring for the mapping).

    Leaves may be anything `tensor_type` accepts, or a `federated_language.Type`, which
    is used as is (so a struct of already placed types can be assembled).
    """
    return _pytree_type(tree, ())


def _pytree_type(tree: Any, _path: tuple) -> federated_language.Type:
    if isinstance(tree, federated_language.Type):
        return tree
    children = _children(tree)
    if children is None:
        return tensor_type(tree, where=f" at {_path_str(_path)}")
    elements = []
    for key, child in children:
        path = _path + (key,)
        elements.append((_element_name(key, path), _pytree_type(child, path)))
    try:
        return federated_language.StructType(elements)
    except ValueError as e:
        raise ExportError(
            f"the pytree node at {_path_str(_path)} cannot become a TFF struct: {e} "
            "Rename the offending keys (TFF reserves the names of StructType's methods, "
            "such as 'items' and 'fields')."
        ) from e


class TensorLeaf(NamedTuple):
    """A non-struct leaf of a TFF type, found depth-first.

    `index_path` selects it by element position at each struct level (what a
    `Selection` proto holds); `name_path` holds the element names (None where unnamed).
    """

    index_path: tuple[int, ...]
    name_path: tuple[Optional[str], ...]
    type: federated_language.Type


def leaves_with_paths(tff_type: federated_language.Type) -> list[TensorLeaf]:
    """Depth-first list of the non-struct parts of `tff_type` (tensors, placed types...)."""
    out: list[TensorLeaf] = []

    def walk(t: federated_language.Type, idx: tuple, names: tuple) -> None:
        if isinstance(t, federated_language.StructType):
            for i, (name, element) in enumerate(t.items()):
                walk(element, idx + (i,), names + (name,))
        else:
            out.append(TensorLeaf(idx, names, t))

    walk(tff_type, (), ())
    return out


def check_flatten_order(tree: Any, tff_type: federated_language.Type) -> None:
    """Raises `ExportError` unless depth-first order over `tff_type` is jax's leaf order.

    Checks, leaf by leaf, that the tensor types agree and that every named jax key
    (dict key, attribute) matches the TFF element name at the same position.
    """
    jax_leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    tff_leaves = leaves_with_paths(tff_type)
    if len(jax_leaves) != len(tff_leaves):
        raise ExportError(
            f"the pytree has {len(jax_leaves)} leaves but the TFF type {tff_type} has "
            f"{len(tff_leaves)} tensors; pass a TFF type with one tensor per array leaf."
        )
    for i, ((path, leaf), tff_leaf) in enumerate(zip(jax_leaves, tff_leaves)):
        where = f" at {_path_str(path)}"
        expected = tensor_type(leaf, where=where)
        if tff_leaf.type != expected:
            raise ExportError(
                f"leaf {i}{where} is {expected} but tensor {i} (depth-first) of the TFF "
                f"type {tff_type} is {tff_leaf.type}; the TFF type must list tensors in "
                "jax's flatten order (dicts by sorted key)."
            )
        jax_names = [
            k.key if isinstance(k, jax.tree_util.DictKey)
            else k.name if isinstance(k, jax.tree_util.GetAttrKey)
            else None
            for k in path
        ]
        for jax_name, tff_name in zip(jax_names, tff_leaf.name_path):
            if jax_name is not None and tff_name is not None and jax_name != tff_name:
                raise ExportError(
                    f"leaf {i}{where} lines up with TFF element {tff_name!r} of "
                    f"{tff_type}; the element names must follow jax's flatten order "
                    "(dicts by sorted key)."
                )


PlacementLike = Union[str, federated_language.framework.PlacementLiteral]


def placement_literal(placement: PlacementLike) -> federated_language.framework.PlacementLiteral:
    """`federated_language.SERVER` / `CLIENTS` for 'server' / 'clients' (or the literal)."""
    if isinstance(placement, str):
        literal = _PLACEMENTS.get(placement.lower())
        if literal is None:
            raise ExportError(
                f"unknown placement {placement!r}; use 'server' or 'clients'."
            )
        return literal
    if placement in (federated_language.SERVER, federated_language.CLIENTS):
        return placement
    raise ExportError(
        f"unknown placement {placement!r}; use 'server', 'clients', "
        "federated_language.SERVER or federated_language.CLIENTS."
    )


def federated(
    member: Any,
    placement: PlacementLike,
    all_equal: Optional[bool] = None,
) -> federated_language.FederatedType:
    """`member` placed at `placement` ('server' or 'clients').

    `member` is a TFF type or a pytree of avals.  `all_equal` defaults to TFF's
    per-placement default: False at CLIENTS (`{T}@CLIENTS`), True at SERVER.
    """
    member_type = pytree_type(member)
    literal = placement_literal(placement)
    try:
        return federated_language.FederatedType(member_type, literal, all_equal)
    except ValueError as e:
        raise ExportError(
            f"cannot place {member_type} at {literal}: {e} Place only tensors and "
            "structs of tensors."
        ) from e


def too_deep_error(args: Sequence[Any], error: Exception) -> ExportError:
    """The ExportError for a proto past protobuf's depth limit, with the arguments' depth."""
    depth = max((_pytree_depth(a) for a in args), default=0)
    return ExportError(
        f"the computation's proto nests deeper than protobuf allows ({PROTO_DEPTH_LIMIT} "
        f"message levels; each level of a pytree takes several): its arguments nest "
        f"{depth} levels deep. Flatten nested tuples/dicts (how deep a pytree can go "
        "depends on where it is used; about 18 levels in a broadcast-map-mean round), "
        "e.g. pass jax.tree_util.tree_leaves(tree) and rebuild the tree inside the "
        f"program ({type(error).__name__})")


# protobuf's default recursion limit for parsing (which building a proto also does).
PROTO_DEPTH_LIMIT = 100


def _pytree_depth(tree: Any) -> int:
    children = named_children(tree)
    if not children:
        return 0
    return 1 + max(_pytree_depth(c) for _, c in children)


TYPED_KEY_FIX = ("TFF tensors hold numbers only. Pass jax.random.key_data(key) (a uint32 "
                 "array) and rebuild the key inside with jax.random.wrap_key_data, or use "
                 "jax.random.PRNGKey keys")


def is_typed_key(x: Any) -> bool:
    """Whether `x` (an array or aval) is a typed PRNG key (`jax.random.key`)."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def refuse_typed_keys(args: Sequence[Any], names: Sequence[Optional[str]]) -> None:
    """ExportError naming the argument that holds a typed PRNG key (not a tensor in TFF)."""
    for i, arg in enumerate(args):
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            dtype = getattr(leaf, "dtype", None)
            if is_typed_key(leaf):
                name = names[i] if i < len(names) and names[i] else f"#{i}"
                raise ExportError(
                    f"argument `{name}`{jax.tree_util.keystr(path)} is a typed PRNG key "
                    f"({dtype}); {TYPED_KEY_FIX}")
