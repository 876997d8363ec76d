"""npz files (the CLI's convention): which key holds each tensor of a value, both ways.

One rule for inputs and results: one key per tensor, its dotted path through the value's
struct elements (the element's name, its index where unnamed); a placement adds nothing
to the path, so `{a, b}@SERVER` and `<a@SERVER, b@SERVER>` both have keys `a` and `b`.
Names are escaped so that no two tensors share a key (`%`, `.`, backslash, NUL as `%25`,
`%2E`, `%5C`, `%00`; a name of digits starts `%3X`): `<a.b=.., a=<b=..>>` has keys
`a%2Eb` and `a.b`. A value that is one tensor has the empty path and the key `arg`
(parameter) or `result`. CLIENTS tensors carry the clients axis; input arrays must have
their tensor's dtype. Values are read and written through `values` (pytree conversions).

Files are read by `npz_files.read_npz` (regular files only, headers checked before
anything is allocated), which this module re-exports.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional

import federated_language
import numpy as np

from fax_bridge.system.npz_files import (MAX_EXPANSION, MAX_NPZ_FILE_BYTES,  # noqa: F401
                                  NpzUnreadable, file_sha256, read_npz)
from fax_bridge.errors import ComputationError
from fax_bridge.runtime.values import from_pytree, to_pytree

ARG_KEY = "arg"
RESULT_KEY = "result"
_NPZ_ESCAPES = {"%": "%25", ".": "%2E", "\\": "%5C", "\0": "%00"}


def _npz_join(prefix: str, name: Optional[str], index: int) -> str:
    """`prefix` extended by one struct element: its escaped name, or its index if unnamed.

    Escaping makes the path of every tensor of a type distinct and reversible
    (`split_npz_key`): `%`, `.`, a backslash and NUL become `%25`, `%2E`, `%5C`, `%00`,
    and a name of ASCII digits has its first digit written `%3X` so it never reads as
    an index.
    """
    if not name:
        segment = str(index)
    else:
        segment = "".join(_NPZ_ESCAPES.get(c, c) for c in name)
        if segment.isascii() and segment.isdigit():
            segment = f"%{ord(segment[0]):02X}{segment[1:]}"
    return f"{prefix}.{segment}" if prefix else segment


def split_npz_key(key: str) -> list:
    """The path an npz key names: element names (str) and indices of unnamed elements (int).

    The inverse of the key rule for keys of struct elements; `arg` and `result` name a
    value that is one tensor (their path is empty).
    """
    return [int(part) if part.isascii() and part.isdigit() else
            re.sub("%([0-9A-F]{2})", lambda m: chr(int(m.group(1), 16)), part)
            for part in key.split(".")]


def npz_layout(type_: federated_language.Type, root: str = ARG_KEY,
               prefix: str = "") -> list[tuple[str, federated_language.TensorType]]:
    """(npz key, tensor type) of every tensor of `type_`, depth-first (`root` if one)."""
    if isinstance(type_, federated_language.FederatedType):
        return npz_layout(type_.member, root, prefix)
    if isinstance(type_, federated_language.StructType):
        out = []
        for i, (n, t) in enumerate(type_.items()):
            out.extend(npz_layout(t, root, _npz_join(prefix, n, i)))
        return out
    return [(prefix or root, type_)]


def _tree_from_npz(npz: Mapping[str, np.ndarray], type_, prefix: str,
                   root: str = ARG_KEY):
    if isinstance(type_, federated_language.FederatedType):
        return _tree_from_npz(npz, type_.member, prefix, root)
    if isinstance(type_, federated_language.StructType):
        items = list(type_.items())
        children = [_tree_from_npz(npz, t, _npz_join(prefix, n, i), root)
                    for i, (n, t) in enumerate(items)]
        if items and all(n for n, _ in items):
            return {n: c for (n, _), c in zip(items, children)}
        return tuple(children)
    return np.asarray(npz[prefix or root])


def args_from_npz(npz: Mapping[str, np.ndarray],
                  parameter_type: Optional[federated_language.Type],
                  cast: bool = False) -> Any:
    """The runtime argument for `parameter_type` read from an npz mapping (or None).

    Every array must have its tensor's dtype; `cast=True` allows numpy's same-kind
    conversions (float64 to float32, int64 to int32, int to float) instead, still
    refusing a value the dtype cannot hold (no wrapping, no overflow to infinity).
    """
    if parameter_type is None:
        if len(npz):
            raise ComputationError(
                f"the computation takes no argument, but the npz file holds {sorted(npz)}")
        return None
    layout = npz_layout(parameter_type)
    wanted = {k for k, _ in layout}
    extra = sorted(set(npz) - wanted)
    missing = sorted(wanted - set(npz))
    if missing or extra:
        raise ComputationError(
            f"the npz file does not fit the parameter {parameter_type}: no key "
            f"{', '.join(f'`{k}`' for k in missing) or '(none missing)'}; unexpected keys "
            f"{extra}; expected exactly {sorted(wanted)}")
    for key, tensor in layout:
        arr = np.asarray(npz[key])
        want = np.dtype(tensor.dtype)
        if arr.dtype != want and not cast:
            raise ComputationError(
                f"npz key `{key}` holds {arr.dtype.name} but the parameter's tensor there "
                f"is {tensor}; save it as {want.name} (`array.astype(numpy.{want.name})`), "
                "or allow the conversion (`fax-bridge run --cast`, `args_from_npz(..., "
                "cast=True)`)")
        if arr.dtype != want and arr.dtype.kind in "biuf" and want.kind in "biuf":
            with np.errstate(all="ignore"):
                back = arr.astype(want).astype(arr.dtype)
            lost = (back != arr) if want.kind in "biu" else (np.isfinite(arr) &
                                                             ~np.isfinite(back))
            if np.any(lost):
                raise ComputationError(
                    f"npz key `{key}`: {arr.dtype.name} value {arr[lost].flat[0]!r} does not "
                    f"fit {want.name} ({tensor}); converting would change it")
    return from_pytree(_tree_from_npz(npz, parameter_type, ""), parameter_type)


def _flat_npz(tree, type_, prefix: str, out: dict) -> None:
    if isinstance(type_, federated_language.FederatedType):
        return _flat_npz(tree, type_.member, prefix, out)
    if isinstance(type_, federated_language.StructType):
        elements = list(tree.values()) if isinstance(tree, dict) else list(tree)
        for i, ((n, t), v) in enumerate(zip(type_.items(), elements)):
            _flat_npz(v, t, _npz_join(prefix, n, i), out)
        return None
    out[prefix or RESULT_KEY] = np.asarray(tree)
    return None


def result_to_npz(value: Any, result_type: federated_language.Type) -> dict[str, np.ndarray]:
    """A runtime result as npz entries (`result` when the result is one tensor)."""
    out: dict[str, np.ndarray] = {}
    _flat_npz(to_pytree(value, result_type), result_type, "", out)
    return out


def _placed_layout(type_, prefix: str = "", clients: bool = False) -> list:
    """(npz key, tensor type, whether it carries a clients axis) of each tensor."""
    if isinstance(type_, federated_language.FederatedType):
        return _placed_layout(type_.member, prefix,
                              type_.placement is federated_language.CLIENTS)
    if isinstance(type_, federated_language.StructType):
        return [entry for i, (n, t) in enumerate(type_.items())
                for entry in _placed_layout(t, _npz_join(prefix, n, i), clients)]
    return [(prefix or RESULT_KEY, type_, clients)]


def result_keys(result_type: federated_language.Type) -> list[str]:
    """The npz keys `result_to_npz` writes for `result_type`, in the type's depth-first
    order: the order of the program's flattened outputs."""
    return [key for key, _, _ in _placed_layout(result_type)]


