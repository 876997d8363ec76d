"""One FedAvg round of a linear model at several model sizes on Flower's simulation engine
(runs in .venv-flower; numpy, flwr and Ray only).

The workload, for each size of ``d * d`` parameters (``d = round(sqrt(size))``):
``w: [d, d]`` float32, 10 clients (``--clients``), each holding 8 examples
(``--examples``) ``x: [8, d]``, ``y: [8, d]`` float32, doing one SGD step (lr 0.1) of
``mean((x @ w - y) ** 2)``; the server takes the mean of the clients' new weights
weighted by their example counts (all equal, so the plain mean). The data are drawn as
``benchmarks/fleet_sizes.py`` draws them: one ``np.random.default_rng(seed)`` gives
``w = normal(d, d) / sqrt(d)``, then ``x = normal(clients, examples, d)``, then ``y``
likewise; client ``i`` holds row ``i``. Round 1 therefore computes the round that
script times, and ``round1_sum`` can be compared with its results.

One ``flwr.simulation.run_simulation`` (Ray backend, one virtual SuperNode per client,
one Ray actor per core) serves every size, smallest first: for each, the ServerApp runs
Flower's message-based ``FedAvg`` (``flwr.serverapp.strategy``, every node trained each
round, weighted by the ``num-examples`` each client reports) for ``--rounds`` rounds
from the same initial ``w``. Client ``i`` is the SuperNode of ``partition-id`` ``i``; it
draws its data on first use (inside the first round, the warm-up, which
``round_s_median`` leaves out). Before the first size, one QUERY message to every node
starts Ray's actors and loads the ClientApp in them (``setup_s``: from the start of the
script to the end of that query). A round is timed from the strategy's
``configure_train`` to its ``evaluate_fn`` (called once the round's aggregate exists).

Printed per size, as soon as it is done, one JSON line: ``round_s_median`` (rounds after
the warm-up), ``round_s_all``, ``peak_rss_mb`` (the largest sampled sum of RSS over this
process and its descendants, Ray's daemons and actors included, sampled every 0.1 s
while that size ran; sizes run in increasing order, so the smaller sizes do not raise a
larger one's figure), ``driver_peak_rss_mb`` (this process alone), ``bytes_moved_per_round``
(the bytes of the model ArrayRecords sent to and received from the clients, as Flower
counts them) beside ``payload_bytes_per_round`` (4 bytes per parameter per client each
way), ``round1_sum`` and ``final_sum`` (float64 sums of the server weights after round 1
and after the last round), ``final_sha256`` (of the last weights' bytes), and
``max_abs_diff_round1`` / ``max_abs_diff_final``: the largest difference from a plain
numpy float32 computation of the same rounds. The load averages at the start and end of
each size are in ``loadavg``.

    .venv-flower/bin/python benchmarks/peers/flower_sizes.py [--sizes 10k,100k,1M,4M,10M]
        [--rounds 5] [--seed 0] [--json OUT]
"""

from __future__ import annotations

import common  # first: starts the clock and puts the peers' directory on the path

import argparse
import hashlib
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import numpy as np

PEER = "flower-sizes"
CLIENTS, EXAMPLES, LR = 10, 8, 0.1
DEFAULT_SIZES = "10k,100k,1M,4M,10M"

# Filled by the ServerApp thread, read by main() after the simulation returns.
STATE: Dict[str, Any] = {}

# Each Ray actor process's data of the size it last served: (seed, d, clients, examples,
# x, y). Filled only in the actors (the driver computes its reference with ``problem``).
_CLIENT_CACHE: List[Any] = []


def parse_size(text: str) -> int:
    """'100k' -> 100000, '4M' -> 4000000, '2500' -> 2500."""
    text = text.strip()
    scale = {"k": 10**3, "K": 10**3, "M": 10**6, "m": 10**6}.get(text[-1:], 1)
    try:
        value = int(float(text[:-1] if scale != 1 else text) * scale)
    except ValueError:
        raise SystemExit(f"--sizes: {text!r} is not a parameter count (e.g. 10k, 1M, 2500)")
    if value < 1:
        raise SystemExit(f"--sizes: {text!r} must be at least 1 parameter")
    return value


