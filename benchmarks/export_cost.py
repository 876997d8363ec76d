"""Cost of exporting a FedAvg round to a TFF proto as the model grows from 10k to 10M parameters.

The round (8 clients by default) broadcasts an MLP `features -> h -> h -> classes` to
the clients, runs `--steps` local SGD steps of batch `--batch` on each client
(`lax.scan`), averages the deltas weighted by the clients' example counts and applies
them at the server.  The hidden width `h` is chosen so the model has about the
requested number of parameters; the exact counts are printed.

Every argument is a `jax.ShapeDtypeStruct`: nothing of the model's size is ever
materialized, so 10M-parameter tracing is cheap.  For each size the script measures

- `trace`: `fax_bridge.trace` (jaxpr and placement analysis);
- `export`: `fax_bridge.tff.export.export_computation` (stages lowered to HLO, the
  building blocks type-checked) plus `SerializeToString`;
- the serialized proto bytes, the bytes of the HloModuleProtos embedded in its `Xla`
  computations and the rest (types, intrinsics, references), the ratio of proto bytes
  to parameter bytes (float32), and the largest `constant` instruction found in any
  HLO module (its element count);
- for models up to `--concrete-max` parameters, a second export with concrete random
  arrays of the same shapes: its proto must be the same as the abstract one, otherwise
  values of the arguments have leaked into the proto.  "The same" compares the protos
  with every HloModuleProto replaced by its HLO text with all constants printed: the
  serialized modules carry a process-wide module `id` that differs between any two
  exports, so raw bytes never match.

Times are medians over `--repeats` runs.  A least-squares slope on log-log of time and
of proto bytes against the parameter count says how they grow (1: linear, 0: flat).

With `--forms`, each size is also converted to TFF's production forms
(`fax_bridge.tff.forms`): the round exported in the forms' type (time, bytes), every
Xla part converted to a portable StableHLO artifact (time, HLO and artifact bytes), and,
in one TFF 0.87 side-environment process for all sizes and repeats, the
DistributeAggregateForm and the MapReduceForm built by TFF (its build times, the Xla ->
XlaCallModule replacement time, and the bytes of all pieces of each form).

With `--leaves 100,1000,3000,10000`, the sweep is over the number of leaves instead:
a FedAvg-style round over a dict of that many float32[4] parameters, whose client
update touches every leaf (`leaves_round`), exported once (`export` s, proto bytes,
Xla parts), then run twice by `fax_bridge.runtime.run_computation` on the host
(`on_device=False`) and twice on jax's default device (`on_device=True`): each run's
time, and the seconds XLA's backend compile took within the first (jax's
`backend_compile_duration` events). `--runs host` or `--runs none` leaves the device
runs, or both, out. Slopes are against the number of leaves.

    python benchmarks/export_cost.py [--sizes 10k,30k,100k,1M,3M,10M] [--repeats 5] \
        [--forms] [--json OUT]
    python benchmarks/export_cost.py --leaves 100,1000,3000,10000 [--runs host,device]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from federated_language.proto import computation_pb2  # noqa: E402
from jax import lax  # noqa: E402
from jax._src.lib import xla_client  # noqa: E402

import fax_bridge  # noqa: E402
from fax_bridge.runtime import hlo as runtime_hlo  # noqa: E402
from fax_bridge.tff import export as tff_export  # noqa: E402
from fax_bridge.tff import forms as tff_forms  # noqa: E402
from fax_bridge.tff import xla as tff_xla  # noqa: E402

DEFAULT_SIZES = (10_000, 30_000, 100_000, 1_000_000, 3_000_000, 10_000_000)
FEATURES = 64
CLASSES = 10
LR = 0.05
SERVER_LR = 1.0

_CONSTANT = re.compile(r"=\s*([a-z0-9]+)\[([0-9,]*)\]\S*\s+constant\(")


# --------------------------------------------------------------------------- model


def hidden_width(target: int, features: int = FEATURES, classes: int = CLASSES) -> int:
    """The width `h` for which `features -> h -> h -> classes` has about `target` params."""
    # params = h^2 + (features + classes + 2) h + classes
    b = features + classes + 2
    h = (-b + math.sqrt(b * b + 4 * max(target - classes, 1))) / 2
    return max(1, round(h))


def layer_sizes(target: int) -> tuple[int, ...]:
    """The MLP layer sizes for a model of about `target` parameters."""
    h = hidden_width(target)
    return (FEATURES, h, h, CLASSES)


def param_count(layers: Sequence[int]) -> int:
    """The number of scalar parameters of the dense MLP with these layer sizes."""
    return sum(i * o + o for i, o in zip(layers[:-1], layers[1:]))


def _logits(params: dict, x: jax.Array) -> jax.Array:
    n = len(params) // 2
    h = x
    for i in range(n):
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        if i < n - 1:
            h = jax.nn.relu(h)
    return h


def _loss(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(_logits(params, x))
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


def _client_update(params: dict, xs: jax.Array, ys: jax.Array):
    def step(p, batch):
        loss, g = jax.value_and_grad(_loss)(p, *batch)
        return jax.tree_util.tree_map(lambda a, b: a - LR * b, p, g), loss

    final, losses = lax.scan(step, params, (xs, ys))
    delta = jax.tree_util.tree_map(lambda a, b: a - b, final, params)
    return delta, jnp.mean(losses)


def _server_update(params: dict, delta: dict) -> dict:
    return jax.tree_util.tree_map(lambda p, d: p + SERVER_LR * d, params, delta)


def make_round(clients: int) -> Callable:
    """The FedAvg round as a `fax_bridge.program` over `clients` clients."""

    @fax_bridge.program(clients=clients)
    def fedavg_round(params, xs, ys, weights):
        at_clients = fax_bridge.federated_broadcast(params)
        deltas, losses = fax_bridge.federated_map_clients(_client_update, (at_clients, xs, ys))
        delta = fax_bridge.federated_weighted_mean(deltas, weights)
        loss = fax_bridge.federated_weighted_mean(losses, weights)
        new_params = fax_bridge.federated_map_server(_server_update, (params, delta))
        return new_params, loss

    return fedavg_round


PLACEMENTS = ("server", "clients", "clients", "clients")


def abstract_args(layers: Sequence[int], clients: int, steps: int, batch: int) -> tuple:
    """`jax.ShapeDtypeStruct` arguments (params, xs, ys, weights) of the round."""
    f32, i32 = jnp.float32, jnp.int32
    params = {}
    for i, (fan_in, fan_out) in enumerate(zip(layers[:-1], layers[1:])):
        params[f"w{i}"] = jax.ShapeDtypeStruct((fan_in, fan_out), f32)
        params[f"b{i}"] = jax.ShapeDtypeStruct((fan_out,), f32)
    xs = jax.ShapeDtypeStruct((clients, steps, batch, layers[0]), f32)
    ys = jax.ShapeDtypeStruct((clients, steps, batch), i32)
    weights = jax.ShapeDtypeStruct((clients,), f32)
    return params, xs, ys, weights


def concrete_args(abstract: tuple, seed: int = 0) -> tuple:
    """Random numpy arrays with the shapes and dtypes of `abstract`."""
    rng = np.random.default_rng(seed)

    def fill(s: jax.ShapeDtypeStruct) -> np.ndarray:
        if np.issubdtype(s.dtype, np.integer):
            return rng.integers(0, CLASSES, size=s.shape).astype(s.dtype)
        return rng.standard_normal(size=s.shape, dtype=np.float32).astype(s.dtype)

    return jax.tree_util.tree_map(fill, abstract)


# --------------------------------------------------------------------------- proto contents


def xla_parts(proto: computation_pb2.Computation) -> list:
    """Every `Xla` computation nested anywhere in `proto`."""
    parts = []

    def walk(msg: Any) -> None:
        if isinstance(msg, computation_pb2.Computation) and \
                msg.WhichOneof("computation") == "xla":
            parts.append(msg)
            return
        for field, value in msg.ListFields():
            if field.message_type is None:
                continue
            for item in (value if field.is_repeated else [value]):
                walk(item)

    walk(proto)
    return parts


def hlo_constants(hlo: bytes) -> list[tuple[str, int]]:
    """(`dtype[shape]`, element count) of every `constant` instruction of an HLO module."""
    text = xla_client.XlaComputation(hlo).as_hlo_text()
    found = []
    for match in _CONSTANT.finditer(text):
        dims = [int(d) for d in match.group(2).split(",") if d]
        found.append((f"{match.group(1)}[{match.group(2)}]", int(np.prod(dims, dtype=np.int64))))
    return found


def canonical_bytes(proto: computation_pb2.Computation) -> bytes:
    """`proto` serialized with each HLO module as its full text (no module ids)."""
    copy = computation_pb2.Computation()
    copy.CopyFrom(proto)
    for part in xla_parts(copy):
        text = xla_client.XlaComputation(part.xla.hlo_module.value).as_hlo_text(
            print_large_constants=True)
        part.xla.hlo_module.value = text.encode()
    return copy.SerializeToString(deterministic=True)


def proto_breakdown(proto: computation_pb2.Computation,
                    serialized: Optional[bytes] = None) -> dict[str, Any]:
    """Proto bytes, embedded HLO bytes, the rest, and the largest HLO constant."""
    data = serialized if serialized is not None else proto.SerializeToString()
    modules = [tff_xla.hlo_module_bytes(c) for c in xla_parts(proto)]
    constants = [c for m in modules for c in hlo_constants(m)]
    largest = max(constants, key=lambda c: c[1], default=("none", 0))
    hlo_bytes = sum(len(m) for m in modules)
    return {
        "proto_bytes": len(data),
        "hlo_modules": len(modules),
        "hlo_bytes": hlo_bytes,
        "rest_bytes": len(data) - hlo_bytes,
        "constants": len(constants),
        "largest_constant": largest[0],
        "largest_constant_elements": largest[1],
    }


# --------------------------------------------------------------------------- measurement


def export_once(program: Callable, args: tuple) -> tuple[bytes, computation_pb2.Computation,
                                                         float, float]:
    """Traces and exports `program(*args)`: (bytes, proto, trace s, export+serialize s)."""
    t0 = time.perf_counter()
    comp = fax_bridge.trace(program, *args, placements=PLACEMENTS)
    t1 = time.perf_counter()
    proto = tff_export.export_computation(comp, ["params", "xs", "ys", "weights"])
    data = proto.SerializeToString()
    t2 = time.perf_counter()
    return data, proto, t1 - t0, t2 - t1


def measure(target: int, clients: int = 8, steps: int = 2, batch: int = 8, repeats: int = 3,
            concrete_max: int = 2_000_000) -> dict[str, Any]:
    """One model size: export times, proto breakdown and the concrete-values check."""
    layers = layer_sizes(target)
    params = param_count(layers)
    args = abstract_args(layers, clients, steps, batch)
    traces, exports, data, proto = [], [], b"", None
    for _ in range(repeats):
        # A fresh program each time: jax caches the trace of a function it has seen.
        program = make_round(clients)
        data, proto, t_trace, t_export = export_once(program, args)
        traces.append(t_trace)
        exports.append(t_export)
    totals = [a + b for a, b in zip(traces, exports)]
    row: dict[str, Any] = {
        "target": target,
        "layers": list(layers),
        "params": params,
        "param_bytes": 4 * params,
        "trace_s": statistics.median(traces),
        "export_s": statistics.median(exports),
        "total_s": statistics.median(totals),
        "totals_s": totals,
    }
    row.update(proto_breakdown(proto, data))
    row["ratio"] = row["proto_bytes"] / row["param_bytes"]
    if params <= concrete_max:
        _, concrete, _, _ = export_once(program, concrete_args(args))
        row["concrete_identical"] = canonical_bytes(concrete) == canonical_bytes(proto)
    else:
        row["concrete_identical"] = None
    return row


def stablehlo_conversion(target: int, clients: int = 8, steps: int = 2, batch: int = 8,
                         repeats: int = 3) -> tuple[dict[str, Any], computation_pb2.Computation]:
    """The round in the forms' type and its Xla parts as StableHLO artifacts: times
    (medians) and bytes. Returns (row, the round proto)."""
    args = abstract_args(layer_sizes(target), clients, steps, batch)
    exports, converts = [], []
    for _ in range(repeats):
        program = make_round(clients)
        t0 = time.perf_counter()
        proto, _ = tff_forms.round_proto(program, *args, placements=PLACEMENTS)
        data = proto.SerializeToString()
        t1 = time.perf_counter()
        modules = [tff_xla.hlo_module_bytes(p) for p in tff_forms.xla_parts(proto)]
        artifacts = [runtime_hlo.portable_artifact(m)[0] for m in modules]
        t2 = time.perf_counter()
        exports.append(t1 - t0)
        converts.append(t2 - t1)
    row = {"round_form_export_s": statistics.median(exports),
           "round_form_bytes": len(data),
           "stablehlo_s": statistics.median(converts),
           "xla_parts": len(modules),
           "hlo_bytes": sum(len(m) for m in modules),
           "stablehlo_bytes": sum(len(a) for a in artifacts)}
    return row, proto


def measure_forms(rows: list[dict[str, Any]], clients: int, steps: int, batch: int,
                  repeats: int) -> None:
    """Adds the production-form costs to each row (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="export_cost_forms_") as tmp:
        jobs = []
        for row in rows:
            conv, proto = stablehlo_conversion(row["target"], clients, steps, batch, repeats)
            row["forms"] = conv
            for r in range(repeats):
                jobs.append(tff_forms.job(f"{row['target']}.{r}", proto, ["daf", "mrf"],
                                          os.path.join(tmp, f"{row['target']}.{r}")))
        built = tff_forms.build_forms(jobs, tmp, timeout_s=1800)
        for row in rows:
            runs = [built[f"{row['target']}.{r}"] for r in range(repeats)]
            for kind in ("daf", "mrf"):
                errors = [r[kind]["error"] for r in runs if "error" in r[kind]]
                if errors:
                    raise RuntimeError(f"{row['params']:,} params, {kind}: {errors[0]}")
            last = runs[-1]
            row["forms"].update({
                "daf_s": statistics.median(r["daf"]["seconds"] for r in runs),
                "daf_bytes": sum(p["bytes"] for p in last["daf"]["pieces"].values()),
                "xla_to_tf_s": statistics.median(r["mrf"]["xla_to_tf_seconds"] for r in runs),
                "mrf_s": statistics.median(r["mrf"]["seconds"] for r in runs),
                "mrf_bytes": sum(p["bytes"] for p in last["mrf"]["pieces"].values()),
            })


