"""Rounds on shaped links: the SuperLink and each SuperNode on hosts of their own.

Every host is a Linux network namespace (needs root, `ip netns`, veth and `tc tbf`):
`fxl-hub` holds a bridge at 10.77.0.1/24 and the SuperLink (with the ServerApp and
`flwr run`); each node K is `fxl-nK` at 10.77.0.(10+K), joined to the bridge by a veth
pair whose node end is shaped to the uplink rate and whose hub end to the downlink rate
(`tc tbf` on each end's egress). The deployment is `fax_bridge.flower.deployment.
LocalDeployment` bound to 10.77.0.1 with each SuperNode and its warm worker run in its
node's namespace (`wrap`), TLS on (a CA and a SuperLink certificate for 10.77.0.1,
`security.local_credentials`): the code a multi-host deployment runs. Its ServerApp
and ClientApp processes are Flower's own commands, fresh interpreters
(`fork_apps=False`), for both apps.

Two apps run on it, in turns, `--repeats` times each per link: fax_bridge's (a FedAvg
round `params * 0.5 + x_c`, weighted by each client's count (and the counts' sum as
the round's output), written by
`fax_bridge.flower.app_dir`; with `--rounded`, also the same app with
`rounded-partials=true`) and Flower's own NumPy FedAvg app (`flower_links_app.py`: the
same update in numpy, `flwr.serverapp.strategy.FedAvg`, one message per client). Each
size (`--sizes`, float32 parameters) and cohort (`--per-node` clients on each of
`--nodes` nodes) gets a deployment; each link (`--links UP/DOWN` in Mbit/s) is set with
`tc` between runs. Per run: the rounds' wall times (the first set apart: nodes compile
then), the bytes each node's link carried up and down per round (its veth's counters,
everything Flower and TLS send), and the link floor, `up bytes / up rate + down bytes /
down rate` of the busiest node (a round's bytes: a run's over its rounds, so they hold
the run's share of what it pays once, such as the app's download: kilobytes). Every
run starts from a model of its own (Flower does not send arrays again that it moved
before). Namespaces and processes are removed on every exit
(and stale ones, by the `fxl-` prefix, before starting).

    sudo .venv/bin/python benchmarks/links.py [--sizes 1000000 10000000] \\
        [--links 20/100 100/1000] [--per-node 1 2] [--rounds 3] [--repeats 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import flower_runs  # noqa: E402
from netns import Network, run_in_hub  # noqa: E402

PREFIX = "fxl-"
HUB_IP = "10.77.0.1"  # a Network's hub on its default subnet
SYSTEMS = ("fax_bridge", "flower")


def fax_round(cohort: int):
    import fax_bridge as fb

    def train(p, x):
        return p * 0.5 + x

    @fb.program(clients=cohort)
    def links_round(params, data):
        new = fb.federated_map_clients(train, (fb.federated_broadcast(params), data["x"]))
        return fb.federated_weighted_mean(new, data["w"]), fb.federated_sum(data["w"])

    return links_round


def write_apps(folder: str, size: int, nodes: int, per_node: int, creds) -> tuple:
    """fax_bridge's app with one population per node, and Flower's app; (node configs,
    {system: app dir})."""
    import numpy as np

    from fax_bridge.data import write_population
    from fax_bridge.flower import app_dir, bundle

    cohort = nodes * per_node
    ids = np.arange(cohort)
    example = {"x": ((ids + 1) / 1000).astype(np.float32),
               "w": (ids + 1).astype(np.float32)}
    made = bundle.build_round(fax_round(cohort), np.zeros(size, np.float32), example,
                              placements=("server", "clients"))
    configs = []
    for k in range(nodes):
        path = os.path.join(folder, "pops", f"node-{k}")
        mine = [c for c in range(cohort) if c // per_node == k]
        write_population(path, ({"x": np.float32([(c + 1) / 1000]),
                                 "w": np.float32([c + 1])} for c in mine))
        configs.append({"population": path, "first-client": mine[0]})
    fax = os.path.join(folder, "fax_app")
    app_dir.write_app(made, fax, superlink=f"{HUB_IP}:9093", nodes=configs,
                      root_certificates=creds.ca_cert,
                      config={"min-nodes": nodes, "poll-s": 0.05})
    flower = write_flower_app(os.path.join(folder, "flower_app"), size, nodes, per_node)
    return configs, {"fax_bridge": fax, "flower": flower}


def write_flower_app(flower: str, size: int, nodes: int, per_node: int) -> str:
    """Flower's own FedAvg app of a `size`-parameter vector (`flower_links_app.py`, its
    run config: 3 rounds, `per_node` clients on each of `nodes` SuperNodes) in `flower`."""
    package = os.path.join(flower, "flower_links")
    os.makedirs(package)
    shutil.copy(os.path.join(HERE, "flower_links_app.py"), os.path.join(package, "apps.py"))
    shutil.copy(os.path.join(HERE, "flower_numpy_app.py"), package)
    for name in ("workload.py", "numpy_mlp.py"):
        shutil.copy(os.path.join(HERE, "peers", name), package)
    with open(os.path.join(package, "__init__.py"), "w") as f:
        f.write('"""Flower\'s FedAvg of a vector model."""\n')
    with open(os.path.join(flower, "pyproject.toml"), "w") as f:
        f.write("\n".join([
            "[project]", 'name = "flower-links"', 'version = "1.0.0"',
            'description = "FedAvg of a vector model"', 'license = "Apache-2.0"',
            "dependencies = []", "", "[tool.flwr.app]", 'publisher = "bench"', "",
            "[tool.flwr.app.components]", 'serverapp = "flower_links.apps:server_app"',
            'clientapp = "flower_links.apps:client_app"', "", "[tool.flwr.app.config]",
            "num-rounds = 3", f"size = {size}", f"clients-per-node = {per_node}",
            f"min-nodes = {nodes}", "poll-s = 0.05", "init = 0.0", 'out-dir = ""', ""]))
    return flower


