"""The round engine: one round of a `RoundSplit`, end to end, over a pluggable transport.

A round by split always runs the same way, wherever its clients live:

  server prepare   `server_steps.prepare`, here;
  broadcast and    the transport sends the client part and the broadcast values to the
  client part      holders of the cohort's clients (device processes, Flower SuperNodes,
                   or this process) and returns one `HolderAnswer` per holder that
                   answered, in client order, and a `LostHolder` per holder that did not;
  check            every answer checked (`validate.check_partial`, `check_pending`)
                   before any is merged; a holder is not trusted, so one whose answer
                   no honest holder of its clients could send is refused by name and
                   dropped from the round as a lost holder is;
  merge, finish    partials merged in client order (`aggregation.merge`), finished;
  secure sums      where the transport sums the split's secure sums itself (Flower's
                   SecAgg+: `Answers.secure`), the answers carry partials of the other
                   aggregations only, and their totals come from that phase, run over
                   the holders that answered once the lost ones are dropped; a holder
                   the phase loses before it contributes is dropped by the same policy,
                   its partials left out of every aggregation, so the whole round is
                   over the holders left;
  server result    `server_steps.result`, checked against the computation's type.

`check_and_merge` is the one loop that checks and merges holders' partials; the phase
path's device aggregation (`GrpcClientsBackend`) uses it too. A `Transport` is the only
thing that differs between the in-process run (`fax_bridge.in_process`), the gRPC device
fleet (`fleet.grpc_transport.GrpcTransport`) and Flower
(`flower.transport.FlowerTransport`).

The round's policy is here too, written once for every fleet: `open_round` samples the
cohort (`policy.plan_round`), records the `RoundReport` and applies `min_clients`
(with `min_clients=0`, a round may have no clients: its sums are then the zero of their
types, and a program with a mean, weighted mean, min or max, which have no value there,
is refused before its first round, `empty_rounds_refusal`); `drop_lost` takes lost
holders' clients out of a round and applies `min_clients` again.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Protocol, Sequence, Union

import numpy as np
from federated_language.common_libs import structure
from federated_language.proto.computation_pb2 import Computation

from fax_bridge.errors import FleetError
from fax_bridge.language.primitive_facts import KIND_OF_URI
from fax_bridge.rounds import server_steps, validate
from fax_bridge.rounds.cohort import Cohort
from fax_bridge.rounds.ids import ClientIds
from fax_bridge.rounds.round_split import RoundSplit, client_partials
from fax_bridge.rounds.policy import (RoundPolicy, RoundReport, Traffic, check_min_clients,
                                      plan_round)
from fax_bridge.runtime import aggregation, values
from fax_bridge.runtime.backend import from_leaves


@dataclasses.dataclass
class HolderAnswer:
    """One holder's answer for its clients: one partial per aggregation, either as it
    arrived (an `AggregateResponse`, checked before use) or an `aggregation.Partial`
    computed in this process (nothing to check). `clients`: the population ids of the
    clients it was sent, which leave the round with it when its answer is refused
    (None: a refused answer fails the round)."""

    where: str         # names the holder in errors
    num_clients: int   # the clients it was sent
    partials: list
    compute_s: float = 0.0
    clients: Optional[np.ndarray] = None


@dataclasses.dataclass
class LostHolder:
    """A holder that did not answer, or whose answer was refused: its name (and why),
    and the clients it held (that the round goes on without). `answer`: for a holder
    whose answer the engine refused (`check_answers`) or a secure phase lost after it
    answered, the index of its answer in `Answers.answered`, whose partials then leave
    the round too (None: it had not answered, or its answer stays in the round).
    `refused`: it answered, but with an answer no honest holder could send, which was
    refused (by the engine or the transport); False: it did not answer, or was lost."""

    where: str
    clients: np.ndarray
    answer: Optional[int] = None
    refused: bool = False


@dataclasses.dataclass
class Answers:
    """What a transport brings back: the answers in client order, and the lost holders.
    `secure`: where the transport sums the split's secure sums in a phase of its own,
    that phase, called with `drop` and returning {aggregation local: its total}; the
    answers then hold partials of the other aggregations only (`plain_aggregations`).
    The phase calls `drop(lost)` with the `LostHolder`s it loses (each naming its
    answer) before it goes on without them; `drop` raises when the round's policy
    fails the round."""

    answered: list
    lost: list = dataclasses.field(default_factory=list)
    secure: Optional[Callable[[Callable[[list], None]], dict]] = None


class Transport(Protocol):
    """How a round's client part reaches the clients and their partials come back.

    `num_clients`: the round's clients, as its caller counted them once (the plan's
    participants, or `cohort.clients_of` in process: the transport counts nothing
    itself); `backend`: what the server steps' interpreter
    path runs on (None where there is none); `reject_nonfinite`: refuse NaN and
    infinities in answers; `traffic`: where the engine adds the partials' payload and
    the holders' compute (None: not counted); `rounded_partials`: the holders send
    rounded float partials (`RoundPolicy.rounded_partials`), which the checks accept.
    """

    num_clients: int
    backend: Any
    reject_nonfinite: bool
    rounded_partials: bool
    traffic: Optional[Traffic]

    def run_clients(self, split: RoundSplit, sent: structure.Struct) -> Answers:
        """Runs `split`'s client part with the broadcast values `sent` on every holder of
        the round's clients; a holder that cannot be reached either raises (the caller
        retries the round) or comes back as a `LostHolder`."""
        ...


def check_and_merge(checks: Sequence[tuple], answers: Sequence[HolderAnswer],
                    reject_nonfinite: bool = False,
                    traffic: Optional[Traffic] = None) -> list:
    """The aggregates' totals (`aggregation.Partial`, one per entry of `checks`) over
    `answers`, which are in client order. `checks`: per aggregation, (kind, its value's
    leaf types, its weight's leaf types, the secure sum's tops or None). Every answer is
    checked before any is merged."""
    return merge_checked(checks, check_answers(checks, answers, reject_nonfinite,
                                               traffic))


def check_answers(checks: Sequence[tuple], answers: Sequence[HolderAnswer],
                  reject_nonfinite: bool = False,
                  traffic: Optional[Traffic] = None, rounded: bool = False,
                  refused: Optional[list] = None) -> list:
    """Each answer's partials (`aggregation.Partial`, one per entry of `checks`), every
    one checked (`check_and_merge`), in the answers' order; nothing is merged.
    `rounded`: the round asked for rounded partials (`RoundPolicy.rounded_partials`).
    A holder is not trusted: an answer no honest holder of its clients could send (the
    wrong number of partials, tensors, shapes, dtypes or clients, values out of reach)
    raises FleetError naming the holder and what was wrong, or, given a `refused` list
    and the holder's `clients`, is appended to it as a `LostHolder` (naming it, why,
    its clients and its answer) and stands as None in the list returned."""
    out: list = []
    pending: list = []  # float64-form leaves of every answer, checked together
    owners: list = []   # the answer each entry of `pending` came from

    def refuse(index: int, error: FleetError) -> None:
        answer = answers[index]
        if refused is None or answer.clients is None:
            raise error
        refused.append(LostHolder(f"{error} (an impossible answer)", answer.clients,
                                  answer=index, refused=True))
        out[index] = None

    for index, answer in enumerate(answers):
        out.append(None)
        mine: list = []
        try:
            found, payload = _check_answer(checks, answer, reject_nonfinite, mine, rounded)
        except FleetError as e:
            refuse(index, e)
            continue
        out[index] = found
        pending.extend(mine)
        owners.extend([index] * len(mine))
        if traffic is not None:
            traffic.compute_seconds += answer.compute_s
            traffic.payload_up += payload
    try:
        validate.check_pending(pending)
    except FleetError:
        if refused is None:
            raise
        for index in sorted(set(owners)):  # which answers hold what failed
            try:
                validate.check_pending([p for p, o in zip(pending, owners) if o == index])
            except FleetError as e:
                refuse(index, e)
    return out


def _check_answer(checks: Sequence[tuple], answer: HolderAnswer, reject_nonfinite: bool,
                  pending: list, rounded: bool) -> tuple[list, int]:
    """(One answer's partials, checked but for the float64-form leaves left in
    `pending`; their payload bytes); FleetError naming the holder otherwise."""
    if len(answer.partials) != len(checks):
        raise FleetError(f"{answer.where}: {len(answer.partials)} partials for "
                         f"{len(checks)} aggregations")
    found, payload = [], 0
    for (kind, value_types, weight_types, tops), message in zip(checks, answer.partials):
        if isinstance(message, aggregation.Partial):
            found.append(message)  # computed in this process
            continue
        partial, size = validate.check_partial(
            message, kind, value_types, weight_types, answer.num_clients, answer.where,
            reject_nonfinite, tops, pending=pending, rounded=rounded)
        payload += size
        found.append(partial)
    return found, payload


def merge_checked(checks: Sequence[tuple], checked: Sequence[list]) -> list:
    """The totals of answers' partials checked by `check_answers`, merged in order."""
    totals = [aggregation.Partial(kind=c[0], leaves=[]) for c in checks]
    for found in checked:  # in client order
        for total, partial in zip(totals, found):
            aggregation.merge(total, partial)
    return totals


