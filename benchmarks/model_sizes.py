"""Round time against model size: fax_bridge's local path, hand-written jit(vmap), DrJAX.

Four models, each at a few sizes from about 10k to 10M parameters:

- `linear`: `w: [d, d]`, squared error on `[batch, d]` inputs;
- `mlp`: 784 -> h -> h -> 10, softmax cross-entropy;
- `cnn`: EMNIST-sized, 28x28x1 inputs, conv 3x3 (c1) -> conv 3x3 (c2) -> 2x2 max pool ->
  dense k -> 62 classes (c1, c2, k = 32, 64, 128 is TFF's EMNIST CNN, 1.2M parameters);
- `lm`: a decoder-only transformer language model (vocabulary V, width d, L layers, four
  heads, 16 tokens per sequence), next-token cross-entropy.

For each size and each aggregation (`sum`: the server adds the mean of the summed client
deltas; `mean`; `weighted`: one weight per client, its example count; `elementwise`: one
weight per parameter, count * (1 + g**2)), one FedAvg-style round (broadcast, one local
SGD step on every client, aggregate) runs as:

- `fax_bridge`: a `@fax_bridge.program` under `jax.jit`;
- `hand`: `jax.jit` of `jax.vmap` with the sums written as `jnp.tensordot`, the fastest
  hand-written form on XLA's CPU backend;
- `drjax`: the same program in DrJAX 0.2.1 (`drjax.program`, `map_fn`, `reduce_*`);
- with `--paths runtime fleet`, also the exported proto run by
  `fax_bridge.runtime.run_computation` and by a `LocalFleet(devices=2)`, with the bytes
  the fleet's last round moved (`RoundReport`) and the devices' peak resident memory;
- with `--flower`, Flower 1.42's simulation engine (`benchmarks/peers/flower_sizes.py`, in
  `.venv-flower`) doing the linear model's round at the same sizes: `w: [d, d]`, one SGD
  step on 8 examples per client, FedAvg weighted by example counts, so it stands in the
  linear model's `weighted` rows (its data and learning rate are its own: times compare,
  results do not).

Each row also records this process's peak resident memory (`VmHWM`) when it was done:
sizes run smallest first, so a row's figure is the largest its size or a smaller one
needed.

Times are medians of `--repeats` samples after two warm-up calls (the first compiles;
the second pays what the first left to later rounds, such as memory they write over); a
sample of a round under 100 ms is the mean of as many calls in a row as fill 100 ms, up
to 1,000. A round slower than `--slow` seconds (its second call) has 2 samples; one whose
first call took over `--give-up` seconds has that call as its only sample and is not run
at the larger sizes of that model and aggregation ("not run"). A row whose fax_bridge
round came out over `--recheck-above` (1.05) times the hand-written one has the two
timed again, alone and in turns (15 pairs of samples of at least 0.3 s, the median of
their ratios), shown beside the first ratio: among the row's other rounds, 5 samples
of two rounds that time alike when timed alone came out up to 1.14x apart. The table
(markdown) gives the ratios to the hand-written round and each implementation's largest
difference from the hand-written result (relative to that result's largest magnitude). `uptime`'s load averages before
and after the run are printed and saved: the figures are only as steady as the machine.

    python benchmarks/model_sizes.py --json out/model_sizes.json --plot docs/img/model_sizes.png
    python benchmarks/model_sizes.py --quick
    python benchmarks/model_sizes.py --from-json out/model_sizes.json   # the table again
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Optional

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import fax_bridge as fb  # noqa: E402

# its sibling fleet_sizes, however this file is loaded (as a script, or by path in tests)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fleet_sizes import peak_rss_mb  # noqa: E402  (benchmarks/)

logging.getLogger("absl").setLevel(logging.ERROR)  # DrJAX's notes that no mesh is set

KINDS = ("sum", "mean", "weighted", "elementwise")
IMPLS = ("fax_bridge", "hand", "drjax")
LR = 0.05
MIN_SAMPLE_S = 0.1  # a faster round is timed over several calls in a row per sample
MAX_CALLS = 1000  # calls in a row per sample, at most

# the models and their sizes (benchmarks/size_models.py)
from size_models import BATCH, BUILDERS, SIZES  # noqa: E402,F401  (benchmarks/)


# --------------------------------------------------------------------------- rounds


def make_local(loss: Callable, kind: str) -> Callable:
    """One client's work: one SGD step; what it returns depends on the aggregation."""

    def local(p, b):
        g = jax.grad(loss)(p, b)
        if kind == "sum":
            return jax.tree.map(lambda gi: -LR * gi, g)
        new = jax.tree.map(lambda a, gi: a - LR * gi, p, g)
        if kind == "mean":
            return new
        if kind == "weighted":
            return new, b["count"]
        return new, jax.tree.map(lambda gi: b["count"] * (1.0 + gi * gi), g)

    return local


