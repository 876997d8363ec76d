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
