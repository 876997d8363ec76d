"""A Flower round's secure sums through Flower's SecAgg+: the ServerApp sees only totals.

A round's `federated_secure_sum_bitwidth` and `federated_secure_sum` (a
`federated_secure_modular_sum` is a bitwidth sum between two local maps, and
`federated_secure_mean` one after a quantizing map) are aggregations of the round's
split (`rounds.round_split.split_round(secure=True)`). Each SuperNode computes its exact
integer partial of each (the sum over its clients, in the values' dtype) with the
round's other partials, answers the `train` message with the others only and keeps
the secure ones in its run state (`relay`). Once the round engine has dropped the
nodes that did not answer (`rounds.engine`), the ServerApp runs Flower's
`SecAggPlusWorkflow` stage by stage over the nodes that answered (`aggregate`, the
secure phase of `flower.transport`): a small strategy whose `configure_fit` names
those nodes and whose `aggregate_fit` keeps the vector SecAgg+ reconstructs; each
node's ClientApp answers the masked stage through `secaggplus_mod` with its kept
partials. No node's partial of a secure sum reaches the ServerApp, only their total.
A node lost during the stages is dropped through the engine's policy while enough
nodes are left to reconstruct (`shares_needed`), and the totals are over the nodes
whose vectors were summed (`aggregate`).

SecAgg+ (flwr 1.42) computes, for n nodes with weight `num_examples` each,
`clipping_range` C, `quantization_range` L and `modulus_range` M:
  node:   q = ceil((clip(v * r, -C, C) + C) * L / (2C)) (stochastic), r =
          round(num_examples / max_weight * L) / L, then q and r*L are masked mod M;
  server: unmasked totals mod M, then  (sum(q) * 2C / L - C - (n - 1) C) * L / sum(rL).
With num_examples = max_weight (r = 1) and L = 2C every step is exact for integers:
a node's vector is v = x - C for its partial x in [0, 2C], so q = x exactly (the
ceiling of an integer: the random step never moves it), sum(q) = sum(x) < M when
n * L < M, and the server's vector is (sum(x) - n C) * fl(1/n), from which
`recover` gets sum(x) = rint(vector * n + n C) exactly (|sum(x) - n C| < 2**31 here,
so the relative error of 3 float64 roundings is far below 1/2). `choose` picks
L = the largest partial a node may hold (clients of the node in the round times one
client's bound, at least 1), C = L / 2, M = 2**32 (Flower's largest), and refuses the
round when n * L >= M or n < 2 (SecAgg+ needs two nodes). `check_build` refuses at
app-build time a secure sum no split of the program's clients over nodes can carry.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from fax_bridge.errors import AggregationError, ExportError, FleetError
from fax_bridge.flower.relay import CENTER_KEY, ROUND_KEY

MOD_RANGE = 2 ** 32  # SecAgg+'s modulus_range: at most 2**32 (its docstring)
MIN_NODES = 2        # SecAggPlusWorkflow stops below two sampled nodes
_FIX = ("lower the bound (a smaller bitwidth or max_input, clipping the values on the "
        "clients), spread the clients over more, smaller SuperNodes, or run the round on "
        "the fleet (LocalFleet, RemoteFleet), whose secure sums have no such limit")


def secure_aggregations(split) -> list:
    """The round split's secure sums, in split order (the others:
    `engine.plain_aggregations`)."""
    return [a for a in split.aggregations if a.secure]


def tops(agg) -> list:
    """The largest value one client may give each tensor of a secure sum, depth first."""
    from fax_bridge.runtime import aggregation

    return aggregation.secure_bounds(agg.kind, agg.bound, len(agg.leaf_types[0]))


def _named_kind(agg) -> str:
    """The name of a secure sum's intrinsic, as messages give it."""
    from fax_bridge.runtime.aggregation import secure_sum_words

    return secure_sum_words(agg.kind)[0]


def _named(agg, top: int) -> str:
    from fax_bridge.runtime.aggregation import secure_sum_words

    what, name = secure_sum_words(agg.kind)
    return f"{what} ({name} {int(np.asarray(agg.bound).max())}, each client's value <= {top})"


@dataclasses.dataclass(frozen=True)
class Quantization:
    """SecAgg+'s settings for a round's secure sums over `nodes` nodes (module docstring)."""

    levels: int   # quantization_range L: a node's partial lies in [0, L]
    nodes: int

    @property
    def center(self) -> float:
        """clipping_range C = L / 2: a node sends its partial minus C."""
        return self.levels / 2


