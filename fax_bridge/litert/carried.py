"""LiteRT models that travel with an app: a directory of converted client parts, searched
before any conversion, so that a node without the converter runs them.

A carried model is one JSON file, `<version>.json`, in a models directory: its
`manifest` (`manifest.build`'s, whose `round.version` is the client part's content hash
and `round.program` what it computes, `convert.program_sha256`) and the `.tflite`
flatbuffer base64-encoded (`tflite_base64`), since app bundles such as Flower's carry
text files only. `pack(split, signature)` converts a round's client part and gives the
file's name and text; `write(folder, packed)` puts them in a directory (`fax-bridge
flower ... --litert` into an app, `fax-bridge litert ... -o DIR` into DIR);
`find(folder, key, signature, fn=...)` is the lookup `runner.model_for` makes before it
converts:

  a model whose version is `key`   that model, never converted here;
  else one that computes what `fn` does (the same program exported again elsewhere: its
  proto bytes, so its hash, differ, `convert.program_sha256` does not): that model;
  models, none of these            `CarriedMismatch`, naming both hashes and the command
                                   that writes this round's model there;
  no directory or no model         None: the caller converts as without carried models.

Nothing carried is believed. A model file is read only as a regular file (never through
a link, a FIFO never waited on, at most `MAX_FILE_BYTES`); where the folder's record is
known (`expect(folder, {file name: sha256})`: the Flower ClientApp gives round.json's,
written with the app), a file the record does not name, or whose sha256 is not the
recorded one, is refused naming the file, both digests and the fix, before it is parsed
(`recorded_files` is that check alone, which the ServerApp makes before any round). Its
manifest must name the client part and the round's shapes, its bytes the manifest's
sha256, and the flatbuffer itself (`model_check.check`) must parse, declare the round's
tensors by name, shape and dtype in its signature and use builtin ops only, checked
once per content before any client runs it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pathlib
import re
import threading
from typing import Mapping, Optional

from fax_bridge.system import private_files
from fax_bridge.errors import ComputationError
from fax_bridge.litert import lowering

FORMAT = "fax_bridge.litert.carried/1"
REWRITE = ("write the models again from the program this round runs: `fax-bridge flower "
           "MODULE:FUNCTION -o APP --litert` rewrites a Flower app with them, `fax-bridge "
           "litert MODULE:FUNCTION --clients N -o DIR` a models folder (--litert-models DIR)")


def write_here(folder: str) -> str:
    """The command that writes this round's model into the models folder `folder`."""
    return (f"write this round's model there: `fax-bridge litert MODULE:FUNCTION --clients "
            f"N -o {folder}` with the program this round runs (its output folder is a "
            "models folder), or give no models folder and the model is converted here")


MAX_FILE_BYTES = 1 << 30
_FOUND: dict = {}  # (file, its sha256, signature) -> ClientModel
_EXPECTED: dict = {}  # folder (real path) -> {file name: sha256} written with it
_LOCK = threading.Lock()


class CarriedMismatch(ComputationError):
    """The carried models are of another client part, or other content, than the round
    asked for."""


def expect(folder: str, record: Mapping[str, str]) -> None:
    """Holds `find` in `folder` to `record` ({file name: sha256} of the models written
    with the app): any other file, or other content, is refused (module docstring)."""
    with _LOCK:
        _EXPECTED[os.path.realpath(folder)] = dict(record)


def _record_of(folder: str) -> Optional[dict]:
    with _LOCK:
        return _EXPECTED.get(os.path.realpath(folder))


def recorded_files(folder: str, record: Mapping[str, str]) -> dict:
    """{file name: bytes} of the models in `folder`, each checked against `record`
    ({file name: sha256}): a file the record does not name, a recorded file that is
    missing, and one of other content are refused by name (`CarriedMismatch`)."""
    _refuse_unrecorded(folder, record)
    out = {}
    for name, digest in sorted(record.items()):
        out[name] = _checked_bytes(os.path.join(folder, name), digest)
    return out


