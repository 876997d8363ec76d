"""Client populations on disk, read back one cohort at a time.

`write_population(directory, clients)` consumes an iterable of client datasets (a
generator works, so the population never has to fit in memory) and appends each array
to one flat binary file per key, recording where every client starts. `ClientStore`
keeps those files open and reads only the clients a round asks for (never mapping them,
so a file changed under it is a clear error, not a crash).

Layout of the directory: `<key>.bin` (raw C-order bytes), `offsets.npy` (int64, one more
entry than clients: client i owns examples `offsets[i]:offsets[i+1]`) and
`population.json` (per key: dtype and per-example shape).

A population is written whole or not at all: its files are written into a private
folder inside `directory` and renamed into place only once the last client is written,
`population.json` removed first and put back last, so a reader finds the old population,
none, or the new one, never new bytes under the old layout (a store that opened files of
both while they were renamed refuses its first read: `ClientStore.check`); a write that
fails (a generator that raises, a full disk) leaves the old population as it was. Its files
are read as another party's (`population.json` and `offsets.npy` through
`fax_bridge.system.private_files` and `npz_files.parse_npy`): regular files only (a FIFO
never blocks the reader, a link is refused), sizes bounded before they are read, the
layout's numbers whole and finite, and every array's dtype a number type
(`checks.numeric_dtype`), so bytes are never read as object pointers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import tempfile
import weakref
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np

from fax_bridge.system import npz_files, private_files
from fax_bridge.data import checks
from fax_bridge.data.padding import PaddedClients, pad_clients
from fax_bridge.errors import DataError

META_FILE = "population.json"
# Rows at most this many bytes apart are read with one call (and the gap dropped)
GAP_BYTES = 16 << 10
OFFSETS_FILE = "offsets.npy"
_FORMAT = 1
MAX_META_BYTES = 1 << 20     # population.json: a dtype and a shape per array
MAX_OFFSETS_BYTES = 1 << 34  # offsets.npy: two billion clients
MAX_ARRAY_BYTES = 1 << 62
MAX_EXAMPLE_RANK = 32
_FIX = "write the population again with fax_bridge.data.write_population"


def _safe_key(key: str) -> str:
    if not isinstance(key, str) or not key or not all(c.isalnum() or c in "_-" for c in key):
        raise DataError(
            f"array key {checks.shown(key)} cannot name a file; use letters, digits, '_' "
            "or '-'.")
    return key


def write_population(directory: str, clients: Iterable[Mapping[str, np.ndarray]],
                     overwrite: bool = False) -> int:
    """Writes client datasets to `directory`; returns the number of clients written.

    Every client must have the same keys, and per key the same dtype (a number type:
    bool, integer, float, complex, or an ml_dtypes type such as bfloat16) and
    per-example shape. An existing population is only replaced with `overwrite=True`,
    and only once every client is written (module docstring): a failed write leaves
    it as it was. `directory` is made (0755) or must be a folder of the user running
    this that no one else can write (`private_files.private_dir`).

    Args:
      directory: the folder to write (created if needed).
      clients: an iterable of client datasets (a generator works).
      overwrite: replace a population already there.

    Returns:
      The number of clients written.

    Example:
      >>> import tempfile, numpy as np
      >>> from fax_bridge.data import ClientStore, write_population
      >>> with tempfile.TemporaryDirectory() as tmp:
      ...     write_population(tmp, ({"x": np.full(i + 1, i)} for i in range(3)))
      ...     with ClientStore(tmp) as store:
      ...         print(store.sizes.tolist(), store.client(2)["x"].tolist())
      3
      [1, 2, 3] [2, 2, 2]
    """
    if not isinstance(directory, (str, os.PathLike)) or not str(directory):
        raise DataError(f"directory must be a folder path, got {checks.shown(directory)}.")
    if isinstance(clients, (Mapping, str, bytes, np.ndarray)) or not isinstance(
            clients, Iterable):
        raise DataError(f"clients must be an iterable of client datasets (dicts of "
                        f"arrays), got {checks.shown(clients)}; wrap one client as [client].")
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise DataError(f"directory {str(directory)!r} is a file; pass a folder path.")
    directory = private_files.private_dir(directory, 0o755)
    if os.path.lexists(os.path.join(directory, META_FILE)) and not overwrite:
        raise FileExistsError(
            f"{directory} already holds a population; pass overwrite=True to replace it.")
    part = tempfile.mkdtemp(prefix=".population-", suffix=".part", dir=directory)
    try:
        spec, count = _write_files(part, clients)
        _move_in(part, directory, spec)
    finally:
        shutil.rmtree(part, ignore_errors=True)
    return count


def _write_files(part: str, clients: Iterable) -> tuple:
    """Writes the population's files into the private folder `part`; (the layout's
    arrays, the number of clients)."""
    spec: Optional[dict] = None
    dtypes: dict = {}
    files: dict = {}
    offsets = [0]

    def new_file(name: str):
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        return os.fdopen(os.open(os.path.join(part, name), flags, 0o644), "wb")

    try:
        for i, client in enumerate(clients):
            checks.dataset(f"client {i}", client)
            if spec is None:
                spec = {}
                for k, v in sorted(client.items()):
                    dtypes[_safe_key(k)] = np.asarray(v).dtype
                    try:
                        name = checks.stored_dtype_name(dtypes[k])
                    except DataError as e:
                        raise DataError(f"client {i}: {k!r}: {e}") from None
                    spec[k] = {"dtype": name, "shape": list(np.shape(v)[1:])}
                files = {k: new_file(f"{k}.bin") for k in spec}
            if sorted(client) != sorted(spec):
                raise DataError(f"client {i} has keys {sorted(client)}, expected {sorted(spec)}.")
            lengths = set()
            for k, s in spec.items():
                a = np.ascontiguousarray(client[k])
                if a.dtype != dtypes[k] or list(a.shape[1:]) != s["shape"]:
                    raise DataError(
                        f"client {i}: {k!r} has dtype {a.dtype} and example shape "
                        f"{a.shape[1:]}, expected {dtypes[k]} and {tuple(s['shape'])}.")
                lengths.add(a.shape[0])
                files[k].write(a.tobytes())
            if len(lengths) != 1:
                raise DataError(f"client {i}'s arrays have different lengths {sorted(lengths)}.")
            offsets.append(offsets[-1] + lengths.pop())
        for f in files.values():
            f.flush()
            os.fsync(f.fileno())
    finally:
        for f in files.values():
            f.close()
    if spec is None:
        raise DataError("write_population got no clients.")
    with new_file(OFFSETS_FILE) as f:
        np.save(f, np.asarray(offsets, dtype=np.int64))
    meta = {"format": _FORMAT, "arrays": spec, "num_clients": len(offsets) - 1}
    with new_file(META_FILE) as f:
        f.write(json.dumps(meta).encode())
    return spec, len(offsets) - 1


def _move_in(part: str, directory: str, spec: dict) -> None:
    """Renames the files written into `part` over the population in `directory`:
    `population.json` removed first and renamed in last, so no reader ever opens the
    new arrays under the old layout; the old arrays the new layout lacks removed."""
    names = [f"{k}.bin" for k in spec] + [OFFSETS_FILE, META_FILE]
    for name in names:  # anything but a file of ours there: refused before any change
        private_files.check_entry(os.path.join(directory, name), kind="regular file")
    try:
        old = set(_read_layout(directory)[1])
    except (OSError, DataError):
        old = set()
    meta = os.path.join(directory, META_FILE)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(meta)
    for name in names[:-1]:
        os.replace(os.path.join(part, name), os.path.join(directory, name))
    for key in old - set(spec):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, f"{key}.bin"))
    os.replace(os.path.join(part, META_FILE), meta)


def _read_file(path: str, limit: int, what: str) -> tuple:
    """(the bytes, the `_identity` when opened) of the population file `path`."""
    f, size = private_files.open_regular(path, limit, what=what, fix=_FIX)
    with f:
        opened = _identity(os.fstat(f.fileno()))
        data = f.read(size + 1)
    if len(data) != size:
        raise DataError(f"{what} {path} changed size while it was read; {_FIX}.")
    return data, opened


def _read_layout(directory: str) -> tuple:
    """(population.json's data, checked, {key: (dtype, example shape)}, offsets,
    {path: `_identity` when opened}) of the population in `directory`.
    FileNotFoundError where it has no population.json; DataError (or
    `private_files.UnsafePathError`) naming the file and the field otherwise."""
    meta_path = os.path.join(directory, META_FILE)
    offsets_path = os.path.join(directory, OFFSETS_FILE)
    text, meta_id = _read_file(meta_path, MAX_META_BYTES, "population layout")
    j = private_files
    try:
        meta = j.parse_json(text, meta_path, fix=_FIX)
        j.json_value(meta, "object", meta_path)
        j.json_field(meta, "format", "int", meta_path, low=_FORMAT, high=_FORMAT)
        stored = j.json_field(meta, "arrays", "object", meta_path)
        num_clients = j.json_field(meta, "num_clients", "int", meta_path, low=0)
        arrays = {}
        for key, entry in stored.items():
            where = f"{meta_path}: array {key!r}"
            j.json_value(entry, "object", where)
            dtype = checks.numeric_dtype(j.json_field(entry, "dtype", "str", where),
                                         where, _FIX)
            shape = j.json_field(entry, "shape", "list", where)
            if len(shape) > MAX_EXAMPLE_RANK:
                raise DataError(f"{where} has an example shape of {len(shape)} dimensions,"
                                f" more than {MAX_EXAMPLE_RANK}; {_FIX}.")
            try:
                _safe_key(key)
            except DataError as e:
                raise DataError(f"{meta_path}: {e}") from None
            arrays[key] = (dtype, tuple(
                j.json_value(d, "int", f"{where}: field 'shape'", low=0,
                             high=MAX_ARRAY_BYTES) for d in shape))
    except private_files.HandedFileError as e:
        raise DataError(f"{e}; {_FIX}." if _FIX not in str(e) else str(e)) from None
    if not arrays:
        raise DataError(f"{meta_path} names no array; {_FIX}.")
    data, offsets_id = _read_file(offsets_path, MAX_OFFSETS_BYTES, "population offsets")
    try:
        offsets = npz_files.parse_npy(data, f"population offsets {offsets_path}", _FIX)
    except npz_files.NpzUnreadable as e:
        raise DataError(str(e)) from None
    if offsets.dtype != np.int64 or offsets.ndim != 1 or offsets.size != num_clients + 1 \
            or offsets[0] != 0 or (np.diff(offsets) < 0).any():
        raise DataError(
            f"{offsets_path} is damaged: it holds {offsets.dtype.name}"
            f"{list(offsets.shape)}, where {num_clients + 1} int64 offsets of "
            f"{num_clients} clients ({META_FILE}) start at 0 and never decrease; {_FIX}.")
    return meta, arrays, offsets.astype(np.int64), {meta_path: meta_id,
                                                    offsets_path: offsets_id}


class ClientStore:
    """A population written by `write_population`, read a cohort at a time.

    Each array's file stays open and rows are read with `pread` into private buffers,
    never memory-mapped: a file truncated, grown, rewritten or replaced under a running
    reader makes that read fail with a `DataError` naming the file and what changed (a
    mapping would instead kill the process with SIGBUS on a truncated page). Before a
    read, `check` compares the files it reads and the layout files (`population.json`,
    `offsets.npy`), under their names, with what was opened (device, inode, size,
    modification and change times: a file replaced or removed is seen too); after it,
    each open file read again, so a read never mixes old and new bytes unnoticed. A
    change that keeps the size, made within the file system's timestamp granularity of
    opening, can go unseen.
    """

    def __init__(self, directory: str):
        if not isinstance(directory, (str, os.PathLike)):
            raise DataError(f"directory must be a folder path, got {checks.shown(directory)}.")
        directory = os.fspath(directory)
        try:
            meta, arrays, offsets, self._opened = _read_layout(directory)
        except FileNotFoundError as e:
            if os.path.basename(str(e.filename)) != META_FILE:
                raise DataError(f"{directory} holds a damaged population ({e}); "
                                f"{_FIX}.") from None
            raise FileNotFoundError(
                f"{directory} holds no population ({META_FILE} missing); write one with "
                "fax_bridge.data.write_population.") from None
        self.directory = directory
        self._layout = list(self._opened)
        self._files: dict = {}
        self._finalizer = weakref.finalize(self, _close_all, self._files)
        self.offsets = offsets
        # what a device compares with other devices' populations: the layout as read
        self.digest = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()
                                     + offsets.tobytes()).hexdigest()[:32]
        total = int(self.offsets[-1])
        self.spec: dict[str, tuple[np.dtype, tuple]] = arrays  # key -> (dtype, example)
        self._paths: dict[str, str] = {}
        for k, (dtype, example) in arrays.items():
            if total == 0:
                continue
            path = os.path.join(directory, f"{k}.bin")
            want = total * math.prod(example) * dtype.itemsize
            try:
                f, size = private_files.open_regular(path, MAX_ARRAY_BYTES, fix=_FIX,
                                                     what="population array")
            except FileNotFoundError:
                self.close()
                raise DataError(
                    f"population array {path} is missing, where {total} examples of "
                    f"{dtype.name}{list(example)} need {want} bytes; {_FIX}.") from None
            except BaseException:
                self.close()
                raise
            self._files[k] = f
            self._opened[path] = _identity(os.fstat(f.fileno()))
            if size != want:
                self.close()
                raise DataError(
                    f"population array {path} holds {size} bytes but {total} examples of "
                    f"{dtype.name}{list(example)} need {want}; the store is damaged; "
                    f"{_FIX}.")
            self._paths[k] = path

    def close(self) -> None:
        """Closes the store's files (reads fail afterwards)."""
        self._finalizer()

    def __enter__(self) -> "ClientStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def check(self, keys: Optional[Sequence[str]] = None) -> None:
        """Raises DataError naming a file of the store that changed on disk since it was
        opened (replaced or removed under its name too): the layout files and the arrays
        `keys` (by default all of them)."""
        paths = self._layout + [self._paths[k] for k in (self._paths if keys is None
                                                         else keys) if k in self._paths]
        for path in paths:
            try:
                now = _identity(os.stat(path))
            except OSError as e:
                raise self._changed(path, f"it is gone ({e.strerror})") from None
            was = self._opened[path]
            if now != was:
                raise self._changed(path, _what_changed(was, now))

    def _changed(self, path: str, what: str) -> DataError:
        return DataError(
            f"population file {path} changed since this store opened it: {what}; no row "
            "of it is returned. Open the population again (a new ClientStore; restart a "
            "device hosting it) to read the new data.")

    def rows(self, key: str, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Examples `starts[i]:starts[i] + counts[i]` of array `key` for every i, one block
        after another, as one array of `sum(counts)` examples copied into memory."""
        return self.read([key], starts, counts)[0]

    def read(self, keys: Sequence[str], starts: np.ndarray,
             counts: np.ndarray) -> list[np.ndarray]:
        """`rows` of each array of `keys`, after one `check` of their files by name."""
        for key in keys:
            if not isinstance(key, str) or key not in self.spec:
                raise DataError(f"key {checks.shown(key)} names no array of the store; it "
                                f"holds {self.keys}.")
        starts, counts = np.asarray(starts, np.int64), np.asarray(counts, np.int64)
        total = int(counts.sum())
        self.check(keys)
        runs = _Runs(starts, counts)
        out = []
        for key in keys:
            dtype, example = self.spec[key]
            block = np.empty((total,) + example, dtype)
            out.append(block)
            if not block.size:
                continue
            fd, path = self._files[key].fileno(), self._paths[key]
            step = block.nbytes // total  # bytes of one example
            for lo, hi, picks, count, places in runs.groups(max(1, GAP_BYTES // step)):
                if count is not None:  # one run: straight into its place in the block
                    self._pread(fd, path, block[places:places + count], lo * step)
                    continue
                span = np.empty((hi - lo,) + example, dtype)  # blocks close together
                self._pread(fd, path, span, lo * step)
                block[places] = span[picks]
            now = _identity(os.fstat(fd))
            if now != self._opened[path]:  # changed while read: old and new bytes may mix
                raise self._changed(path, _what_changed(self._opened[path], now))
        return out

    def _pread(self, fd: int, path: str, into: np.ndarray, offset: int) -> None:
        """Fills the contiguous array `into` with the file's bytes from `offset`."""
        want = into.nbytes
        got = os.preadv(fd, [into], offset)
        while 0 < got < want:  # a read may return less than asked; ask for the rest
            more = os.preadv(fd, [memoryview(into).cast("B")[got:]], offset + got)
            if not more:
                break
            got += more
        if got != want:
            raise self._changed(path, f"{want} bytes at offset {offset} read as {got} "
                                "(truncated)")

    @property
    def num_clients(self) -> int:
        return len(self.offsets) - 1

    @property
    def sizes(self) -> np.ndarray:
        """Number of examples of every client."""
        return np.diff(self.offsets)

    @property
    def keys(self) -> list[str]:
        return sorted(self.spec)

    def client(self, i: int) -> dict:
        """Client i's dataset, copied into memory."""
        i = checks.integer("i", i, 0, self.num_clients - 1,
                           fix=f"the store holds clients 0..{self.num_clients - 1}")
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        self.check()
        return {k: self.rows(k, np.array([lo]), np.array([hi - lo])) for k in self.keys}

    def cohort(self, ids: Sequence[int], size: Optional[int] = None,
               multiple_of: int = 1) -> PaddedClients:
        """The clients `ids`, padded to a common size (see `pad_clients`)."""
        picked = checks.indices("ids", ids, self.num_clients)
        if picked.size == 0:
            raise DataError("ids names no client; pass at least one client id.")
        return pad_clients([self.client(int(i)) for i in picked], size=size,
                           multiple_of=multiple_of)


def _identity(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _what_changed(was: tuple, now: tuple) -> str:
    """What differs between two `_identity` tuples of one path, in words."""
    if was[:2] != now[:2]:
        return f"it was replaced by another file (inode {was[1]} -> {now[1]})"
    if now[2] < was[2]:
        return f"it was truncated from {was[2]} to {now[2]} bytes"
    if now[2] > was[2]:
        return f"it grew from {was[2]} to {now[2]} bytes"
    return f"it was rewritten in place (modified {(now[3] - was[3]) / 1e9:+.6f} s later)" \
        if now[3] != was[3] else "its metadata changed (ctime)"


class _Runs:
    """Blocks of examples `starts[i]:starts[i] + counts[i]`, read in file order: the
    blocks that follow one another make one run, and runs separated by at most a few
    examples one read of their span (a call costs more than copying a few KiB)."""

    def __init__(self, starts: np.ndarray, counts: np.ndarray):
        keep = counts > 0
        starts, counts = starts[keep], counts[keep]
        order = np.argsort(starts, kind="stable")
        # in file order: where each block starts, its examples, its place in the result
        self.starts, self.counts = starts[order], counts[order]
        self.dests = (np.cumsum(counts) - counts)[order]
        self.ends = self.starts + self.counts

    def groups(self, gap: int):
        """What to read, a group of blocks at most `gap` examples apart at a time: the
        span `lo:hi` of the group and either (None, count, place) when it goes straight
        to `place:place + count` of the result, or (picks, None, places): the span's
        examples `picks` go to the result's `places`."""
        starts, ends, counts, dests = self.starts, self.ends, self.counts, self.dests
        if not starts.size:
            return
        reach = np.maximum.accumulate(ends)
        cuts = np.flatnonzero(starts[1:] - reach[:-1] > gap) + 1
        bounds = [0, *cuts.tolist(), len(starts)]
        first, last, place = starts.tolist(), reach.tolist(), dests.tolist()
        for a, b in zip(bounds, bounds[1:]):
            lo, hi = first[a], last[b - 1]
            if b - a == 1 or (hi - lo == int(counts[a:b].sum()) and
                              bool((np.diff(dests[a:b]) == counts[a:b - 1]).all())):
                # one block, or blocks that follow one another in the file and the result
                yield lo, hi, None, hi - lo, place[a]
                continue
            c = counts[a:b]
            within = np.arange(int(c.sum())) - np.repeat(np.cumsum(c) - c, c)
            yield (lo, hi, np.repeat(starts[a:b] - lo, c) + within, None,
                   np.repeat(dests[a:b], c) + within)


def _close_all(files: dict) -> None:
    for f in files.values():
        with contextlib.suppress(OSError):
            f.close()
    files.clear()
