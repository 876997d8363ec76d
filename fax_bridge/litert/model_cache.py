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

Beside the models, `store_names(part, names)` keeps the tensor names a round gave client
part `part` (`convert.convert_round`, which has the round), as `<sha256 of part>.names`
(one JSON object: `NAMES_FORMAT`, the client part's hash, its input and output names),
so that a device of this machine given the client part alone names its model alike
(`read_names`, believed on the same terms as an entry: a damaged record is named in a
warning and the model is named by index).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import re
import warnings
from typing import Optional

from fax_bridge.system import private_files
from fax_bridge.errors import ComputationError

FORMAT = "fax_bridge.litert.cache/1"
SUFFIX = ".litert"
MAX_ENTRY_BYTES = 1 << 30
NAMES_FORMAT = "fax_bridge.litert.names/1"
NAMES_SUFFIX = ".names"
MAX_NAMES_BYTES = 1 << 24
_NAME = re.compile(r"[A-Za-z0-9_./-]{1,1024}")  # what `pytree_names.tensor_names` gives
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


def names_path(part: str) -> pathlib.Path:
    """The names record of client part `part` (its content hash)."""
    return cache_dir() / f"{hashlib.sha256(part.encode()).hexdigest()}{NAMES_SUFFIX}"


def store_names(part: str, names: tuple) -> None:
    """Records `names` ((input names, output names)) as those a round gave client part
    `part`, whole or not at all; an unusable cache records nothing."""
    folder = _folder()
    if folder is None:
        return
    text = json.dumps({"format": NAMES_FORMAT, "client_part": part,
                       "inputs": list(names[0]), "outputs": list(names[1])})
    try:
        private_files.write_file(names_path(part), text, 0o600)
    except OSError as e:
        _warn_once(f"fax_bridge: the LiteRT model cache {folder} cannot be written "
                   f"({e.strerror or e}); each process converts its models")


def read_names(part: str) -> Optional[tuple]:
    """(input names, output names) a round gave client part `part` on this machine
    (`store_names`), or None: none recorded, or a record not believed (a regular file of
    ours, of this format and client part, whose names are lists of distinct valid
    tensor names; anything else is named in a warning)."""
    path = names_path(part)
    if not os.path.lexists(path) or _folder() is None:
        return None
    why = None
    try:
        raw = private_files.read_regular(path, MAX_NAMES_BYTES, ours=True,
                                         what="the LiteRT tensor names record")
        data = private_files.parse_json(raw, path)  # bounded: a ValueError
        if not isinstance(data, dict) or data.get("format") != NAMES_FORMAT:
            why = "it is not a fax_bridge tensor names record"
        elif data.get("client_part") != part:
            why = f"it is the record of client part {data.get('client_part')!r}"
        else:
            found = (data.get("inputs"), data.get("outputs"))
            if not all(isinstance(n, list) and len(set(map(str, n))) == len(n)
                       and all(isinstance(x, str) and _NAME.fullmatch(x) for x in n)
                       for n in found):
                why = "its inputs and outputs are not lists of distinct tensor names"
    except (OSError, ValueError) as e:
        why = f"{type(e).__name__}: {e}"
    if why is None:
        return tuple(data["inputs"]), tuple(data["outputs"])
    _warn_once(f"fax_bridge: the LiteRT tensor names record {path} is damaged ({why}); "
               f"the model of client part {part[:16]} is named by index (`rm {path}`: "
               "the round's next conversion with its split records the names again)")
    return None
