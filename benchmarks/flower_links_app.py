"""Flower's own FedAvg of a model of any size, as a Flower app (flwr 1.42), for `links.py`.

The model is one float32 vector of `size` parameters (`start_model`: `init` plus seeded
noise). Each client c
trains it as fax_bridge's round in `links.py` does: `params * 0.5 + x_c` with
`x_c = (c + 1) / 1000`, weighted by `c + 1` examples. The ServerApp is
`flwr.serverapp.strategy.FedAvg` as it comes, one message per cohort client (client c
to the (c mod K)'th SuperNode, the cohort `clients-per-node` clients on each of the K
nodes), its replies pulled every `poll-s` seconds (`flower_numpy_app.PollingGrid`,
copied beside this file). `rounds.json` in `out-dir` holds each round's wall time, from
`configure_train` to the aggregated model.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from flower_numpy_app import PollingGrid  # noqa: E402  (copied beside this file)

def start_model(size: int, init: float) -> np.ndarray:
    """A run's first model: `init` plus noise seeded by it (no two chunks of it alike:
    Flower sends a chunk it has sent before by reference)."""
    rng = np.random.default_rng(int(init * 1024))
    return (rng.standard_normal(size, np.float32) * np.float32(1e-3)
            + np.float32(init)).astype(np.float32)


client_app = ClientApp()
server_app = ServerApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    client = int(msg.content["config"]["client-id"])
    params = msg.content["arrays"].to_numpy_ndarrays()
    model = [p * np.float32(0.5) + np.float32((client + 1) / 1000) for p in params]
    return Message(RecordDict({
        "arrays": ArrayRecord(model),
        "metrics": MetricRecord({"num-examples": client + 1}),
    }), reply_to=msg)


class CohortFedAvg(FedAvg):
    """FedAvg sending client c of the cohort to node c mod K, one message each."""

    def __init__(self, nodes: list, per_node: int, times: list, **kwargs):
        super().__init__(**kwargs)
        self.nodes, self.per_node, self.times = nodes, per_node, times

    def configure_train(self, server_round, arrays, config, grid):
        self.times.append(time.perf_counter())
        messages = []
        for c in range(len(self.nodes) * self.per_node):
            record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key:
                                 ConfigRecord({**config, "client-id": c})})
            messages.append(Message(content=record, message_type="train",
                                    dst_node_id=self.nodes[c % len(self.nodes)]))
        return messages


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    wanted = int(config["min-nodes"])
    deadline = time.monotonic() + 300
    while len(list(grid.get_node_ids())) < wanted:
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {wanted} SuperNodes came up")
        time.sleep(0.1)
    nodes = sorted(grid.get_node_ids())
    starts: list = []
    ends: list = []
    strategy = CohortFedAvg(nodes, int(config["clients-per-node"]), starts,
                            fraction_evaluate=0.0, weighted_by_key="num-examples",
                            min_available_nodes=wanted)

    def round_done(server_round: int, arrays: ArrayRecord):
        if server_round > 0:
            ends.append(time.perf_counter())
        return None

    init = [start_model(int(config["size"]), float(config["init"]))]
    strategy.start(PollingGrid(grid, float(config["poll-s"])), ArrayRecord(init),
                   num_rounds=int(config["num-rounds"]), timeout=1200,
                   evaluate_fn=round_done)
    os.makedirs(str(config["out-dir"]), exist_ok=True)
    with open(os.path.join(str(config["out-dir"]), "rounds.json"), "w") as f:
        json.dump({"wall_s": [e - s for s, e in zip(starts, ends)]}, f)