def result_from_npz(npz: Mapping[str, np.ndarray],
                    result_type: federated_language.Type) -> Any:
    """The result `result_to_npz` wrote, as the generic pytree of `result_type` (dicts
    where every element is named, tuples otherwise). Its keys must be exactly the
    type's and each array its tensor's dtype and shape (CLIENTS tensors with their
    clients axis first); ComputationError naming the key otherwise."""
    layout = _placed_layout(result_type)
    wanted = [k for k, _, _ in layout]
    if sorted(npz) != sorted(wanted):
        raise ComputationError(
            f"the result file does not fit the result {result_type}: keys "
            f"{sorted(npz)[:20]}, expected exactly {sorted(wanted)[:20]}")
    for key, tensor, clients in layout:
        arr = np.asarray(npz[key])
        shape = tuple(tensor.shape) if tensor.shape is not None else None
        got = arr.shape[1:] if clients and arr.ndim else arr.shape
        fits = arr.dtype == np.dtype(tensor.dtype) and (clients <= (arr.ndim > 0)) and (
            shape is None or (len(got) == len(shape) and all(
                d is None or d == a for d, a in zip(shape, got))))
        if not fits:
            raise ComputationError(
                f"result key `{key}` holds {arr.dtype.name}{list(arr.shape)}, but the "
                f"result's tensor there is {tensor}"
                + (" (with a leading clients axis)" if clients else ""))
    return _tree_from_npz(npz, result_type, "", RESULT_KEY)
