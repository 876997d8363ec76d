"""LiteRT client parts: which rounds convert, how far from XLA, how big, how fast.

Three tables (markdown), for docs/litert.md:

1. `--algorithms`: every round of `examples/algorithm_rounds.py` (3 clients of the
   digits MLP), DP-FedAvg, and a round whose clients send E3M0 codes: whether it has one
   client part (a round split), whether it converts (or the op it is refused for), the
   model's size and conversion time, the largest |LiteRT - XLA| over the round's float
   outputs (the round run in process both ways) and the bound the parity check holds it
   to (twice `parity.rounding.evaluation_bounds`, the largest over the outputs).
2. `--sizes`: FedAvg-style rounds of `benchmarks/model_sizes.py`'s MLP, CNN and
   transformer LM at about 100k, 1M and 10M parameters (one SGD step on a client's
   batch): parameters, model file size, conversion time, one client's step in the
   LiteRT interpreter (one thread) against the same client part under `jax.jit`
   (medians of `--repeats` timed calls after a warm-up), |LiteRT - jit| on that client,
   and the peak resident memory of a fresh process that loads the model and runs the
   client (a LiteRT device), with what loading and running added to the process that
   held only the interpreter's module and the inputs.
3. `--workloads`: the models phones train in TFF's tasks, one client step each (one
   SGD step on a client's batch; the reconstruction round's client part): the EMNIST
   CNN (conv 3x3x32, conv 3x3x64, 2x2 max pool, dropout, dense 128, dropout, dense 62,
   1.2M parameters), a Stack Overflow next-word model (vocabulary 10,004, embedding 96,
   LSTM 670, dense 96, softmax over the vocabulary; sequences of 20) and Federated
   Reconstruction's matrix factorization (3,706 items, dimension 50; the user's vector
   local): parameters, model size, the largest |LiteRT - jit| on client 0 and that
   element's bound (twice `parity.rounding.aggregand_bounds`; "within": every element
   within its own), one client's step in LiteRT against jit.
4. `--fleet`: one round of the 100k MLP on `LocalFleet(devices=2)` with XLA devices and
   with LiteRT devices (`client_runtime="litert"`), median of `--repeats` rounds after one
   warm-up round (which converts and loads the model).

    python benchmarks/litert_sizes.py --json out/litert.json      # all four
    python benchmarks/litert_sizes.py --sizes --quick              # 100k only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import jax
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "examples")]

import fax_bridge as fb  # noqa: E402
from fax_bridge import in_process  # noqa: E402
from fax_bridge.parity import rounding as parity_rounding  # noqa: E402
from fax_bridge.language import tracing  # noqa: E402
from fax_bridge.litert import convert, lowering, refusals, runner  # noqa: E402
from fax_bridge.litert import manifest as litert_manifest  # noqa: E402
from fax_bridge.rounds import round_split  # noqa: E402
from fax_bridge.runtime import interpreter, values  # noqa: E402

SIZE_MODELS = [("mlp", "h=100", (100,)), ("mlp", "h=512", (512,)), ("mlp", "h=2900", (2900,)),
               ("cnn", "32-64-128", (32, 64, 128)),
               ("lm", "V512-d64-L2", (512, 64, 2)), ("lm", "V2048-d128-L2", (2048, 128, 2)),
               ("lm", "V8192-d320-L4", (8192, 320, 4))]


def _median_s(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return float(np.median(samples))


def _leaves(proto, args, runtime: str, like: Any) -> list:
    """The round's output leaves, run in process, in the order of jit's result `like`."""
    from fax_bridge.parity.check import leaves_in_type_order

    split = round_split.split_round(proto)
    prepared = interpreter.prepare(proto)
    arg = values.bind_arguments(prepared.parameter, args, {}).runtime_value()
    got = values.check_value(in_process.run_in_process(split, arg, client_runtime=runtime),
                             prepared.result, "result")
    tree = values.to_pytree(got, prepared.result)
    if jax.tree_util.tree_structure(tree) != jax.tree_util.tree_structure(like):
        return leaves_in_type_order(tree, prepared.result)
    return jax.tree_util.tree_leaves(tree)


def _extra_targets(clients: int) -> dict:
    import jax.numpy as jnp
    import optax

    import _digits as D
    from fax_bridge.algorithms import dp_fed_avg, e3m0

    cohort = D.Population(0).cohort(range(clients))
    params = D.init_mlp(0)
    dp = dp_fed_avg(D.loss, optax.sgd(0.1), clients=clients, noise_multiplier=0.5)
    out = {"dp_fed_avg": (dp.next, (dp.init(params), cohort.data, cohort.mask),
                          dp.placements)}

    def coded_update(p, batch):
        g = jax.grad(D.loss)(p, jax.tree.map(lambda a: a[0], batch))
        return jax.tree.map(lambda x: e3m0.decode(*e3m0.encode(-0.1 * x)), g)

    @fb.program(clients=clients)
    def e3m0_round(p, data):
        delta = fb.federated_mean(fb.federated_map_clients(
            coded_update, (fb.federated_broadcast(p), data)))
        return jax.tree.map(jnp.add, p, delta)

    out["e3m0_codes"] = (e3m0_round, (params, cohort.data), ("server", "clients"))
    return out


def algorithms(clients: int) -> list[dict]:
    import algorithm_rounds

    targets = dict(algorithm_rounds.export_targets(clients), **_extra_targets(clients))
    rows = []
    for name, (prog, args, placements) in targets.items():
        row: dict[str, Any] = {"name": name}
        rows.append(row)
        proto = fb.export_tff(prog, *args, placements=placements)
        split = round_split.split_round(proto)
        if split is None:
            row["status"] = "no single client part (runs phase by phase, as XLA)"
            continue
        model = _convert(row, split)
        if model is None:
            continue
        row["scatter_fixes"] = model.scatter_fixes
        convert._MADE[split.client_part_hash] = model  # the runs below use this one
        like = jax.jit(prog)(*args)
        xla, lite = _leaves(proto, args, "xla", like), _leaves(proto, args, "litert", like)
        comp = tracing.trace(prog, *args, placements=placements)
        bounds = parity_rounding.evaluation_bounds(comp, args)
        floats = [i for i, leaf in enumerate(xla) if np.asarray(leaf).dtype.kind == "f"]
        row["max_err"] = max(float(np.max(np.abs(np.asarray(xla[i], np.float64)
                                                 - np.asarray(lite[i], np.float64)),
                                          initial=0.0)) for i in floats)
        row["bound"] = max(float(2 * np.max(bounds[i], initial=0.0)) for i in floats)
        row["within"] = all(np.all(np.abs(np.asarray(xla[i], np.float64)
                                          - np.asarray(lite[i], np.float64))
                                   <= 2 * bounds[i]) for i in floats)
        print(json.dumps(row), flush=True)
    return rows


_PEAK = """
import sys, numpy as np


