"""The round engine: any split of the clients over holders gives the same bits, every
answer is checked before any is merged, and lost holders go through the one policy."""

from __future__ import annotations

import numpy as np
import pytest
from federated_language.common_libs import structure
from hypothesis import example, given, settings, strategies as st

import fax_bridge as fb
from fax_bridge.errors import FleetError
from fax_bridge.rounds import engine, partials, wire
from fax_bridge import in_process
from fax_bridge.rounds import round_split
from fax_bridge.rounds.ids import ClientIds
from fax_bridge.fleet.pool import Traffic
from fax_bridge.rounds.policy import RoundPolicy
from fax_bridge.runtime import aggregation, interpreter, values
from fax_bridge.runtime.backend import from_leaves

N = 7
PLACE = ("server", "clients", "clients")


@fb.program(clients=N)
def _round(params, x, counts):
    at = fb.federated_broadcast(params * 2.0)
    out = fb.federated_map_clients(lambda p, x: (p + x.sum(), (x * p).mean()), (at, x))
    return (fb.federated_weighted_mean(out[0], counts) + params,
            fb.federated_sum(out[1]), fb.federated_mean(out[1] * 3.0))


def _args(seed: int):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=3).astype(np.float32),
            (rng.normal(size=(N, 3)) * 10.0 ** rng.integers(-3, 4, size=(N, 1))
             ).astype(np.float32),
            rng.uniform(1, 5, size=N).astype(np.float32))


PROTO = fb.export_tff(_round, *_args(0), placements=PLACE)
SPLIT = round_split.split_round(PROTO)
PREPARED = interpreter.prepare(PROTO)


def _forge(messages: list, how: str) -> None:
    """Makes a holder's encoded partials (of `_round`'s aggregations: a weighted mean
    of a [3] value, a sum and a mean of scalars) an answer no honest holder sends, well
    formed on the wire: `how` names what is impossible in it."""
    first = messages[0]
    if how == "clients":  # a count other than the clients it was sent
        first.num_clients += 1
    elif how == "partials":  # a partial too few for the round's aggregations
        messages.pop()
    elif how == "tensors":  # a tensor too many for the aggregated value
        first.leaves.add().CopyFrom(first.leaves[0])
    elif how == "shape":
        first.leaves[0].shape[:] = [3, 2]
    elif how == "dtype":
        first.leaves[0].dtype = "int32"
    elif how == "weights":  # a weighted mean without its weights' partial
        del first.weight_leaves[:]
    elif how == "reach":  # weights no client gives (each client's weight is >= 0)
        weight = first.weight_leaves[0]
        if weight.HasField("addend"):
            wire.encode_tensor(np.float32(-1.0), weight.addend)
        else:
            assert weight.doubles, weight
            weight.doubles = np.float64([-1.0]).tobytes()
    else:
        raise AssertionError(how)


FORGERIES = ("clients", "partials", "tensors", "shape", "dtype", "weights", "reach")


class _Holders:
    """A transport over holders of consecutive blocks of the clients, answering with
    encoded partials as a device does (`lost`: holder indices that do not answer;
    `forged`: holder indices whose answers are impossible as `forgery` says, `_forge`;
    `ids`: the holders name their clients' population ids, so a refused one can leave
    the round)."""

    backend = None
    reject_nonfinite = False
    rounded_partials = False

    def __init__(self, arg, cuts, lost=(), forged=(), forgery="clients", ids=False):
        self.inputs = [arg[i] for i in SPLIT.client_inputs]
        self.num_clients = len(self.inputs[0])
        self.blocks = [range(a, b) for a, b in zip([0, *cuts], [*cuts, self.num_clients])]
        self.lost = set(lost)
        self.forged = {forged} if isinstance(forged, int) else set(forged)
        self.forgery, self.ids = forgery, ids
        self.traffic = Traffic()

    def answering(self, split, sent, out):
        """(holder, its block, its partials) of each holder that answers; the others are
        added to `out.lost`."""
        specs = [a.spec for a in split.aggregations]
        for h, block in enumerate(self.blocks):
            if h in self.lost:
                out.lost.append(engine.LostHolder(f"holder {h}", np.arange(
                    block.start, block.stop)))
                continue
            members = [structure.Struct([(None, c[i]) for c in self.inputs]) for i in block]
            yield h, block, round_split.client_partials(
                split.client_part, split.client_part_hash, sent, members, specs)

    def run_clients(self, split, sent):
        out = engine.Answers([])
        for h, block, found in self.answering(split, sent, out):
            messages = [partials.to_message(p) for p in found]
            if h in self.forged:
                _forge(messages, self.forgery)
            out.answered.append(engine.HolderAnswer(
                f"holder {h}", len(block), messages,
                clients=np.arange(block.start, block.stop) if self.ids else None))
        return out