def split_checks(aggregations: Sequence) -> list:
    """`check_and_merge`'s checks for a split's aggregations (`RoundSplit.aggregations`,
    or `plain_aggregations`)."""
    return [(a.kind, *a.leaf_types, None) for a in aggregations]


def plain_aggregations(split: RoundSplit) -> list:
    """The split's aggregations other than secure sums, in split order: those whose
    partials cross as answers where a transport sums the secure ones itself."""
    return [a for a in split.aggregations if not a.secure]


def run_round(split: RoundSplit, arg: Any, transport: Transport, result_type=None,
              on_lost: Optional[Callable[[list, int], None]] = None) -> Any:
    """One round of `split` (module docstring); `arg` is the parameter's runtime value
    (its CLIENTS elements are the transport's business). `on_lost(lost, answered)` is
    called with the lost holders and those whose answers were refused (`check_answers`:
    an answer no honest holder could send; and how many answered and are still in the
    round) after every answer is checked; it raises to fail the round, else the round
    finishes without those clients. Without it, a lost holder or a refused answer fails
    the round. The result is
    checked against `result_type` when given. Where the answers come with a secure
    phase (`Answers.secure`), the phase runs after `on_lost`, over the holders that
    answered; the holders it loses go through `on_lost` too and their answers are left
    out, and only then are the other aggregations merged."""
    n = transport.num_clients
    env = server_steps.prepare(split, arg, transport.backend, n)
    sent = structure.Struct([(None, env[name]) for name in split.broadcasts])
    answers = transport.run_clients(split, sent)
    merged = split.aggregations if answers.secure is None else plain_aggregations(split)
    checks = split_checks(merged)
    refused: Optional[list] = None if on_lost is None else []
    checked = check_answers(checks, answers.answered, transport.reject_nonfinite,
                            transport.traffic, transport.rounded_partials, refused)
    out: set = set()  # answers refused, or left out by the secure phase

    def drop(lost: list) -> None:
        nonlocal n
        if on_lost is None:
            raise FleetError("holders of the round's clients did not answer: "
                             + "; ".join(h.where for h in lost))
        out.update(h.answer for h in lost if h.answer is not None)
        on_lost(lost, len(answers.answered) - len(out))
        n -= sum(len(h.clients) for h in lost)

    lost = [*answers.lost, *(refused or [])]
    if lost:
        drop(lost)
    if answers.secure is not None and len(answers.answered) > len(out):
        env.update(answers.secure(drop))
    elif answers.secure is not None:  # no holder left: every aggregation is over none
        merged, checks, checked = split.aggregations, split_checks(split.aggregations), []
    totals = merge_checked(checks, [c for i, c in enumerate(checked) if i not in out])
    for agg, total in zip(merged, totals):
        env[agg.local] = from_leaves(agg.member_type,
                                     aggregation.finish(total, agg.member_type))
    result = server_steps.result(split, env, transport.backend, n)
    return result if result_type is None else values.check_value(result, result_type,
                                                                 "result")