def hwm():  # this process's peak resident set (VmHWM starts anew at exec; ru_maxrss not)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))


from ai_edge_litert.interpreter import Interpreter
data = {k: v for k, v in np.load(sys.argv[2]).items()}
floor = hwm()
it = Interpreter(model_path=sys.argv[1], num_threads=1)
run = it.get_signature_runner("client_update")
run(**{n: data[f"in_{i}"] for i, n in enumerate(sys.argv[3].split(","))})
print(floor, hwm())
"""


def _convert(row: dict, split):
    """`split`'s client part converted afresh (no cache), `row` given its status and, when
    it runs, the model's size and the conversion time; None when the converter refuses."""
    start = time.perf_counter()
    try:
        model = convert.convert_client_part(
            split.client_part, *lowering.split_types(split), split.aggregations,
            key=split.client_part_hash, use_cache=False)
    except refusals.ConversionRefused as e:
        row["status"] = "refused: " + ", ".join(e.ops)
        return None
    row.update(status="runs", bytes=model.size, convert_s=time.perf_counter() - start)
    return model


def _converted(row: dict, proto, args: tuple):
    """`proto`'s client part converted afresh, `row` given its status, size and
    conversion time: (split, model, LiteRT runner, example client inputs, jitted client
    part), or None when the converter refuses it (the row, printed, says why)."""
    split = round_split.split_round(proto)
    made = _convert(row, split)
    if made is None:
        print(json.dumps(row), flush=True)
        return None
    prepared = interpreter.prepare(proto)
    arg = values.bind_arguments(prepared.parameter, args, {}).runtime_value()
    inputs, _ = litert_manifest.example_client(split, arg)
    flat = jax.jit(lowering.flat_function(split.client_part, made.signature_types))
    return split, made, runner.ClientRunner(made), inputs, flat