def side(size: int) -> int:
    """``d`` of the ``[d, d]`` model of about ``size`` parameters."""
    return max(1, round(math.sqrt(size)))


def problem(seed: int, d: int, clients: int = CLIENTS,
            examples: int = EXAMPLES) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(initial w [d, d], x [clients, examples, d], y [clients, examples, d]), float32."""
    rng = np.random.default_rng(seed)
    w = (rng.normal(size=(d, d)) / math.sqrt(d)).astype(np.float32)
    x = rng.normal(size=(clients, examples, d)).astype(np.float32)
    y = rng.normal(size=(clients, examples, d)).astype(np.float32)
    return w, x, y


def client_data(seed: int, d: int, clients: int, examples: int,
                client: int) -> Tuple[np.ndarray, np.ndarray]:
    """(x, y) of ``client``, drawn once per (actor) process and size."""
    key = (seed, d, clients, examples)
    if not _CLIENT_CACHE or _CLIENT_CACHE[0] != key:
        _, x, y = problem(seed, d, clients, examples)
        _CLIENT_CACHE[:] = [key, x, y]
    return _CLIENT_CACHE[1][client], _CLIENT_CACHE[2][client]


def sgd_step(w: np.ndarray, x: np.ndarray, y: np.ndarray,
             lr: float = LR) -> Tuple[np.ndarray, float]:
    """(w after one SGD step of mean((x @ w - y) ** 2), the loss before it), float32."""
    residual = x @ w - y
    loss = float(np.mean(residual.astype(np.float64) ** 2))
    grad = (x.T @ residual) * np.float32(2.0 / residual.size)
    return (w - np.float32(lr) * grad).astype(np.float32), loss


def reference(seed: int, d: int, rounds: int, clients: int = CLIENTS,
              examples: int = EXAMPLES) -> List[np.ndarray]:
    """The server weights after each of ``rounds`` rounds, in plain numpy."""
    w, x, y = problem(seed, d, clients, examples)
    out = []
    for _ in range(rounds):
        w = np.mean(np.stack([sgd_step(w, x[i], y[i])[0] for i in range(clients)]),
                    axis=0, dtype=np.float64).astype(np.float32)
        out.append(w)
    return out


def build_apps(sizes: Sequence[int], rounds: int, seed: int, clients: int,
               examples: int) -> Any:
    """(ServerApp, ClientApp): the ServerApp runs ``rounds`` FedAvg rounds per size."""
    from flwr.app import (ArrayRecord, ConfigRecord, Context, Message, MessageType,
                          MetricRecord, RecordDict)
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg

    client_app = ClientApp()

    @client_app.query()
    def query(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        return Message(RecordDict({"metrics": MetricRecord({"partition-id": pid})}), reply_to=msg)

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        config = msg.content["config"]
        client = int(context.node_config["partition-id"])
        (w,) = msg.content["arrays"].to_numpy_ndarrays()
        x, y = client_data(int(config["seed"]), w.shape[0], int(config["clients"]),
                           int(config["examples"]), client)
        new_w, loss = sgd_step(w, x, y)
        content = RecordDict({
            "arrays": ArrayRecord([new_w]),
            "metrics": MetricRecord({"train_loss": loss, "num-examples": x.shape[0]}),
        })
        return Message(content, reply_to=msg)

    class TimedFedAvg(FedAvg):
        """Flower's FedAvg, noting when each round starts and the model bytes moved."""

        def configure_train(self, server_round: int, arrays: Any, config: Any,
                            grid: Any) -> Any:
            STATE["round_start"].append(time.perf_counter())
            messages = list(super().configure_train(server_round, arrays, config, grid))
            STATE["bytes"] += sum(m.content[self.arrayrecord_key].count_bytes()
                                  for m in messages)
            return messages

        def aggregate_train(self, server_round: int, replies: Any) -> Any:
            replies = list(replies)
            STATE["bytes"] += sum(m.content[self.arrayrecord_key].count_bytes()
                                  for m in replies if not m.has_error())
            STATE["errors"] += sum(1 for m in replies if m.has_error())
            return super().aggregate_train(server_round, replies)

    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        deadline = time.monotonic() + 600
        while len(list(grid.get_node_ids())) < clients:
            if time.monotonic() > deadline:
                raise RuntimeError("not all SuperNodes came up")
            time.sleep(0.1)
        # One query to every node starts the Ray actors and loads the ClientApp in them.
        replies = grid.send_and_receive(
            [Message(RecordDict(), dst_node_id=n, message_type=MessageType.QUERY)
             for n in grid.get_node_ids()],
            timeout=1200,
        )
        partitions = sorted(int(m.content["metrics"]["partition-id"])
                            for m in replies if not m.has_error())
        if partitions != list(range(clients)):
            raise RuntimeError(f"the nodes answered partitions {partitions}, "
                               f"not 0..{clients - 1}")
        STATE["setup_s"] = time.perf_counter() - common.PROCESS_T0
        for size in sizes:
            STATE["results"].append(run_size(grid, size))

    def run_size(grid: Grid, size: int) -> Dict[str, Any]:
        d = side(size)
        w0, _, _ = problem(seed, d, clients, examples)
        STATE.update(round_start=[], round_end=[], kept={}, bytes=0, errors=0)
        load_start = os.getloadavg()
        rss = common.PeakRss().start()
        driver = DriverRss().start()

        def record_round(server_round: int, arrays: Any) -> None:
            if server_round > 0:
                STATE["round_end"].append(time.perf_counter())
                if server_round in (1, rounds):
                    STATE["kept"][server_round] = arrays
            return None

        strategy = TimedFedAvg(fraction_train=1.0, fraction_evaluate=0.0,
                               min_train_nodes=clients, min_available_nodes=clients,
                               weighted_by_key="num-examples")
        result = strategy.start(
            grid, ArrayRecord([w0]), num_rounds=rounds, timeout=1200,
            train_config=ConfigRecord({"seed": seed, "clients": clients,
                                       "examples": examples}),
            evaluate_fn=record_round,
        )
        peak, driver_peak = rss.stop(), driver.stop()
        load_end = os.getloadavg()
        if len(STATE["round_end"]) != rounds or STATE["errors"]:
            raise RuntimeError(f"size {d * d}: {len(STATE['round_end'])} of {rounds} rounds "
                               f"finished, {STATE['errors']} client replies were errors")
        round_s = [e - s for s, e in zip(STATE["round_start"], STATE["round_end"])]
        (w1,) = STATE["kept"][1].to_numpy_ndarrays()
        (w_final,) = STATE["kept"][rounds].to_numpy_ndarrays()
        ref = reference(seed, d, rounds, clients, examples)
        timed = round_s[1:] if len(round_s) > 1 else round_s
        line = {
            "peer": PEER,
            "params": d * d,
            "d": d,
            "clients": clients,
            "examples": examples,
            "rounds": rounds,
            "warmup_rounds": 1 if rounds > 1 else 0,
            "round_s_median": round(statistics.median(timed), 6),
            "round_s_all": [round(t, 6) for t in round_s],
            "peak_rss_mb": peak,
            "driver_peak_rss_mb": driver_peak,
            "bytes_moved_per_round": STATE["bytes"] // rounds,
            "payload_bytes_per_round": 4 * d * d * clients * 2,
            "train_loss_per_round": [
                round(float(result.train_metrics_clientapp[r]["train_loss"]), 6)
                for r in range(1, rounds + 1)
            ],
            "round1_sum": float(np.sum(w1, dtype=np.float64)),
            "final_sum": float(np.sum(w_final, dtype=np.float64)),
            "final_sha256": hashlib.sha256(np.ascontiguousarray(w_final).tobytes()).hexdigest(),
            "max_abs_diff_round1": float(np.max(np.abs(w1 - ref[0]))),
            "max_abs_diff_final": float(np.max(np.abs(w_final - ref[-1]))),
            "reference_final_sum": float(np.sum(ref[-1], dtype=np.float64)),
            "loadavg": {"start": [round(v, 2) for v in load_start],
                        "end": [round(v, 2) for v in load_end]},
            "setup_s": round(STATE["setup_s"], 3),
            **STATE["meta"],
        }
        print(json.dumps(line), flush=True)
        return line

    return server_app, client_app