_RUNS = [0]  # runs so far: each starts from a model of its own


def start_model(size: int, init: float):
    """A run's first model, as `flower_links_app.start_model` makes Flower's: `init`
    plus noise seeded by it (Flower sends a chunk it has sent before by reference, so
    a constant model would barely cross the links)."""
    import numpy as np

    rng = np.random.default_rng(int(init * 1024))
    return (rng.standard_normal(size, np.float32) * np.float32(1e-3)
            + np.float32(init)).astype(np.float32)


def run_once(deployment, network: Network, system: str, apps: dict, rounds: int,
             out: str, size: int) -> dict:
    """One `flwr run`: each round's wall time and each node's link bytes a round. Each
    run starts from a model no run had (all `init`, a value of its own): Flower keeps
    the arrays it has moved by their content and does not send them again, so a run
    repeating an earlier one's rounds would cross the links with almost nothing."""
    from fax_bridge.flower.bundle import write_state

    import numpy as np

    _RUNS[0] += 1
    init = _RUNS[0] / 1024
    before = [network.counters(k) for k in range(network.nodes)]
    app = apps["flower" if system == "flower" else "fax_bridge"]
    config = {"num-rounds": rounds, "out-dir": out}
    if system == "flower":
        config["init"] = init
    else:
        config["initial-state"] = write_state([start_model(size, init)],
                                              out + "-initial.npz")
    if system == "fax_bridge_rounded":
        config["rounded-partials"] = True
    run = deployment.run(app, config, timeout_s=1800)
    after = [network.counters(k) for k in range(network.nodes)]
    got = flower_runs.outcome(run, out, "flower" if system == "flower" else system, rounds)
    if system == "flower":
        walls = got["wall_s"]
        reported = None
    else:
        reports = got
        walls = [r["wall_s"] for r in reports]
        reported = {"bytes_up_per_client": reports[-1]["bytes_up_per_client"],
                    "bytes_down_per_client": reports[-1]["bytes_down_per_client"]}
    return {"wall_s": walls, "reported": reported, "rounds": rounds,
            "up_bytes": [(a[0] - b[0]) / rounds for a, b in zip(after, before)],
            "down_bytes": [(a[1] - b[1]) / rounds for a, b in zip(after, before)]}


