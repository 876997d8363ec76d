"""Client populations on disk, read back one cohort at a time through numpy memmaps.

`write_population(directory, clients)` consumes an iterable of client datasets (a
generator works, so the population never has to fit in memory) and appends each array
to one flat binary file per key, recording where every client starts. `ClientStore`
maps those files read-only and copies out only the clients a round asks for.

Layout of the directory: `<key>.bin` (raw C-order bytes), `offsets.npy` (int64, one more
entry than clients: client i owns examples `offsets[i]:offsets[i+1]`) and
`population.json` (per key: dtype and per-example shape).
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np

from fax_bridge.data import checks
from fax_bridge.data.padding import PaddedClients, pad_clients
from fax_bridge.errors import DataError

META_FILE = "population.json"
OFFSETS_FILE = "offsets.npy"
_FORMAT = 1


def _safe_key(key: str) -> str:
    if not isinstance(key, str) or not key or not all(c.isalnum() or c in "_-" for c in key):
        raise DataError(
            f"array key {key!r} cannot name a file; use letters, digits, '_' or '-'.")
    return key


def write_population(directory: str, clients: Iterable[Mapping[str, np.ndarray]],
                     overwrite: bool = False) -> int:
    """Writes client datasets to `directory`; returns the number of clients written.

    Every client must have the same keys, and per key the same dtype and per-example
    shape. An existing population is only replaced with `overwrite=True`.
    """
    if not isinstance(directory, (str, os.PathLike)) or not str(directory):
        raise DataError(f"directory must be a folder path, got {checks.shown(directory)}.")
    if isinstance(clients, (Mapping, str, bytes, np.ndarray)) or not isinstance(
            clients, Iterable):
        raise DataError(f"clients must be an iterable of client datasets (dicts of "
                        f"arrays), got {checks.shown(clients)}; wrap one client as [client].")
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise DataError(f"directory {str(directory)!r} is a file; pass a folder path.")
    os.makedirs(directory, exist_ok=True)
    if os.path.exists(os.path.join(directory, META_FILE)) and not overwrite:
        raise FileExistsError(
            f"{directory} already holds a population; pass overwrite=True to replace it.")
    spec: Optional[dict] = None
    files: dict = {}
    offsets = [0]
    try:
        for i, client in enumerate(clients):
            checks.dataset(f"client {i}", client)
            if spec is None:
                spec = {_safe_key(k): {"dtype": np.asarray(v).dtype.str,
                                       "shape": list(np.shape(v)[1:])}
                        for k, v in sorted(client.items())}
                files = {k: open(os.path.join(directory, f"{k}.bin"), "wb") for k in spec}
            if sorted(client) != sorted(spec):
                raise DataError(f"client {i} has keys {sorted(client)}, expected {sorted(spec)}.")
            lengths = set()
            for k, s in spec.items():
                a = np.ascontiguousarray(client[k])
                if a.dtype.str != s["dtype"] or list(a.shape[1:]) != s["shape"]:
                    raise DataError(
                        f"client {i}: {k!r} has dtype {a.dtype} and example shape "
                        f"{a.shape[1:]}, expected {np.dtype(s['dtype'])} and {tuple(s['shape'])}.")
                lengths.add(a.shape[0])
                files[k].write(a.tobytes())
            if len(lengths) != 1:
                raise DataError(f"client {i}'s arrays have different lengths {sorted(lengths)}.")
            offsets.append(offsets[-1] + lengths.pop())
    finally:
        for f in files.values():
            f.close()
    if spec is None:
        raise DataError("write_population got no clients.")
    np.save(os.path.join(directory, OFFSETS_FILE), np.asarray(offsets, dtype=np.int64))
    with open(os.path.join(directory, META_FILE), "w") as f:
        json.dump({"format": _FORMAT, "arrays": spec, "num_clients": len(offsets) - 1}, f)
    return len(offsets) - 1


class ClientStore:
    """A population written by `write_population`, memory-mapped read-only."""

    def __init__(self, directory: str):
        if not isinstance(directory, (str, os.PathLike)):
            raise DataError(f"directory must be a folder path, got {checks.shown(directory)}.")
        meta_path = os.path.join(directory, META_FILE)
        if not os.path.exists(meta_path):
            raise FileNotFoundError(
                f"{directory} holds no population ({META_FILE} missing); write one with "
                "fax_bridge.data.write_population.")
        try:
            with open(meta_path) as f:
                meta = json.load(f)
            if meta.get("format") != _FORMAT:
                raise DataError(
                    f"{meta_path} has format {meta.get('format')}, expected {_FORMAT}.")
            offsets = np.asarray(np.load(os.path.join(directory, OFFSETS_FILE),
                                         allow_pickle=False), np.int64)
            arrays = {_safe_key(k): (np.dtype(s["dtype"]), tuple(int(d) for d in s["shape"]))
                      for k, s in meta["arrays"].items()}
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            if isinstance(e, DataError):
                raise
            raise DataError(f"{directory} holds a damaged population ({type(e).__name__}: "
                            f"{e}); write it again with write_population.") from None
        if offsets.ndim != 1 or offsets.size < 1 or offsets[0] != 0 or (
                np.diff(offsets) < 0).any():
            raise DataError(f"{directory}/{OFFSETS_FILE} is damaged (offsets must start at "
                            "0 and never decrease); write the population again.")
        self.directory = directory
        self.offsets = offsets
        total = int(self.offsets[-1])
        self.spec: dict[str, tuple[np.dtype, tuple]] = {}  # key -> (dtype, example shape)
        self._arrays = {}
        for k, (dtype, example) in arrays.items():
            self.spec[k] = (dtype, example)
            shape = (total,) + example
            path = os.path.join(directory, f"{k}.bin")
            if total == 0:
                self._arrays[k] = np.zeros(shape, dtype=dtype)
                continue
            want = total * int(np.prod(example, dtype=np.int64)) * dtype.itemsize
            size = os.path.getsize(path) if os.path.exists(path) else -1
            if size != want:
                raise DataError(
                    f"population array {path} holds {size} bytes but {total} examples of "
                    f"{dtype.name}{list(example)} need {want}; the store is damaged.")
            self._arrays[k] = np.memmap(path, dtype=dtype, mode="r", shape=shape)

    def array(self, key: str) -> np.ndarray:
        """The stored array `key`: every example of every client, memory-mapped."""
        if not isinstance(key, str) or key not in self._arrays:
            raise DataError(f"key {checks.shown(key)} names no array of the store; it holds "
                            f"{self.keys}.")
        return self._arrays[key]

    @property
    def num_clients(self) -> int:
        return len(self.offsets) - 1

    @property
    def sizes(self) -> np.ndarray:
        """Number of examples of every client."""
        return np.diff(self.offsets)

    @property
    def keys(self) -> list[str]:
        return sorted(self._arrays)

    def client(self, i: int) -> dict:
        """Client i's dataset, copied into memory."""
        i = checks.integer("i", i, 0, self.num_clients - 1,
                           fix=f"the store holds clients 0..{self.num_clients - 1}")
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return {k: np.array(a[lo:hi]) for k, a in self._arrays.items()}

    def cohort(self, ids: Sequence[int], size: Optional[int] = None,
               multiple_of: int = 1) -> PaddedClients:
        """The clients `ids`, padded to a common size (see `pad_clients`)."""
        picked = checks.indices("ids", ids, self.num_clients)
        if picked.size == 0:
            raise DataError("ids names no client; pass at least one client id.")
        return pad_clients([self.client(int(i)) for i in picked], size=size,
                           multiple_of=multiple_of)
