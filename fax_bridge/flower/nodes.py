"""The ServerApp's side of talking to SuperNodes: waiting for them, asking each for its
block of the population, and one push-then-pull exchange with a deadline.

`exchange` is `Grid.send_and_receive` with the pull interval in the caller's hands:
Flower's own waits 3 s between pulls and has no option to change it, so a round would
wait up to 3 s after the last node answered. It pushes the messages once, pulls the
outstanding replies every `poll_s` until all are in or `timeout_s` has passed (a node
that has not answered by then is late), and returns the replies by destination node.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterable

from fax_bridge.errors import FleetError
from fax_bridge.flower import records


@dataclasses.dataclass(frozen=True)
class Node:
    """A SuperNode and the population ids it serves, [first, stop)."""

    node_id: int
    first: int
    stop: int

    @property
    def name(self) -> str:
        return f"node {self.node_id} (clients {self.first}..{self.stop - 1})"


def exchange(grid, messages: list, timeout_s: float, poll_s: float) -> dict:
    """{destination node id: reply} of the replies that came within `timeout_s`."""
    sent = {}
    for message_id, message in zip(grid.push_messages(messages), messages):
        sent[message_id] = message.metadata.dst_node_id
    replies: dict = {}
    end = time.monotonic() + timeout_s
    while sent:
        for reply in grid.pull_messages(list(sent)):
            node = sent.pop(reply.metadata.reply_to_message_id, None)
            if node is not None:
                replies[node] = reply
        if not sent or time.monotonic() >= end:
            break
        time.sleep(min(poll_s, max(0.0, end - time.monotonic())))
    return replies


def wait_for_nodes(grid, count: int, timeout_s: float, poll_s: float) -> list:
    """The ids of the connected SuperNodes once at least `count` are (sorted)."""
    end = time.monotonic() + timeout_s
    while True:
        ids = sorted(int(i) for i in grid.get_node_ids())
        if len(ids) >= count:
            return ids
        if time.monotonic() >= end:
            raise FleetError(
                f"only {len(ids)} SuperNodes joined the SuperLink within {timeout_s}s; "
                f"the run wants {count} (run config `min-nodes`); start the missing ones "
                "or lower min-nodes")
        time.sleep(poll_s)


def discover(grid, node_ids: Iterable[int], timeout_s: float, poll_s: float) -> list:
    """Each node's block of the population (a `query` message), in population order.

    The blocks must not overlap and must together be clients 0..N-1, so that a cohort
    sampled from the population maps onto the nodes."""
    from flwr.app import Message, MessageType, RecordDict

    node_ids = list(node_ids)
    messages = [Message(RecordDict(), dst_node_id=n, message_type=MessageType.QUERY)
                for n in node_ids]
    replies = exchange(grid, messages, timeout_s, poll_s)
    nodes, problems = [], []
    for n in node_ids:
        reply = replies.get(n)
        if reply is None:
            problems.append(f"node {n} did not answer within {timeout_s}s")
        elif reply.has_error():
            problems.append(f"node {n}: {reply.error.reason}")
        else:
            m = reply.content[records.METRICS]
            first = int(m["first-client"])
            nodes.append(Node(n, first, first + int(m["num-clients"])))
    if problems:
        raise FleetError("SuperNodes could not say which clients they serve: "
                         + "; ".join(problems))
    nodes.sort(key=lambda node: (node.first, node.node_id))
    expected = 0
    for node in nodes:
        if node.first != expected:
            what = "overlaps" if node.first < expected else "leaves a gap before"
            raise FleetError(
                f"{node.name} {what} client {expected}: the SuperNodes' blocks must "
                f"together be clients 0..N-1, each once; fix their --node-config "
                f"first-client / num-clients (blocks: "
                f"{[(x.node_id, x.first, x.stop) for x in nodes]})")
        expected = node.stop
    return nodes