def choose(secure: Sequence, counts: Sequence[int]) -> Quantization:
    """The quantization that carries the secure sums `secure` exactly when nodes holding
    `counts` clients of the round each send their partials; FleetError below two nodes,
    AggregationError when the largest partial times the nodes reaches 2**32."""
    n = len(counts)
    if n < MIN_NODES:
        raise FleetError(
            f"the round's secure sums ({', '.join(_named_kind(a) for a in secure)}) run "
            f"through Flower's SecAgg+, which needs at least {MIN_NODES} SuperNodes holding "
            f"clients of the round; {n} answered. Start more SuperNodes (min-nodes), lower "
            "the dropout or raise the wait, or run the round on the fleet")
    largest, worst = 0, None
    for agg in secure:
        for top in tops(agg):
            if max(counts) * top >= largest:
                largest, worst = max(counts) * top, (agg, top)
    levels = max(largest, 1)
    if n * levels >= MOD_RANGE:
        agg, top = worst
        raise AggregationError(
            f"{_named(agg, top)}: a SuperNode of {max(counts)} clients in the round may "
            f"hold a partial of {largest}, and SecAgg+ carries {n} such partials exactly "
            f"only while {n} * {largest} < its modulus 2**32; {_FIX}")
    return Quantization(levels=levels, nodes=n)


def check_build(split, clients: int) -> None:
    """ExportError when a secure sum of the round cannot be carried by SecAgg+ however
    `clients` clients are split over two or more nodes: n nodes, the largest holding k,
    need n * k * top < 2**32, and n * k >= clients."""
    for agg in secure_aggregations(split):
        for top in tops(agg):
            if max(clients, MIN_NODES) * top >= MOD_RANGE:
                raise ExportError(
                    f"{_named(agg, top)}: a Flower round sums it through SecAgg+, which "
                    f"carries it exactly only while the nodes times the largest node's "
                    f"partial stays below its modulus 2**32, and {max(clients, MIN_NODES)}"
                    f" clients * {top} reaches it whatever the split; {_FIX}")


def node_vector(kept: Sequence[np.ndarray], center: float) -> list:
    """What a node gives SecAgg+ for its kept partials: one flat float64 vector, every
    tensor's elements depth first, minus C (exact: the partials are integers below 2**31
    and C a multiple of 1/2). One flat vector whatever the tensors' shapes: SecAgg+'s
    server adjusts each array it reconstructs in place, which a 0-d array does not take
    (its sum would come back unadjusted); tensors of no elements add nothing, and a
    vector of none at all is one zero partial (`carried_size`). `relay.give_kept` does
    the same without importing fax_bridge."""
    flat = [np.asarray(x, np.float64).reshape(-1) for x in kept]
    vector = np.concatenate(flat) if flat else np.zeros(0)
    if not vector.size:
        vector = np.zeros(1)
    return [vector - center]


def carried_size(secure: Sequence) -> int:
    """The length of the vector a node gives SecAgg+ for the secure sums `secure`: their
    tensors' elements, at least 1 (`node_vector`)."""
    return max(1, sum(math.prod(t.shape) for agg in secure for t in agg.leaf_types[0]))


def recover(vector: Sequence[np.ndarray], quant: Quantization, nodes: int) -> np.ndarray:
    """The exact integer totals (int64, one flat vector as `node_vector` laid them out)
    from what SecAgg+ hands `aggregate_fit` when `nodes` nodes contributed (module
    docstring)."""
    shift = nodes * quant.center
    flat = [np.asarray(v, np.float64).reshape(-1) for v in vector]
    flat = np.concatenate(flat) if flat else np.zeros(0)
    with np.errstate(all="ignore"):
        total = np.rint(flat * nodes + shift)
    if not np.all(np.abs(total) < 2.0 ** 62):
        raise FleetError(f"SecAgg+ gave totals that are not {nodes} nodes' partials "
                         "(non-finite or far out of range): a node's masked weight or "
                         "vector was forged")
    return total.astype(np.int64)


