"""A round's client part -> a LiteRT model (`.tflite`) with one named signature.

`convert_round(split)` (or `convert_client_part(fn, aggregations)`) lowers the client part
to StableHLO (`lowering`), has litert-converter turn it into a flatbuffer in the
converter's side environment (`side_convert.py` run by `.venv-litert`'s python:
`tools/litert/setup.sh`, `make litert-venv`; `FAX_BRIDGE_LITERT_PYTHON` names another),
fixes its scatter regions (`flatbuffer.fix_scatter_regions`), and checks that the model
uses LiteRT builtin ops only and that the interpreter prepares it; anything else is a
`refusals.ConversionRefused` naming the op, the user's source lines that compute it,
its jax primitive and the rewrite. The converter's side script first rewrites what has
an exact builtin form (`side_rewrites`: a max pool's gradient).

`convert_round(split)` names the tensors by pytree path as far as the round's proto
names them (`tensor_names.signature_names(split)`: `broadcast/params/w`, `client/x`,
`aggregate/0/value/<path>`; `fax-bridge litert` adds the paths one trace of the
program records, `manifest.convert_named`). A device given the client part alone (a
fleet's: no round, no split) converts it with `convert_without_split`, named as the
round named it where this machine converted it with its split (`round_names`: this
process's, else `model_cache`'s record, which a fleet's coordinator writes before any
client work), else by index (`lowering.client_signature`: `broadcast/0/w`,
`client/0`). Names change the flatbuffer's bytes, never what it computes.

A model is made once per client part, names and shapes: kept in this process by
content hash and names, and on disk (`model_cache`: `FAX_BRIDGE_LITERT_CACHE`, default
`~/.cache/fax_bridge/litert`, each entry verified when read back) by the sha256 of its
StableHLO and signature (names included), so the devices of one machine convert a
round shape once between them (the key holds the side scripts' sha256 too, so a model
made before they changed is made again). A node that must not convert takes a model
carried with its app instead (`carried`, looked up first by `runner.model_for`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import re
import subprocess
import tempfile
import threading
import time
from typing import Optional

from federated_language.proto import computation_pb2

from fax_bridge.errors import ComputationError
from fax_bridge.litert import flatbuffer, lowering, model_cache, refusals, tensor_names
from fax_bridge.runtime import local_eval

REPO = pathlib.Path(__file__).resolve().parents[2]
SIDE_SCRIPT = pathlib.Path(__file__).resolve().with_name("side_convert.py")
SETUP_HINT = "build it with `make litert-venv` (tools/litert/setup.sh)"
CONVERTER = "litert-converter 0.5.0"
SIGNATURE = "client_update"
TIMEOUT_S = 600.0


class ConverterMissing(ComputationError):
    """The converter's side environment is not built."""


@dataclasses.dataclass
class ClientModel:
    """A client part as a LiteRT model, and what its signature's tensors are."""

    tflite: bytes
    signature: str
    signature_types: lowering.ClientSignature  # types and named leaves, in leaf order
    client_part_hash: str
    operators: list            # LiteRT operator names the model uses
    scatter_fixes: int         # scatter region operators rewritten (`flatbuffer`)
    convert_s: float           # lowering + conversion time (0 when taken from a cache)
    # what the model computes, whatever the client part's proto bytes (`program_sha256`)
    program_sha256: str = ""

    @property
    def inputs(self) -> tuple:
        return self.signature_types.inputs

    @property
    def outputs(self) -> tuple:
        return self.signature_types.outputs

    @property
    def size(self) -> int:
        return len(self.tflite)


def converter_python() -> pathlib.Path:
    """The interpreter of the converter's side environment."""
    return pathlib.Path(os.environ.get("FAX_BRIDGE_LITERT_PYTHON",
                                       REPO / ".venv-litert" / "bin" / "python"))


