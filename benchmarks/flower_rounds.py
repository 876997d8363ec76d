"""Round times of a fax_bridge round on Flower's Deployment Engine, warm and cold nodes.

Writes the quickstart round's Flower app (`fax-bridge flower`), its example clients as
one population per SuperNode, starts a SuperLink and the SuperNodes on loopback
(`fax_bridge.flower.deployment.LocalDeployment`), once with warm workers and once with
ClientApps computing in their own processes, runs `flwr run` and reads each round's
`RoundReport` (wall time from the ServerApp's server prepare to its result, and the
nodes' compute).

    .venv/bin/python benchmarks/flower_rounds.py [--rounds 5] [--nodes 2] [--clients 6]
        [--modes warm cold] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run_mode(warm: bool, rounds: int, nodes: int, clients: int, folder: str) -> dict:
    """One deployment's rounds: {"start_s", "run_s", "rounds": [{wall_s, compute_s}]}."""
    from fax_bridge import cli
    from fax_bridge.flower.deployment import LocalDeployment

    app = os.path.join(folder, "app")
    pops = os.path.join(folder, "pops")
    if cli.main(["flower", os.path.join(ROOT, "examples", "quickstart.py:fedavg_round"),
                 "-o", app, "--clients", str(clients), "--write-population", pops,
                 "--nodes", str(nodes)]) != 0:
        raise SystemExit("fax-bridge flower failed")
    configs = [{"population": os.path.join(pops, f"node-{k}"),
                "first-client": k * clients // nodes} for k in range(nodes)]
    out = os.path.join(folder, "out")
    start = time.perf_counter()
    with LocalDeployment(configs, os.path.join(folder, "flwr"), warm=warm) as deployment:
        started = time.perf_counter() - start
        run = deployment.run(app, {"num-rounds": rounds, "out-dir": out,
                                   "min-nodes": nodes}, timeout_s=1800)
        ran = time.perf_counter() - start - started
    if run.returncode != 0:
        raise SystemExit(f"flwr run failed:\n{run.stdout[-3000:]}")
    with open(os.path.join(out, "reports.jsonl")) as f:
        reports = [json.loads(line) for line in f]
    return {"start_s": started, "run_s": ran,
            "rounds": [{"wall_s": r["wall_s"], "compute_s": r["compute_s"],
                        "participants": len(r["participants"])} for r in reports]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--modes", nargs="+", choices=("warm", "cold"),
                        default=["warm", "cold"])
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    results = {"machine": f"{os.cpu_count()} CPUs, load average "
                          f"{os.getloadavg()[0]:.1f} at start"}
    for mode in args.modes:
        with tempfile.TemporaryDirectory(prefix=f"flower-{mode}-") as folder:
            results[mode] = run_mode(mode == "warm", args.rounds, args.nodes, args.clients,
                                     folder)
    print(results["machine"])
    print(f"{'mode':6s} {'start s':>8s} {'round 0 s':>10s} {'later median s':>15s} "
          f"{'later compute ms':>17s}")
    for mode in args.modes:
        r = results[mode]
        later = r["rounds"][1:]
        median = statistics.median(x["wall_s"] for x in later) if later else float("nan")
        compute = statistics.median(x["compute_s"] for x in later) * 1e3 if later \
            else float("nan")
        print(f"{mode:6s} {r['start_s']:8.1f} {r['rounds'][0]['wall_s']:10.2f} "
              f"{median:15.2f} {compute:17.1f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