def _refuse_unrecorded(folder: str, record: Mapping[str, str]) -> None:
    extra = [f"{v}.json" for v in versions(folder) if f"{v}.json" not in record]
    if extra:
        raise CarriedMismatch(
            f"{os.path.join(folder, extra[0])} is not a LiteRT model this app was written "
            f"with (its record names {sorted(record) or 'none'}): it was added since, "
            f"from another round; remove it, or {REWRITE}")


def _checked_bytes(path: str, digest: Optional[str]) -> bytes:
    """The bytes of the carried file `path` (a regular file, never through a link), and
    with `digest` only where they have that sha256."""
    try:
        raw = private_files.read_regular(path, MAX_FILE_BYTES, what="the carried LiteRT model",
                                         fix=REWRITE)
    except FileNotFoundError:
        raise CarriedMismatch(f"the carried LiteRT model {path} is missing, but the app was "
                              f"written with it; {REWRITE}") from None
    except OSError as e:
        raise ComputationError(f"the carried LiteRT model {path} cannot be read "
                               f"({e.strerror or e}); {REWRITE}") from None
    if digest is not None:
        found = hashlib.sha256(raw).hexdigest()
        if found != digest:
            raise CarriedMismatch(
                f"the carried LiteRT model {path} is not the one the app was written with "
                f"(sha256 {found}, the app records {digest}): another round's model, or "
                f"one changed since; {REWRITE}")
    return raw


def pack(split, signature: str, aggregands: Optional[list] = None,
         argument_names: Optional[list] = None) -> tuple:
    """(file name, JSON text) of the round split's client part converted with its
    tensors named by pytree path (`manifest.convert_named`: the aggregands' leaves by
    `aggregands`, `pytree_names.recording_aggregands`' list, the round parameter's
    elements by `argument_names`; a client part that cannot convert is refused here,
    naming the op) with its manifest."""
    from fax_bridge.litert import manifest

    model = manifest.convert_named(split, aggregands, argument_names)
    built = manifest.build(split, model, signature)
    text = json.dumps({"format": FORMAT, "manifest": built,
                       "tflite_base64": base64.b64encode(model.tflite).decode()})
    return f"{model.client_part_hash}.json", text


def write(folder: str, packed: list) -> list:
    """Writes the packed models (`pack`'s pairs) into `folder`; returns their paths."""
    private_files.private_dir(folder, 0o755)
    return [private_files.write_file(os.path.join(folder, name), text, 0o644)
            for name, text in packed]


def _read(path: pathlib.Path, raw: bytes) -> dict:
    try:
        data = private_files.parse_json(raw, path, max_depth=256)  # bounded: a ValueError
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
        tflite = base64.b64decode(data["tflite_base64"], validate=True)
        model = data["manifest"]["model"]
        if hashlib.sha256(tflite).hexdigest() != model["sha256"]:
            raise ValueError("the model's bytes do not have the sha256 its manifest names")
        data["manifest"]["round"]["version"]  # noqa: B018 - present, or KeyError
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ComputationError(f"the carried LiteRT model {path} cannot be read "
                               f"({type(e).__name__}: {e}); {REWRITE}") from None
    data["tflite"] = tflite
    return data


_VERSION = re.compile(r"[0-9a-f]{64}")


def versions(folder: str) -> list:
    """The client-part hashes of the models carried in `folder` (sorted): its files
    named `<64 hex digits>.json` (a `fax-bridge litert` folder's `manifest.json` beside
    them is not one)."""
    path = pathlib.Path(folder)
    return sorted(p.stem for p in path.glob("*.json")
                  if _VERSION.fullmatch(p.stem)) if path.is_dir() else []