def totals_of(secure: Sequence, totals: np.ndarray, clients: int, where: str) -> dict:
    """{aggregation local: its value} from the recovered flat totals (`recover`: tensors
    depth first over the secure sums), each checked to lie in [0, clients * top], shaped
    as its tensor and cast to its dtype."""
    from fax_bridge.runtime.backend import from_leaves

    totals = np.asarray(totals).reshape(-1)
    if totals.size != carried_size(secure):
        raise FleetError(f"{where}: SecAgg+ gave {totals.size} values; the round's secure "
                         f"sums hold {carried_size(secure)}")
    out, at = {}, 0
    for agg in secure:
        leaves = []
        for t, top in zip(agg.leaf_types[0], tops(agg)):
            shape = tuple(t.shape)
            total = totals[at:at + math.prod(shape)].reshape(shape)
            at += total.size
            if total.size and (int(total.min()) < 0 or int(total.max()) > clients * top):
                raise FleetError(
                    f"{where}: the SecAgg+ total of {_named_kind(agg)} lies in "
                    f"{int(total.min())}..{int(total.max())}, outside what {clients} clients "
                    f"within the bound can give (0..{clients * top}): a node gave a partial "
                    "out of range")
            leaves.append(total.astype(np.dtype(t.dtype.type)))
        out[agg.local] = from_leaves(agg.member_type, leaves)
    if not at and totals[0] != 0:
        raise FleetError(f"{where}: the SecAgg+ total of secure sums of no elements is "
                         f"{int(totals[0])}, not 0: a node gave a partial out of range")
    return out


# ------------------------------------------------------------------- server phase

STAGES = ("setup", "share keys", "collect masked vectors", "unmask")  # SecAgg+'s, in order
_LOSS_FIX = ("restart the nodes or raise the wait (node-timeout-s, round-deadline-s)")


def checked_threshold(fraction: float) -> float:
    """`fraction` (run config `secagg-threshold`) when it lies in [0, 1], else FleetError."""
    if not 0.0 <= fraction <= 1.0:
        raise FleetError(f"run config secagg-threshold={fraction} is not a fraction of the "
                         "nodes in [0, 1]; give 0 (a strict majority, the default) or a "
                         "fraction such as 0.75 (1: every node, no loss tolerated)")
    return fraction


def shares_needed(fraction: float, nodes: int) -> int:
    """SecAgg+'s reconstruction threshold for a round whose SecAgg+ starts on `nodes`
    nodes (every node holds a share of every node's secrets): `fraction` of them rounded
    up, 0 meaning a strict majority (nodes // 2 + 1), at least 2 and at most `nodes`.
    That many nodes' shares reconstruct a lost node's masks; fewer survivors fail the
    round."""
    fraction = checked_threshold(fraction)
    wanted = nodes // 2 + 1 if fraction == 0.0 else math.ceil(fraction * nodes - 1e-9)
    return min(nodes, max(MIN_NODES, wanted))


class _Exchange:
    """What `SecAggPlusWorkflow`'s stages call on a grid (`send_and_receive`), through
    `nodes.exchange` (Flower's own sleeps 3 s between pulls); it notes, for the last
    exchange, how many nodes were asked and which did not answer or answered with an
    error, and why (`sent`, `lost`)."""

    def __init__(self, grid, poll_s: float, traffic=None, expected=None):
        self.grid, self.poll_s, self.sent, self.lost = grid, poll_s, 0, {}
        self.traffic = traffic  # a RoundReport's Traffic: SecAgg+'s messages counted
        self.expected = expected  # secagg_replies.Expected: what the replies may hold
        self.stage = ""  # the SecAgg+ stage (Flower's name) the exchange is for

    def send_and_receive(self, messages, *, timeout=None) -> list:
        from fax_bridge.flower import nodes

        messages = list(messages)
        replies = nodes.exchange(self.grid, messages, timeout, self.poll_s)
        self.sent, self.lost = len(messages), {}
        if self.traffic is not None:
            from fax_bridge.flower.records import content_bytes

            self.traffic.rpcs += len(messages)
            self.traffic.bytes_down += sum(content_bytes(m.content) for m in messages)
            self.traffic.bytes_up += sum(content_bytes(r.content)
                                         for r in replies.values() if not r.has_error())
        from fax_bridge.flower import secagg_replies

        accepted = []
        for m in messages:
            node = m.metadata.dst_node_id
            reply = replies.get(node)
            if reply is None:
                self.lost[node] = f"no answer within {timeout}s"
            elif reply.has_error():
                self.lost[node] = str(reply.error.reason)[:500]
            else:
                try:  # the workflow sees only replies of the stage's form
                    secagg_replies.check(self.stage, m, reply, self.expected)
                except FleetError as e:
                    self.lost[node] = f"a malformed reply: {e}"
                else:
                    accepted.append(reply)
        return accepted


