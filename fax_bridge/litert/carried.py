"""LiteRT models that travel with an app: a directory of converted client parts, searched
before any conversion, so that a node without the converter runs them.

A carried model is one JSON file, `<version>.json`, in a models directory: its
`manifest` (`manifest.build`'s, whose `round.version` is the client part's content hash)
and the `.tflite` flatbuffer base64-encoded (`tflite_base64`), since app bundles such as
Flower's carry text files only. `pack(split, signature)` converts a round's client part
and gives the file's name and text; `write(folder, packed)` puts them in a directory;
`find(folder, key, signature)` is the lookup `runner.model_for` makes before it converts:

  a model whose version is `key`   that model, never converted here;
  models, none of version `key`    `CarriedMismatch`, naming both hashes and the fix;
  no directory or no model         None: the caller converts as without carried models.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pathlib
import threading
from typing import Optional

from fax_bridge.errors import ComputationError
from fax_bridge.litert import convert, flatbuffer, lowering, manifest

FORMAT = "fax_bridge.litert.carried/1"
REWRITE = ("write the models again from this round (`fax-bridge flower ... --litert` "
           "rewrites a Flower app with them)")


_FOUND: dict = {}  # (file, its mtime and size, signature) -> ClientModel
_LOCK = threading.Lock()


class CarriedMismatch(ComputationError):
    """The carried models are of another client part than the round asked for."""


def pack(split, signature: str) -> tuple:
    """(file name, JSON text) of the round split's client part converted
    (`convert.convert_round`; a client part that cannot convert is refused here, naming
    the op) with its manifest."""
    model = convert.convert_round(split)
    built = manifest.build(split, model, signature)
    text = json.dumps({"format": FORMAT, "manifest": built,
                       "tflite_base64": base64.b64encode(model.tflite).decode()})
    return f"{model.client_part_hash}.json", text


def write(folder: str, packed: list) -> list:
    """Writes the packed models (`pack`'s pairs) into `folder`; returns their paths."""
    os.makedirs(folder, exist_ok=True)
    paths = []
    for name, text in packed:
        path = os.path.join(folder, name)
        with open(path, "w") as f:
            f.write(text)
        paths.append(path)
    return paths


def _read(path: pathlib.Path) -> dict:
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
        tflite = base64.b64decode(data["tflite_base64"], validate=True)
        model = data["manifest"]["model"]
        if hashlib.sha256(tflite).hexdigest() != model["sha256"]:
            raise ValueError("the model's bytes do not have the sha256 its manifest names")
        data["manifest"]["round"]["version"]  # noqa: B018 - present, or KeyError
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ComputationError(f"the carried LiteRT model {path} cannot be read "
                               f"({type(e).__name__}: {e}); {REWRITE}") from None
    data["tflite"] = tflite
    return data


def versions(folder: str) -> list:
    """The client-part hashes of the models carried in `folder` (sorted)."""
    path = pathlib.Path(folder)
    return sorted(p.stem for p in path.glob("*.json")) if path.is_dir() else []


def find(folder: Optional[str], key: str, signature):
    """The carried model of client part `key` (module docstring) as a `convert.ClientModel`
    over `signature` (`lowering.ClientSignature`: the caller's types; the tensors' names
    are the carried model's), or None where `folder` carries no model."""
    found = versions(folder) if folder else []
    if not found:
        return None
    if key not in found:
        raise CarriedMismatch(
            f"the LiteRT models carried in {folder} are of client part "
            f"{', '.join(found)}, but the round asks for client part {key}: they were "
            f"written for another round; {REWRITE}")
    path = pathlib.Path(folder) / f"{key}.json"
    try:
        stat = path.stat()
    except OSError:
        stat = None
    cache_key = (str(path), stat and (stat.st_mtime_ns, stat.st_size),
                 signature.inputs, signature.outputs)
    with _LOCK:
        if cache_key in _FOUND:
            return _FOUND[cache_key]
    try:
        model = _load(folder, path, key, signature)
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # a damaged manifest
        raise ComputationError(f"the carried LiteRT model {path} has a manifest that "
                               f"cannot be read ({type(e).__name__}: {e}); {REWRITE}") from None
    with _LOCK:
        _FOUND[cache_key] = model
    return model


def _load(folder: str, path: pathlib.Path, key: str, signature):
    """`find`'s model, read from `path` and checked."""
    data = _read(path)
    built = data["manifest"]
    if built["round"]["version"] != key:
        raise CarriedMismatch(
            f"the carried LiteRT model {key}.json in {folder} is of client part "
            f"{built['round']['version']}, but the round asks for client part {key}; "
            f"{REWRITE}")
    named = []
    for role, mine in (("inputs", signature.inputs), ("outputs", signature.outputs)):
        theirs = built[role]
        if [(list(t.shape), t.dtype) for t in mine] != \
                [(list(t["shape"]), t["dtype"]) for t in theirs]:
            raise CarriedMismatch(
                f"the carried LiteRT model {key}.json in {folder} has {role} "
                f"{[(t['shape'], t['dtype']) for t in theirs][:6]}, but the round's client "
                f"part has {[(list(t.shape), t.dtype) for t in mine][:6]}; {REWRITE}")
        named.append(tuple(lowering.Tensor(t["name"], tuple(t["shape"]), t["dtype"])
                           for t in theirs))
    _check_signature(data["tflite"], built["model"]["signature"], named, path)
    sig = lowering.ClientSignature(signature.parameter, signature.result, *named)
    return convert.ClientModel(data["tflite"], built["model"]["signature"], sig, key,
                               flatbuffer.operators(data["tflite"]), 0, 0.0)


def _check_signature(tflite: bytes, name: str, named: list, path: pathlib.Path) -> None:
    """Refuses a manifest whose signature or tensor names are not the model's own."""
    from ai_edge_litert.interpreter import Interpreter

    try:
        found = Interpreter(model_content=tflite, num_threads=1).get_signature_list()
    except (RuntimeError, ValueError) as e:
        raise ComputationError(f"the carried LiteRT model {path} cannot be loaded ({e}); "
                               f"{REWRITE}") from None
    want = {"inputs": sorted(t.name for t in named[0]),
            "outputs": sorted(t.name for t in named[1])}
    have = found.get(name)
    if have is None or {k: sorted(have[k]) for k in want} != want:
        raise ComputationError(
            f"the carried LiteRT model {path} names signature {name!r} with tensors "
            f"{want}, but the model has signatures {found}; {REWRITE}")