def summarize(runs: list, up_mbit: float, down_mbit: float) -> dict:
    later = [w for r in runs for w in r["wall_s"][1:]]
    up = max(statistics.median(r["up_bytes"][k] for r in runs)
             for k in range(len(runs[0]["up_bytes"])))
    down = max(statistics.median(r["down_bytes"][k] for r in runs)
               for k in range(len(runs[0]["down_bytes"])))
    floor = up * 8 / (up_mbit * 1e6) + down * 8 / (down_mbit * 1e6)
    median = statistics.median(later) if later else None
    return {"round_s": median, "up_bytes": up, "down_bytes": down, "floor_s": floor,
            "to_floor": median / floor if median else None,
            "first_s": [r["wall_s"][0] for r in runs]}


def inside(args: argparse.Namespace) -> int:
    """The benchmark proper, run in the hub namespace (`main` sets up the network)."""
    sys.path.insert(0, ROOT)
    from fax_bridge.flower.deployment import LocalDeployment
    from fax_bridge.flower.security import local_credentials

    network = Network(args.nodes, args.prefix)  # made by main; only shaped and read here
    links = [tuple(float(x) for x in link.split("/")) for link in args.links]
    systems = list(SYSTEMS) + (["fax_bridge_rounded"] if args.rounded else [])
    results = {"machine": f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f} "
                          "at start", "nodes": args.nodes, "rounds": args.rounds,
               "repeats": args.repeats, "rows": []}
    with tempfile.TemporaryDirectory(prefix="links-") as folder:
        creds = local_credentials(os.path.join(folder, "creds"), hosts=[HUB_IP])
        for size in args.sizes:
            for per_node in args.per_node:
                sub = os.path.join(folder, f"{size}-{per_node}")
                configs, apps = write_apps(sub, size, args.nodes, per_node, creds)
                with LocalDeployment(configs, os.path.join(sub, "flwr"), host=HUB_IP,
                                     wrap=network.wrap, credentials=creds, fork_apps=False,
                                     start_timeout_s=600) as deployment:
                    for up, down in links:
                        for k in range(args.nodes):
                            network.shape(k, up, down)
                        runs: dict = {s: [] for s in systems}
                        for repeat in range(args.repeats):
                            order = systems if repeat % 2 == 0 else systems[::-1]
                            for system in order:
                                out = os.path.join(sub, f"out-{system}-{up}-{repeat}")
                                got = run_once(deployment, network, system, apps,
                                               args.rounds, out, size)
                                got["load_average"] = os.getloadavg()[0]
                                runs[system].append(got)
                                print(f"{size} x{per_node} {up:g}/{down:g} {system} "
                                      f"#{repeat}: rounds "
                                      + ", ".join(f"{w:.2f}" for w in got["wall_s"])
                                      + f" s; a round: up {max(got['up_bytes']) / 1e6:.2f}"
                                      f" MB, down {max(got['down_bytes']) / 1e6:.2f} MB a "
                                      f"node (load {got['load_average']:.1f})", flush=True)
                        for system in systems:
                            row = {"size": size, "per_node": per_node,
                                   "link": f"{up:g}/{down:g}", "system": system,
                                   **summarize(runs[system], up, down),
                                   "runs": runs[system]}
                            results["rows"].append(row)
                        flower = results["rows"][-len(systems) + 1]
                        for row in results["rows"][-len(systems):]:
                            row["to_flower"] = row["round_s"] / flower["round_s"]
    print(results["machine"])
    print(f"{'link':>9s} {'size':>9s} {'cl/node':>7s} {'system':>19s} {'round s':>8s} "
          f"{'up MB':>7s} {'down MB':>8s} {'floor s':>8s} {'/floor':>6s} {'/flower':>7s}")
    for r in results["rows"]:
        print(f"{r['link']:>9s} {r['size']:>9d} {r['per_node']:>7d} {r['system']:>19s} "
              f"{r['round_s']:8.2f} {r['up_bytes'] / 1e6:7.2f} {r['down_bytes'] / 1e6:8.2f} "
              f"{r['floor_s']:8.2f} {r['to_floor']:6.2f} "
              + (f"{r['to_flower']:7.2f}" if "to_flower" in r else ""))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def _idle(network: Network, k: int, quiet_s: float = 2.0, most_s: float = 90.0) -> None:
    """Waits (at most `most_s`) until node `k`'s uplink has carried nothing for
    `quiet_s`: a stale answer still uploading would slow the next scenario."""
    end, last, since = time.monotonic() + most_s, None, time.monotonic()
    while time.monotonic() < end:
        now = network.counters(k)[0]
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.2)