def _bits(result) -> list:
    return [np.asarray(leaf).tobytes() for leaf in structure.flatten(result)]


def _arg(seed: int, clients=None):
    bound = values.bind_arguments(PREPARED.parameter, _args(seed), {})
    if clients is not None:
        bound = bound.select_clients(np.asarray(clients))
    return bound.runtime_value()


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), cuts=st.sets(st.integers(1, N - 1), max_size=N - 1))
def test_any_split_over_holders_gives_the_in_process_bits(seed, cuts):
    arg = _arg(seed)
    want = in_process.run_in_process(SPLIT, arg)
    transport = _Holders(arg, sorted(cuts))
    got = engine.run_round(SPLIT, arg, transport, PREPARED.result)
    assert _bits(got) == _bits(want)
    assert transport.traffic.payload_up > 0


def test_a_forged_answer_is_refused_before_anything_is_merged(monkeypatch):
    # The engine's merge of holders' partials is watched; a holder's own partial (of
    # its clients' calls, `round_split.client_partials`) is made as usual.
    merged = []
    monkeypatch.setattr(engine, "merge_checked", lambda *a: merged.append(a))
    with pytest.raises(FleetError, match="holder 2: a partial over 4 clients"):
        engine.run_round(SPLIT, _arg(1), _Holders(_arg(1), [2, 4], forged=2))
    assert merged == []  # holders 0 and 1 answered well, yet nothing was merged


@settings(max_examples=40, deadline=None)
@given(forgery=st.sampled_from(FORGERIES), seed=st.integers(0, 2**16),
       cuts=st.sets(st.integers(1, N - 1), min_size=1, max_size=N - 1), data=st.data())
def test_a_holder_with_an_impossible_answer_leaves_the_round_as_a_lost_one(
        forgery, seed, cuts, data):
    """A holder is not trusted: each kind of answer no honest holder of its clients
    sends (well formed on the wire) is refused naming the holder and what was wrong;
    the holder leaves the round with its clients, as a lost one does (the report's
    lost_devices and lost_clients), min_clients is applied again, and the round has the
    honest holders' bits; below min_clients it fails, naming them."""
    arg, cuts = _arg(seed), sorted(cuts)
    blocks = list(zip([0, *cuts], [*cuts, N]))
    forged = data.draw(st.sets(st.integers(0, len(blocks) - 1), min_size=1,
                               max_size=len(blocks) - 1), label="forged")
    honest = [c for h, (a, b) in enumerate(blocks) if h not in forged for c in range(a, b)]
    least = data.draw(st.integers(1, N), label="min_clients")
    policy = RoundPolicy(min_clients=least)
    reports: list = []
    rep = engine.open_round(policy, N, 0, reports, devices=len(blocks))
    answered = []

    def on_lost(lost, left):
        answered.append(left)
        engine.drop_lost(rep, policy, lost, "fix it")

    transport = _Holders(arg, cuts, forged=forged, forgery=forgery, ids=True)
    if len(honest) < least:
        with pytest.raises(FleetError, match=rf"round 0: lost holder {min(forged)}[:,] .*an "
                                             rf"impossible answer.* only {len(honest)} "
                                             rf"clients are left but min_clients={least}"):
            engine.run_round(SPLIT, arg, transport, PREPARED.result, on_lost=on_lost)
        assert "min_clients" in rep.error
        return
    got = engine.run_round(SPLIT, arg, transport, PREPARED.result, on_lost=on_lost)
    assert _bits(got) == _bits(in_process.run_in_process(SPLIT, _arg(seed, honest)))
    assert answered == [len(blocks) - len(forged)]
    assert list(rep.participants) == honest and rep.error is None
    assert sorted(set(range(N)) - set(honest)) == list(rep.lost_clients)
    assert [w.split(":")[0].split(",")[0] for w in rep.lost_devices] == [
        f"holder {h}" for h in sorted(forged)]
    assert all(w.endswith("(an impossible answer)") for w in rep.lost_devices)