def fax_round(local: Callable, kind: str, clients: int) -> Callable:
    @fb.program(clients=clients)
    def round_(p, data):
        out = fb.federated_map_clients(local, (fb.federated_broadcast(p), data))
        if kind == "sum":
            return jax.tree.map(lambda a, s: a + s / clients, p, fb.federated_sum(out))
        if kind == "mean":
            return fb.federated_mean(out)
        return fb.federated_weighted_mean(*out)

    return round_


def hand_round(local: Callable, kind: str, clients: int) -> Callable:
    def round_(p, data):
        out = jax.vmap(local, in_axes=(None, 0))(p, data)
        ones = jnp.ones((clients,), jnp.float32)
        total = lambda v: jnp.tensordot(ones, v, 1)
        if kind == "sum":
            return jax.tree.map(lambda a, d: a + total(d) / clients, p, out)
        if kind == "mean":
            return jax.tree.map(lambda v: total(v) / clients, out)
        new, w = out
        if kind == "weighted":
            return jax.tree.map(lambda v: jnp.tensordot(w, v, 1) / jnp.sum(w), new)
        return jax.tree.map(lambda v, wi: total(wi * v) / total(wi), new, w)

    return round_


def drjax_round(local: Callable, kind: str, clients: int) -> Callable:
    import drjax

    @drjax.program(placements={"clients": clients})
    def round_(p, data):
        out = drjax.map_fn(local, (drjax.broadcast(p), data))
        if kind == "sum":
            return jax.tree.map(lambda a, s: a + s / clients, p, drjax.reduce_sum(out))
        if kind == "mean":
            return drjax.reduce_mean(out)
        new, w = out
        if kind == "weighted":
            w = jax.tree.map(lambda _: w, new)
        return drjax.reduce_weighted_mean(new, w)

    return round_


ROUNDS = {"fax_bridge": fax_round, "hand": hand_round, "drjax": drjax_round}


def param_count(params: Any) -> int:
    return int(sum(np.size(a) for a in jax.tree.leaves(params)))


