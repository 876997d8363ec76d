"""Where a Flower round of `readme_round.py` spends its time, outside Flower's own transfer.

The app `fax-bridge flower` writes (`readme_round.links_round`, `--size` float32
parameters, two nodes of one client) runs its rounds through the ServerApp's own code
(`flower.server.run_round`: the round engine, `FlowerTransport`, `nodes.exchange`) on a
grid held in this process, whose nodes answer as the app's ClientApp does (`relay`:
the train message's arrays packed into one body, sent over loopback HTTP to a real warm
worker, `python -m fax_bridge.flower.worker`, one a node, started as the README starts
it, and its answer turned into records). What the SuperLink, the SuperNodes and their
ClientApp processes add (moving the messages, the same bytes for both apps) is left
out: each stage is timed as the round runs. Flower's FedAvg app
(`flower_links_app.py`) is timed the same way, its ClientApp's `train` and
`FedAvg.aggregate_train` on the same grid messages. Medians over `--rounds` rounds after
a first one (the workers compile then). Flower starts a ClientApp process for every
message a SuperNode gets; the seconds a fresh interpreter takes to import each app's
ClientApp module (as the app bundles have them) are timed too, `--imports` times each,
and so is what each of those processes does with the app's bundle (FAB) before it runs
the app: flwr 1.42's `install_from_fab` (hash, unzip, check every file's hash; the app is
installed already after the first).

    .venv/bin/python benchmarks/readme_round_split.py [--size 1000000] [--rounds 5]
        [--imports 5]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "peers")]  # flower_links_app imports numpy_mlp

import readme_round  # noqa: E402

TIMES: dict = collections.defaultdict(list)


def timed(name: str, fn):
    """`fn`, adding each call's seconds to TIMES[name]."""

    def wrapper(*args, **kwargs):
        began = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name].append(time.perf_counter() - began)

    return wrapper


class LocalGrid:
    """A grid whose nodes answer in this process: `answer(message)` gives a reply."""

    def __init__(self, node_ids: list, answer):
        self.node_ids, self.answer, self.replies = node_ids, answer, {}

    def get_node_ids(self) -> list:
        return list(self.node_ids)

    def push_messages(self, messages) -> list:
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            ids.append(message.metadata.message_id)
            self.replies[ids[-1]] = self.answer(message)
        return ids

    def pull_messages(self, message_ids) -> list:
        return [self.replies.pop(m) for m in message_ids if m in self.replies]


def fax_node(addresses: dict, token: str, bundle: str):
    """The app ClientApp's `query` and `train` (relay to the node's warm worker), each
    stage timed."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

    from fax_bridge.flower import relay

    def answer(msg):
        address = addresses[msg.metadata.dst_node_id]
        if msg.metadata.message_type == "query":
            share = json.loads(relay.call(address, token, "/share"))
            return Message(RecordDict({relay.METRICS: MetricRecord(share)}), reply_to=msg)
        began = time.perf_counter()
        arrays, header = relay.request_of(msg.content)
        header["bundle"] = bundle
        body = relay.pack(arrays, header)
        packed = time.perf_counter()
        answer_body = relay.call(address, token, "/round", body)
        called = time.perf_counter()
        out, info = relay.unpack(answer_body)
        reply = Message(RecordDict({
            relay.PARTIALS: ArrayRecord({k: Array(v) for k, v in out.items()}),
            relay.LAYOUT: ConfigRecord(info["layout"]),
            relay.METRICS: MetricRecord({"num-clients": [int(c) for c in info["counts"]],
                                         "compute-s": float(info["compute-s"])}),
            relay.SERVED: ConfigRecord({k: str(v) for k, v in info["served"].items()}),
            relay.ROUND: ConfigRecord(header[relay.ROUND])}), reply_to=msg)
        done = time.perf_counter()
        TIMES["node: records to a relay body"].append(packed - began)
        TIMES["node: worker's client part (compute_s)"].append(info["compute-s"])
        TIMES["node: HTTP to the worker and back, bodies read and written there"].append(
            called - packed - info["compute-s"])
        TIMES["node: relay body to records"].append(done - called)
        return reply

    return answer


def fax_rounds(folder: str, nodes: int, size: int, rounds: int, env: dict) -> list:
    """The rounds' wall times; the workers end with it."""
    readme = readme_round.write_app(folder, nodes, size, 0, env)
    _, background, _ = readme_round.readme_commands(readme)
    from fax_bridge.system.private_files import write_file

    token_file = os.path.join(folder, "worker.token")
    token = uuid.uuid4().hex
    write_file(token_file, token)  # owner-only (0600): a worker refuses a readable token
    workers, addresses = [], {}
    try:
        for k, line in enumerate(l for l in background if "supernode" in l):
            words = line.split()
            population = words[words.index("--population") + 1]
            with socket.socket() as probe:  # a free port on loopback
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            address = f"127.0.0.1:{port}"
            workers.append(subprocess.Popen(
                [sys.executable, "-m", "fax_bridge.flower.worker", "--listen", address,
                 "--token-file", token_file, "--population", population,
                 "--first-client", words[words.index("--first-client") + 1]],
                env=env, start_new_session=True, stdout=subprocess.DEVNULL))
            addresses[1000 + k] = address
            readme_round._wait_port(port, 120, workers)
        return run_fax(folder, addresses, token, rounds)
    finally:
        for proc in workers:
            readme_round._end(proc)