def test_lost_holders_fail_the_round_unless_the_policy_drops_them():
    arg = _arg(2)
    with pytest.raises(FleetError, match="did not answer: holder 1"):
        engine.run_round(SPLIT, arg, _Holders(arg, [3], lost=[1]))
    reports: list = []
    rep = engine.open_round(RoundPolicy(min_clients=3), N, 0, reports, devices=2)
    got = engine.run_round(SPLIT, arg, _Holders(arg, [3], lost=[1]), PREPARED.result,
                           on_lost=lambda lost, answered: engine.drop_lost(
                               rep, RoundPolicy(min_clients=3), lost, "fix it"))
    assert _bits(got) == _bits(in_process.run_in_process(SPLIT, _arg(2, range(3))))
    assert reports == [rep] and rep.lost_devices == ["holder 1"]
    assert rep.lost_clients == ClientIds(np.arange(3, N)) and len(rep.participants) == 3
    rep = engine.open_round(RoundPolicy(min_clients=4), N, 1, reports, devices=2)
    with pytest.raises(FleetError, match=r"round 1: lost holder 1, taking clients "
                                         r"\[3, 4, 5, 6\] .*only 3 clients are left but "
                                         r"min_clients=4; fix it"):
        engine.drop_lost(rep, RoundPolicy(min_clients=4),
                         [engine.LostHolder("holder 1", np.arange(3, N))], "fix it")
    assert "min_clients=4" in rep.error


def test_open_round_records_a_report_even_when_min_clients_refuses():
    reports: list = []
    with pytest.raises(FleetError, match="min_clients"):
        engine.open_round(RoundPolicy(cohort_size=2, min_clients=3), N, 0, reports, 1)
    assert len(reports) == 1 and "min_clients" in reports[0].error
    rep = engine.open_round(RoundPolicy(min_clients=3), None, 1, reports, 1)
    assert rep.population == 0 and rep.error is None  # no clients: nothing to check


# -- a transport that sums the secure sums itself (as Flower's SecAgg+ does) -----------


@fb.program(clients=N)
def _secure_round(params, x, counts):
    import jax.numpy as jnp

    at = fb.federated_broadcast(params)
    codes = fb.federated_map_clients(
        lambda p, x: jnp.clip(jnp.abs(x + p) * 10, 0, 255).astype(jnp.int32), (at, x))
    return (fb.federated_secure_sum_bitwidth(codes, 8),
            fb.federated_weighted_mean(x, counts) + params)


SECURE_PROTO = fb.export_tff(_secure_round, *_args(0), placements=PLACE)
SECURE_SPLIT = round_split.split_round(SECURE_PROTO, secure=True)
SECURE_PREPARED = interpreter.prepare(SECURE_PROTO)


class _SecureHolders(_Holders):
    """Holders that answer their plain partials as messages and keep their secure sums'
    partials back for a secure phase of the transport's own (`Answers.secure`), which
    sums them over the holders that answered; `events` records what ran when."""

    def __init__(self, arg, cuts, lost=(), events=None, lost_in_phase=()):
        super().__init__(arg, cuts, lost)
        self.events = events if events is not None else []
        self.lost_in_phase = set(lost_in_phase)

    def run_clients(self, split, sent):
        out, kept = engine.Answers([]), []
        for h, block, found in self.answering(split, sent, out):
            kept.append((h, block, [p for p, a in zip(found, split.aggregations)
                                    if a.secure]))
            out.answered.append(engine.HolderAnswer(f"holder {h}", len(block), [
                partials.to_message(p) for p, a in zip(found, split.aggregations)
                if not a.secure]))

        def secure(drop) -> dict:
            gone = [engine.LostHolder(f"holder {h} (in the secure phase)",
                                      np.arange(block.start, block.stop), answer=i)
                    for i, (h, block, _) in enumerate(kept) if h in self.lost_in_phase]
            if gone:
                drop(gone)
            summed = [k for k in kept if k[0] not in self.lost_in_phase]
            self.events.append(("secure", len(summed)))
            got = {}
            for i, agg in enumerate(a for a in split.aggregations if a.secure):
                total = aggregation.Partial(kind=agg.kind, leaves=[])
                for _, _, holder in summed:
                    aggregation.merge(total, holder[i])
                got[agg.local] = from_leaves(agg.member_type, aggregation.finish(total))
            return got

        out.secure = secure
        return out


