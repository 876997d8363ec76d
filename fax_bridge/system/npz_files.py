"""Reading npz files another party handed over: the one reader a run uses.

`read_npz(path)` is the one reader of npz files a run is handed (inputs, a carried
state): a regular file only (a FIFO never hangs it; a link refused where the caller says
so), its sha256 checked first where the caller records one, each member an `.npy` array
read without pickles whose header is checked before anything is allocated: the bytes it
claims must be in the member, and all members together within a bound from the file's
real size (`MAX_EXPANSION` times it; a compressed member may unpack that much), so a
header claiming 2^40 elements is a named refusal, not a `MemoryError`. `read_npy(path)`
reads one `.npy` file so (a population's `offsets.npy`): its header's claim must be
exactly the bytes the file holds after it.
"""

from __future__ import annotations

import hashlib
import math
import os
import zipfile
from typing import Optional

import numpy as np

from fax_bridge.system import private_files
from fax_bridge.errors import ComputationError

MAX_EXPANSION = 1032  # deflate's largest ratio: what a compressed member may unpack to
MAX_NPZ_FILE_BYTES = 1 << 40


class NpzUnreadable(ComputationError):
    """An npz file that is not one this reads (`read_npz`), named with what was wrong."""


def read_npz(path: "os.PathLike | str", *, what: str = "npz file",
             follow_links: bool = True, sha256: Optional[str] = None,
             max_bytes: Optional[int] = None,
             fix: str = "write it with numpy.savez") -> dict[str, np.ndarray]:
    """The arrays of the npz file at `path` by key (module docstring).

    Args:
      path: the file.
      what: how the user names it, for messages (a flag, a run config key).
      follow_links: False refuses a symbolic link at `path` (never followed).
      sha256: the hex digest the file's bytes must have, where the caller recorded it.
      max_bytes: the most bytes the arrays may take together; at most `MAX_EXPANSION`
        times the file's size whatever is given.
      fix: how to write a file this reads, ending each refusal.

    Returns:
      {key: array}; `FileNotFoundError` where there is no file, `NpzUnreadable` (or
      `private_files.UnsafePathError`) naming `what`, `path` and the problem otherwise.
    """
    path = os.fspath(path)
    f, size = private_files.open_regular(path, MAX_NPZ_FILE_BYTES, what=what,
                                         follow_links=follow_links, fix=fix)
    with f:
        if sha256 is not None:
            found = file_sha256(f)
            if found != sha256:
                raise NpzUnreadable(
                    f"{what} {path} is not the file that was recorded with it (sha256 "
                    f"{found}, recorded {sha256}): it was written for another round or "
                    f"changed since; {fix}")
            f.seek(0)
        bound = size * MAX_EXPANSION if max_bytes is None else min(max_bytes,
                                                                    size * MAX_EXPANSION)
        try:
            return _members(f, size, bound)
        except NpzUnreadable as e:
            detail = str(e)
        except MemoryError:
            detail = "its arrays do not fit in memory"
        except Exception as e:  # noqa: BLE001 - any failure to parse the file's bytes
            # zipfile raises many kinds for damaged bytes (BadZipFile, an unknown zip
            # version's NotImplementedError, a flipped flag's "encrypted" RuntimeError, ...)
            detail = f"{type(e).__name__}: {e}"
    raise NpzUnreadable(f"{what} {path} is not a readable npz archive of numeric arrays "
                        f"({detail}); {fix}")


def read_npy(path: "os.PathLike | str", *, what: str = "npy file",
             max_bytes: int = MAX_NPZ_FILE_BYTES,
             fix: str = "write it with numpy.save") -> np.ndarray:
    """The array of the `.npy` file at `path`, a regular file of at most `max_bytes`
    (never a link; `FileNotFoundError` where there is none), checked by `parse_npy`."""
    return parse_npy(private_files.read_regular(path, max_bytes, what=what, fix=fix),
                     f"{what} {os.fspath(path)}", fix)


