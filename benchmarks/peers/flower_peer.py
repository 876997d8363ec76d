"""The shared FedAvg workload on Flower's simulation engine (runs in .venv-flower).

``flwr.simulation.run_simulation`` with the Ray backend runs 100 virtual SuperNodes;
SuperNode ``i`` is client ``i`` of the workload (its ``partition-id``). With
``--workload large`` (``large_workload.py``: a cohort of 1,000 from 10,000 clients) it
runs ``--supernodes`` of them (default one per client), client ``c`` on SuperNode
``c mod supernodes``; each train message names its client (``client-id`` in its
config), and the first round is the warm-up, left out of ``round_s_median``. The ServerApp
drives Flower's message-based ``FedAvg`` strategy (``flwr.serverapp.strategy``),
weighted by the ``num-examples`` each client reports (its example count). Two things are
added to the stock strategy: the cohort of each round is the workload's schedule
instead of Flower's random sampling, and the bytes of model arrays sent and received
are counted. To address a cohort, the ServerApp first asks every node for its
partition id with one QUERY message (part of setup). Clients train with the numpy MLP
of ``numpy_mlp`` (hand-written backprop; no torch, TensorFlow or jax in this venv).

Flower's and Ray's usage telemetry are switched off, Ray's dashboard is not started,
and Ray is shut down at the end, with any leftover child processes terminated.

    .venv-flower/bin/python benchmarks/peers/flower_peer.py [--rounds 20] [--seed 0] [--json OUT]
    .venv-flower/bin/python benchmarks/peers/flower_peer.py --workload large [--rounds 3]
        [--supernodes 10000] [--json OUT]
"""

from __future__ import annotations

import common  # first: starts the clock and puts workload on the path

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import time
from typing import Any, Dict, Iterable, NamedTuple, Optional, Tuple

import numpy as np

import large_workload
import numpy_mlp
import workload

# Filled by the ServerApp thread, read by main() after the simulation returns.
STATE: Dict[str, Any] = {}

_CLIENT_DATA: Optional[workload.ClientData] = None
_POPULATION: Optional[large_workload.Population] = None


def client_data() -> workload.ClientData:
    """The workload's client batches, built once per (Ray worker) process."""
    global _CLIENT_DATA
    if _CLIENT_DATA is None:
        _CLIENT_DATA = workload.client_data(workload.load_split())
    return _CLIENT_DATA


def client_batches(name: str, client: int, population: int = 0) -> Tuple[Any, Any, int]:
    """(x, y, example count) of client ``client`` of workload ``name`` (``large``: of a
    population of ``population``); each (Ray worker) process builds its clients once."""
    global _POPULATION
    if name == "large":
        if _POPULATION is None or _POPULATION.size != population:
            _POPULATION = large_workload.Population(population)
        x, y = _POPULATION.batches(np.asarray([client]))
        return x[0], y[0], large_workload.EXAMPLES
    data = client_data()
    return data.x[client], data.y[client], int(data.counts[client])


class Spec(NamedTuple):
    """What the ServerApp needs of a workload: its name, population, SuperNodes, cohorts."""

    name: str
    population: int
    supernodes: int
    cohort_size: int

    def cohort(self, seed: int, round_index: int) -> Any:
        """The client ids of 0-based round ``round_index``."""
        if self.name == "large":
            return large_workload.cohort(seed, round_index, self.population, self.cohort_size)
        return workload.cohort(seed, round_index)


def spec_of(name: str, supernodes: Optional[int] = None, population: Optional[int] = None,
            cohort: Optional[int] = None) -> Spec:
    """The ``Spec`` of workload ``name`` (``shared`` or ``large``, whose ``population``
    and ``cohort`` may be shrunk) on ``supernodes`` SuperNodes (default one per client)."""
    if name == "large":
        population = population or large_workload.POPULATION
        cohort = cohort or large_workload.COHORT
    else:
        population, cohort = workload.NUM_CLIENTS, workload.COHORT
    nodes = population if supernodes is None else int(supernodes)
    if not 1 <= nodes <= population:
        raise SystemExit(f"--supernodes {nodes}: give 1..{population} (the population)")
    return Spec(name, population, nodes, cohort)