def test_the_fleet_splits_no_secure_sum_and_a_flower_split_holds_them():
    assert round_split.split_round(SECURE_PROTO) is None  # the fleet: phase by phase
    kinds = {a.kind: a.secure for a in SECURE_SPLIT.aggregations}
    assert kinds == {"secure_sum_bitwidth": True, "weighted_mean": False}
    assert [a.kind for a in engine.plain_aggregations(SECURE_SPLIT)] == ["weighted_mean"]


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), cut=st.integers(1, N - 1), lose=st.booleans())
def test_a_transports_secure_phase_runs_after_the_lost_are_dropped(seed, cut, lose):
    """The engine merges only the plain aggregations; the secure phase runs once the
    policy has dropped the lost holders, over those that answered, and the round has
    the bits of the in-process round over them."""
    arg, events = _arg(seed), []
    lost = [1] if lose else []
    transport = _SecureHolders(arg, [cut], lost=lost, events=events)
    got = engine.run_round(SECURE_SPLIT, arg, transport, SECURE_PREPARED.result,
                           on_lost=lambda gone, answered: events.append(("lost", answered)))
    survivors = range(cut) if lose else range(N)
    want = in_process.run_in_process(SECURE_SPLIT, _arg(seed, survivors))
    assert _bits(got) == _bits(want)
    assert events == ([("lost", 1)] if lose else []) + [("secure", 2 - lose)]

    def refuse(gone, answered):
        raise FleetError("too few")

    events.clear()
    with pytest.raises(FleetError, match="too few"):
        engine.run_round(SECURE_SPLIT, arg, _SecureHolders(arg, [cut], [1], events),
                         on_lost=refuse)
    assert events == []  # the policy refused: no secure phase over a failed round


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), cuts=st.sets(st.integers(1, N - 1), min_size=2,
                                                 max_size=4), data=st.data())
def test_holders_the_secure_phase_loses_leave_every_aggregation_of_the_round(
        seed, cuts, data):
    """A holder lost in the secure phase, after its answer was checked, goes through
    the policy; its plain partials are left out too, so the round has the in-process
    bits over the holders left; the policy can still fail the round."""
    arg, events, cuts = _arg(seed), [], sorted(cuts)
    blocks = list(zip([0, *cuts], [*cuts, N]))
    gone = data.draw(st.sets(st.integers(0, len(blocks) - 1), min_size=1,
                             max_size=len(blocks) - 1))
    transport = _SecureHolders(arg, cuts, events=events, lost_in_phase=gone)
    reports: list = []
    rep = engine.open_round(RoundPolicy(), N, 0, reports, devices=len(blocks))
    got = engine.run_round(SECURE_SPLIT, arg, transport, SECURE_PREPARED.result,
                           on_lost=lambda lost, answered: (
                               events.append(("lost", answered)),
                               engine.drop_lost(rep, RoundPolicy(), lost, "fix it")))
    survivors = [c for h, (a, b) in enumerate(blocks) if h not in gone
                 for c in range(a, b)]
    want = in_process.run_in_process(SECURE_SPLIT, _arg(seed, survivors))
    assert _bits(got) == _bits(want)
    assert events == [("lost", len(blocks) - len(gone)), ("secure", len(blocks) - len(gone))]
    assert list(rep.participants) == survivors
    assert rep.lost_devices == [f"holder {h} (in the secure phase)" for h in sorted(gone)]
    rep = engine.open_round(RoundPolicy(min_clients=N), N, 1, reports, len(blocks))
    with pytest.raises(FleetError, match=r"round 1: lost holder .*in the secure phase.*"
                                         r"min_clients=7; fix it"):
        engine.run_round(SECURE_SPLIT, arg, _SecureHolders(arg, cuts, lost_in_phase=gone),
                         on_lost=lambda lost, answered: engine.drop_lost(
                             rep, RoundPolicy(min_clients=N), lost, "fix it"))


# -- rounds over zero clients ----------------------------------------------------------


def _one_kind(kind: str):
    """A round of one aggregation of `kind` over the clients' values (min and max: a sum
    whose intrinsic names them instead, as protos written elsewhere may)."""
    import jax.numpy as jnp

    aggregate = {
        "sum": lambda v, c: fb.federated_sum(v), "min": lambda v, c: fb.federated_sum(v),
        "max": lambda v, c: fb.federated_sum(v), "mean": lambda v, c: fb.federated_mean(v),
        "weighted_mean": lambda v, c: fb.federated_weighted_mean(v, c),
        "secure_sum_bitwidth": lambda v, c: fb.federated_secure_sum_bitwidth(
            fb.federated_map_clients(lambda x: jnp.clip(x * 10, 0, 255).astype(
                jnp.int32), v), 8),
        "secure_sum": lambda v, c: fb.federated_secure_sum(
            fb.federated_map_clients(lambda x: jnp.clip(x * 10, 0, 99).astype(
                jnp.int16), v), 99)}[kind]

    @fb.program(clients=N)
    def one(params, x, counts):
        at = fb.federated_broadcast(params)
        return params * 2.0, aggregate(fb.federated_map_clients(
            lambda p, x: jnp.abs(x * p), (at, x)), counts)

    proto = fb.export_tff(one, *_args(0), placements=PLACE)
    if kind in ("min", "max"):
        for node in _intrinsics(proto):
            if node.uri == "federated_sum":
                node.uri = f"federated_{kind}"
    return proto


