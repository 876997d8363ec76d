"""What `fax-bridge litert` writes for a mobile developer: the model, its manifest, an
example client and a check that runs it.

  client_update.tflite   the round's client part (`convert.convert_round`)
  manifest.json          the signature's inputs and outputs (name, shape, dtype; for an
                         output, which aggregation it feeds, as value or weight, and the
                         largest difference from jit the rounding bound allows on the
                         example client), the round's type signature and version (the
                         client part's content hash), converter and interpreter versions
  example_client.npz     the example client's inputs (`in_<i>`) and what the client part's
                         XLA gives for them (`out_<i>`), in the manifest's order
  check.py               runs the model on the example client with the LiteRT
                         interpreter and compares each output within its bound (needs
                         only numpy and ai-edge-litert); exit status 0 when all are

The example client is client 0 of the example arguments, its broadcast values computed
by the round's server prepare step.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Any, Optional

import numpy as np
from federated_language.common_libs import structure

from fax_bridge.litert import convert, lowering
from fax_bridge.runtime import local_eval

FORMAT = "fax_bridge.litert/1"
MODEL_FILE = "client_update.tflite"
EXAMPLE_FILE = "example_client.npz"
INTERPRETER = "ai-edge-litert 2.3.0"

CHECK_SCRIPT = '''"""Runs {model} on the example client with the LiteRT interpreter and compares each
output with what jax's XLA gave, within the bound in manifest.json. Needs numpy and
ai-edge-litert. Exit status 0 when every output is within its bound."""
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
out = run(**{{t["name"]: example[f"in_{{i}}"] for i, t in enumerate(manifest["inputs"])}})
ok = True
for i, t in enumerate(manifest["outputs"]):
    got = np.asarray(out[t["name"]], np.float64).reshape(t["shape"])
    diff = float(np.max(np.abs(got - example[f"out_{{i}}"]), initial=0.0))
    bound = t["bound"] if t["bound"] is not None else 0.0
    fine = diff <= bound
    ok = ok and fine
    print(f"{{t['name']:40s}} max |LiteRT - jit| {{diff:.3e}}  bound {{bound:.3e}}  "
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
    """Per model output, twice the example client's rounding bound (`parity_rounding.
    aggregand_bounds`, client 0), where the recorded aggregands line up with the
    outputs leaf for leaf (same shapes in the same order); None otherwise."""
    values = [e[0] for _, errs in recorded for e in errs[:1]]
    weights = [e[0] for _, errs in recorded for e in errs[1:2]]
    out: list = []
    by_role = {"value": iter(values), "weight": iter(weights)}
    for tensor in model.outputs:
        role = tensor.name.split("/")[2] if tensor.name.startswith("aggregate/") else ""
        found = next(by_role.get(role, iter(())), None)
        if found is None or tuple(np.shape(found)) != tensor.shape:
            return [None] * len(model.outputs)
        out.append(float(2.0 * np.max(found, initial=0.0)))
    return out


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
                        "bound": None if bounds is None else bounds[i]})
    return {
        "format": FORMAT,
        "round": {"type_signature": signature, "version": model.client_part_hash,
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


def write(out_dir: pathlib.Path, split, model: convert.ClientModel, signature: str,
          example: tuple, bounds: Optional[list] = None) -> dict:
    """Writes the four files (module docstring) into `out_dir`; returns the manifest."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MODEL_FILE).write_bytes(model.tflite)
    manifest = build(split, model, signature, bounds)
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    inputs, outputs = example
    np.savez(out_dir / EXAMPLE_FILE, **{f"in_{i}": x for i, x in enumerate(inputs)},
             **{f"out_{i}": x for i, x in enumerate(outputs)})
    (out_dir / "check.py").write_text(CHECK_SCRIPT.format(model=MODEL_FILE))
    return manifest
