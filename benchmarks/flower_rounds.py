"""FedAvg rounds on Flower's Deployment Engine: fax_bridge's Flower app beside Flower's own.

The workload is the peers' (`peers/workload.py`): a 64-64-10 MLP from
`peers/init_params.npz`, the digits split over 100 clients, a cohort of 10 a round, each
client 5 SGD steps of 16 examples at lr 0.1, the server averaging by example counts.
One loopback deployment (`fax_bridge.flower.deployment.LocalDeployment`: a SuperLink
and 2 SuperNodes, each with a warm fax_bridge worker, SuperExec task poll 0.05 s) runs,
in turn, `--repeats` times each:

* `fax_bridge`: the round written in fax_bridge (`jax_mlp.local_train` under
  `federated_map_clients`, `federated_weighted_mean`), its Flower app
  (`fax_bridge.flower.app_dir`), each SuperNode serving 50 clients from its own
  population, `cohort-size=10` (the ServerApp's `RoundPolicy`), the ServerApp pulling
  every 0.05 s. Per round: the `RoundReport`'s wall time (server prepare to result).
* `flower`: Flower's own NumPy FedAvg app (`flower_numpy_app.py`, copied with
  `workload.py` and `numpy_mlp.py` into an app this script writes):
  `flwr.serverapp.strategy.FedAvg` as it comes, one message per cohort client, replies
  pulled by `Grid.send_and_receive` (every 3 s).
* `flower_matched`: the same app sent as fax_bridge's is: one message per SuperNode
  naming its cohort clients, replies pulled every 0.05 s.
  Per round (both): `configure_train` to the aggregated model, in the ServerApp.

The ServerApp and ClientApp processes are forked from a server per host that has Flower
loaded (`fax_bridge.flower.forked_apps`, the deployment's default); with
`--fresh-apps` each is Flower's own command, a fresh interpreter. With `--cold` the
SuperNodes have no warm worker: each ClientApp computes the round itself (`client`),
compiling its client part every round.

Every round of every repeat is kept; the first of a run is set apart (nodes start,
the warm workers compile). Then, for scale, the same workload on a `LocalFleet` of 2
devices (`peers/fax_bridge_peer.py --mode fleet`). Results go to `--json`.

    .venv/bin/python benchmarks/flower_rounds.py [--rounds 6] [--repeats 2] [--json OUT]
        [--systems fax_bridge flower flower_matched fleet] [--fresh-apps] [--cold]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PEERS = os.path.join(HERE, "peers")
NODES = 2
FLOWER_PACKAGE = "flower_fedavg"
SYSTEMS = ("fax_bridge", "flower", "flower_matched", "fleet")
COMPILING_S = 0.5  # nodes' compute in a round above this: a worker compiled
sys.path.insert(0, HERE)

import flower_runs  # noqa: E402  (benchmarks/)


def fax_round(cohort: int):
    """The workload's round as a fax_bridge program `(params, {"xb", "yb", "counts"})
    -> (params, loss)`."""
    import fax_bridge as fb
    from jax_mlp import local_train

    @fb.program(clients=cohort)
    def fedavg_round(params, data):
        at_clients = fb.federated_broadcast(params)
        new_params, losses = fb.federated_map_clients(
            local_train, (at_clients, data["xb"], data["yb"]))
        return (fb.federated_weighted_mean(new_params, data["counts"]),
                fb.federated_weighted_mean(losses, data["counts"]))

    return fedavg_round


def write_fax_app(folder: str, data, init: dict, seed: int) -> list:
    """fax_bridge's app and one population per SuperNode; the nodes' configs."""
    import numpy as np

    import workload
    from fax_bridge.data import write_population
    from fax_bridge.flower import app_dir, bundle

    cohort = workload.COHORT
    ids = workload.cohort(seed, 0)
    example = {"xb": data.x[ids], "yb": data.y[ids], "counts": data.counts[ids]}
    made = bundle.build_round(fax_round(cohort), {k: np.asarray(v) for k, v in init.items()},
                              example, placements=("server", "clients"))
    configs = []
    per_node = workload.NUM_CLIENTS // NODES
    for k in range(NODES):
        block = range(k * per_node, (k + 1) * per_node if k < NODES - 1
                      else workload.NUM_CLIENTS)
        path = os.path.join(folder, "pops", f"node-{k}")
        write_population(path, ({"xb": data.x[i][None], "yb": data.y[i][None],
                                 "counts": data.counts[i][None]} for i in block))
        configs.append({"population": path, "first-client": block.start})
    app_dir.write_app(made, os.path.join(folder, "fax_app"), config={
        "cohort-size": cohort, "seed": seed, "min-nodes": NODES, "poll-s": 0.05})
    return configs


def write_flower_app(folder: str, data, seed: int) -> str:
    """Flower's own app (module docstring) and the clients' batches as .npy files."""
    import numpy as np

    app = os.path.join(folder, "flower_app")
    package = os.path.join(app, FLOWER_PACKAGE)
    os.makedirs(package)
    shutil.copy(os.path.join(HERE, "flower_numpy_app.py"), os.path.join(package, "apps.py"))
    for name in ("workload.py", "numpy_mlp.py"):
        shutil.copy(os.path.join(PEERS, name), os.path.join(package, name))
    with open(os.path.join(package, "__init__.py"), "w") as f:
        f.write('"""Flower\'s FedAvg of the digits workload."""\n')
    data_dir = os.path.join(folder, "flower_data")
    os.makedirs(data_dir)
    for key in ("x", "y", "counts"):
        np.save(os.path.join(data_dir, f"{key}.npy"), getattr(data, key))
    with open(os.path.join(app, "pyproject.toml"), "w") as f:
        f.write("\n".join([
            "[project]", 'name = "flower-fedavg-digits"', 'version = "1.0.0"',
            'description = "FedAvg of the digits workload"', 'license = "Apache-2.0"',
            "dependencies = []", "", "[tool.flwr.app]", 'publisher = "bench"', "",
            "[tool.flwr.app.components]", f'serverapp = "{FLOWER_PACKAGE}.apps:server_app"',
            f'clientapp = "{FLOWER_PACKAGE}.apps:client_app"', "",
            "[tool.flwr.app.config]", "num-rounds = 3", "per-node = false", "poll-s = 0.0",
            f"seed = {seed}", f"min-nodes = {NODES}",
            f'data-dir = "{data_dir}"', f'init-path = "{os.path.join(PEERS, "init_params.npz")}"',
            'out-dir = ""', ""]))
    return app


def run_system(deployment, system: str, apps: dict, rounds: int, out: str) -> dict:
    """One `flwr run` of `rounds` rounds: {"run_s", "wall_s": [...], ...}."""
    start = time.perf_counter()
    if system == "fax_bridge":
        run = deployment.run(apps["fax_bridge"], {"num-rounds": rounds, "out-dir": out},
                             timeout_s=1200)
    else:
        run = deployment.run(apps["flower"], {
            "num-rounds": rounds, "out-dir": out, "per-node": system == "flower_matched",
            "poll-s": 0.05 if system == "flower_matched" else 0.0}, timeout_s=1200)
    took = time.perf_counter() - start
    if system == "fax_bridge":
        reports = flower_runs.outcome(run, out, system, rounds)
        return {"run_s": took, "wall_s": [r["wall_s"] for r in reports],
                "compute_s": [r["compute_s"] for r in reports],
                "participants": [len(r["participants"]) for r in reports]}
    got = flower_runs.outcome(run, out, "flower", rounds)
    return {"run_s": took, "wall_s": got["wall_s"], "loss": got["loss"]}


def run_fleet(rounds: int, seed: int) -> dict:
    """The same workload on a LocalFleet of 2 devices (`peers/fax_bridge_peer.py`)."""
    with tempfile.TemporaryDirectory(prefix="fleet-") as folder:
        path = os.path.join(folder, "fleet.json")
        subprocess.run([sys.executable, os.path.join(PEERS, "fax_bridge_peer.py"), "--mode",
                        "fleet", "--devices", str(NODES), "--rounds", str(rounds),
                        "--seed", str(seed), "--json", path], check=True,
                       stdout=subprocess.DEVNULL)
        with open(path) as f:
            got = json.load(f)
    return {"wall_s": got["round_s_all"], "setup_s": got["setup_s"]}


def summary(runs: list) -> dict:
    """Each run's first round apart; the median and range of the later ones over all
    runs. fax_bridge's later rounds in which a node compiled (compute over
    `COMPILING_S`) are counted apart too: a node runs every round in the bucket of its
    largest share of the cohort (`flower.client.partials_for`), so only a run's first
    round should compile."""
    later, compiling = [], []
    for r in runs:
        computes = r.get("compute_s", [0.0] * len(r["wall_s"]))
        for wall, compute in list(zip(r["wall_s"], computes))[1:]:
            (compiling if compute > COMPILING_S else later).append(wall)
    return {"first_s": [r["wall_s"][0] for r in runs],
            "later_median_s": statistics.median(later) if later else None,
            "later_min_s": min(later) if later else None,
            "later_max_s": max(later) if later else None,
            "later_rounds": len(later), "compiling_rounds_s": compiling}


def add_summary(results: dict) -> None:
    """The summary of every system and the ratios of fax_bridge's later rounds to
    Flower's."""
    results["summary"] = {s: summary(r) for s, r in results["runs"].items()}
    fax = results["summary"].get("fax_bridge", {}).get("later_median_s")
    for key, system in (("ratio_fax_bridge_to_flower", "flower"),
                        ("ratio_fax_bridge_to_flower_matched", "flower_matched")):
        other = results["summary"].get(system, {}).get("later_median_s")
        if fax and other:
            results[key] = fax / other


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--fresh-apps", action="store_true",
                        help="ServerApp and ClientApp processes as Flower's own commands "
                             "(fresh interpreters), not forked")
    parser.add_argument("--cold", action="store_true",
                        help="no warm workers: each ClientApp computes (and compiles)")
    args = parser.parse_args()
    sys.path.insert(0, PEERS)
    import workload
    from fax_bridge.flower.deployment import LocalDeployment

    results: dict = {"machine": f"{os.cpu_count()} CPUs; load average "
                                f"{os.getloadavg()[0]:.1f} at start",
                     "rounds": args.rounds, "repeats": args.repeats,
                     "deployment": f"1 SuperLink, {NODES} SuperNodes on loopback, "
                                   + ("no workers" if args.cold else "warm fax_bridge "
                                      "workers") + ", SuperExec task poll 0.05 s, app "
                                   "processes " + ("fresh" if args.fresh_apps else
                                                   "forked"),
                     "runs": {}}
    deployed = [s for s in args.systems if s != "fleet"]
    with tempfile.TemporaryDirectory(prefix="flower-rounds-") as folder:
        data = workload.client_data(workload.load_split())
        init = workload.load_init_params()
        configs = write_fax_app(folder, data, init, args.seed)
        apps = {"fax_bridge": os.path.join(folder, "fax_app"),
                "flower": write_flower_app(folder, data, args.seed)}
        if deployed:
            start = time.perf_counter()
            with LocalDeployment(configs, os.path.join(folder, "flwr"), poll_s=0.05,
                                 fork_apps=not args.fresh_apps,
                                 warm=not args.cold) as deployment:
                results["start_s"] = time.perf_counter() - start
                for repeat in range(args.repeats):
                    for system in deployed:
                        out = os.path.join(folder, f"out-{system}-{repeat}")
                        got = run_system(deployment, system, apps, args.rounds, out)
                        got["load_average"] = os.getloadavg()[0]
                        results["runs"].setdefault(system, []).append(got)
                        print(f"{system} run {repeat}: rounds "
                              + ", ".join(f"{w:.2f}" for w in got["wall_s"])
                              + f" s (load {got['load_average']:.1f})", flush=True)
    if "fleet" in args.systems:
        for repeat in range(args.repeats):
            got = run_fleet(args.rounds, args.seed)
            got["load_average"] = os.getloadavg()[0]
            results["runs"].setdefault("fleet", []).append(got)
            print("fleet run {}: rounds {} s".format(
                repeat, ", ".join(f"{w:.3f}" for w in got["wall_s"])), flush=True)
    add_summary(results)
    print(results["machine"])
    print(f"{'system':15s} {'first round s':>22s} {'later median s':>15s} "
          f"{'later range s':>16s}  compiling rounds s")
    for system, s in results["summary"].items():
        later = (f"{s['later_median_s']:15.3f} {s['later_min_s']:7.3f}.."
                 f"{s['later_max_s']:.3f}" if s["later_rounds"] else  # every round compiled
                 f"{'-':>15s} {'-':>16s}")
        print(f"{system:15s} {', '.join(f'{x:.2f}' for x in s['first_s']):>22s} {later}  "
              + ", ".join(f"{x:.2f}" for x in s["compiling_rounds_s"]))
    for key in ("ratio_fax_bridge_to_flower", "ratio_fax_bridge_to_flower_matched"):
        if key in results:
            print(f"{key}: {results[key]:.2f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