def run_fax(folder: str, addresses: dict, token: str, rounds: int) -> list:
    from fax_bridge.flower import nodes as flower_nodes
    from fax_bridge.flower import records, server, transport
    from fax_bridge.flower.bundle import read_round
    from fax_bridge.rounds import engine, server_steps

    bundle = os.path.join(folder, "app", "fax_round")
    server_steps.prepare = timed("server: prepare (broadcast)", server_steps.prepare)
    server_steps.result = timed("server: result", server_steps.result)
    transport.train_messages = timed("server: broadcast to records",
                                     transport.train_messages)
    records.answer_of = timed("server: records to partials", records.answer_of)
    engine.check_answers = timed("server: check the answers", engine.check_answers)
    engine.merge_checked = timed("server: exact sums", engine.merge_checked)
    flower_nodes.exchange = timed("exchange (the nodes' side, all nodes)",
                                  flower_nodes.exchange)
    grid = LocalGrid(sorted(addresses), fax_node(addresses, token, bundle))
    settings = server.Settings.from_run_config({"num-rounds": rounds + 1})
    made = read_round(bundle)
    nodes = flower_nodes.discover(grid, grid.get_node_ids(), 60, 0.05)
    state = made.state_value(made.state)
    cohort = server.cohort_of(settings, nodes)
    walls = []
    for r in range(rounds + 1):
        if r == 1:
            TIMES.clear()
        began = time.perf_counter()
        state = server.run_round(grid, made, nodes, state, r, settings, cohort, [],
                                 first=r == 0)[0]
        walls.append(time.perf_counter() - began)
    return walls


def flower_rounds(nodes: int, size: int, rounds: int) -> list:
    """Flower's FedAvg app's ClientApp `train` and `aggregate_train` on the same grid."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

    import flower_links_app as app

    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(),
                      run_config={})
    strategy = app.CohortFedAvg(list(range(1000, 1000 + nodes)), 1, [],
                                fraction_evaluate=0.0, weighted_by_key="num-examples")
    arrays = ArrayRecord([app.start_model(size, 1.0)])
    walls = []
    for r in range(rounds + 1):
        began = time.perf_counter()
        messages = strategy.configure_train(r + 1, arrays, ConfigRecord({}), None)
        replies = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            node_began = time.perf_counter()
            replies.append(app.train(message, context))
            if r:
                TIMES["flower node: ClientApp train"].append(
                    time.perf_counter() - node_began)
        merged_began = time.perf_counter()
        arrays, _ = strategy.aggregate_train(r + 1, replies)
        if r:
            TIMES["flower server: aggregate_train"].append(time.perf_counter() - merged_began)
        walls.append(time.perf_counter() - began)
    return walls


def import_seconds(folder: str, module: str, attribute: str, env: dict,
                   times: int) -> list:
    """Seconds a fresh interpreter takes to import `module` from `folder` and read its
    `attribute` (a ClientApp process's start), `times` times."""
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); t = time.perf_counter(); "
            "import importlib; getattr(importlib.import_module(sys.argv[2]), sys.argv[3]); "
            "print(time.perf_counter() - t)")
    return [float(subprocess.run([sys.executable, "-c", code, folder, module, attribute],
                                 env=env, capture_output=True, text=True, timeout=300,
                                 check=True).stdout.split()[-1]) for _ in range(times)]