def stablehlo_to_tflite(text: str, inputs: list, outputs: list,
                        signature: str = SIGNATURE, timeout_s: float = TIMEOUT_S) -> bytes:
    """The flatbuffer of the StableHLO module `text` (its `main` as the signature
    `signature` with those input and output names), as litert-converter writes it."""
    python = converter_python()
    if not python.exists():
        raise ConverterMissing(f"the LiteRT converter's interpreter {python} does not exist; "
                               f"{SETUP_HINT}, or set FAX_BRIDGE_LITERT_PYTHON; or let the "
                               "app carry the model, converted where it is written, so "
                               "that this node needs no converter (`fax-bridge flower ... "
                               "--litert`: docs/litert.md)")
    with tempfile.TemporaryDirectory(prefix="fax_litert_") as tmp:
        tmp = pathlib.Path(tmp)
        (tmp / "module.mlir").write_text(text)
        (tmp / "spec.json").write_text(json.dumps(
            {"signature": signature, "inputs": inputs, "outputs": outputs}))
        try:
            proc = subprocess.run(
                [str(python), "-P", str(SIDE_SCRIPT), str(tmp / "module.mlir"),
                 str(tmp / "model.tflite"), str(tmp / "spec.json")],
                capture_output=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise ComputationError(f"the LiteRT converter did not finish within "
                                   f"{timeout_s:g} s") from None
        err = proc.stderr.decode(errors="replace")
        try:
            answer = json.loads(proc.stdout.decode().strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            raise ComputationError(f"the LiteRT converter exited with status "
                                   f"{proc.returncode} and no answer; its stderr:\n"
                                   f"{err[-2000:]}") from None
        if not answer["ok"]:
            ops = answer.get("ops") or refusals.ops_in_message(answer["error"] + err)
            raise refusals.refuse(f"{CONVERTER} cannot convert", ops, answer["error"])
        return (tmp / "model.tflite").read_bytes()


def _check_runs(model: bytes) -> None:
    """Refuses a model that needs non-builtin ops or that the interpreter cannot prepare."""
    names = flatbuffer.operators(model)
    foreign = flatbuffer.non_builtin(names)
    if foreign:
        raise refusals.refuse("the model needs ops outside LiteRT's builtins", foreign)
    from ai_edge_litert.interpreter import Interpreter

    try:
        Interpreter(model_content=model, num_threads=1).allocate_tensors()
    except (RuntimeError, ValueError) as e:
        found = refusals.failed_node(str(e)) or refusals.ops_in_message(str(e)) or [
            n for n in names if re.search(rf"\b{n}\b", str(e))]
        raise refusals.refuse("the LiteRT interpreter refuses", found, str(e)) from None


_MADE: dict = {}  # (client part hash, input names, output names) -> ClientModel
_NAMES: dict = {}  # client part hash -> the names `convert_round` last gave it here
_PROGRAMS: dict = {}  # (client part hash, tensor shapes) -> its `program_sha256`
_LOCK = threading.Lock()


def program_sha256(text: str, sig: lowering.ClientSignature) -> str:
    """The sha256 of what a client part computes: its StableHLO text (`lowering.lower`,
    without source locations) and its tensors' shapes and dtypes, in signature order.
    Two exports of one program give client parts of other bytes (their HLO keeps the
    exporting call stack) and so other content hashes, but this same digest."""
    shapes = [[list(t.shape), t.dtype] for t in sig.inputs + sig.outputs]
    return hashlib.sha256(json.dumps(shapes).encode() + text.encode()).hexdigest()


def program_sha256_of(fn: computation_pb2.Computation, sig: lowering.ClientSignature,
                      key: Optional[str] = None) -> str:
    """`program_sha256` of the client part `fn` (content hash `key`) over `sig`, lowered
    once per process."""
    key = key or local_eval.content_hash(fn)
    cache_key = (key, tuple((t.shape, t.dtype) for t in sig.inputs + sig.outputs))
    with _LOCK:
        if cache_key in _PROGRAMS:
            return _PROGRAMS[cache_key]
    digest = program_sha256(lowering.lower(fn, sig), sig)
    with _LOCK:
        _PROGRAMS[cache_key] = digest
    return digest


@functools.lru_cache(maxsize=None)
def _side_digest() -> str:
    """The sha256 of the side scripts (`side_convert.py`, `side_rewrites.py`): part of a
    cached model's key, so a model made before they changed is made again."""
    h = hashlib.sha256()
    for name in ("side_convert.py", "side_rewrites.py"):
        h.update(SIDE_SCRIPT.with_name(name).read_bytes())
    return h.hexdigest()


def convert_client_part(fn: computation_pb2.Computation, param, result,
                        aggregations: Optional[list] = None, *, key: Optional[str] = None,
                        use_cache: bool = True, names: Optional[tuple] = None
                        ) -> ClientModel:
    """The client part `fn`, of type `param -> result`, as a LiteRT model (module
    docstring). `aggregations`: the split's, which name the outputs; `names`: (input
    names, output names) in their place (`lowering.client_signature`); `key`: `fn`'s
    content hash where the caller has it (a model is kept by it and its names)."""
    key = key or local_eval.content_hash(fn)
    start = time.perf_counter()
    sig = lowering.client_signature(param, result, aggregations, names)
    ins, outs = [t.name for t in sig.inputs], [t.name for t in sig.outputs]
    made_key = (key, tuple(ins), tuple(outs))  # names change the model's bytes
    with _LOCK:
        if use_cache and made_key in _MADE:
            return _MADE[made_key]
    text = lowering.lower(fn, sig)
    digest = hashlib.sha256(json.dumps([CONVERTER, SIGNATURE, ins, outs, _side_digest()])
                            .encode() + text.encode()).hexdigest()
    cached = model_cache.read(digest, sig, SIGNATURE) if use_cache else model_cache.Lookup(None)
    model = cached.model
    fixes = 0
    if model is None:
        try:
            model, fixes = flatbuffer.fix_scatter_regions(stablehlo_to_tflite(text, ins, outs))
            _check_runs(model)
        except refusals.ConversionRefused as e:
            raise refusals.located(e, lowering.source_lines(fn, sig, e.ops)) from None
        except ConverterMissing as e:  # a damaged cache entry is named, not just missed
            if cached.damaged is None:
                raise
            raise ConverterMissing(f"{cached.damaged} where the converter is. {e}") from None
        if use_cache:
            model_cache.store(digest, model)
        took = time.perf_counter() - start
    else:
        took = 0.0
    made = ClientModel(model, SIGNATURE, sig, key,
                       flatbuffer.operators(model), fixes, took,
                       program_sha256=program_sha256(text, sig))
    with _LOCK:
        if use_cache:
            _MADE[made_key] = made
    return made


def convert_round(split, use_cache: bool = True) -> ClientModel:
    """The client part of a round split (`rounds.round_split.RoundSplit`) as a model
    whose tensors are named by pytree path as far as the round's proto names them
    (`tensor_names.signature_names(split)`: the outputs by the aggregation each feeds);
    the names are kept for the client part (`round_names`), so that a device of this
    machine given the client part alone names its model alike."""
    param, result = lowering.split_types(split)
    names = tuple(tuple(n) for n in tensor_names.signature_names(split))
    made = convert_client_part(split.client_part, param, result, split.aggregations,
                               key=split.client_part_hash, use_cache=use_cache,
                               names=names)
    with _LOCK:
        _NAMES[split.client_part_hash] = names
    if use_cache and model_cache.read_names(split.client_part_hash) != names:
        model_cache.store_names(split.client_part_hash, names)
    return made


def round_names(key: str) -> Optional[tuple]:
    """(input names, output names) the round gave client part `key` where this machine
    converted it with its split (`convert_round`): this process's, else the model
    cache's record (`model_cache.read_names`); None where none has."""
    with _LOCK:
        names = _NAMES.get(key)
    return names if names is not None else model_cache.read_names(key)


def convert_without_split(fn: computation_pb2.Computation, param, result,
                          aggregations: Optional[list] = None, *,
                          key: Optional[str] = None) -> ClientModel:
    """The client part `fn` (content hash `key`, of type `param -> result`) of a round
    not at hand (a fleet device's: `runner.model_for`) as a model named as its round
    named it (`round_names`), else by index (`lowering.client_signature`); names that
    do not fit its tensors (a record of other leaves) are not used."""
    key = key or local_eval.content_hash(fn)
    names = round_names(key)
    if names is not None:
        try:
            lowering.client_signature(param, result, aggregations, names)
        except ComputationError:
            names = None
    return convert_client_part(fn, param, result, aggregations, key=key, names=names)