def _reports(out: str) -> list:
    """The fax_bridge app's round reports of a run: round, participants, lost nodes
    (named with the reason), error."""
    path = os.path.join(out, "reports.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [{k: r.get(k) for k in ("round", "participants", "lost_devices", "error",
                                       "wall_s")} for r in map(json.loads, f)]


def fault_runs(args: argparse.Namespace, deployment, network: Network, app: str,
               folder: str) -> list:
    """The faults (module docstring of `faults`), each a run of fax_bridge's app; what
    each run's reports say and whether `flwr run` ended."""
    import threading

    out, deadline = [], args.deadline_s
    # a run's first round waits longer (each node starts its ClientApp processes then)
    base = {"round-deadline-s": deadline, "first-round-timeout-s": 120.0,
            "min-clients": 1}

    def run(name: str, rounds: int, **config) -> dict:
        path = os.path.join(folder, f"fault-{name}-{len(out)}")
        start = time.perf_counter()
        done = deployment.run(app, {**base, "num-rounds": rounds, "out-dir": path, **config},
                              timeout_s=rounds * (deadline + 60) + 240)
        got = {"scenario": name, "returncode": done.returncode,
               "run_s": time.perf_counter() - start, "reports": _reports(path)}
        if done.returncode:
            got["output"] = done.stdout[-1500:]
        out.append(got)
        print(json.dumps(got)[:1500], flush=True)
        return got

    for k in range(network.nodes):
        network.shape(k, 20, 100)
    # A straggler: node 1's uplink at 1 Mbit/s, its answer slower than the deadline
    # (the first round waits for it: it waits 120 s).
    network.shape(1, 1, 100)
    run("straggler-1mbit", 3)
    network.shape(1, 20, 100)
    _idle(network, 1)
    # A cut link: node 1's veth taken down once a quarter of its second round's answer
    # went up, and up again after the deadline.
    answer = args.sizes[0] * 4
    network.shape(1, 2, 100)  # so that its upload lasts longer than the watch's step
    stop = threading.Event()

    def cut() -> None:
        start = network.counters(1)[0]
        end = time.monotonic() + 3 * deadline + 300
        while not stop.is_set() and time.monotonic() < end:
            if network.counters(1)[0] - start > answer + answer // 4:
                network.set_link(1, False)
                print("node 1's link taken down mid-upload", flush=True)
                stop.wait(deadline + 5)
                network.set_link(1, True)
                return
            time.sleep(0.05)

    watch = threading.Thread(target=cut, daemon=True)
    watch.start()
    try:
        run("link-down-mid-upload", 3)
    finally:
        stop.set()
        watch.join(timeout=deadline + 30)
        network.set_link(1, True)
    network.shape(1, 20, 100)
    _idle(network, 1)
    # A SuperLink restart between rounds: a run of 3 rounds, checkpointed; once its first
    # round is reported the SuperLink is ended and started again (the run with it), the
    # nodes reconnect, and the same run again resumes with its second round.
    checkpoint = os.path.join(folder, "checkpoint")
    first = os.path.join(folder, "fault-before-restart")
    config = {**base, "num-rounds": 3, "checkpoint-dir": checkpoint, "out-dir": first}
    result: dict = {}
    running = threading.Thread(target=lambda: result.update(done=deployment.run(
        app, config, timeout_s=3 * (deadline + 60) + 120)), daemon=True)
    running.start()
    end = time.monotonic() + 3 * (deadline + 60) + 120
    while time.monotonic() < end and running.is_alive() and not _reports(first):
        time.sleep(0.2)
    restarted = bool(_reports(first)) and running.is_alive()
    if restarted:
        deployment.restart_superlink()
    running.join(timeout=3 * (deadline + 60) + 150)
    out.append({"scenario": "superlink-restart-after-round-1", "restarted": restarted,
                "returncode": result["done"].returncode if "done" in result else None,
                "reports": _reports(first)})
    print(json.dumps(out[-1])[:1500], flush=True)
    got = run("resumed-after-superlink-restart", 3,
              **{"checkpoint-dir": checkpoint, "wait-nodes-s": 120.0})
    got["resumed_rounds"] = [r["round"] for r in got["reports"]]
    return out


