"""A round typed from the app README `fax-bridge flower` writes, timed beside Flower's own app.

What a user does, step by step: `fax-bridge flower THIS_FILE:links_round -o app
--clients K --write-population pops --nodes K` writes the app and its README; the
README's first command block is run as written (its `export`, `flower-superlink ... &`,
one `python -m fax_bridge.flower.supernode ... &` a node, then `flwr run app fax-bridge
--stream`). The round is `links.py`'s (`params * 0.5 + x_c`, weighted by each client's
count; one client a node), of a `--size` float32 vector. Flower's own NumPy FedAvg app
(`flower_links_app.py`, one message a client) runs on the same SuperLink and SuperNodes
with `flwr run` against the same connection; the two apps run in turns, `--repeats`
times each, the order reversed every repeat. Every run starts from a model of its own
(the app is written again with a new seed before each fax_bridge run; Flower's app gets
a new `init`): Flower sends a chunk it has moved before by reference.

Each `flwr run`'s output is kept with the second each line arrived (`timed_output` in
the JSON): where the run's time outside its rounds goes; so is the README commands'
(`background_output`, seconds from the start, as each run's `began_s`): when each
SuperNode took a round's message and sent its reply.
A round's time is what each app measures itself: fax_bridge's `reports.jsonl` (`wall_s`,
the ServerApp's round from its server step to the result) and Flower's `rounds.json`
(from `configure_train` to the aggregated model); the first round of a run is set apart
(each node starts its ClientApp then). `flwr run`'s own wall time is kept too.
The deployment's processes run with HOME in a temporary folder (the SuperLink installs
apps under `~/.flwr`), and end with the command.

    .venv/bin/python benchmarks/readme_round.py [--size 1000000] [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SEED_ENV = "FAX_BRIDGE_README_ROUND_SEED"
SIZE_ENV = "FAX_BRIDGE_README_ROUND_SIZE"


def _train(p, d):
    return p * 0.5 + d["x"][0], d["w"][0]


def links_round(params, data):
    """`links.py`'s round with the example axis a population needs."""
    import fax_bridge as fb

    new, w = fb.federated_map_clients(_train, (fb.federated_broadcast(params), data))
    return fb.federated_weighted_mean(new, w), fb.federated_sum(w)


def example_args(clients: int):
    """The round's example arguments (`fax-bridge flower` finds them): a model of
    `$FAX_BRIDGE_README_ROUND_SIZE` parameters seeded by `$FAX_BRIDGE_README_ROUND_SEED`,
    client c holding x = (c + 1) / 1000 and weight c + 1."""
    size = int(os.environ.get(SIZE_ENV, "1000000"))
    rng = np.random.default_rng(int(os.environ.get(SEED_ENV, "0")))
    ids = np.arange(clients)
    data = {"x": ((ids + 1) / 1000).astype(np.float32)[:, None],
            "w": (ids + 1).astype(np.float32)[:, None]}
    params = (rng.standard_normal(size, np.float32) * np.float32(1e-3)).astype(np.float32)
    return (params, data), ("server", "clients")


def readme_commands(readme: str) -> tuple:
    """The README's first command block: ({exported variable: value}, [background
    commands], the `flwr run` command), continuation lines joined."""
    from fax_bridge.flower.app_dir import command_blocks

    block = command_blocks(readme)[0]
    lines = block.replace("\\\n", " ").splitlines()
    env, background, run = {}, [], None
    for line in (" ".join(l.split()) for l in lines if l.strip()):
        if line.startswith("export "):
            key, value = line[len("export "):].split("=", 1)
            env[key] = value
        elif line.endswith("&"):
            background.append(line[:-1].strip())
        elif "flwr run" in line:
            run = line
    if run is None or not background:
        raise SystemExit(f"no SuperLink, SuperNode and `flwr run` commands in:\n{block}")
    return env, background, run