def sizes(quick: bool, repeats: int, clients: int = 2) -> list[dict]:
    import model_sizes as M

    rows = []
    chosen = [m for m in SIZE_MODELS if not quick or m[1] in ("h=100", "V512-d64-L2")]
    for model, label, cfg in chosen:
        init, batch, loss = M.BUILDERS[model](*cfg)
        rng = np.random.default_rng(0)
        params = init(rng)
        data = batch(rng, clients, M.BATCH[model])
        prog = M.fax_round(M.make_local(loss, "mean"), "mean", clients)
        row: dict[str, Any] = {"model": model, "size": label,
                               "params": M.param_count(params)}
        rows.append(row)
        proto = fb.export_tff(prog, params, data, placements=("server", "clients"))
        converted = _converted(row, proto, (params, data))
        if converted is None:
            continue
        split, made, run, inputs, flat = converted
        lite = run(inputs)
        want = jax.block_until_ready(flat(*inputs))
        row["max_err"] = max(float(np.max(np.abs(np.asarray(a, np.float64)
                                                 - np.asarray(b, np.float64)), initial=0.0))
                             for a, b in zip(lite, want))
        row["litert_ms"] = 1e3 * _median_s(lambda: run(inputs), repeats)
        row["jit_ms"] = 1e3 * _median_s(lambda: jax.block_until_ready(flat(*inputs)), repeats)
        tmp = f"/tmp/fax_litert_peak_{os.getpid()}"
        with open(tmp + ".tflite", "wb") as f:
            f.write(made.tflite)
        np.savez(tmp + ".npz", **{f"in_{i}": x for i, x in enumerate(inputs)})
        peak = subprocess.run([sys.executable, "-c", _PEAK, tmp + ".tflite", tmp + ".npz",
                               ",".join(t.name for t in made.inputs)],
                              capture_output=True, text=True)
        if peak.returncode == 0:  # the process with its inputs loaded, then after the run
            floor, top = (int(v) / 1024 for v in peak.stdout.split()[-2:])
            row["peak_mib"], row["model_mib"] = top, top - floor
        for ext in (".tflite", ".npz"):
            os.remove(tmp + ext)
        print(json.dumps(row), flush=True)
    return rows


def _emnist_cnn(rng, clients: int, batch: int = 4):
    import jax.numpy as jnp

    from fax_bridge.litert import layers

    conv = lambda *s: (rng.standard_normal(s) / np.sqrt(np.prod(s[:3]))).astype(np.float32)
    dense = lambda a, b: (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
    params = {"c1": conv(3, 3, 1, 32), "cb1": np.zeros(32, np.float32),
              "c2": conv(3, 3, 32, 64), "cb2": np.zeros(64, np.float32),
              "d1": dense(12 * 12 * 64, 128), "db1": np.zeros(128, np.float32),
              "d2": dense(128, 62), "db2": np.zeros(62, np.float32)}
    data = {"x": rng.random((clients, batch, 28, 28, 1)).astype(np.float32),
            "y": rng.integers(0, 62, (clients, batch)).astype(np.int32),
            "key": rng.integers(-2**31, 2**31 - 1, (clients, 2)).astype(np.int32)}
    from size_models import cnn_features

    def loss(p, b):
        z = layers.dropout(b["key"], 0.25, cnn_features(p, b["x"]))
        z = layers.dropout(b["key"] + 1, 0.5, jax.nn.relu(z @ p["d1"] + p["db1"]))
        logits = z @ p["d2"] + p["db2"]
        return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(b["y"], 62), -1))

    return params, data, loss