# -- the round's policy, for every fleet -------------------------------------------------


def open_round(policy: RoundPolicy, population: Union[Cohort, int, None], round_index: int,
               reports: list, devices: int,
               program: Optional[Computation] = None) -> RoundReport:
    """Samples round `round_index`'s clients (`policy.plan_round`) from `population`, the
    round's `Cohort` (`Cohort.of`: derived and checked once) or the population's size,
    and appends its `RoundReport` to `reports` (before anything runs, so a failed round
    leaves one too); raises FleetError, recorded in the report, when fewer than
    `min_clients` take part, or when `program` (the round's computation) aggregates
    with a kind that has no value over zero clients while the policy lets a round run
    with none (`empty_rounds_refusal`), whatever this round's draw. `population` None:
    no client takes part, nothing to check."""
    counted = (population if isinstance(population, Cohort)
               else Cohort.of(policy.cohort_size, population or 0))
    planned = plan_round(policy, counted, round_index)
    rep = RoundReport(round=round_index, population=counted.population, cohort=planned.cohort,
                      dropped=planned.dropped, late=planned.late,
                      participants=planned.participants, delays_s=planned.delays_s,
                      devices=devices)
    reports.append(rep)
    if population is not None:
        try:
            refusal = empty_rounds_refusal(policy, program)
            if refusal:
                raise FleetError(f"round {round_index}: {refusal}")
            check_min_clients(policy, planned, round_index)
        except FleetError as e:
            rep.error = str(e)
            raise
    return rep