def _strategy(ids: list, config: dict):
    """A Flower strategy for one SecAgg+ phase: fit on nodes `ids` with `config`, keeping
    the reconstructed vector and the contributing nodes (`.vector`, `.contributors`)."""
    from flwr.common import FitIns, Parameters, parameters_to_ndarrays
    from flwr.server.compat.grid_client_proxy import GridClientProxy
    from flwr.server.strategy import Strategy

    class Capture(Strategy):
        vector = None
        contributors: list = []
        node_ids = list(ids)

        def initialize_parameters(self, client_manager):
            return None

        def configure_fit(self, server_round, parameters, client_manager):
            empty = Parameters(tensors=[], tensor_type="numpy.ndarray")
            return [(GridClientProxy(n, None, 0), FitIns(empty, dict(config)))
                    for n in self.node_ids]

        def aggregate_fit(self, server_round, results, failures):
            self.contributors = sorted(proxy.node_id for proxy, _ in results)
            if results:  # every result holds the same reconstructed vector
                self.vector = parameters_to_ndarrays(results[0][1].parameters)
            return None, {}

        def configure_evaluate(self, server_round, parameters, client_manager):
            return []

        def aggregate_evaluate(self, server_round, results, failures):
            return None, {}

        def evaluate(self, server_round, parameters):
            return None

    return Capture()


