"""Flower's own FedAvg of the peers' digits workload, as a Flower app (flwr 1.42).

`flower_rounds.py` copies this file, `peers/workload.py` and `peers/numpy_mlp.py` into the
package of an app directory it writes and runs it with `flwr run` on the same loopback
deployment as fax_bridge's app. The ServerApp drives `flwr.serverapp.strategy.FedAvg`
(weighted by each reply's `num-examples`, no evaluation round); the ClientApp trains
with `numpy_mlp.local_train` (the workload's 5 SGD steps of 16 examples, lr 0.1) from
the broadcast model. Each round's cohort is `workload.cohort(seed, round)` (10 of the
100 clients), the clients' batches are read from `.npy` files written beforehand
(`data-dir`, memory-mapped, so a ClientApp reads only its clients' rows).

Run config:
  per-node   false: one message per cohort client, client c to the c mod K'th SuperNode
             (Flower's idiom: FedAvg averages one reply per client); true: one message
             per SuperNode naming its cohort clients, answered with their
             example-weighted mean model and their total count (the same average).
  poll-s     0: the strategy's `Grid.send_and_receive` (Flower pulls replies every 3 s);
             > 0: the same push, then a pull every poll-s seconds.
  out-dir    where `rounds.json` (each round's wall time, from `configure_train` to the
             aggregated model, and its loss) is written.
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

import numpy_mlp  # noqa: E402  (copied beside this file)
import workload  # noqa: E402

client_app = ClientApp()
server_app = ServerApp()
_DATA: dict = {}


def _client_arrays(folder: str) -> dict:
    if folder not in _DATA:
        _DATA[folder] = {k: np.load(os.path.join(folder, f"{k}.npy"), mmap_mode="r")
                         for k in ("x", "y", "counts")}
    return _DATA[folder]


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    config = msg.content["config"]
    data = _client_arrays(str(config["data-dir"]))
    params = workload.params_from_list(msg.content["arrays"].to_numpy_ndarrays())
    models, losses, counts = [], [], []
    for client in config["client-ids"]:
        model, loss = numpy_mlp.local_train(params, np.asarray(data["x"][client]),
                                            np.asarray(data["y"][client]))
        models.append(model)
        losses.append(loss)
        counts.append(float(data["counts"][client]))
    model = models[0] if len(models) == 1 else numpy_mlp.weighted_average(models, counts)
    return Message(RecordDict({
        "arrays": ArrayRecord(workload.params_to_list(model)),
        "metrics": MetricRecord({"train_loss": float(np.average(losses, weights=counts)),
                                 "num-examples": int(sum(counts))}),
    }), reply_to=msg)


class PollingGrid:
    """A Grid whose `send_and_receive` pulls every `poll_s` seconds (Flower's sleeps
    3 s between pulls); everything else is the Grid's own."""

    def __init__(self, grid: Grid, poll_s: float):
        self.grid, self.poll_s = grid, poll_s

    def __getattr__(self, name: str):
        return getattr(self.grid, name)

    def send_and_receive(self, messages, *, timeout=None):
        ids = set(self.grid.push_messages(messages))
        end = time.time() + (timeout or 0.0)
        replies: list = []
        while timeout is None or time.time() < end:
            got = list(self.grid.pull_messages(ids))
            replies.extend(got)
            ids.difference_update(m.metadata.reply_to_message_id for m in got)
            if not ids:
                break
            time.sleep(self.poll_s)
        return replies


class WorkloadFedAvg(FedAvg):
    """FedAvg whose cohort is the workload's schedule, sent per client or per node."""

    def __init__(self, nodes: list, per_node: bool, seed: int, data_dir: str,
                 times: list, **kwargs):
        super().__init__(**kwargs)
        self.nodes, self.per_node, self.seed = nodes, per_node, seed
        self.data_dir, self.times = data_dir, times

    def configure_train(self, server_round, arrays, config, grid):
        self.times.append(time.perf_counter())
        ids = [int(c) for c in workload.cohort(self.seed, server_round - 1)]
        groups: dict = {}
        for c in ids:
            node = self.nodes[c % len(self.nodes)]
            if self.per_node:
                groups.setdefault(node, []).append(c)
            else:
                groups[(node, c)] = [c]
        messages = []
        for key, clients in groups.items():
            node = key if self.per_node else key[0]
            record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key:
                                 ConfigRecord({**config, "client-ids": clients,
                                               "data-dir": self.data_dir})})
            messages.append(Message(content=record, message_type="train", dst_node_id=node))
        return messages


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    nodes_wanted = int(config["min-nodes"])
    deadline = time.monotonic() + 120
    while len(list(grid.get_node_ids())) < nodes_wanted:
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {nodes_wanted} SuperNodes came up")
        time.sleep(0.1)
    nodes = sorted(grid.get_node_ids())
    poll_s = float(config["poll-s"])
    starts: list = []
    ends: list = []
    strategy = WorkloadFedAvg(nodes, bool(config["per-node"]), int(config["seed"]),
                              str(config["data-dir"]), starts, fraction_evaluate=0.0,
                              weighted_by_key="num-examples",
                              min_available_nodes=nodes_wanted)

    def round_done(server_round: int, arrays: ArrayRecord):
        if server_round > 0:
            ends.append(time.perf_counter())
        return None

    with np.load(str(config["init-path"])) as f:
        init = [np.asarray(f[k], np.float32) for k in workload.PARAM_NAMES]
    result = strategy.start(PollingGrid(grid, poll_s) if poll_s > 0 else grid,
                            ArrayRecord(init), num_rounds=int(config["num-rounds"]),
                            timeout=600, evaluate_fn=round_done)
    rounds = int(config["num-rounds"])
    out = {"wall_s": [e - s for s, e in zip(starts, ends)],
           "loss": [float(result.train_metrics_clientapp[r]["train_loss"])
                    for r in range(1, rounds + 1)]}
    os.makedirs(str(config["out-dir"]), exist_ok=True)
    with open(os.path.join(str(config["out-dir"]), "rounds.json"), "w") as f:
        json.dump(out, f)