def _forms_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'params':>10} {'export s':>8} {'round B':>8} {'->SHLO s':>8} {'HLO B':>8} "
            f"{'SHLO B':>8} {'DAF s':>6} {'DAF B':>8} {'->TF s':>6} {'MRF s':>6} "
            f"{'MRF B':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        f = r["forms"]
        lines.append(
            f"{r['params']:>10,} {f['round_form_export_s']:>8.3f} {f['round_form_bytes']:>8,} "
            f"{f['stablehlo_s']:>8.3f} {f['hlo_bytes']:>8,} {f['stablehlo_bytes']:>8,} "
            f"{f['daf_s']:>6.3f} {f['daf_bytes']:>8,} {f['xla_to_tf_s']:>6.3f} "
            f"{f['mrf_s']:>6.3f} {f['mrf_bytes']:>8,}")
    return "\n".join(lines)


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of log(y) against log(x)."""
    lx, ly = np.log(np.asarray(xs, float)), np.log(np.asarray(ys, float))
    if len(lx) < 2 or np.ptp(lx) == 0:
        return float("nan")
    return float(np.polyfit(lx, ly, 1)[0])


def _parse_size(text: str) -> int:
    text = text.strip().lower()
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def _table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'params':>10} {'hidden':>6} {'trace s':>8} {'export s':>8} {'total s':>8} "
            f"{'proto B':>9} {'HLO B':>9} {'rest B':>8} {'proto/param':>11} "
            f"{'max const':>9} {'values?':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        same = {True: "same", False: "DIFFER", None: "-"}[r["concrete_identical"]]
        lines.append(
            f"{r['params']:>10,} {r['layers'][1]:>6} {r['trace_s']:>8.3f} {r['export_s']:>8.3f} "
            f"{r['total_s']:>8.3f} {r['proto_bytes']:>9,} {r['hlo_bytes']:>9,} "
            f"{r['rest_bytes']:>8,} {r['ratio']:>11.2e} {r['largest_constant_elements']:>9,} "
            f"{same:>8}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- many leaves

LEAF_CLIENTS = 4


def leaves_round(leaves: int) -> tuple[Callable, dict, np.ndarray]:
    """(round, parameters, client data): a broadcast of a dict of `leaves` float32[4]
    parameters, a client update of every leaf, their mean."""
    @fax_bridge.program(clients=LEAF_CLIENTS)
    def round_(w, data):
        def local(w, d):
            return jax.tree_util.tree_map(lambda p: p - LR * d * p, w)
        return fax_bridge.federated_mean(
            fax_bridge.federated_map_clients(local, (fax_bridge.federated_broadcast(w), data)))

    w = {f"p{i:05d}": np.full((4,), i % 97, np.float32) for i in range(leaves)}
    return round_, w, np.linspace(0.5, 1.5, LEAF_CLIENTS, dtype=np.float32)


def _compile_seconds() -> list:
    """A list that fills with the seconds of each XLA backend compile from now on."""
    seen: list = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **_: seen.append(secs)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    return seen


def measure_leaves(leaves: int, runs: Sequence[str], compiles: list) -> dict[str, Any]:
    """One leaf count: export time and proto, then two runs per path in `runs`."""
    from fax_bridge.runtime import run_computation

    fn, w, data = leaves_round(leaves)
    t0 = time.perf_counter()
    proto = fax_bridge.export_tff(fn, w, data, placements=("server", "clients"))
    row: dict[str, Any] = {"leaves": leaves, "export_s": time.perf_counter() - t0,
                           "proto_bytes": proto.ByteSize(), "xla_parts": len(xla_parts(proto))}
    for path in runs:
        for which in ("first", "second"):
            before, t0 = len(compiles), time.perf_counter()
            out = run_computation(proto, w, data, on_device=path == "device")
            jax.block_until_ready(out)
            row[f"{path}_{which}_s"] = time.perf_counter() - t0
            row[f"{path}_{which}_xla_compile_s"] = sum(compiles[before:])
    return row


def leaves_main(args: argparse.Namespace) -> dict[str, Any]:
    """The `--leaves` sweep: prints a table and the slopes, returns the rows."""
    counts = [_parse_size(s) for s in args.leaves.split(",") if s.strip()]
    runs = [r for r in args.runs.split(",") if r in ("host", "device")]
    print(f"Round over a dict of float32[4] leaves, {LEAF_CLIENTS} clients; jax "
          f"{jax.__version__} on {jax.default_backend()}, {platform.machine()} "
          f"{os.cpu_count()} CPUs", flush=True)
    compiles = _compile_seconds()
    rows = []
    for leaves in counts:
        rows.append(measure_leaves(leaves, runs, compiles))
        print("  " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v:,}"
                               for k, v in rows[-1].items()), flush=True)
    keys = [k for k in rows[0] if k.endswith("_s") or k == "proto_bytes"]
    print()
    print(f"{'leaves':>7} " + " ".join(f"{k.removesuffix('_s'):>22}" for k in keys))
    for r in rows:
        print(f"{r['leaves']:>7,} " + " ".join(
            f"{r[k]:>22,}" if isinstance(r[k], int) else f"{r[k]:>22.3f}" for k in keys))
    slopes = {k: loglog_slope(counts, [max(r[k], 1e-6) for r in rows]) for k in keys}
    print("log-log slope vs leaves (1 = linear): " +
          ", ".join(f"{k} {v:.2f}" for k, v in slopes.items()))
    result = {"config": {"clients": LEAF_CLIENTS, "runs": runs, "jax": jax.__version__,
                         "backend": jax.default_backend(), "cpus": os.cpu_count()},
              "rows": rows, "slopes": slopes}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Runs the benchmark, prints the table and slopes, returns (and optionally saves) it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES),
                        help="comma-separated parameter counts (10k, 1M, 1e6 ... accepted)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--concrete-max", type=int, default=2_000_000,
                        help="also export concrete arrays for models up to this many params")
    parser.add_argument("--forms", action="store_true",
                        help="also measure the conversion to TFF's production forms (needs "
                             "the TFF 0.87 side environment, make tff-venv)")
    parser.add_argument("--json", metavar="OUT", help="write the results as JSON")
    parser.add_argument("--leaves", metavar="N,N,...",
                        help="sweep the number of leaves instead of the model size")
    parser.add_argument("--runs", default="host,device",
                        help="with --leaves: which runs to time (host, device, none)")
    args = parser.parse_args(argv)
    if args.leaves:
        return leaves_main(args)
    sizes = [_parse_size(s) for s in args.sizes.split(",") if s.strip()]

    print(f"FedAvg round export: {args.clients} clients, {args.steps} local steps, batch "
          f"{args.batch}, MLP {FEATURES}->h->h->{CLASSES}, median of {args.repeats}; "
          f"jax {jax.__version__}, {platform.machine()} {os.cpu_count()} CPUs, "
          f"python {platform.python_version()}", flush=True)
    # One untimed export first, so the first size does not pay jax's one-time setup.
    export_once(make_round(args.clients),
                abstract_args(layer_sizes(min(sizes)), args.clients, args.steps, args.batch))
    rows = []
    for target in sizes:
        row = measure(target, args.clients, args.steps, args.batch, args.repeats,
                      args.concrete_max)
        rows.append(row)
        print(f"  {row['params']:,} params: {row['total_s']:.3f} s, "
              f"{row['proto_bytes']:,} proto bytes", flush=True)
    print()
    print(_table(rows))

    params = [r["params"] for r in rows]
    slopes = {
        "total_s": loglog_slope(params, [r["total_s"] for r in rows]),
        "trace_s": loglog_slope(params, [r["trace_s"] for r in rows]),
        "export_s": loglog_slope(params, [r["export_s"] for r in rows]),
        "proto_bytes": loglog_slope(params, [r["proto_bytes"] for r in rows]),
        "hlo_bytes": loglog_slope(params, [r["hlo_bytes"] for r in rows]),
    }
    print()
    print("log-log slope vs params (1 = linear, 0 = flat): " +
          ", ".join(f"{k} {v:.3f}" for k, v in slopes.items()))
    growth = {
        "params": params[-1] / params[0],
        "proto_bytes": rows[-1]["proto_bytes"] / rows[0]["proto_bytes"],
        "total_s": rows[-1]["total_s"] / rows[0]["total_s"],
    }
    print(f"smallest -> largest: params x{growth['params']:.0f}, proto bytes "
          f"x{growth['proto_bytes']:.3f}, export time x{growth['total_s']:.2f}")
    checked = [r for r in rows if r["concrete_identical"] is not None]
    largest = max(rows, key=lambda r: r["largest_constant_elements"])
    print(f"largest HLO constant: {largest['largest_constant']} "
          f"({largest['largest_constant_elements']:,} elements, at {largest['params']:,} "
          f"params); concrete-argument exports identical: "
          f"{sum(bool(r['concrete_identical']) for r in checked)}/{len(checked)}")

    if args.forms:
        measure_forms(rows, args.clients, args.steps, args.batch, args.repeats)
        print()
        print("Production forms (SHLO: portable StableHLO artifacts; TFF times measured "
              "inside TFF 0.87):")
        print(_forms_table(rows))
        for key in ("stablehlo_s", "stablehlo_bytes", "daf_s", "daf_bytes", "mrf_s",
                    "mrf_bytes"):
            slopes[f"forms.{key}"] = loglog_slope(params, [r["forms"][key] for r in rows])
        print("log-log slope vs params: " + ", ".join(
            f"{k[6:]} {v:.3f}" for k, v in slopes.items() if k.startswith("forms.")))

    result = {
        "config": {"clients": args.clients, "steps": args.steps, "batch": args.batch,
                   "repeats": args.repeats, "features": FEATURES, "classes": CLASSES,
                   "jax": jax.__version__, "python": platform.python_version(),
                   "machine": platform.machine(), "cpus": os.cpu_count()},
        "rows": rows,
        "slopes": slopes,
        "growth": growth,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