def install_seconds(app: str, env: dict, times: int) -> tuple:
    """(the app's FAB bytes, seconds a fresh interpreter's `install_from_fab` of them
    takes, `times` times, the first installing it)."""
    from pathlib import Path

    from flwr.cli.build import build_fab_from_disk

    fab = os.path.join(os.path.dirname(app), os.path.basename(app) + ".fab")
    with open(fab, "wb") as f:
        f.write(build_fab_from_disk(Path(app)))
    code = ("import sys, time; from pathlib import Path; "
            "from flwr.cli.install import install_from_fab; "
            "content = Path(sys.argv[1]).read_bytes(); t = time.perf_counter(); "
            "install_from_fab(content, skip_prompt=True); print(time.perf_counter() - t)")
    seconds = [float(subprocess.run([sys.executable, "-c", code, fab], env=env,
                                    capture_output=True, text=True, timeout=300,
                                    check=True).stdout.split()[-1]) for _ in range(times)]
    return os.path.getsize(fab), seconds


def imports(folder: str, size: int, nodes: int, env: dict, times: int) -> dict:
    """{app: (seconds to import its ClientApp module, FAB bytes, seconds to install
    the FAB), each time}."""
    import links

    flower = links.write_flower_app(os.path.join(folder, "flower_app"), size, nodes, 1)
    fax = os.path.join(folder, "app")
    return {"fax_bridge": (import_seconds(fax, "fax_round.client_app", "app", env, times),
                           *install_seconds(fax, env, times)),
            "flower": (import_seconds(flower, "flower_links.apps", "client_app", env, times),
                       *install_seconds(flower, env, times))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=1_000_000)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--imports", type=int, default=5)
    args = p.parse_args()
    if args.rounds < 1 or args.imports < 2:
        p.error("--rounds must be at least 1 (the first round is set apart) and --imports "
                "at least 2 (the first install is set apart)")
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1  # a ServerApp's
    signal.signal(signal.SIGTERM, lambda s, f: (_ for _ in ()).throw(SystemExit(128 + s)))
    folder = tempfile.mkdtemp(prefix="readme-split-")
    env = {**os.environ, "HOME": os.path.join(folder, "home"),
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    os.makedirs(env["HOME"])
    load = os.getloadavg()[0]
    try:
        walls = fax_rounds(folder, args.nodes, args.size, args.rounds, env)
        fax_times = dict(TIMES)
        TIMES.clear()
        flower_walls = flower_rounds(args.nodes, args.size, args.rounds)
        started = imports(folder, args.size, args.nodes, env, args.imports)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"load average {load:.1f} to {os.getloadavg()[0]:.1f}")
    print(f"fax_bridge round (after the first): {statistics.median(walls[1:]):.3f} s "
          f"(first {walls[0]:.2f} s)")
    per_round = len(walls) - 1
    for name, values in list(fax_times.items()) + list(TIMES.items()):
        print(f"  {name}: {sum(values) / per_round:.3f} s a round "
              f"({len(values) // per_round} a round)")
    print(f"flower round (after the first): {statistics.median(flower_walls[1:]):.3f} s")
    for app, (seconds, fab_bytes, installs) in started.items():
        print(f"{app}: ClientApp module import in a fresh interpreter, median "
              f"{statistics.median(seconds):.3f} s ({', '.join(f'{s:.2f}' for s in seconds)})")
        print(f"{app}: FAB of {fab_bytes} bytes, install_from_fab median after the first "
              f"{statistics.median(installs[1:]):.3f} s "
              f"({', '.join(f'{s:.3f}' for s in installs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