class DriverRss:
    """Peak RSS of this process alone, sampled every 0.1 s in a daemon thread (MiB)."""

    def __init__(self) -> None:
        import threading

        import psutil

        self._proc = psutil.Process()
        self._peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="driver-rss", daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, self._proc.memory_info().rss)
            self._stop.wait(0.1)

    def start(self) -> "DriverRss":
        self._thread.start()
        return self

    def stop(self) -> float:
        self._stop.set()
        self._thread.join(timeout=2)
        self._peak = max(self._peak, self._proc.memory_info().rss)
        return round(self._peak / 2**20, 1)


def run(sizes: Sequence[int], rounds: int, seed: int, clients: int = CLIENTS,
        examples: int = EXAMPLES, object_store_mb: int = 1024) -> List[Dict[str, Any]]:
    """Runs every size in one simulation; returns the per-size result lines."""
    import flwr
    import ray
    from flwr.simulation import run_simulation

    cpus = max(1, os.cpu_count() or 1)
    meta = {"object_store_mb": object_store_mb, "ray_actors": min(cpus, clients),
            "versions": {"flwr": flwr.__version__, "ray": ray.__version__,
                         "numpy": np.__version__}}
    STATE.update(results=[], setup_s=None, meta=meta)
    sizes = sorted(sizes)
    server_app, client_app = build_apps(sizes, rounds, seed, clients, examples)
    backend_config = {
        "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
        "init_args": {
            "num_cpus": cpus,
            "num_gpus": 0,
            "include_dashboard": False,
            "object_store_memory": object_store_mb * 2**20,
            "log_to_driver": False,
        },
    }
    try:
        run_simulation(server_app=server_app, client_app=client_app,
                       num_supernodes=clients, backend_name="ray",
                       backend_config=backend_config)
    finally:
        # Listed while Ray's daemons still hold them: its workers outlive the raylet
        # for a moment after shutdown and are then no longer our descendants.
        ray_procs = common.descendants()
        if ray.is_initialized():
            ray.shutdown()
        common.end_processes(ray_procs, grace_s=10.0)
    if len(STATE["results"]) != len(sizes):
        raise RuntimeError(f"the simulation finished {len(STATE['results'])} of "
                           f"{len(sizes)} sizes")
    return STATE["results"]


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help=f"comma-separated parameter counts (default {DEFAULT_SIZES})")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds per size, the first a warm-up (default 5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data (default 0)")
    p.add_argument("--clients", type=int, default=CLIENTS, help="clients = SuperNodes (10)")
    p.add_argument("--examples", type=int, default=EXAMPLES, help="examples per client (8)")
    p.add_argument("--object-store-mb", type=int, default=1024,
                   help="Ray's object store (MiB, default 1024)")
    p.add_argument("--json", metavar="OUT", default=None,
                   help="also write the result lines to OUT")
    a = p.parse_args(argv)
    if a.rounds < 1 or a.clients < 1 or a.examples < 1:
        raise SystemExit("--rounds, --clients and --examples must be at least 1")
    sizes = [parse_size(s) for s in a.sizes.split(",") if s.strip()]
    if not sizes:
        raise SystemExit("--sizes: give at least one parameter count")
    try:
        results = run(sizes, a.rounds, a.seed, a.clients, a.examples, a.object_store_mb)
    finally:
        common.end_processes()
    if a.json:
        with open(a.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
