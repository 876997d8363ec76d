"""Converted LiteRT models kept on disk between processes, verified when read back.

The devices of one machine convert a round shape once between them: `convert` keys a
model by the sha256 of its StableHLO and signature and keeps it in `cache_dir()`
(`FAX_BRIDGE_LITERT_CACHE`, default `~/.cache/fax_bridge/litert`), a folder of ours
that no one else can write (`private_files.private_dir`, 0700), as `<key>.litert`: one
header line (`FORMAT`, the key and the model's sha256, as JSON) and the flatbuffer.

`read(key, signature)` believes an entry only when it is a regular file of ours (never
read through a link), its header names this key, its bytes have the recorded sha256
(so another key's entry copied under this name, or a cut or zeroed file, is caught) and
`model_check.check` holds against the round's signature. Anything else is a damaged
entry: a warning names the file and why, and the caller converts again and `store`
replaces it; where it cannot convert, `Lookup.damaged` names the file in its refusal
and how to fix it. A cache folder that is unsafe or unwritable costs a conversion per
process (warned once), never the round.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import warnings
from typing import Optional

from fax_bridge.system import private_files
from fax_bridge.errors import ComputationError

FORMAT = "fax_bridge.litert.cache/1"
SUFFIX = ".litert"
MAX_ENTRY_BYTES = 1 << 30
_WARNED: set = set()


@dataclasses.dataclass(frozen=True)
class Lookup:
    """What `read` found: the model's bytes, or None and, where an entry was there but
    not believed, `damaged` (a sentence naming the file, why, and the fix)."""

    model: Optional[bytes]
    damaged: Optional[str] = None


def cache_dir() -> pathlib.Path:
    """Where converted models are kept between processes."""
    return pathlib.Path(os.environ.get("FAX_BRIDGE_LITERT_CACHE",
                                       pathlib.Path.home() / ".cache" / "fax_bridge" / "litert"))


def path_of(key: str) -> pathlib.Path:
    """The cache entry of key `key`."""
    return cache_dir() / f"{key}{SUFFIX}"


def _warn_once(text: str) -> None:
    if text not in _WARNED:
        _WARNED.add(text)
        warnings.warn(text, RuntimeWarning, stacklevel=3)


def _folder() -> Optional[str]:
    """The cache folder, made or verified ours alone; None (warned) where it is not."""
    try:
        return private_files.private_dir(cache_dir(), 0o700)
    except OSError as e:
        _warn_once(f"fax_bridge: the LiteRT model cache {cache_dir()} is not used ({e}); "
                   "each process converts its models (set FAX_BRIDGE_LITERT_CACHE to a "
                   "folder of your own)")
        return None


def read(key: str, signature, name: str) -> Lookup:
    """The cached model of `key` if its entry holds (module docstring), checked against
    `signature` (`lowering.ClientSignature`, whose tensor names the model's are) as its
    signature `name`."""
    path = path_of(key)
    if not os.path.lexists(path) or _folder() is None:
        return Lookup(None)
    try:
        why = None
        raw = private_files.read_regular(path, MAX_ENTRY_BYTES, ours=True,
                                         what="the cached LiteRT model")
        line, _, model = raw.partition(b"\n")
        header = private_files.parse_json(line, path)  # bounded: a ValueError
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            why = "its header is not a fax_bridge cache entry's"
        elif header.get("key") != key:
            why = f"it is the entry of key {header.get('key')!r}, copied under this name"
        elif hashlib.sha256(model).hexdigest() != header.get("sha256"):
            why = (f"its {len(model)} bytes of model do not have the sha256 its header "
                   "records (cut, zeroed or changed)")
    except (OSError, ValueError) as e:
        why = f"{type(e).__name__}: {e}"
    if why is None:
        from fax_bridge.litert import model_check

        try:
            model_check.check(model, name, signature.inputs, signature.outputs,
                              where="its model", fix="it is not this round's")
        except ComputationError as e:
            why = str(e)
    if why is None:
        return Lookup(model)
    damaged = (f"the cached LiteRT model {path} is damaged ({why}); remove it (`rm "
               f"{path}`) and convert the round again")
    _warn_once(f"fax_bridge: {damaged}: converting again")
    return Lookup(None, damaged)


def store(key: str, model: bytes) -> None:
    """Writes `model` as the entry of `key`, whole or not at all (devices may read the
    cache at once); an unusable cache costs a conversion per process, not the round."""
    folder = _folder()
    if folder is None:
        return
    header = json.dumps({"format": FORMAT, "key": key,
                         "sha256": hashlib.sha256(model).hexdigest()}).encode()
    try:
        private_files.write_file(path_of(key), header + b"\n" + model, 0o600)
    except OSError as e:
        _warn_once(f"fax_bridge: the LiteRT model cache {folder} cannot be written "
                   f"({e.strerror or e}); each process converts its models")
