"""What `fax-bridge litert` writes for a mobile developer: the model, its manifest, an
example client and a check that runs it.

  client_update.tflite   the round's client part (`convert.convert_round`)
  manifest.json          the signature's inputs and outputs (name, shape, dtype; for an
                         output, which aggregation it feeds, as value or weight, and the
                         largest difference from jit the rounding bound allows on the
                         example client), the round's type signature and version (the
                         client part's content hash), converter and interpreter versions
  example_client.npz     keyed by the tensors' names: the example client's inputs, what
                         the client part's XLA gives for them, and under `bound/<output>`
                         each output's bound element by element
  check.py               runs the model on the example client with the LiteRT
                         interpreter and prints, per output, the largest difference from
                         XLA and its bound (needs only numpy and ai-edge-litert); exit
                         status 0 when every element is within its bound

Tensors are named by pytree path (`tensor_names`: `broadcast/state/params/w0`,
`client/batches/x`, `aggregate/0/value/w0`, `aggregate/0/weight`).

The example client is client 0 of the example arguments, its broadcast values computed
by the round's server prepare step. Its bounds are twice the rounding analysis's
(`parity.rounding.aggregand_bounds`, client 0, element by element).
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Any, Optional, Sequence

import numpy as np
from federated_language.common_libs import structure

from fax_bridge.language import pytree_names
from fax_bridge.litert import convert, lowering, tensor_names
from fax_bridge.runtime import local_eval

FORMAT = "fax_bridge.litert/1"
MODEL_FILE = "client_update.tflite"
EXAMPLE_FILE = "example_client.npz"
INTERPRETER = "ai-edge-litert 2.3.0"

CHECK_SCRIPT = '''"""Runs {model} on the example client with the LiteRT interpreter and compares each
output with what jax's XLA gave, element by element within the bound in
{example} (`bound/<output>`, twice the rounding analysis's). Prints, per output, the
largest |LiteRT - jit|, the bound at that element and the largest bound. Needs numpy
and ai-edge-litert. Exit status 0 when every element is within its bound."""
import json
import pathlib
import sys

import numpy as np
from ai_edge_litert.interpreter import Interpreter

here = pathlib.Path(__file__).resolve().parent
manifest = json.loads((here / "manifest.json").read_text())
example = np.load(here / manifest["example"]["file"])
interpreter = Interpreter(model_path=str(here / manifest["model"]["file"]))
run = interpreter.get_signature_runner(manifest["model"]["signature"])
out = run(**{{t["name"]: example[t["name"]] for t in manifest["inputs"]}})
ok = True
for t in manifest["outputs"]:
    name = t["name"]
    got = np.asarray(out[name], np.float64).reshape(t["shape"])
    want = np.asarray(example[name], np.float64)
    key = "bound/" + name
    bound = (np.asarray(example[key], np.float64) if key in example.files
             else np.full(want.shape, t["bound"] or 0.0))
    diff = np.abs(got - want)
    worst = int(np.argmax(diff)) if diff.size else 0
    fine = bool(np.all(diff <= bound))
    ok = ok and fine
    print(f"{{name:40s}} max |LiteRT - jit| {{float(diff.flat[worst]) if diff.size else 0.0:.3e}}"
          f"  bound there {{float(bound.flat[worst]) if bound.size else 0.0:.3e}}"
          f"  largest bound {{float(np.max(bound, initial=0.0)):.3e}}  "
          f"{{'ok' if fine else 'OVER THE BOUND'}}")
print("CHECK OK" if ok else "CHECK FAILED")
sys.exit(0 if ok else 1)
'''


def example_client(split, arg: Any) -> tuple[list, list]:
    """(input leaves, the XLA client part's output leaves) of client 0 of `arg` (the
    round's runtime argument), in the signature's order."""
    from fax_bridge.rounds import server_steps

    member = structure.Struct([(None, arg[i][0]) for i in split.client_inputs])
    env = server_steps.prepare(split, arg, None, len(arg[split.client_inputs[0]]))
    sent = structure.Struct([(None, env[name]) for name in split.broadcasts])
    param, result = lowering.split_types(split)
    inputs = lowering.flatten(sent, param[0], []) + lowering.flatten(member, param[1], [])
    out = local_eval.compile_local(split.client_part)(structure.Struct([(None, sent),
                                                                        (None, member)]))
    return ([np.asarray(x) for x in inputs],
            [np.asarray(x) for x in lowering.flatten(out, result, [])])


def output_bounds(split, model: convert.ClientModel, recorded: list) -> list:
    """Per model output, element by element, twice the example client's rounding bound
    (`parity.rounding.aggregand_bounds`' entries, one per aggregated leaf in evaluation
    order, client 0); None for an output whose aggregation's entries cannot be told
    (another kind or shape than the output's)."""
    entries = list(recorded)
    at = 0
    found: dict = {}  # (aggregation, role, leaf) -> bound
    for k, agg in enumerate(split.aggregations):
        values, _ = agg.leaf_types
        mine = []
        while at < len(entries) and len(mine) < len(values):
            kind, errs = entries[at]
            at += 1
            if kind == agg.kind:
                mine.append(errs)
        for i, errs in enumerate(mine):
            found[(k, "value", i)] = 2.0 * np.asarray(errs[0][0], np.float64)
        if mine and len(mine[0]) > 1:
            found[(k, "weight", 0)] = 2.0 * np.asarray(mine[0][1][0], np.float64)
    out: list = []
    seen: dict = {}
    for tensor in model.outputs:
        parts = tensor.name.split("/")
        role = (int(parts[1]), parts[2]) if parts[0] == "aggregate" and len(parts) > 2 \
            else None
        leaf = seen.get(role, 0)
        seen[role] = leaf + 1
        bound = found.get((*role, leaf)) if role else None
        if bound is not None and bound.shape != tuple(tensor.shape):
            bound = None
        out.append(bound)
    return out


def fresh(prog):
    """`prog` as a function jax has never traced (a program stays a program), with its
    name and signature, so a trace of it inside `pytree_names.recording_aggregands` sees
    every aggregation: jax keeps an earlier trace of the same function, in which none
    would be seen."""
    import functools

    from fax_bridge import api

    if isinstance(prog, api.Program):
        inner = prog.fn
        return api.Program(functools.wraps(inner)(lambda *a, **k: inner(*a, **k)),
                           prog.clients, prog.placement, prog.clients_per_step)
    return functools.wraps(prog)(lambda *a, **k: prog(*a, **k))


def traced_with_paths(prog, args: tuple, placements: Any = None) -> tuple:
    """(`tracing.trace` of the program at `args`, the aggregands' leaf paths as
    `pytree_names.recording_aggregands` saw them), traced anew (`fresh`)."""
    from fax_bridge.language import tracing

    with pytree_names.recording_aggregands() as record:
        comp = tracing.trace(fresh(prog), *args, placements=placements)
    return comp, record


def convert_named(split, recorded: Optional[list] = None,
                  argument_names: Optional[Sequence[Optional[str]]] = None
                  ) -> convert.ClientModel:
    """The split's client part as a model whose tensors are named by pytree path
    (`tensor_names.signature_names`, with the paths one trace of the program recorded:
    `recorded`); its version is the client part's content hash, as
    `convert.convert_round`'s (the model is the same where the trace adds no name)."""
    param, result = lowering.split_types(split)
    names = tensor_names.signature_names(split, recorded, argument_names)
    return convert.convert_client_part(split.client_part, param, result, split.aggregations,
                                       key=split.client_part_hash, names=names)


def build(split, model: convert.ClientModel, signature: str,
          bounds: Optional[list] = None) -> dict:
    """The manifest (module docstring) of `model`, converted from `split`."""
    from importlib.metadata import version

    __version__ = version("fax_bridge")
    aggs = {}
    for k, agg in enumerate(split.aggregations):
        aggs[f"aggregate/{k}"] = agg
    outputs = []
    for i, t in enumerate(model.outputs):
        parts = t.name.split("/")
        agg = aggs.get("/".join(parts[:2]))
        outputs.append({"name": t.name, "shape": list(t.shape), "dtype": t.dtype,
                        "aggregation": None if agg is None else int(parts[1]),
                        "kind": None if agg is None else agg.kind,
                        "role": parts[2] if agg is not None else None,
                        "aggregate_local": None if agg is None else agg.local,
                        "bound": None if bounds is None or bounds[i] is None
                        else float(np.max(bounds[i], initial=0.0))})
    return {
        "format": FORMAT,
        "round": {"type_signature": signature, "version": model.client_part_hash,
                  "program": model.program_sha256,
                  "fax_bridge": __version__,
                  "aggregations": [{"index": k, "kind": a.kind, "local": a.local}
                                   for k, a in enumerate(split.aggregations)]},
        "model": {"file": MODEL_FILE, "signature": model.signature, "bytes": model.size,
                  "sha256": hashlib.sha256(model.tflite).hexdigest(),
                  "operators": model.operators, "converter": convert.CONVERTER,
                  "interpreter": INTERPRETER},
        "inputs": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype}
                   for t in model.inputs],
        "outputs": outputs,
        "example": {"file": EXAMPLE_FILE, "client": 0, "check": "check.py"},
    }


FILES = (MODEL_FILE, "manifest.json", EXAMPLE_FILE, "check.py")  # what `write` writes


def write(out_dir: pathlib.Path, split, model: convert.ClientModel, signature: str,
          example: tuple, bounds: Optional[list] = None) -> dict:
    """Writes the four files (module docstring) into `out_dir`; returns the manifest."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MODEL_FILE).write_bytes(model.tflite)
    manifest = build(split, model, signature, bounds)
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    inputs, outputs = example
    arrays = {t.name: x for t, x in zip(model.inputs, inputs)}
    arrays.update((t.name, x) for t, x in zip(model.outputs, outputs))
    arrays.update((f"bound/{t.name}", b) for t, b in zip(model.outputs, bounds or [])
                  if b is not None)
    with open(out_dir / EXAMPLE_FILE, "wb") as f:  # keys hold "/": savez's kwargs do not
        np.savez(f, **arrays)
    (out_dir / "check.py").write_text(CHECK_SCRIPT.format(model=MODEL_FILE,
                                                          example=EXAMPLE_FILE))
    return manifest