def _intrinsics(message):
    from federated_language.proto import computation_pb2

    if isinstance(message, computation_pb2.Intrinsic):
        yield message
        return
    for field, value in message.ListFields():
        if field.message_type is not None and \
                field.message_type.full_name.startswith("federated_language."):
            repeated = getattr(field, "is_repeated", None)
            repeated = field.label == field.LABEL_REPEATED if repeated is None else repeated
            for item in (value if repeated else [value]):
                yield from _intrinsics(item)


_KINDS = sorted(aggregation.KINDS)
_ONE_KIND = {kind: _one_kind(kind) for kind in _KINDS}


@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(_KINDS), population=st.integers(1, N),
       dropout=st.sampled_from([0.0, 0.5, 0.9]), seed=st.integers(0, 2**16),
       least=st.integers(0, N), cut=st.integers(0, N))
@example(kind="sum", population=3, dropout=0.9, seed=0, least=0, cut=0)  # none left
@example(kind="secure_sum", population=3, dropout=0.9, seed=0, least=0, cut=0)
@example(kind="secure_sum_bitwidth", population=3, dropout=0.9, seed=0, least=0, cut=0)
@example(kind="mean", population=3, dropout=0.0, seed=0, least=0, cut=0)  # all report
@example(kind="max", population=3, dropout=0.9, seed=0, least=1, cut=0)
@example(kind="weighted_mean", population=7, dropout=0.5, seed=1, least=2, cut=2)
def test_a_round_over_zero_clients_sums_to_zero_or_is_refused_before_it_runs(
        kind, population, dropout, seed, least, cut):
    """Any population, dropout and min_clients in 0..population: a round that keeps at
    least min_clients clients runs over them (holders' answers checked and merged); one
    left with none (min_clients=0) gives its sums the zero of their type; and a program
    with an aggregation that has no value over zero clients is refused with
    min_clients=0 before its first round, whatever that round draws, naming the round,
    the aggregation and the fix."""
    min_clients = min(least, population)
    policy = RoundPolicy(dropout=dropout, seed=seed, min_clients=min_clients)
    proto = _ONE_KIND[kind]
    split = round_split.split_round(proto, secure=True)
    prepared = interpreter.prepare(proto)
    reports: list = []
    if min_clients == 0 and aggregation.empty_refusal(kind):
        with pytest.raises(FleetError, match=rf"^round 3: min_clients=0 lets a round run "
                                             rf"with no clients, but federated_{kind} has "
                                             r"no value over zero clients \(.+\); set "
                                             r"min_clients to at least 1.*federated_sum"):
            engine.open_round(policy, population, 3, reports, 1, proto)
        assert reports[0].error.startswith("round 3: min_clients=0")
        return
    try:
        rep = engine.open_round(policy, population, 3, reports, 1, proto)
    except FleetError:
        assert 0 < min_clients and reports[0].error
        return
    ids = rep.participants.array()
    assert len(ids) >= min_clients
    args = [a[:population] if i else a for i, a in enumerate(_args(seed))]
    bound = values.bind_arguments(prepared.parameter, args, {}).select_clients(ids)
    arg = bound.runtime_value()
    got = in_process.run_in_process(split, arg, num_clients=len(ids))
    result_type = prepared.result
    values.check_value(got, result_type, "result")
    aggregate = np.asarray(got[1])
    if not len(ids):  # the zero of the member type: its dtype and shape
        assert aggregate.shape == (3,) and not aggregate.any()
        assert aggregate.dtype == {"secure_sum": np.int16,
                                   "secure_sum_bitwidth": np.int32}.get(kind, np.float32)
        return
    holders = _Holders(arg, [cut] if 0 < cut < len(ids) else [])
    holders.inputs = [arg[i] for i in split.client_inputs]
    assert _bits(engine.run_round(split, arg, holders, result_type)) == _bits(got)
