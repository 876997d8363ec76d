"""Flower's SuperNodes as a round transport (`rounds.engine.Transport`).

Each SuperNode holding participants of a round gets one `train` message (the broadcast
and the ids of its participants) and answers with its clients' partials as records
(`records`); a node that answers with an error, not within the wait, or with an answer
`records.answer_of` refuses (a missing record, a malformed layout, counts or arrays)
comes back as a lost holder, named with the reason, for the engine's policy to drop;
so does one whose answer reads well but holds partials no honest node could send (the
engine's checks, `engine.check_answers`). An answer that is not what the node sent
(a partial tensor whose sha256 is not the one the node computed before laying it out
as records), or that says the node received another broadcast or other client ids than
were sent (`records.check_received`), fails the round with a `TransferError` naming the
node and the tensor: no honest node sends it, but unlike a forged answer it is what a
codec, relay or transport that alters values gives every node it touches, which
dropping would turn into a smaller round reported as a success.
Each answer also names the client runtime that computed it and the sha256 of the LiteRT
model that ran (`records.served_of`), which the round's report keeps (`served`).
The engine checks and merges the partials as it does a device's.

The round's secure sums are not in the answers: a node keeps its partials of them
back, and the transport hands the engine a secure phase (`engine.Answers.secure`) that
sums them through Flower's SecAgg+ over the nodes that answered (`secagg.aggregate`),
so the ServerApp sees only their totals. A node SecAgg+ loses before its masked vector
is summed goes to the engine's policy as a lost holder naming its answer, which the
engine then leaves out of the round's other aggregations too.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from fax_bridge.errors import FleetError, TransferError
from fax_bridge.rounds import client_runtime
from fax_bridge.rounds.engine import Answers, HolderAnswer, LostHolder, plain_aggregations
from fax_bridge.rounds.policy import Traffic
from fax_bridge.rounds.round_split import RoundSplit
from fax_bridge.flower import nodes as flower_nodes
from fax_bridge.flower import records, secagg


def train_messages(split: RoundSplit, sent: Any, nodes: list, ids: np.ndarray,
                   round_index: int, ttl_s: float, cohort: int = 0,
                   rounded: bool = False) -> list:
    """(node, its participants, message) for each node holding participants of the
    round; the messages expire when the round stops waiting (`ttl_s`), so a node that
    comes back later does not work on a round that is over. `cohort`: the most clients
    any round of the run samples (0: not known), which a warm worker compiles for;
    `rounded`: the nodes send rounded partials (`RoundPolicy.rounded_partials`)."""
    from flwr.app import ConfigRecord, Message, MessageType, RecordDict

    from fax_bridge.runtime.backend import as_numpy, leaves

    tensors = [t for value in sent for t in leaves(as_numpy(value))]
    arrays, layout = records.tensors_to_record(tensors)
    out = []
    for node in nodes:
        mine = ids[(ids >= node.first) & (ids < node.stop)]
        if not mine.size:
            continue
        content = RecordDict({
            records.BROADCAST: arrays, records.LAYOUT: layout,
            records.IDS: records.ids_to_record(mine),
            records.ROUND: ConfigRecord({"round": round_index, "cohort": int(cohort),
                                         "client-part": split.client_part_hash,
                                         "rounded-partials": bool(rounded)})})
        out.append((node, mine, Message(content, dst_node_id=node.node_id,
                                        message_type=MessageType.TRAIN,
                                        group_id=str(round_index), ttl=ttl_s)))
    return out


class FlowerTransport:
    """The SuperNodes of a grid as an `engine.Transport`: `ids` are the round's
    participants (population order), `wait_s` how long the round waits for answers,
    `threshold` SecAgg+'s reconstruction threshold as a fraction of the nodes that
    start it (`secagg.shares_needed`), `cohort` the most clients a round of the run
    samples (`train_messages`); `served` (the round report's) gets, for each node that
    answers, the client runtime and LiteRT model its answer names (`records.served_of`)."""

    backend = None
    reject_nonfinite = False

    def __init__(self, grid, nodes: list, ids: np.ndarray, round_index: int, wait_s: float,
                 poll_s: float, traffic: Traffic, threshold: float = 0.0, cohort: int = 0,
                 rounded_partials: bool = False, served: Optional[dict] = None):
        self.grid, self.nodes, self.ids = grid, nodes, ids
        self.served = {} if served is None else served
        self.rounded_partials = bool(rounded_partials)
        self.threshold, self.cohort = threshold, cohort
        self.round_index, self.wait_s, self.poll_s = round_index, wait_s, poll_s
        self.num_clients = len(ids)
        self.traffic = traffic

    def run_clients(self, split: RoundSplit, sent: Any) -> Answers:
        from fax_bridge.runtime.backend import as_numpy, leaves

        sends = train_messages(split, sent, self.nodes, self.ids, self.round_index,
                               max(self.wait_s, 1.0), self.cohort, self.rounded_partials)
        tensors = [t for value in sent for t in leaves(as_numpy(value))]  # as sent
        # bytes_*: every record of the messages (SecAgg+'s too, `secagg.aggregate`);
        # payload_*: the round's arrays (broadcast and ids down, partials up)
        self.traffic.bytes_down += sum(records.content_bytes(m.content) for _, _, m in sends)
        self.traffic.payload_down += sum(
            records.payload_bytes(m.content[records.BROADCAST])
            + records.payload_bytes(m.content[records.IDS]) for _, _, m in sends)
        self.traffic.rpcs += len(sends)
        replies = flower_nodes.exchange(self.grid, [m for _, _, m in sends], self.wait_s,
                                        self.poll_s)
        plain = plain_aggregations(split)  # secure sums: the secure phase below
        kinds = [a.kind for a in plain]
        out, answered = Answers([]), []
        for node, mine, _ in sends:  # node order is population order
            reply = replies.get(node.node_id)
            if reply is None or reply.has_error():
                out.lost.append(LostHolder(f"{node.name}: " + (
                    f"no answer within {self.wait_s}s" if reply is None
                    else reply.error.reason), mine))
                continue
            try:  # a malformed answer loses its node, named, as no answer does
                if reply.metadata.src_node_id != node.node_id:
                    raise FleetError(f"{node.name}: its answer came as node "
                                     f"{reply.metadata.src_node_id}")
                partials, seconds = records.answer_of(
                    reply.content, kinds, node.name,
                    sent=records.tensors_sha256([*tensors, np.asarray(mine, np.int64)]))
                runtime, model = records.served_of(reply.content, node.name)
            except TransferError:  # altered on the way: the round fails, never smaller
                raise
            except FleetError as e:
                out.lost.append(LostHolder(f"{e} (a malformed answer)", mine,
                                           refused=True))
                continue
            self.served[node.name] = client_runtime.served(runtime, model)
            answered.append((node, mine))
            self.traffic.bytes_up += records.content_bytes(reply.content)
            self.traffic.payload_up += records.payload_bytes(reply.content[records.PARTIALS])
            out.answered.append(HolderAnswer(node.name, len(mine), partials, seconds,
                                             clients=mine))
        if len(plain) < len(split.aggregations):
            out.secure = lambda drop: secagg.aggregate(
                self.grid, split, answered, self.round_index, self.wait_s, self.poll_s,
                drop, self.threshold, self.traffic)
        return out