def max_rel_diff(a: Any, b: Any) -> float:
    """max |a - b| over all leaves, relative to the largest |b|."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    scale = max(float(np.max(np.abs(np.asarray(x)))) for x in lb) or 1.0
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(la, lb)) / scale


def _timed(fn: Callable, *args, calls: int = 1) -> float:
    """Seconds per call over `calls` calls in a row."""
    start = time.perf_counter()
    for _ in range(calls):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) / calls


def _measure(fns: dict[str, Callable], args: tuple, repeats: int, slow: float,
             give_up: float) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """Each function's result (from a warm-up call) and samples of seconds per call,
    taken in turn (the first one rotating; the jit rounds, `IMPLS`, apart from the
    others) so that every function sees the same changes in load: `repeats` samples, 2
    of a round whose second call took over `slow` seconds, and none of one whose first
    call took over `give_up` seconds (that call is then its only sample).
    """
    results, times, samples, calls = {}, {}, {}, {}
    for name, fn in fns.items():
        start = time.perf_counter()
        results[name] = jax.block_until_ready(fn(*args))
        warm = time.perf_counter() - start
        if warm > give_up:
            samples[name], calls[name], times[name] = 0, 1, [warm]
            continue
        # A second call before the samples: the first pays one-off costs (a compile,
        # memory that later rounds write over), and how many calls fill a sample is
        # worked out from the second; a fast round timed over too few calls in a row
        # measures XLA's thread pool waking up rather than the round.
        per_call = _timed(fn, *args)
        calls[name] = min(MAX_CALLS, max(1, int(MIN_SAMPLE_S / per_call)))
        samples[name] = repeats if per_call <= slow else 2
        times[name] = []
    # The jit rounds take turns among themselves, then the exported ones among theirs:
    # in one rotation of all five, fax_bridge's sample came right after the fleet's in
    # four repeats of five, and hand-written's in none.
    groups = [[n for n in fns if n in IMPLS], [n for n in fns if n not in IMPLS]]
    for i in range(repeats):
        for names in groups:
            for name in (names[i % len(names):] + names[:i % len(names)]) if names else ():
                if len(times[name]) < samples[name]:
                    times[name].append(_timed(fns[name], *args, calls=calls[name]))
    return results, times


RECHECK_SAMPLES, RECHECK_SAMPLE_S = 15, 0.3


def _recheck(fns: dict[str, Callable], args: tuple) -> float:
    """fax_bridge's round over the hand-written one timed again, the two alone and in
    turns: the median of `RECHECK_SAMPLES` ratios of samples of at least
    `RECHECK_SAMPLE_S` seconds each, taken one right after the other."""
    per_call = max(_timed(fns["hand"], *args), 1e-6)
    calls = min(10 * MAX_CALLS, max(1, int(RECHECK_SAMPLE_S / per_call)))
    ratios = []
    for i in range(RECHECK_SAMPLES):
        order = ("fax_bridge", "hand") if i % 2 == 0 else ("hand", "fax_bridge")
        got = {name: _timed(fns[name], *args, calls=calls) for name in order}
        ratios.append(got["fax_bridge"] / got["hand"])
    return statistics.median(ratios)


def run_size(model: str, label: str, cfg: tuple, kinds: tuple, clients: int, repeats: int,
             slow: float, paths: tuple, fleet, given_up: dict, give_up: float,
             seed: int = 0, recheck_above: Optional[float] = None) -> list[dict[str, Any]]:
    """Every aggregation kind and implementation at one model size: rows of the table.

    An implementation that took over `give_up` seconds a round for a (model, kind) is not
    run at the larger sizes (`given_up`, updated here). A row whose fax_bridge round came
    out over `recheck_above` times the hand-written one has the two timed again
    (`_recheck`, `fax_over_hand_recheck`).
    """
    init, make_batch, loss = BUILDERS[model](*cfg)
    rng = np.random.default_rng(seed)
    params = jax.tree.map(jnp.asarray, init(rng))
    data = make_batch(rng, clients, BATCH[model])
    data["count"] = rng.integers(1, BATCH[model] + 1, clients).astype(np.float32)
    data = jax.tree.map(jnp.asarray, data)
    rows = []
    for kind in kinds:
        local = make_local(loss, kind)
        skipped = given_up.setdefault((model, kind), set())
        fns = {name: ROUNDS[name](local, kind, clients) for name in IMPLS}
        compiled, compile_s = {}, {}
        for name, fn in fns.items():
            if name not in skipped:
                start = time.perf_counter()
                compiled[name] = jax.jit(fn).lower(params, data).compile()
                compile_s[name] = time.perf_counter() - start
        if any(p not in skipped for p in paths):
            proto = fb.export_tff(fns["fax_bridge"], params, data,
                                  placements=("server", "clients"))
            run_path = {"runtime": lambda p, d: fb.runtime.run_computation(proto, p, d),
                        "fleet": lambda p, d: fleet.run(proto, p, d)}
            compiled.update({p: run_path[p] for p in paths if p not in skipped})
        results, times = _measure(compiled, (params, data), repeats, slow, give_up)
        skipped.update(name for name, t in times.items() if max(t) > give_up)
        fleet_round = None
        if "fleet" in times and fleet.last_report is not None:
            traffic = fleet.last_report.traffic
            fleet_round = {"bytes_up": traffic.bytes_up, "bytes_down": traffic.bytes_down,
                           "shared_up": traffic.shared_up, "shared_down": traffic.shared_down,
                           "payload_up": traffic.payload_up,
                           "device_peak_rss_mb": [round(peak_rss_mb(str(p)), 1)
                                                  for p in fleet.pids]}
        med = {k: (statistics.median(times[k]) if k in times else None)
               for k in IMPLS + paths}
        ratio = lambda a: med[a] / med["hand"] if med[a] and med["hand"] else None
        recheck = None
        if recheck_above and (ratio("fax_bridge") or 0) > recheck_above:
            recheck = _recheck({k: compiled[k] for k in ("fax_bridge", "hand")},
                               (params, data))
        rows.append({
            "model": model, "size": label, "params": param_count(params), "kind": kind,
            "median_s": med, "runs": {k: len(v) for k, v in times.items()},
            "samples_s": {k: [round(t, 6) for t in v] for k, v in times.items()},
            "compile_s": compile_s, "fax_over_hand": ratio("fax_bridge"),
            "fax_over_hand_recheck": recheck,
            "drjax_over_hand": ratio("drjax"),
            "max_rel_diff": {k: max_rel_diff(results[k], results["hand"])
                             for k in results if k != "hand" and "hand" in results},
            "peak_rss_mb": round(peak_rss_mb(), 1), "fleet_round": fleet_round,
        })
        print(format_row(rows[-1], paths), flush=True)
    return rows


# --------------------------------------------------------------------------- report


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}" if s < 10 else f"{s * 1e3:.0f}"


def header(paths: tuple) -> str:
    cols = ["model", "size", "params", "agg", "fax_bridge ms", "hand ms", "drjax ms",
            "fax/hand", "drjax/hand"] + [f"{p} ms" for p in paths]
    cols += [f"{k} vs hand" for k in ("fax_bridge", "drjax") + paths]
    return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)  # a markdown table


def format_row(r: dict[str, Any], paths: tuple) -> str:
    m = r["median_s"]
    ms = lambda k: "-" if k not in m else "not run" if m[k] is None else _ms(m[k])
    ratio = lambda v: "-" if v is None else f"{v:.2f}"
    fax = ratio(r["fax_over_hand"])
    if r.get("fax_over_hand_recheck") is not None:
        fax += f" (again: {r['fax_over_hand_recheck']:.2f})"
    cols = [r["model"], r["size"], f"{r['params']:,}", r["kind"], ms("fax_bridge"), ms("hand"),
            ms("drjax"), fax, ratio(r["drjax_over_hand"])]
    diff = lambda k: "-" if k not in r["max_rel_diff"] else f"{r['max_rel_diff'][k]:.1e}"
    cols += [ms(p) for p in paths] + [diff(k) for k in ("fax_bridge", "drjax") + paths]
    return "| " + " | ".join(cols) + " |"


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in KINDS if any(r["kind"] == k for r in rows)]
    cols = 2 if len(kinds) > 2 else len(kinds)
    rows_n = -(-len(kinds) // cols)
    fig, grid = plt.subplots(rows_n, cols, figsize=(5.5 * cols, 4.4 * rows_n), sharey=True,
                             squeeze=False)
    axes = [list(grid.flat)]
    colors = {"linear": "C0", "mlp": "C1", "cnn": "C2", "lm": "C3"}
    styles = {"fax_bridge": ("-", "o"), "hand": ("--", "s"), "drjax": (":", "^"),
              "runtime": ("-.", "v"), "fleet": ("-.", "D"), "flower": ((0, (1, 3)), "x")}
    for ax, kind in zip(axes[0], kinds):
        for model, color in colors.items():
            sel = sorted((r for r in rows if r["kind"] == kind and r["model"] == model),
                         key=lambda r: r["params"])
            if not sel:
                continue
            for impl, (ls, marker) in styles.items():
                pts = [(r["params"], r["median_s"][impl]) for r in sel
                       if r["median_s"].get(impl)]
                if not pts:
                    continue
                ax.plot([p for p, _ in pts], [t for _, t in pts],
                        ls=ls, marker=marker, color=color, ms=4,
                        label=f"{model} {impl}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"aggregation: {kind}")
        ax.set_xlabel("parameters")
        ax.grid(True, which="both", alpha=0.3)
    for ax in grid[:, 0]:
        ax.set_ylabel("round time (s, median)")
    axes[0][-1].legend(fontsize=6, ncol=2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--max-params", type=float, default=None,
                        help="skip sizes with more parameters than this")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=None, help="samples (5; --quick: 3)")
    parser.add_argument("--slow", type=float, default=1.0,
                        help="seconds: a round whose second call is slower is timed twice")
    parser.add_argument("--give-up", type=float, default=10.0,
                        help="seconds: a round whose first call is slower is timed once, "
                             "and not run at the larger sizes of that model and aggregation")
    parser.add_argument("--recheck-above", type=float, default=1.05,
                        help="time fax_bridge's and the hand-written round again, alone "
                             "and in turns, where their ratio came out above this (0: never)")
    parser.add_argument("--paths", nargs="*", default=[], choices=["runtime", "fleet"],
                        help="also time the exported proto in process and on LocalFleet(2)")
    parser.add_argument("--flower", action="store_true",
                        help="also time Flower's simulation engine on the linear model's "
                             "sizes (needs .venv-flower: benchmarks/peers/setup_venvs.sh "
                             "flower)")
    parser.add_argument("--quick", action="store_true",
                        help="only the smallest size of each model")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--from-json", default=None,
                        help="print the table (and --plot) of a saved run instead of running")
    args = parser.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            result = json.load(f)
        report(result, args.plot)
        return result
    repeats = args.repeats or (3 if args.quick else 5)
    paths = tuple(args.paths)
    load_before = os.getloadavg()
    print(header(paths), flush=True)
    rows: list[dict[str, Any]] = []
    given_up: dict = {}
    with contextlib.ExitStack() as stack:
        fleet = stack.enter_context(fb.LocalFleet(devices=2)) if "fleet" in paths else None
        for model in args.models:
            for label, cfg in SIZES[model][:1] if args.quick else SIZES[model]:
                init = BUILDERS[model](*cfg)[0]
                if (args.max_params
                        and param_count(init(np.random.default_rng(0))) > args.max_params):
                    continue
                rows += run_size(model, label, cfg, tuple(args.kinds), args.clients, repeats,
                                 args.slow, paths, fleet, given_up, args.give_up,
                                 recheck_above=args.recheck_above)
    import drjax

    flower = run_flower(rows, args.clients, repeats) if args.flower else None
    if flower is not None and "skipped" not in flower:
        paths += ("flower",)
    result = {
        "config": {"clients": args.clients, "repeats": repeats, "slow_s": args.slow,
                   "give_up_s": args.give_up, "recheck_above": args.recheck_above,
                   "batch": BATCH, "paths": list(paths),
                   "flower": flower,
                   "jax": jax.__version__, "drjax": drjax.__version__,
                   "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                   "xla_flags": os.environ.get("XLA_FLAGS", ""),
                   "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "rows": rows,
    }
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    report(result, args.plot, table=flower is not None)
    if flower is not None and "skipped" in flower:  # said again under the tables
        print(f"\nNo Flower column: {flower['skipped']}", flush=True)
    return result


def run_flower(rows: list[dict[str, Any]], clients: int, repeats: int) -> dict[str, Any]:
    """Flower's simulation engine at the linear model's sizes (module docstring), its
    median round put beside the linear `weighted` rows (`median_s["flower"]`, with its
    peak memory and bytes in `flower_round`); what ran, or why it could not."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
    from run_peer import PeerFailed, PeerUnavailable, run_flower_sizes

    linear = [r for r in rows if r["model"] == "linear" and r["kind"] == "weighted"]
    if not linear:
        why = ("Flower runs the linear model's weighted round only, and no such row ran "
               "(add --models linear and --kinds weighted)")
        print(f"Flower: skipped ({why})", flush=True)
        return {"skipped": why}
    sizes = sorted({str(r["params"]) for r in linear}, key=int)
    print(f"Flower simulation at {', '.join(sizes)} parameters ...", flush=True)
    try:
        found = run_flower_sizes(sizes, rounds=repeats + 1,
                                 extra_args=["--clients", str(clients)])
    except (PeerUnavailable, PeerFailed) as e:
        print(f"Flower: skipped ({e})", flush=True)
        return {"skipped": str(e)}
    by_params = {int(f["params"]): f for f in found}
    missing = sorted({r["params"] for r in linear} - set(by_params))
    if missing:
        print(f"Flower: no result at {missing} parameters: those rows have no Flower "
              "figure", flush=True)
    for r in linear:
        f = by_params.get(r["params"])
        if f is None:
            continue
        r["median_s"]["flower"] = f["round_s_median"]
        r["flower_round"] = {k: f.get(k) for k in (
            "round_s_all", "peak_rss_mb", "driver_peak_rss_mb", "bytes_moved_per_round",
            "payload_bytes_per_round", "loadavg")}
    return {"sizes": sizes, "rounds": repeats + 1, "missing": missing}


