"""The ServerApp's side of talking to SuperNodes: waiting for them, asking each for its
block of the population, and one push-then-pull exchange with a deadline.

`exchange` is `Grid.send_and_receive` with the pull interval in the caller's hands:
Flower's own waits 3 s between pulls and has no option to change it, so a round would
wait up to 3 s after the last node answered. It pushes the messages once, pulls the
outstanding replies every `poll_s` until all are in or `timeout_s` has passed (a node
that has not answered by then is late), and returns the replies by destination node.
Flower's `pull_messages` returns a reply once its message is in, then fetches the
reply's arrays, waiting while they still upload; so each outstanding reply is pulled
on a thread of its own (daemon: one still fetching when the deadline passes is left
behind, and does not hold the round), and a node behind a slow link is late by the
deadline instead of holding the round until its upload ends.
"""

from __future__ import annotations

import dataclasses
import threading
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
    lock = threading.Lock()
    arrived = threading.Event()
    pulling: set = set()  # message ids with a pull in flight

    def pull(message_id: str) -> None:
        try:
            got = list(grid.pull_messages([message_id]))
        except Exception:  # noqa: BLE001 - a failed pull is retried at the next poll
            got = []
        with lock:
            pulling.discard(message_id)
            for reply in got:
                node = sent.get(reply.metadata.reply_to_message_id)
                if node is not None and node not in replies:
                    replies[node] = reply
        if got:  # else the next poll pulls again, poll_s later
            arrived.set()

    end = time.monotonic() + timeout_s
    while True:
        with lock:
            waiting = [m for m, node in sent.items()
                       if node not in replies and m not in pulling]
            pulling.update(waiting)
            done = len(replies) == len(sent)
        if done:
            break
        for message_id in waiting:
            threading.Thread(target=pull, args=(message_id,), daemon=True,
                             name=f"pull {message_id[:12]}").start()
        left = end - time.monotonic()
        if left <= 0:
            break
        arrived.wait(min(poll_s, left))
        arrived.clear()
    with lock:
        return dict(replies)


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


MAX_UNDECLARED_CLIENTS = 1 << 20  # the most clients the nodes' blocks may claim together


def share_of(reply, bound: int) -> tuple:
    """(first client, client count) a SuperNode's answer to the `query` message claims,
    parsed strictly: a `metrics` MetricRecord of exactly "first-client" and
    "num-clients", whole numbers (never a bool or a float) with first-client >= 0,
    num-clients >= 1 and their block inside clients 0..`bound`-1; FleetError saying
    what is wrong otherwise (the caller names the node)."""
    from flwr.app import MetricRecord

    record = reply.content.metric_records.get(records.METRICS) \
        if hasattr(reply.content, "metric_records") else None
    if not isinstance(record, MetricRecord):
        raise FleetError(f"its answer has no {records.METRICS!r} metrics record")
    keys = sorted(record.keys())
    if keys != ["first-client", "num-clients"]:
        raise FleetError(f"its answer's metrics hold {str(keys)[:120]}; expected exactly "
                         "first-client and num-clients")
    first = records.whole(record["first-client"], "first-client", "its answer", 0,
                          2 ** 62)
    count = records.whole(record["num-clients"], "num-clients", "its answer", 1, 2 ** 62)
    if first + count > bound:
        raise FleetError(f"it claims clients {first}..{first + count - 1}, past the "
                         f"{bound} clients of the run's population (run config "
                         f"population-size, else at most {MAX_UNDECLARED_CLIENTS})")
    return first, count


def discover(grid, node_ids: Iterable[int], timeout_s: float, poll_s: float,
             population: int = 0, min_nodes: int = 1, log=None) -> list:
    """Each node's block of the population (a `query` message), in population order.

    Args:
      grid: the ServerApp's Flower grid.
      node_ids: the connected SuperNodes (`wait_for_nodes`).
      timeout_s, poll_s: how long to wait for the answers, and the pull interval.
      population: the clients the nodes hold together (run config population-size);
        0: not declared, at most `MAX_UNDECLARED_CLIENTS`.
      min_nodes: the fewest nodes the run goes on with (run config min-nodes).
      log: where the nodes left out are named (None: nowhere).

    Each answer is read by `share_of`, bounded by the population before anything is
    kept per client. A node that does not answer, answers an error or claims a block
    `share_of` refuses is left out, named with what was wrong. The blocks of the others
    must not overlap and must together be clients 0..N-1 (N: `population` where
    declared), so that a cohort sampled from the population maps onto the nodes, and
    at least `min_nodes` must be left; FleetError naming the nodes left out and the
    condition otherwise."""
    from flwr.app import Message, MessageType, RecordDict

    node_ids = list(node_ids)
    bound = population or MAX_UNDECLARED_CLIENTS
    messages = [Message(RecordDict(), dst_node_id=n, message_type=MessageType.QUERY)
                for n in node_ids]
    replies = exchange(grid, messages, timeout_s, poll_s)
    nodes, left = [], []
    for n in node_ids:
        reply = replies.get(n)
        if reply is None:
            left.append(f"node {n} did not answer within {timeout_s}s")
        elif reply.has_error():
            left.append(f"node {n}: {str(reply.error.reason)[:200]}")
        elif reply.metadata.src_node_id != n:
            left.append(f"node {n}: its answer came as node {reply.metadata.src_node_id}")
        else:
            try:
                first, count = share_of(reply, bound)
            except FleetError as e:
                left.append(f"node {n}: {e}")
                continue
            nodes.append(Node(n, first, first + count))
    why = f"; left out: {'; '.join(left)}" if left else ""
    nodes.sort(key=lambda node: (node.first, node.node_id))
    expected = 0
    for node in nodes:
        if node.first != expected:
            what = "overlaps" if node.first < expected else "leaves a gap before"
            raise FleetError(
                f"{node.name} {what} client {expected}: the SuperNodes' blocks must "
                f"together be clients 0..N-1, each once; fix their --node-config "
                f"first-client / num-clients (blocks: "
                f"{[(x.node_id, x.first, x.stop) for x in nodes][:20]}){why}")
        expected = node.stop
    if population and expected != population:
        raise FleetError(f"the SuperNodes' blocks hold clients 0..{expected - 1}; the run "
                         f"config declares population-size={population}: start the "
                         f"nodes of the missing clients or fix population-size{why}")
    if len(nodes) < max(min_nodes, 1):
        raise FleetError(f"SuperNodes could not say which clients they serve: only "
                         f"{len(nodes)} of {len(node_ids)} did, the run wants "
                         f"{min_nodes} (run config min-nodes){why}")
    if left and log is not None:
        log(f"fax_bridge: SuperNodes left out of the run{why[len('; left out'):]}")
    return nodes