def parse_npy(data: bytes, name: str, fix: str = "write it with numpy.save") -> np.ndarray:
    """The array the `.npy` bytes `data` of the file `name` hold (no pickles): an
    `NpzUnreadable` naming `name` and the problem unless its header claims exactly
    the bytes that follow it. The array is a read-only view of `data`."""
    import io

    try:
        f = io.BytesIO(data)
        shape, fortran, dtype, at = _header(f, "")
        nbytes = math.prod(shape) * dtype.itemsize
        if at + nbytes != len(data):
            raise NpzUnreadable(f"its header claims {dtype.name}{list(shape)} ({nbytes} "
                                f"bytes), but {max(0, len(data) - at)} bytes follow it")
        return np.frombuffer(data, dtype, offset=at, count=math.prod(shape)).reshape(
            shape, order="F" if fortran else "C")
    except NpzUnreadable as e:
        detail = str(e).replace("its member '' ", "it ")
    except Exception as e:  # noqa: BLE001 - numpy's many refusals of a bad header
        detail = f"{type(e).__name__}: {str(e)[:200]}"
    raise NpzUnreadable(f"{name} is not a readable .npy array ({detail}); {fix}")


def file_sha256(f) -> str:
    """The sha256 (hex) of what is left to read in the open binary file `f`."""
    digest = hashlib.sha256()
    for block in iter(lambda: f.read(1 << 20), b""):
        digest.update(block)
    return digest.hexdigest()


def _members(f, size: int, bound: int) -> dict[str, np.ndarray]:
    """Each member of the open zip `f` (of `size` bytes) as an array, headers checked
    before any array is allocated; together at most `bound` bytes."""
    out: dict[str, np.ndarray] = {}
    total = 0
    with zipfile.ZipFile(f) as archive:
        for info in archive.infolist():
            name = info.filename
            key = name[:-4] if name.endswith(".npy") else name
            if key in out or not name.endswith(".npy"):
                raise NpzUnreadable(f"its member {name!r} is not one distinct .npy array")
            if info.compress_size > size or (info.compress_type == zipfile.ZIP_STORED
                                             and info.file_size != info.compress_size):
                raise NpzUnreadable(f"its member {name!r} claims {info.file_size} bytes "
                                    f"in a file of {size}")
            with archive.open(info) as member:
                shape, fortran, dtype, at = _header(member, name)
                nbytes = math.prod(shape) * dtype.itemsize
                if at + nbytes != info.file_size:
                    raise NpzUnreadable(
                        f"its member {name!r} has a header claiming {dtype.name}{list(shape)}"
                        f" ({nbytes} bytes), but holds {max(0, info.file_size - at)} "
                        "bytes of data")
                total += nbytes
                if total > bound:
                    raise NpzUnreadable(
                        f"its member {name!r} claims {dtype.name}{list(shape)}, and its "
                        f"arrays {total} bytes together, more than the {bound} a file of "
                        f"{size} bytes may hold")
                buf = bytearray(nbytes)
                view, got = memoryview(buf), 0
                while got < nbytes:
                    n = member.readinto(view[got:])
                    if not n:
                        raise NpzUnreadable(f"its member {name!r} ends early")
                    got += n
            try:
                out[key] = np.frombuffer(buf, dtype).reshape(shape, order="F" if fortran
                                                             else "C")
            except ValueError as e:  # no element, but too large in its other dimensions
                raise NpzUnreadable(f"its member {name!r} claims the shape {list(shape)}, "
                                    f"which numpy refuses: {e}") from None
    return out


def _header(member, name: str) -> tuple:
    """(shape, fortran order, dtype, offset of the data) of an .npy member."""
    fmt = np.lib.format
    version = fmt.read_magic(member)
    if version == (1, 0):
        shape, fortran, dtype = fmt.read_array_header_1_0(member)
    elif version == (2, 0):
        shape, fortran, dtype = fmt.read_array_header_2_0(member)
    else:
        raise NpzUnreadable(f"its member {name!r} is .npy version {version}, not 1.0 or 2.0")
    if dtype.hasobject:
        raise NpzUnreadable(f"its member {name!r} holds object arrays, which are never "
                            "unpickled")
    if any(int(d) < 0 for d in shape):
        raise NpzUnreadable(f"its member {name!r} claims the shape {list(shape)}")
    return tuple(int(d) for d in shape), bool(fortran), dtype, member.tell()