def empty_rounds_refusal(policy: RoundPolicy, program: Optional[Computation]
                         ) -> Optional[str]:
    """Why `policy` cannot run rounds of `program`, or None: with `min_clients=0` a round
    may be left with no clients, where a sum is the zero of its type but a mean,
    weighted mean, min or max has no value (`aggregation.empty_refusal`); refused before
    any round runs rather than in the round that happens to draw none."""
    if policy.min_clients > 0 or program is None:
        return None
    from fax_bridge.tff.forms import intrinsic_uris

    kinds = sorted({KIND_OF_URI[u] for u in intrinsic_uris(program) if u in KIND_OF_URI})
    refusals = [r for r in map(aggregation.empty_refusal, kinds) if r]
    if not refusals:
        return None
    return (f"min_clients=0 lets a round run with no clients, but {'; '.join(refusals)}; "
            "set min_clients to at least 1 (min-clients in a Flower app's run config), "
            "or aggregate with federated_sum, whose value over no clients is the zero "
            "of its type")


def drop_lost(rep: RoundReport, policy: RoundPolicy, lost: Sequence[LostHolder],
              fix: str) -> None:
    """Takes the lost holders' clients out of the round `rep` reports (its
    `lost_devices`, `lost_clients`, `participants`); raises FleetError, recorded in the
    report, when fewer than `min_clients` are left (`fix`: what the user can change)."""
    record_lost(rep, lost)
    if len(rep.participants) < policy.min_clients:
        rep.error = (f"round {rep.round}: lost {'; '.join(rep.lost_devices)}, taking "
                     f"clients {listed(rep.lost_clients)} with them; only "
                     f"{len(rep.participants)} clients are left but "
                     f"min_clients={policy.min_clients}; {fix}")
        raise FleetError(rep.error)


def record_lost(rep: RoundReport, lost: Sequence[LostHolder]) -> None:
    """Records lost holders in `rep` (`drop_lost` without the `min_clients` check)."""
    rep.lost_devices.extend(h.where for h in lost)
    gone = np.concatenate([np.asarray(h.clients, np.int64) for h in lost])
    rep.lost_clients = ClientIds(np.union1d(rep.lost_clients.array(), gone))
    rep.participants = rep.participants.without(gone)


def listed(ids: ClientIds, shown: int = 20) -> str:
    """The first `shown` ids of a set, and how many more there are."""
    more = f" and {len(ids) - shown} more" if len(ids) > shown else ""
    return f"{list(ids[:shown])}{more}"