def build_apps(rounds: int, seed: int, spec: Optional[Spec] = None) -> Any:
    """(ServerApp, ClientApp) for the workload."""
    from flwr.app import (ArrayRecord, ConfigRecord, Context, Message, MessageType,
                          MetricRecord, RecordDict)
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg

    spec = spec or spec_of("shared")
    client_app = ClientApp()

    @client_app.query()
    def query(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        return Message(RecordDict({"metrics": MetricRecord({"partition-id": pid})}), reply_to=msg)

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        config = msg.content["config"]
        x, y, count = client_batches(str(config["workload"]), int(config["client-id"]),
                                     int(config["population"]))
        params = workload.params_from_list(msg.content["arrays"].to_numpy_ndarrays())
        new_params, loss = numpy_mlp.local_train(params, x, y)
        content = RecordDict({
            "arrays": ArrayRecord(workload.params_to_list(new_params)),
            "metrics": MetricRecord({"train_loss": loss, "num-examples": count}),
        })
        return Message(content, reply_to=msg)

    class ScheduledFedAvg(FedAvg):
        """FedAvg whose cohorts follow the workload's schedule; counts array bytes."""

        def __init__(self, node_of_partition: Dict[int, int], **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.node_of_partition = node_of_partition

        def configure_train(self, server_round: int, arrays: Any, config: Any,
                            grid: Any) -> Iterable[Any]:
            STATE["round_start"].append(time.perf_counter())
            ids = spec.cohort(seed, server_round - 1)
            STATE["bytes"] += arrays.count_bytes() * len(ids)
            messages = []
            for client in ids:
                client_config = ConfigRecord({**config, "server-round": server_round,
                                              "workload": spec.name, "client-id": int(client),
                                              "population": spec.population})
                record = RecordDict({self.arrayrecord_key: arrays,
                                     self.configrecord_key: client_config})
                node = self.node_of_partition[int(client) % spec.supernodes]
                messages.append(Message(content=record, message_type=MessageType.TRAIN,
                                        dst_node_id=node))
            return messages

        def aggregate_train(self, server_round: int, replies: Iterable[Any]) -> Any:
            replies = list(replies)
            STATE["bytes"] += sum(
                m.content[self.arrayrecord_key].count_bytes() for m in replies if not m.has_error()
            )
            STATE["errors"] += sum(1 for m in replies if m.has_error())
            return super().aggregate_train(server_round, replies)

    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        deadline = time.monotonic() + 600
        while len(list(grid.get_node_ids())) < spec.supernodes:
            if time.monotonic() > deadline:
                raise RuntimeError("not all SuperNodes came up")
            time.sleep(0.1)
        node_ids = list(grid.get_node_ids())
        replies = grid.send_and_receive(
            [Message(RecordDict(), dst_node_id=n, message_type=MessageType.QUERY)
             for n in node_ids],
            timeout=1200,
        )
        node_of_partition = {
            int(m.content["metrics"]["partition-id"]): m.metadata.src_node_id
            for m in replies if not m.has_error()
        }
        if len(node_of_partition) != spec.supernodes:
            raise RuntimeError(f"only {len(node_of_partition)} nodes answered the partition query")
        strategy = ScheduledFedAvg(
            node_of_partition,
            fraction_evaluate=0.0,
            weighted_by_key="num-examples",
            min_available_nodes=spec.supernodes,
        )

        def record_round(server_round: int, arrays: Any) -> None:
            if server_round > 0:
                STATE["round_end"].append(time.perf_counter())
                STATE["params"].append(workload.params_from_list(arrays.to_numpy_ndarrays()))
            return None

        result = strategy.start(
            grid,
            ArrayRecord(workload.params_to_list(workload.load_init_params())),
            num_rounds=rounds,
            timeout=1200,
            evaluate_fn=record_round,
        )
        STATE["losses"] = [
            float(result.train_metrics_clientapp[r]["train_loss"]) for r in range(1, rounds + 1)
        ]

    return server_app, client_app


def run(rounds: int, seed: int, spec: Optional[Spec] = None) -> Dict[str, Any]:
    """The benchmark: import, Ray start-up and discovery are setup, then the rounds."""
    spec = spec or spec_of("shared")
    rss = common.PeakRss().start()
    import flwr
    from flwr.simulation import run_simulation

    STATE.update(round_start=[], round_end=[], params=[], losses=[], bytes=0, errors=0)
    server_app, client_app = build_apps(rounds, seed, spec)
    cpus = max(1, os.cpu_count() or 1)
    backend_config = {
        "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
        "init_args": {
            "num_cpus": cpus,
            "num_gpus": 0,
            "include_dashboard": False,
            "object_store_memory": 256 * 2**20,
            "log_to_driver": False,
        },
    }
    try:
        run_simulation(
            server_app=server_app,
            client_app=client_app,
            num_supernodes=spec.supernodes,
            backend_name="ray",
            backend_config=backend_config,
        )
    finally:
        import ray

        # Listed while Ray's daemons still hold them: its workers outlive the raylet
        # for a moment after shutdown and are then no longer our descendants.
        ray_procs = common.descendants()
        if ray.is_initialized():
            ray.shutdown()
        common.end_processes(ray_procs, grace_s=10.0)
    if len(STATE["round_end"]) != rounds or len(STATE["losses"]) != rounds:
        raise RuntimeError(f"simulation finished {len(STATE['round_end'])} of {rounds} rounds")
    if STATE["errors"]:
        raise RuntimeError(f"{STATE['errors']} client replies were errors")
    peak = rss.stop()
    setup_s = STATE["round_start"][0] - common.PROCESS_T0
    round_s = [e - s for s, e in zip(STATE["round_start"], STATE["round_end"])]
    import ray

    extra: Dict[str, Any] = {
        "versions": {"flwr": flwr.__version__, "ray": ray.__version__},
        "client_impl": "numpy (hand-written backprop)",
        "bytes_moved_note": "model arrays in ArrayRecords, server->clients and back",
    }
    large = spec.name == "large"
    if large:
        extra.update(workload="large", population=spec.population,
                     cohort=spec.cohort_size, supernodes=spec.supernodes,
                     final_params={k: v.tolist() for k, v in STATE["params"][-1].items()})
    return common.result_line(
        "flower", setup_s, round_s, STATE["losses"], STATE["params"], peak, STATE["bytes"],
        extra=extra, warmup=1 if large else 0)


def main() -> None:
    parser = common.base_parser(__doc__.splitlines()[0], workloads=True)
    parser.add_argument("--supernodes", type=int, default=None,
                        help="SuperNodes to simulate (default one per client)")
    args = parser.parse_args()
    spec = spec_of(args.workload, args.supernodes, args.population_size, args.cohort_size)
    try:
        result = run(common.rounds_of(args), args.seed, spec)
    finally:
        common.end_processes()
    common.emit(result, args.json)


if __name__ == "__main__":
    main()