def _wait_port(port: int, timeout_s: float, procs: list) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for proc in procs:
            if proc.poll() is not None:
                raise SystemExit(f"a README command exited with code {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.3)
    raise SystemExit(f"nothing listened on 127.0.0.1:{port} within {timeout_s}s")


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass


def _timed_run(command: str, env: dict, log: str) -> subprocess.CompletedProcess:
    """Runs `command` (a `flwr run ... --stream`), writing each line of its output to
    `log` after the seconds since the start at which it arrived (where a run's time
    goes); its output and exit status."""
    began = time.perf_counter()
    proc = subprocess.Popen(["bash", "-c", command], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    try:
        with open(log, "w") as f:
            for line in proc.stdout:
                lines.append(line)
                f.write(f"{time.perf_counter() - began:8.2f} {line}")
        proc.wait(timeout=1800)
    finally:
        _end(proc)
    return subprocess.CompletedProcess(command, proc.returncode, "".join(lines))


def _keep_lines(stream, lines: list, start: float) -> None:
    """Appends each line of `stream` to `lines` after the seconds since `start` at
    which it arrived (a SuperNode's "Receiving" and "Sending" lines: when it took a
    round's message and when it sent the reply)."""
    for line in stream:
        lines.append(f"{time.perf_counter() - start:8.2f} {line.rstrip()}")


def write_app(folder: str, nodes: int, size: int, seed: int, env: dict) -> str:
    """`fax-bridge flower` as the user types it; the README's text. Each seed writes
    the (same) populations to a folder of its own: the running SuperNodes hold the
    first ones open, and a store refuses a file replaced under it."""
    command = ["fax-bridge", "flower", f"{os.path.abspath(__file__)}:links_round", "-o",
               os.path.join(folder, "app"), "--clients", str(nodes), "--write-population",
               os.path.join(folder, f"pops-{seed}"), "--nodes", str(nodes)]
    done = subprocess.run(command, env={**env, SEED_ENV: str(seed), SIZE_ENV: str(size)},
                          capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    with open(os.path.join(folder, "app", "README.md")) as f:
        return f.read()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=1_000_000)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    sys.path.insert(0, HERE)
    import links

    signal.signal(signal.SIGTERM, lambda s, f: (_ for _ in ()).throw(SystemExit(128 + s)))
    folder = tempfile.mkdtemp(prefix="readme-round-")
    env = {**os.environ, "HOME": os.path.join(folder, "home"),
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    os.makedirs(env["HOME"])
    start = time.perf_counter()
    readme = write_app(folder, args.nodes, args.size, 0, env)
    exported, background, run = readme_commands(readme)
    env.update(exported)
    flower = links.write_flower_app(os.path.join(folder, "flower_app"), args.size,
                                    args.nodes, 1)
    flower_run = run.replace(os.path.join(folder, "app") + " ", flower + " ", 1)
    procs, results = [], {"load_average_start": os.getloadavg()[0], "runs": [],
                          "background": background, "background_output": []}
    try:
        for k, command in enumerate(background):
            procs.append(subprocess.Popen(["bash", "-c", command], env=env,
                                          start_new_session=True, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
            results["background_output"].append([])
            threading.Thread(target=_keep_lines, daemon=True, args=(
                procs[-1].stdout, results["background_output"][k], start)).start()
            if command.startswith("flower-superlink"):
                port = int(re.search(r"--port (\d+)", command).group(1))
                _wait_port(port, 120, procs)
        print(f"README commands started ({time.perf_counter() - start:.1f}s from "
              "`fax-bridge flower`)", flush=True)
        for repeat in range(args.repeats):
            order = ("fax_bridge", "flower") if repeat % 2 == 0 else ("flower", "fax_bridge")
            for system in order:
                out = os.path.join(folder, f"out-{system}-{repeat}")
                if system == "fax_bridge":
                    write_app(folder, args.nodes, args.size, repeat + 1, env)
                    command = run  # as written; it writes app/results
                    results_dir = os.path.join(folder, "app", "results")
                    shutil.rmtree(results_dir, ignore_errors=True)
                else:
                    command = (flower_run + " --run-config "
                               + shlex.quote(f'init={repeat + 1}.0 out-dir="{out}"'))
                began = time.perf_counter()
                got_began = began - start
                log = os.path.join(folder, f"{system}-{repeat}.log")
                done = _timed_run(command, env, log)
                run_s = time.perf_counter() - began
                if system == "fax_bridge":
                    with open(os.path.join(results_dir, "reports.jsonl")) as f:
                        reports = [json.loads(line) for line in f]
                    if any(r.get("error") for r in reports):
                        raise SystemExit(f"a round failed: {reports}")
                    walls = [r["wall_s"] for r in reports]
                    compute = [r.get("compute_s") for r in reports]
                    os.rename(results_dir, out)
                else:
                    with open(os.path.join(out, "rounds.json")) as f:
                        walls, compute = json.load(f)["wall_s"], None
                if done.returncode or len(walls) < 2:
                    raise SystemExit(f"{system}: {command} failed:\n{done.stdout[-3000:]}")
                got = {"system": system, "repeat": repeat, "began_s": got_began,
                       "wall_s": walls,
                       "compute_s": compute, "flwr_run_s": run_s,
                       "load_average": os.getloadavg()[0]}
                print(json.dumps(got), flush=True)
                with open(log) as f:
                    got["timed_output"] = f.read().splitlines()
                results["runs"].append(got)
    finally:
        for proc in reversed(procs):
            _end(proc)
        shutil.rmtree(folder, ignore_errors=True)
    rows = {}
    for system in ("fax_bridge", "flower"):
        mine = [r for r in results["runs"] if r["system"] == system]
        rows[system] = {"round_s": statistics.median(w for r in mine for w in r["wall_s"][1:]),
                        "first_s": [r["wall_s"][0] for r in mine],
                        "flwr_run_s": statistics.median(r["flwr_run_s"] for r in mine),
                        "load": [r["load_average"] for r in mine]}
    rows["ratio"] = rows["fax_bridge"]["round_s"] / rows["flower"]["round_s"]
    rows["flwr_run_ratio"] = rows["fax_bridge"]["flwr_run_s"] / rows["flower"]["flwr_run_s"]
    results["summary"] = rows
    print(json.dumps(rows, indent=1))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