def faults(args: argparse.Namespace) -> int:
    """The faults on shaped links, inside the hub namespace: a straggler behind a
    1 Mbit/s uplink against the round's deadline, a node whose link goes down while it
    uploads its answer, and a SuperLink restart between rounds (a checkpointed run
    resumed). Each round must end as the policy says, its report naming a dropped node
    and why, the next round must run, and no run may outlast its bound."""
    sys.path.insert(0, ROOT)
    from fax_bridge.flower.deployment import LocalDeployment
    from fax_bridge.flower.security import local_credentials

    network = Network(args.nodes, args.prefix)
    with tempfile.TemporaryDirectory(prefix="links-faults-") as folder:
        creds = local_credentials(os.path.join(folder, "creds"), hosts=[HUB_IP])
        configs, apps = write_apps(folder, args.sizes[0], args.nodes, 1, creds)
        with LocalDeployment(configs, os.path.join(folder, "flwr"), host=HUB_IP,
                             wrap=network.wrap, credentials=creds, fork_apps=False,
                             start_timeout_s=600) as deployment:
            found = fault_runs(args, deployment, network, apps["fax_bridge"], folder)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"machine": f"{os.cpu_count()} CPUs", "size": args.sizes[0],
                       "deadline_s": args.deadline_s, "runs": found}, f, indent=1)
    return 0 if all(r["returncode"] == 0 for r in found
                    if r["scenario"] != "superlink-restart-after-round-1") else 1


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    p.add_argument("--links", nargs="+", default=["20/100", "100/1000"],
                   help="UP/DOWN rates in Mbit/s")
    p.add_argument("--per-node", type=int, nargs="+", default=[1, 2],
                   help="cohort clients on each node")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds a run, at least 2: the first is reported apart (first_s), "
                        "the round time is a median over the others")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--rounded", action="store_true",
                   help="also run fax_bridge's app with rounded-partials=true")
    p.add_argument("--json", default=None)
    p.add_argument("--timeout-s", type=float, default=7200)
    p.add_argument("--faults", action="store_true",
                   help="run the faults instead (a cut link, a 1 Mbit/s straggler, a "
                        "SuperLink restart) at the first size")
    p.add_argument("--deadline-s", type=float, default=20.0,
                   help="the faults' round deadline")
    p.add_argument("--prefix", default=PREFIX, help="the namespaces' name prefix")
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    return p


def _exit_on_signal(signum, _frame) -> None:
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.rounds < 2 and not args.faults:
        p.error(f"--rounds {args.rounds}: give at least 2 (the first round is reported "
                "apart; the round time is a median over the rounds after it)")
    signal.signal(signal.SIGTERM, _exit_on_signal)  # so that every exit path cleans up
    if args.inside:
        return faults(args) if args.faults else inside(args)
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        print("links: needs root with `ip` and `tc` (network namespaces); skipped",
              file=sys.stderr)
        return 2
    with Network(args.nodes, args.prefix) as network:
        return run_in_hub(network, __file__, args.timeout_s)


if __name__ == "__main__":
    sys.exit(main())
