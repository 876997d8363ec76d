"""The bound a LiteRT parity check holds each model family to, against what differs.

For each round of `examples/phone_models.py` (a transformer block, a max-pool CNN under
fed_adam, an average-pool CNN, a GRU and an LSTM next-word model, an MLP) under each
`--algorithm` (default: the family's own; `phone_models.ALGORITHMS`: fed_sgd,
streaming_diloco's first round, dp_fed_avg, ...) at `--clients` clients, this runs the
round with jit and in process with the client runtime (`--runtime`, LiteRT by default:
the client part in the LiteRT interpreter, exact sums), `--rounds` times from the state
jit reached (as `check_parity` checks one call), and prints a row per family and
algorithm over the rounds' float outputs:

  max_diff        the largest |runtime - jit|
  max_allowed     the largest difference the check allows (twice the bound,
                  `parity.rounding.evaluation_bounds`)
  diff/allowed    the largest share of its own allowance an element used
  bound/limit     the largest per-leaf bound over 1e-4 x the leaf's largest |value| plus
                  its float32 spacing (at most 1 is the target; leaves of zeros, such as
                  the outer state of a fragment not yet synced, are left out: their
                  bound is the floor, 2 ulps of zero, against a limit of one)
  first_order     with --first-order: the largest bound of the first-order analysis
                  alone (`parity.first_order`), twice it as above
  bound_s         seconds to make the bounds (the float64 shadow; with the first-order
                  analysis for loop-free rounds)
  method          what gave the leaves' bounds (`LeafParity.bound_method`'s first words)
  worst           the output leaf (and round) of the largest diff/allowed and of the
                  largest bound/limit

A combination that cannot run prints its error in place of the figures.

    python benchmarks/parity_bounds.py [--models transformer,cnn,gru] [--clients 3]
        [--algorithm fed_sgd,streaming_diloco,dp_fed_avg] [--rounds 1]
        [--runtime litert|xla] [--first-order] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import phone_models  # noqa: E402

import fax_bridge as fb  # noqa: E402
from fax_bridge.parity import first_order as parity_first_order  # noqa: E402
from fax_bridge.parity import rounding as parity_rounding  # noqa: E402
from fax_bridge.language import tracing  # noqa: E402
from fax_bridge.runtime import run_computation  # noqa: E402


def _limit(values) -> float:
    top = np.float32(np.max(np.abs(np.asarray(values, np.float64)), initial=0.0))
    return 1e-4 * float(top) + float(np.spacing(top))


def measure(name: str, clients: int, rounds: int, runtime: str,
            first_order: bool, algorithm: str | None = None) -> dict:
    """One row: family `name` under `algorithm` (None: its own), `rounds` rounds."""
    prog, args, placements = phone_models.make_round(name, clients, algorithm)
    row = {"model": name, "algorithm": algorithm or phone_models.own_algorithm(name),
           "clients": clients, "rounds": rounds, "runtime": runtime,
           "max_diff": 0.0, "max_allowed": 0.0, "diff/allowed": 0.0, "bound/limit": 0.0,
           "first_order": 0.0 if first_order else None, "bound_s": 0.0, "methods": [],
           "worst_diff": None, "worst_bound": None}
    jitted = jax.jit(prog)
    for r in range(rounds):
        local = jitted(*args)
        paths, _ = jax.tree_util.tree_flatten_with_path(local)
        want = [np.asarray(x) for _, x in paths]
        proto = fb.export_tff(prog, *args, placements=placements)
        got = [np.asarray(x) for x in jax.tree_util.tree_leaves(
            run_computation(proto, *args, client_runtime=runtime))]
        comp = tracing.trace(prog, *args, placements=placements)
        methods: list = []
        start = time.perf_counter()
        bounds = parity_rounding.evaluation_bounds(comp, args, methods, float32=want)
        row["bound_s"] += time.perf_counter() - start
        first = parity_first_order.first_order_bounds(comp, args) if first_order else None
        for i, (w, g, b, m) in enumerate(zip(want, got, bounds, methods)):
            if not np.issubdtype(w.dtype, np.floating) or w.size == 0:
                continue
            leaf = f"round {r + 1} {jax.tree_util.keystr(paths[i][0])}"
            diff = np.abs(w.astype(np.float64) - g.astype(np.float64))
            allowed = 2.0 * np.asarray(b, np.float64)
            row["max_diff"] = max(row["max_diff"], float(diff.max()))
            row["max_allowed"] = max(row["max_allowed"], float(allowed.max()))
            with np.errstate(divide="ignore", invalid="ignore"):
                share = np.where(diff == 0, 0.0, diff / allowed)
            if float(share.max()) > row["diff/allowed"]:
                row["worst_diff"] = leaf
            row["diff/allowed"] = max(row["diff/allowed"], float(share.max()))
            # a leaf of zeros has the floor, 2 ulps of zero, against 1: nothing to weigh
            ratio = float(np.max(b)) / _limit(w) if np.any(w) else 0.0
            if ratio > row["bound/limit"]:
                row["worst_bound"] = leaf
            row["bound/limit"] = max(row["bound/limit"], ratio)
            if first is not None:
                row["first_order"] = max(row["first_order"], 2.0 * float(np.max(first[i])))
            base = m.split(";")[0].split(" (")[0]
            if base not in row["methods"]:
                row["methods"].append(base)
        args = (local[0],) + tuple(args[1:])  # the next round from jit's state
    return row


def _line(row: dict) -> str:
    head = f"| {row['model']} | {row['algorithm']} | {row['clients']} | {row['rounds']} |"
    if "error" in row:
        return f"{head} cannot run: {row['error']} |||||||"
    first = "-" if row["first_order"] is None else f"{row['first_order']:.2e}"
    return (f"{head} {row['max_diff']:.2e} | {row['max_allowed']:.2e} | "
            f"{row['diff/allowed']:.3f} | {row['bound/limit']:.3f} | {first} | "
            f"{row['bound_s']:.1f} | {', '.join(row['methods'])} | "
            f"{row['worst_diff'] or '-'}; {row['worst_bound'] or '-'} |")


def _names(p: argparse.ArgumentParser, flag: str, given: str, known: tuple) -> list:
    names = [n for n in given.split(",") if n]
    unknown = sorted(set(names) - set(known))
    if unknown or not names:
        p.error(f"{flag} {unknown or given!r}: give a comma-separated list of "
                f"{', '.join(known)}")
    return names


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(phone_models.ROUNDS),
                   help=f"comma-separated, of {', '.join(phone_models.ROUNDS)}")
    p.add_argument("--algorithm", default=None,
                   help="comma-separated, of " + ", ".join(phone_models.ALGORITHMS)
                   + " (default: each family's own)")
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--runtime", choices=("litert", "xla"), default="litert")
    p.add_argument("--first-order", action="store_true",
                   help="also the first-order analysis's bound (slow through loops)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    names = _names(p, "--models", args.models, phone_models.ROUNDS)
    algorithms = ([None] if args.algorithm is None else
                  _names(p, "--algorithm", args.algorithm, phone_models.ALGORITHMS))
    if args.clients < 1 or args.rounds < 1:
        p.error("--clients and --rounds are at least 1")
    rows = []
    print("| model | algorithm | clients | rounds | max diff | max allowed | diff/allowed | "
          "bound/limit | first-order | bound s | method | worst (diff; bound) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        for algorithm in algorithms:
            try:
                row = measure(name, args.clients, args.rounds, args.runtime,
                              args.first_order, algorithm)
            except Exception as e:  # noqa: BLE001 - a row says why it cannot run
                why = (str(e).splitlines() or [""])[0][:300]
                row = {"model": name, "algorithm": algorithm or
                       phone_models.own_algorithm(name), "clients": args.clients,
                       "rounds": args.rounds, "runtime": args.runtime,
                       "error": f"{type(e).__name__}: {why}"}
            rows.append(row)
            print(_line(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