def _stages(link: _Exchange, strategy, round_index: int, quant: Quantization,
            shares: int, wait_s: float, where: str):
    """Runs Flower's `SecAggPlusWorkflow` stage by stage over the strategy's nodes,
    yielding (stage name, whether the workflow goes on) after each; FleetError naming
    `where` when a stage cannot use the replies it accepted (`secagg_replies`)."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
    from flwr.server.compat.legacy_context import LegacyContext
    from flwr.server.workflow import SecAggPlusWorkflow
    from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
    from flwr.server.workflow.constant import Key as WorkflowKey
    from flwr.server.workflow.secure_aggregation.secaggplus_workflow import WorkflowState

    from flwr.server.client_manager import SimpleClientManager
    from flwr.server.compat.grid_client_proxy import GridClientProxy

    nodes = SimpleClientManager()  # the nodes SecAgg+ runs over: what its log counts
    for node_id in strategy.node_ids:
        nodes.register(GridClientProxy(node_id, None, 0))
    context = LegacyContext(Context(run_id=0, node_id=0, node_config={},
                                    state=RecordDict(), run_config={}), strategy=strategy,
                            client_manager=nodes)
    context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord(
        {WorkflowKey.CURRENT_ROUND: round_index})
    context.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
    workflow = SecAggPlusWorkflow(
        num_shares=1.0, reconstruction_threshold=shares, max_weight=1.0,
        clipping_range=float(quant.center), quantization_range=quant.levels,
        modulus_range=MOD_RANGE, timeout=wait_s)
    from flwr.common.secure_aggregation.secaggplus_constants import Stage

    state = WorkflowState()
    for name, flwr_name, step in zip(STAGES, Stage.all(), (
            workflow.setup_stage, workflow.share_keys_stage,
            workflow.collect_masked_vectors_stage, workflow.unmask_stage)):
        link.sent, link.lost, link.stage = 0, {}, flwr_name
        try:
            going = step(link, context, state)
        except (ArithmeticError, LookupError, TypeError, ValueError) as e:
            # what no single reply shows: the nodes' shares do not combine
            raise FleetError(
                f"{where}: SecAgg+'s {name} stage could not combine the replies of nodes "
                f"{sorted(strategy.node_ids)} ({type(e).__name__}: {str(e)[:200]}): a node "
                "sent shares or keys that do not fit the others' (forged, or another "
                f"SecAgg+); {_LOSS_FIX}") from None
        yield name, going


def _lose(live: list, link: _Exchange, stage: str, shares: int, started: int, where: str,
          drop, index: dict) -> list:
    """Hands the nodes lost at `stage` (`link.lost`) to the round's policy (`drop`) and
    returns the nodes left in the round. Before the masked vectors are summed a lost
    node leaves the round with its clients (its answer is left out); one lost during
    the unmask stage has its vector in the sum already, so its clients stay. Raises
    FleetError when fewer nodes than the reconstruction threshold answered `stage`."""
    from fax_bridge.rounds.engine import LostHolder

    kept = stage == STAGES[-1]
    by_id = {node.node_id: (node, mine) for node, mine in live}
    named, lost = [], []
    for node_id, why in sorted(link.lost.items()):
        node, mine = by_id[node_id]
        named.append(f"{node.name}: lost during SecAgg+'s {stage} stage ({why})")
        lost.append(LostHolder(named[-1] + ", after its masked vector was summed: its "
                               "clients stay in the round", np.zeros(0, np.int64))
                    if kept else LostHolder(named[-1], mine, answer=index[node_id]))
    left = link.sent - len(lost)
    if left < shares:
        problem = (
            f"{where}: lost {'; '.join(named)}; only {left} of the {link.sent} nodes "
            f"asked answered that stage, fewer than SecAgg+'s reconstruction threshold of "
            f"{shares} shares (run config secagg-threshold, of the {started} nodes that "
            f"started SecAgg+); {_LOSS_FIX}, or lower secagg-threshold (fewer nodes then "
            "suffice to unmask a node)")
        try:
            drop(lost)
        except FleetError as e:
            problem += f"; {e}"
        raise FleetError(problem)
    drop(lost)
    return live if kept else [(n, m) for n, m in live if n.node_id not in link.lost]


def aggregate(grid, split, answered: Sequence, round_index: int, wait_s: float,
              poll_s: float, drop, threshold: float = 0.0, traffic=None) -> dict:
    """{aggregation local: its total} of the round's secure sums (none: {}), summed by
    SecAgg+ over the nodes that answered the round's `train` message: `answered` holds
    (node, its participants) in node order, the order of the engine's answers.

    A node lost at a stage goes to `drop` (the engine's policy, which fails the round
    below min_clients) unless fewer nodes than SecAgg+'s reconstruction threshold
    (`shares_needed(threshold, ...)`) answered that stage, which fails the round.
    Lost during setup or share keys, before any masked vector exists: SecAgg+ starts
    again over the nodes left. During collect masked vectors: the unmask stage removes
    the lost nodes' masks from the others' shares, and the totals are over the nodes
    left. During unmask: the lost node's vector is in the sum, so it stays in the round
    (starting again without it would show the ServerApp its partial, as the difference
    of two sums). `traffic` (the round report's): SecAgg+'s messages are counted in its
    bytes and RPCs."""
    secure = secure_aggregations(split)
    if not secure:
        return {}
    where = f"round {round_index} (SecAgg+)"
    index = {node.node_id: i for i, (node, _) in enumerate(answered)}
    live, shares = list(answered), None
    while True:
        quant = choose(secure, [len(mine) for _, mine in live])
        if shares is None:
            shares = shares_needed(threshold, len(live))
        strategy = _strategy([node.node_id for node, _ in live],
                             {ROUND_KEY: round_index, CENTER_KEY: quant.center})
        from fax_bridge.flower.secagg_replies import Expected

        link = _Exchange(grid, poll_s, traffic, Expected(carried_size(secure), len(live)))
        again = False
        for stage, going in _stages(link, strategy, round_index, quant, shares, wait_s,
                                    where):
            if link.lost:
                live = _lose(live, link, stage, shares, len(answered), where, drop, index)
                again = stage in STAGES[:2]
                if again:
                    break
            if not going:
                raise FleetError(f"{where}: SecAgg+ stopped at its {stage} stage with no "
                                 f"node lost; {_LOSS_FIX}")
        if not again:
            break
    contributors = set(strategy.contributors)
    if strategy.vector is None or contributors != {node.node_id for node, _ in live}:
        raise FleetError(f"{where}: SecAgg+ summed the vectors of nodes "
                         f"{sorted(contributors)}, not of the nodes left in the round "
                         f"{[node.node_id for node, _ in live]}; {_LOSS_FIX}")
    from logging import INFO

    from flwr.supercore import log as flwr_log

    flwr_log(INFO, f"fax_bridge: {where}: summed the secure sums of nodes "
                   f"{sorted(contributors)}")
    totals = recover(strategy.vector, quant, len(contributors))
    return totals_of(secure, totals, sum(len(mine) for _, mine in live), where)