def _stackoverflow_lstm(rng, clients: int, batch: int = 4, seq: int = 20):
    import jax.numpy as jnp

    vocab, d, h = 10004, 96, 670
    dense = lambda a, b: (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
    params = {"embed": (rng.standard_normal((vocab, d)) * 0.05).astype(np.float32),
              "wi": dense(d, 4 * h), "wh": dense(h, 4 * h), "b": np.zeros(4 * h, np.float32),
              "proj": dense(h, d), "pb": np.zeros(d, np.float32),
              "out": dense(d, vocab), "ob": np.zeros(vocab, np.float32)}
    data = {"tokens": rng.integers(0, vocab, (clients, batch, seq + 1)).astype(np.int32)}

    def loss(p, b):
        tokens = b["tokens"]
        x = jax.nn.one_hot(tokens[:, :-1], vocab) @ p["embed"]

        def cell(carry, xt):
            hh, c = carry
            i, f, g, o = jnp.split(xt @ p["wi"] + hh @ p["wh"] + p["b"], 4, -1)
            c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
            hh = jax.nn.sigmoid(o) * jnp.tanh(c)
            return (hh, c), hh

        zero = jnp.zeros((tokens.shape[0], h), jnp.float32)
        _, hs = jax.lax.scan(cell, (zero, zero), jnp.swapaxes(x, 0, 1))
        logits = (jnp.swapaxes(hs, 0, 1) @ p["proj"] + p["pb"]) @ p["out"] + p["ob"]
        target = jax.nn.one_hot(tokens[:, 1:], vocab)
        return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * target, -1))

    return params, data, loss


def _fedavg_round(loss, clients: int):
    def update(p, b):
        g = jax.grad(loss)(p, b)
        return jax.tree.map(lambda a, gi: a - 0.1 * gi, p, g)

    @fb.program(clients=clients)
    def one_round(p, data):
        return fb.federated_mean(fb.federated_map_clients(update, (fb.federated_broadcast(p),
                                                                   data)))

    return one_round


def _reconstruction_mf(rng, clients: int, batches: int = 2, batch: int = 8):
    import jax.numpy as jnp
    import optax

    from fax_bridge.algorithms import fed_reconstruction

    items, d = 3706, 50

    def loss(global_params, local_params, b):
        rows = jax.nn.one_hot(b["item"], items) @ global_params["item_embeddings"]
        return jnp.mean((rows @ local_params["user"] - b["rating"]) ** 2)

    alg = fed_reconstruction(loss, {"user": jnp.zeros(d)}, clients=clients,
                             client_optimizer=optax.sgd(0.1),
                             reconstruction_optimizer=optax.sgd(0.5))
    data = {"item": rng.integers(0, items, (clients, batches, batch)).astype(np.int32),
            "rating": rng.integers(1, 6, (clients, batches, batch)).astype(np.float32)}
    mask = np.ones((clients, batches, batch), bool)
    params = {"item_embeddings": (rng.standard_normal((items, d)) * 0.1).astype(np.float32)}
    return alg.next, (alg.init(params), data, mask, data, mask), alg.placements, \
        items * d + d


def workloads(repeats: int, clients: int = 2) -> list[dict]:
    from fax_bridge.language import pytree_names

    rng = np.random.default_rng(0)
    cases = []
    for name, build in (("EMNIST CNN", _emnist_cnn), ("Stack Overflow LSTM", _stackoverflow_lstm)):
        params, data, loss = build(rng, clients)
        cases.append((name, _fedavg_round(loss, clients), (params, data),
                      ("server", "clients"), sum(np.size(v) for v in params.values())))
    prog, args, placements, count = _reconstruction_mf(rng, clients)
    cases.append(("Reconstruction MF", prog, args, placements, count))
    rows = []
    for name, prog, args, placements, count in cases:
        row: dict[str, Any] = {"model": name, "params": int(count)}
        rows.append(row)
        proto = fb.export_tff(prog, *args, placements=placements)
        converted = _converted(row, proto, args)
        if converted is None:
            continue
        split, made, run, inputs, flat = converted
        lite, want = run(inputs), jax.block_until_ready(flat(*inputs))
        with pytree_names.recording_aggregands():
            comp = tracing.trace(prog, *args, placements=placements)
        bounds = litert_manifest.output_bounds(
            split, made, parity_rounding.aggregand_bounds(comp, args))
        diffs = [np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
                 for a, b in zip(lite, want)]
        worst = max(range(len(diffs)), key=lambda i: float(np.max(diffs[i], initial=0.0)))
        row["max_err"] = float(np.max(diffs[worst], initial=0.0))
        if bounds[worst] is not None:  # the bound of the element that differs most
            at = np.unravel_index(np.argmax(diffs[worst]), np.shape(diffs[worst]))
            row["bound"] = float(np.broadcast_to(bounds[worst], np.shape(diffs[worst]))[at])
        row["within"] = all(b is not None and bool(np.all(d <= np.asarray(b)))
                            for d, b in zip(diffs, bounds))
        row["litert_ms"] = 1e3 * _median_s(lambda: run(inputs), repeats)
        row["jit_ms"] = 1e3 * _median_s(lambda: jax.block_until_ready(flat(*inputs)), repeats)
        print(json.dumps(row), flush=True)
    return rows


