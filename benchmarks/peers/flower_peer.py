"""The shared FedAvg workload on Flower's simulation engine (runs in .venv-flower).

``flwr.simulation.run_simulation`` with the Ray backend runs 100 virtual SuperNodes;
SuperNode ``i`` is client ``i`` of the workload (its ``partition-id``). The ServerApp
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
"""

from __future__ import annotations

import common  # first: starts the clock and puts workload on the path

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import time
from typing import Any, Dict, Iterable, Optional

import numpy_mlp
import workload

# Filled by the ServerApp thread, read by main() after the simulation returns.
STATE: Dict[str, Any] = {}

_CLIENT_DATA: Optional[workload.ClientData] = None


def client_data() -> workload.ClientData:
    """The workload's client batches, built once per (Ray worker) process."""
    global _CLIENT_DATA
    if _CLIENT_DATA is None:
        _CLIENT_DATA = workload.client_data(workload.load_split())
    return _CLIENT_DATA


def build_apps(rounds: int, seed: int) -> Any:
    """(ServerApp, ClientApp) for the workload."""
    from flwr.app import ArrayRecord, Context, Message, MessageType, MetricRecord, RecordDict
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
        pid = int(context.node_config["partition-id"])
        data = client_data()
        params = workload.params_from_list(msg.content["arrays"].to_numpy_ndarrays())
        new_params, loss = numpy_mlp.local_train(params, data.x[pid], data.y[pid])
        content = RecordDict({
            "arrays": ArrayRecord(workload.params_to_list(new_params)),
            "metrics": MetricRecord({"train_loss": loss, "num-examples": int(data.counts[pid])}),
        })
        return Message(content, reply_to=msg)

    class ScheduledFedAvg(FedAvg):
        """FedAvg whose cohorts follow the workload's schedule; counts array bytes."""

        def __init__(self, node_of_client: Dict[int, int], **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.node_of_client = node_of_client

        def configure_train(self, server_round: int, arrays: Any, config: Any, grid: Any) -> Iterable[Any]:
            STATE["round_start"].append(time.perf_counter())
            ids = workload.cohort(seed, server_round - 1)
            config["server-round"] = server_round
            record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
            STATE["bytes"] += arrays.count_bytes() * len(ids)
            nodes = [self.node_of_client[int(i)] for i in ids]
            return self._construct_messages(record, nodes, MessageType.TRAIN)

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
        deadline = time.monotonic() + 120
        while len(list(grid.get_node_ids())) < workload.NUM_CLIENTS:
            if time.monotonic() > deadline:
                raise RuntimeError("not all SuperNodes came up")
            time.sleep(0.1)
        node_ids = list(grid.get_node_ids())
        replies = grid.send_and_receive(
            [Message(RecordDict(), dst_node_id=n, message_type=MessageType.QUERY) for n in node_ids],
            timeout=300,
        )
        node_of_client = {
            int(m.content["metrics"]["partition-id"]): m.metadata.src_node_id
            for m in replies if not m.has_error()
        }
        if len(node_of_client) != workload.NUM_CLIENTS:
            raise RuntimeError(f"only {len(node_of_client)} nodes answered the partition query")
        strategy = ScheduledFedAvg(
            node_of_client,
            fraction_evaluate=0.0,
            weighted_by_key="num-examples",
            min_available_nodes=workload.NUM_CLIENTS,
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
            timeout=300,
            evaluate_fn=record_round,
        )
        STATE["losses"] = [
            float(result.train_metrics_clientapp[r]["train_loss"]) for r in range(1, rounds + 1)
        ]

    return server_app, client_app


def run(rounds: int, seed: int) -> Dict[str, Any]:
    """The benchmark: import, Ray start-up and discovery are setup, then the rounds."""
    rss = common.PeakRss().start()
    import flwr
    from flwr.simulation import run_simulation

    STATE.update(round_start=[], round_end=[], params=[], losses=[], bytes=0, errors=0)
    server_app, client_app = build_apps(rounds, seed)
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
            num_supernodes=workload.NUM_CLIENTS,
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

    return common.result_line(
        "flower", setup_s, round_s, STATE["losses"], STATE["params"], peak, STATE["bytes"],
        extra={
            "versions": {"flwr": flwr.__version__, "ray": ray.__version__},
            "client_impl": "numpy (hand-written backprop)",
            "bytes_moved_note": "model arrays in ArrayRecords, server->clients and back",
        },
    )


def main() -> None:
    args = common.base_parser(__doc__.splitlines()[0]).parse_args()
    try:
        result = run(args.rounds, args.seed)
    finally:
        common.end_processes()
    common.emit(result, args.json)


if __name__ == "__main__":
    main()
