"""Checked command-line arguments and result files shared by every fax-bridge subcommand.

The `argparse` types here refuse a bad value when the command line is read, before any
work starts; argparse then names the flag (`argument --clients: must be an integer >= 1,
got 0`). `save_result` never loses a finished result to a bad output path: when the
file cannot be written it saves the result in the temporary directory and says where.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import tempfile
from typing import Callable, Mapping, Optional

import numpy as np

from fax_bridge.errors import ComputationError


def int_in(low: int, high: Optional[int] = None) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high] (no upper bound without `high`)."""

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            span = f">= {low}" if high is None else f"in {low}..{high}"
            raise argparse.ArgumentTypeError(f"must be an integer {span}, got {value}")
        return value

    return parse


def float_at_least(low: float) -> Callable[[str], float]:
    """An argparse type: a finite float >= low."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not np.isfinite(value) or value < low:
            raise argparse.ArgumentTypeError(f"must be a finite number >= {low}, got {text}")
        return value

    return parse


def listen_address(text: str) -> str:
    """An argparse type: HOST:PORT to listen on, port in 0..65535 (0: a free port)."""
    from fax_bridge.errors import AddressError
    from fax_bridge.fleet.protocol import parse_address

    try:
        parse_address(text, "HOST:PORT", allow_port_zero=True)
    except AddressError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def output_file(suffix: str = "") -> Callable[[str], str]:
    """An argparse type: a file path whose folder exists and is writable.

    With `suffix` (e.g. ".npz") a path without it gets it appended, as numpy would when
    saving, so the path printed afterwards is the file really written.
    """

    def parse(text: str) -> str:
        if not text or text.endswith(os.sep):
            raise argparse.ArgumentTypeError(f"{text!r} names a folder, not a file")
        path = text if not suffix or text.endswith(suffix) else text + suffix
        folder = pathlib.Path(path).parent
        if not folder.is_dir():
            raise argparse.ArgumentTypeError(
                f"the folder {str(folder)!r} of {text!r} does not exist; create it first")
        if not os.access(folder, os.W_OK):
            raise argparse.ArgumentTypeError(f"the folder {str(folder)!r} is not writable")
        if pathlib.Path(path).is_dir():
            raise argparse.ArgumentTypeError(f"{path!r} is a folder, not a file")
        return path

    return parse


def write_or_rescue(path: str, write: Callable[[object], None], suffix: str,
                    what: str) -> tuple[str, Optional[str]]:
    """Writes with `write(file)` to `path`; on failure to a new temporary file instead.

    Returns (the path written, None) or (the rescue path, the reason `path` failed).
    """
    try:
        with open(path, "wb") as f:
            write(f)
        return path, None
    except OSError as e:
        reason = f"cannot write {path!r} ({e.strerror or e})"
    fd, rescue = tempfile.mkstemp(prefix=f"fax-bridge-{what}-", suffix=suffix)
    with os.fdopen(fd, "wb") as f:
        write(f)
    return rescue, reason


def save_result(path: str, arrays: Mapping[str, np.ndarray]) -> tuple[str, Optional[str]]:
    """Saves a result npz at `path` (or rescues it; see `write_or_rescue`)."""
    return write_or_rescue(path, lambda f: np.savez(f, **arrays), ".npz", "result")


def load_npz(path: str, flag: str = "--inputs") -> dict[str, np.ndarray]:
    """The arrays of an npz file, or a ComputationError naming the flag and the problem."""
    try:
        with np.load(path, allow_pickle=False) as f:
            if not hasattr(f, "files"):
                raise ValueError("it holds a single .npy array, not an npz archive")
            return {k: f[k] for k in f.files}
    except FileNotFoundError:
        raise ComputationError(f"{flag} {path}: no such file") from None
    except IsADirectoryError:
        raise ComputationError(f"{flag} {path}: is a folder, not an npz file") from None
    except Exception as e:  # noqa: BLE001 - any failure to parse the file's bytes
        # numpy and zipfile raise many kinds for damaged bytes (BadZipFile, an unknown zip
        # version's NotImplementedError, a flipped flag's "encrypted" RuntimeError, ...)
        if "Object arrays" in str(e):
            detail = "it holds object arrays, which are never unpickled"
        elif "pickle" in str(e):
            detail = "its bytes are neither an npz archive nor a .npy array"
        else:
            detail = f"{type(e).__name__}: {e}"
        raise ComputationError(
            f"{flag} {path} is not a readable npz archive of numeric arrays ({detail}); "
            "write it with numpy.savez") from None
