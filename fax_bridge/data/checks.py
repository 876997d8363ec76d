"""Argument checks shared by the data helpers: each refusal is a `DataError` naming the
argument, the value it got and what to pass instead, before numpy sees the value."""

from __future__ import annotations

import numbers
from typing import Any, Mapping, Optional

import numpy as np

from fax_bridge.errors import DataError


def shown(value: Any) -> str:
    """A short repr of `value` for an error message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def integer(name: str, value: Any, low: int = 0, high: Optional[int] = None,
            fix: str = "") -> int:
    """`value` as an int in [low, high]; bools and floats (even 3.0) are refused."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise DataError(f"{name} must be an integer, got {shown(value)} "
                        f"({type(value).__name__}){'; ' + fix if fix else ''}.")
    value = int(value)
    if value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"between {low} and {high}"
        raise DataError(f"{name} must be {span}, got {value}{'; ' + fix if fix else ''}.")
    return value


def real(name: str, value: Any, low: float, high: float = np.inf,
         low_open: bool = False, high_open: bool = False, fix: str = "") -> float:
    """`value` as a finite float in the interval from `low` to `high`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise DataError(f"{name} must be a number, got {shown(value)} "
                        f"({type(value).__name__}){'; ' + fix if fix else ''}.")
    value = float(value)
    inside = (value > low if low_open else value >= low) and (
        value < high if high_open else value <= high)
    if not (np.isfinite(value) and inside):
        span = (f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
                if np.isfinite(high) else f"{'>' if low_open else '>='} {low:g}")
        raise DataError(f"{name} must be a finite number {span}, got {value!r}"
                        f"{'; ' + fix if fix else ''}.")
    return value


def seed(value: Any) -> int:
    """A seed for `numpy.random.default_rng`: an integer >= 0."""
    return integer("seed", value, 0, fix="pass a non-negative integer such as 0")


def indices(name: str, value: Any, size: int) -> np.ndarray:
    """`value` as a 1-D int64 array of positions in [0, size)."""
    try:
        arr = np.asarray(value)
    except Exception:  # noqa: BLE001 - ragged or odd objects: refused by name below
        arr = np.asarray(None)
    if arr.size == 0 and arr.ndim == 1:
        return arr.astype(np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise DataError(f"{name} must be a 1-D array of integer positions, got "
                        f"{shown(value)}; pass e.g. numpy.arange(3).")
    if arr.min() < 0 or arr.max() >= size:
        raise DataError(f"{name} must hold positions in [0, {size}), got values from "
                        f"{arr.min()} to {arr.max()}; negative positions are not wrapped.")
    return arr.astype(np.int64)


def dataset(name: str, value: Any) -> Mapping:
    """A client dataset: a non-empty dict of arrays, each with a leading example axis."""
    if not isinstance(value, Mapping) or not value:
        raise DataError(
            f"{name} must be a non-empty dict of arrays sharing a leading example axis, "
            f"e.g. {{'x': images, 'y': labels}}; got {shown(value)}.")
    for key, array in value.items():
        if not isinstance(key, str):
            raise DataError(f"{name} has the key {key!r}; name every array with a string.")
        try:
            arr = np.asarray(array)
        except Exception:  # noqa: BLE001 - ragged nested lists
            arr = np.asarray(None)
        if arr.dtype == object:
            raise DataError(f"{name}[{key!r}] is not a numeric array (got "
                            f"{shown(array)}); give numpy arrays of numbers or strings.")
        if arr.ndim == 0:
            raise DataError(f"{name}[{key!r}] has no leading example axis (got "
                            f"{shown(array)}); give every array one row per example.")
    return value


NUMERIC_KINDS = "biufc"  # bool, signed and unsigned ints, floats, complex


def _ml_dtype(name: str) -> Optional[np.dtype]:
    """The ml_dtypes type `name` names (bfloat16, float8_e4m3fn, int4, ...), or None."""
    import ml_dtypes  # jax's extended number types

    found = getattr(ml_dtypes, name, None) if name.isidentifier() else None
    if isinstance(found, type) and issubclass(found, np.generic):
        return np.dtype(found)
    return None


def stored_dtype_name(dtype: np.dtype) -> str:
    """How a file records `dtype` for `numeric_dtype` to read back: numpy's own with
    its byte order ('<f4') for numpy's numbers, the name for an ml_dtypes type
    ('bfloat16', which numpy records as the bytes 'V2'). DataError for any other."""
    dtype = np.dtype(dtype)
    if dtype.kind in NUMERIC_KINDS and not dtype.fields and dtype.subdtype is None:
        return dtype.str
    if _ml_dtype(dtype.name) == dtype:
        return dtype.name
    raise DataError(f"dtype {dtype} is not a number type a file of numbers holds; give "
                    "bool, integer, float or complex arrays (bfloat16 and the other "
                    "ml_dtypes types too)")


def numeric_dtype(name: Any, what: str, fix: str = "") -> np.dtype:
    """The numeric dtype that `name`, read from a file another party may have written,
    records (`stored_dtype_name`): numpy's bool, integer, float and complex types in any
    byte order ('<f4', 'int32') and ml_dtypes' ('bfloat16'). Every other (objects,
    whose bytes would be read as pointers; strings, structures, dates, voids of any
    size) is a DataError naming `what` and the dtype: raw bytes are only ever read as
    numbers."""
    dtype = None
    if isinstance(name, str) and 0 < len(name) <= 40:
        dtype = _ml_dtype(name)
        if dtype is None and name.isprintable():
            try:
                dtype = np.dtype(name)
            except (TypeError, ValueError, SyntaxError):
                dtype = None
            if dtype is not None and (dtype.kind not in NUMERIC_KINDS or dtype.fields
                                      or dtype.subdtype is not None):
                raise DataError(
                    f"{what} has dtype {shown(name)} ({dtype.name}), which is not a number "
                    "type: only bool, integer, float and complex data (bfloat16 and the "
                    f"other ml_dtypes types too) is read{'; ' + fix if fix else ''}.")
    if dtype is None:
        raise DataError(f"{what} has dtype {shown(name)}, which names no number type "
                        f"numpy or ml_dtypes knows{'; ' + fix if fix else ''}.")
    return dtype