def fleet(repeats: int, clients: int = 8) -> list[dict]:
    import model_sizes as M

    from fax_bridge.fleet.launcher import LocalFleet

    init, batch, loss = M.BUILDERS["mlp"](100)
    rng = np.random.default_rng(0)
    params, data = init(rng), batch(rng, clients, M.BATCH["mlp"])
    prog = M.fax_round(M.make_local(loss, "mean"), "mean", clients)
    proto = fb.export_tff(prog, params, data, placements=("server", "clients"))
    rows = []
    for runtime in ("xla", "litert"):
        with LocalFleet(devices=2, client_runtime=runtime) as f:
            row = {"runtime": runtime, "clients": clients,
                   "round_ms": 1e3 * _median_s(lambda: f.run(proto, params, data), repeats)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _table(rows: list[dict], cols: list[tuple]) -> str:
    head = "| " + " | ".join(c[0] for c in cols) + " |"
    lines = [head, "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(
            (fmt.format(r[key]) if r.get(key) is not None else "-") for _, key, fmt in cols)
            + " |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algorithms", action="store_true")
    p.add_argument("--sizes", action="store_true")
    p.add_argument("--workloads", action="store_true")
    p.add_argument("--fleet", action="store_true")
    p.add_argument("--quick", action="store_true", help="--sizes: the 100k models only")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    every = not (args.algorithms or args.sizes or args.workloads or args.fleet)
    load = os.getloadavg()
    out: dict[str, Any] = {"load_before": load}
    if every or args.algorithms:
        out["algorithms"] = algorithms(3)
        print(_table(out["algorithms"], [
            ("round", "name", "{}"), ("LiteRT", "status", "{}"), ("model bytes", "bytes", "{}"),
            ("convert s", "convert_s", "{:.1f}"), ("max abs err", "max_err", "{:.2e}"),
            ("bound", "bound", "{:.2e}"), ("within", "within", "{}")]))
    if every or args.sizes:
        out["sizes"] = sizes(args.quick, args.repeats)
        print(_table(out["sizes"], [
            ("model", "model", "{}"), ("size", "size", "{}"), ("params", "params", "{:,}"),
            ("LiteRT", "status", "{}"), ("model bytes", "bytes", "{:,}"),
            ("convert s", "convert_s", "{:.1f}"), ("LiteRT ms", "litert_ms", "{:.2f}"),
            ("jit ms", "jit_ms", "{:.2f}"), ("max abs err", "max_err", "{:.2e}"),
            ("peak MiB", "peak_mib", "{:.0f}"), ("+model MiB", "model_mib", "{:.0f}")]))
    if every or args.workloads:
        out["workloads"] = workloads(args.repeats)
        print(_table(out["workloads"], [
            ("model", "model", "{}"), ("params", "params", "{:,}"), ("LiteRT", "status", "{}"),
            ("model bytes", "bytes", "{:,}"), ("max abs err", "max_err", "{:.2e}"),
            ("bound", "bound", "{:.2e}"), ("within", "within", "{}"),
            ("LiteRT ms", "litert_ms", "{:.2f}"), ("jit ms", "jit_ms", "{:.2f}")]))
    if every or args.fleet:
        out["fleet"] = fleet(args.repeats)
        print(_table(out["fleet"], [("devices run", "runtime", "{}"),
                                    ("clients", "clients", "{}"),
                                    ("round ms", "round_ms", "{:.1f}")]))
    out["load_after"] = os.getloadavg()
    print(f"load average before {load}, after {out['load_after']}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return out


if __name__ == "__main__":
    main()