def memory_table(rows: list[dict[str, Any]]) -> None:
    """Bytes and peak memory per process, for the rows the fleet or Flower ran."""
    shown = [r for r in rows if r.get("fleet_round") or r.get("flower_round")]
    if not shown:
        return
    print("\n| model | size | params | agg | this process peak MB | fleet bytes up / param "
          "/ device (of it by shared memory) | fleet bytes down / param / device (by shared "
          "memory) | fleet devices' peak MB "
          "| Flower bytes / round / param | Flower peak MB (all processes) |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
    for r in shown:
        fleet, flower, n = r.get("fleet_round") or {}, r.get("flower_round") or {}, r["params"]
        devices = len(fleet.get("device_peak_rss_mb") or []) or 1
        per = lambda b: "-" if b is None else f"{b / n / devices:.2f}"

        def moved_of(way: str) -> str:  # gRPC bytes and shared-memory bytes together
            wire, shared = fleet.get(f"bytes_{way}"), fleet.get(f"shared_{way}") or 0
            return "-" if wire is None else f"{per(wire + shared)} ({per(shared)})"
        moved = flower.get("bytes_moved_per_round")
        flower_bytes = "-" if moved is None else f"{moved / n:.1f}"
        print(f"| {r['model']} | {r['size']} | {n:,} | {r['kind']} | {r.get('peak_rss_mb', '-')} "
              f"| {moved_of('up')} | {moved_of('down')} "
              f"| {' / '.join(map(str, fleet.get('device_peak_rss_mb') or [])) or '-'} "
              f"| {flower_bytes} "
              f"| {flower.get('peak_rss_mb', '-') if flower else '-'} |")
    print()


def report(result: dict[str, Any], plot_path: str | None = None, table: bool = True) -> None:
    """The table (unless printed already), the load, and the plot of a run's result."""
    cfg = result["config"]
    paths = tuple(cfg["paths"])
    if table:
        print(header(paths))
        for r in result["rows"]:
            print(format_row(r, paths))
    memory_table(result["rows"])
    load = lambda v: ", ".join(f"{x:.2f}" for x in v)
    print(f"load average (1, 5, 15 min): before {load(cfg['loadavg_before'])}, "
          f"after {load(cfg['loadavg_after'])}")
    if plot_path:
        plot(result["rows"], plot_path,
             f"One FedAvg round, {cfg['clients']} clients, jax.jit on a shared "
             f"{cfg['machine']} (load {cfg['loadavg_before'][0]:.0f}-"
             f"{cfg['loadavg_after'][0]:.0f})")


if __name__ == "__main__":
    main()