def find(folder: Optional[str], key: str, signature,
         record: Optional[Mapping[str, str]] = None, fn=None):
    """The carried model of client part `key` (module docstring) as a `convert.ClientModel`
    over `signature` (`lowering.ClientSignature`: the caller's types; the tensors' names
    are the carried model's), or None where `folder` carries no model. `record`: the
    folder's {file name: sha256}, else the one `expect` was given, if any. `fn`: the
    client part, whose program a model of another version may compute."""
    if record is None and folder:
        record = _record_of(folder)
    if record is not None and folder:
        _refuse_unrecorded(folder, record)
    found = versions(folder) if folder else []
    if not found:
        return None
    version = key if key in found else _computing(folder, found, record, fn, key,
                                                  signature)
    if version is None:
        fix = REWRITE if record is not None else write_here(folder)
        raise CarriedMismatch(
            f"the LiteRT models carried in {folder} are of client part "
            f"{', '.join(found)}, but the round asks for client part {key}, and none "
            f"computes what it does: they were written from another program or for other "
            f"shapes; {fix}")
    path = pathlib.Path(folder) / f"{version}.json"
    raw = _checked_bytes(str(path), None if record is None else record.get(path.name))
    cache_key = (str(path), hashlib.sha256(raw).hexdigest(), key, signature.inputs,
                 signature.outputs)
    with _LOCK:
        if cache_key in _FOUND:
            return _FOUND[cache_key]
    try:
        model = _load(folder, path, raw, version, signature, key)
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # a damaged manifest
        raise ComputationError(f"the carried LiteRT model {path} has a manifest that "
                               f"cannot be read ({type(e).__name__}: {e}); {REWRITE}") from None
    with _LOCK:
        _FOUND[cache_key] = model
    return model


def _computing(folder: str, found: list, record: Optional[Mapping[str, str]], fn,
               key: str, signature) -> Optional[str]:
    """The version among `found` whose manifest says it computes what the client part
    `fn` (content hash `key`) does over `signature` (`convert.program_sha256`); None
    without `fn` or where none does."""
    if fn is None:
        return None
    from fax_bridge.litert import convert

    wanted = convert.program_sha256_of(fn, signature, key)
    for version in found:
        path = pathlib.Path(folder) / f"{version}.json"
        raw = _checked_bytes(str(path), None if record is None else record.get(path.name))
        if _read(path, raw)["manifest"]["round"].get("program") == wanted:
            return version
    return None


def _load(folder: str, path: pathlib.Path, raw: bytes, version: str, signature,
          key: str):
    """`find`'s model of version `version` for client part `key`, read from `raw` (the
    bytes of `path`) and checked."""
    from fax_bridge.litert import convert, model_check

    data = _read(path, raw)
    built = data["manifest"]
    if built["round"]["version"] != version:
        raise CarriedMismatch(
            f"the carried LiteRT model {version}.json in {folder} is of client part "
            f"{built['round']['version']}, but its name says {version}; {REWRITE}")
    named = []
    for role, mine in (("inputs", signature.inputs), ("outputs", signature.outputs)):
        theirs = built[role]
        if [(list(t.shape), t.dtype) for t in mine] != \
                [(list(t["shape"]), t["dtype"]) for t in theirs]:
            raise CarriedMismatch(
                f"the carried LiteRT model {version}.json in {folder} has {role} "
                f"{[(t['shape'], t['dtype']) for t in theirs][:6]}, but the round's client "
                f"part has {[(list(t.shape), t.dtype) for t in mine][:6]}; {REWRITE}")
        named.append(tuple(lowering.Tensor(t["name"], tuple(t["shape"]), t["dtype"])
                           for t in theirs))
    # `named`: the manifest's names with the round's shapes and dtypes (checked above),
    # which the flatbuffer itself must declare
    where = f"the carried LiteRT model {path}"
    operators = model_check.check(data["tflite"], built["model"]["signature"], *named,
                                  where=where, fix=REWRITE)
    model_check.prepares(data["tflite"], where, REWRITE)
    sig = lowering.ClientSignature(signature.parameter, signature.result, *named)
    return convert.ClientModel(data["tflite"], built["model"]["signature"], sig, key,
                               operators, 0, 0.0,
                               program_sha256=built["round"].get("program") or "")
