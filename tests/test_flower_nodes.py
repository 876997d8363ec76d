"""The ServerApp's discovery of the SuperNodes' blocks (`fax_bridge.flower.nodes`):
each node's answer is read strictly and bounded by the run's population before
anything is kept per client; a node whose answer is missing, an error or anything but
two whole numbers inside the population is left out and named, and the run goes on
with the others while their blocks tile the population and min-nodes hold."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import example, given, settings, strategies as st

from fax_bridge.errors import FleetError

flwr = pytest.importorskip("flwr")
from flwr.app import (ConfigRecord, Error, Message, MetricRecord,  # noqa: E402
                      RecordDict)

from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from fax_bridge.flower import nodes, records  # noqa: E402


@pytest.fixture(autouse=True)
def _task_identity():
    """Flower's messages take their run from the task's identity: a ServerApp's."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1


class _Grid:
    """Answers each `query` with `answers[node]`: a dict (the metrics record), a
    RecordDict (the whole content), "error", or None (no answer)."""

    def __init__(self, answers: dict):
        self.answers, self.replies = answers, {}

    def push_messages(self, messages):
        ids = []
        for message in messages:
            message_id = uuid.uuid4().hex
            message.metadata.__dict__["_message_id"] = message_id
            answer = self.answers[message.metadata.dst_node_id]
            if isinstance(answer, dict):
                answer = RecordDict({records.METRICS: MetricRecord(answer)})
            if answer == "error":
                self.replies[message_id] = Message(Error(code=0, reason="it failed"),
                                                   reply_to=message)
            elif answer is not None:
                self.replies[message_id] = Message(answer, reply_to=message)
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids):
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]


def _discover(answers: dict, population: int = 0, min_nodes: int = 1):
    logged = []
    found = nodes.discover(_Grid(answers), sorted(answers), 0.5, 0.01, population,
                           min_nodes, logged.append)
    return [(n.node_id, n.first, n.stop) for n in found], logged


def test_honest_blocks_tile_the_population():
    answers = {7: {"first-client": 4, "num-clients": 2},
               3: {"first-client": 0, "num-clients": 4}}
    assert _discover(answers) == ([(3, 0, 4), (7, 4, 6)], [])
    assert _discover(answers, population=6)[0] == [(3, 0, 4), (7, 4, 6)]


_FORGED = st.one_of(
    st.integers(-2 ** 70, 2 ** 70), st.floats(allow_nan=True),
    st.lists(st.integers(0, 3), max_size=3), st.sampled_from([2 ** 23, 10 ** 6, 2 ** 40]))


@st.composite
def _answers(draw):
    """A forged answer of node 9, beside honest nodes 1 and 2 holding clients 0..5."""
    how = draw(st.sampled_from(["first", "count", "keys", "missing", "config", "empty",
                                "error", "silent"]))
    forged: object = {"first-client": 6, "num-clients": draw(st.integers(1, 4))}
    if how == "first":
        forged["first-client"] = draw(_FORGED)
    elif how == "count":
        forged["num-clients"] = draw(_FORGED)
    elif how == "keys":
        forged[draw(st.sampled_from(["extra", "compute-s"]))] = 1
    elif how == "missing":
        del forged[draw(st.sampled_from(sorted(forged)))]
    elif how == "config":  # text where numbers belong, in a record of another kind
        forged = RecordDict({records.METRICS: ConfigRecord(
            {"first-client": "6", "num-clients": "1"})})
    elif how == "empty":
        forged = RecordDict()
    else:
        forged = {"error": "error", "silent": None}[how]
    return how, forged


@settings(max_examples=150, deadline=None)
@given(case=_answers(), population=st.sampled_from([0, 6, 8]))
@example(case=("count", {"first-client": 6, "num-clients": 2 ** 40}), population=0)
@example(case=("count", {"first-client": 6, "num-clients": 2 ** 23}), population=6)
@example(case=("count", {"first-client": 6, "num-clients": 10 ** 6}), population=0)
@example(case=("first", {"first-client": 6.0, "num-clients": 1}), population=0)
def test_a_forged_or_missing_answer_leaves_its_node_out_named(case, population):
    """Node 9 answers anything; nodes 1 and 2 hold clients 0..5. A claim that is not two
    whole numbers inside the population (its declared size, else
    `MAX_UNDECLARED_CLIENTS`) leaves node 9 out, named with what was wrong, and the run
    goes on with 0..5; where node 9's block is honest and the population declares it,
    it is in; a declared population the blocks left do not hold fails naming node 9."""
    how, forged = case
    answers = {1: {"first-client": 0, "num-clients": 4},
               2: {"first-client": 4, "num-clients": 2}, 9: forged}
    bound = population or nodes.MAX_UNDECLARED_CLIENTS
    wellformed = isinstance(forged, dict) and \
        sorted(forged) == ["first-client", "num-clients"] and \
        all(type(v) is int for v in forged.values()) and forged["first-client"] >= 0 \
        and forged["num-clients"] >= 1 and sum(forged.values()) <= bound
    honest = wellformed and forged["first-client"] == 6
    try:
        found, logged = _discover(answers, population)
    except FleetError as e:
        text = str(e)
        if honest:  # blocks short of or past the declared population: it is named
            assert f"population-size={population}" in text
            assert population != 6 + forged["num-clients"]
            return
        assert "node 9" in text, text
        if wellformed:  # a block of the right form where others' are: never taken
            assert "overlaps" in text or "gap" in text
        else:
            assert population not in (0, 6)
        return
    assert not wellformed or honest
    if honest:
        stop = 6 + forged["num-clients"]
        assert found == [(1, 0, 4), (2, 4, 6), (9, 6, stop)] and not logged
        assert population in (0, stop)
        return
    assert found == [(1, 0, 4), (2, 4, 6)] and population in (0, 6)
    assert len(logged) == 1 and "node 9" in logged[0], logged


def test_too_few_nodes_left_or_a_gap_fail_naming_the_nodes_left_out():
    answers = {1: {"first-client": 0, "num-clients": 4}, 2: {"first-client": 4.5},
               3: {"first-client": 4, "num-clients": 2}}
    with pytest.raises(FleetError, match=r"only 2 of 3 did, the run wants 3 \(run config "
                                         r"min-nodes\); left out: node 2: .*num-clients"):
        _discover(answers, min_nodes=3)
    answers[3] = "error"
    with pytest.raises(FleetError, match=r"the run config declares population-size=6.*"
                                         r"left out: node 2: .*; node 3: it failed"):
        _discover(answers, population=6)
    answers = {1: {"first-client": 0, "num-clients": 4}, 2: "error",
               3: {"first-client": 5, "num-clients": 1}}
    with pytest.raises(FleetError, match=r"leaves a gap before client 4.*left out: node 2"):
        _discover(answers)


def test_claims_past_the_population_leave_their_node_out_naming_the_setting():
    """A block past the declared population, or past `MAX_UNDECLARED_CLIENTS` where none
    is declared, leaves its node out before anything is kept per client, naming the
    setting that declares the population."""
    half = nodes.MAX_UNDECLARED_CLIENTS // 2
    answers = {k: {"first-client": k * half, "num-clients": half} for k in range(3)}
    with pytest.raises(FleetError, match=rf"left out: node 2: it claims clients "
                                         rf"{2 * half}\.\.{3 * half - 1}, past the "
                                         rf"{2 * half} clients of the run's population "
                                         r"\(run config population-size"):
        _discover(answers, min_nodes=3)
    found, logged = _discover(answers)
    assert len(found) == 2 and "node 2: it claims" in logged[0]
    answers = {1: {"first-client": 0, "num-clients": 4}, 2: {"first-client": 4,
                                                             "num-clients": 10 ** 6}}
    found, logged = _discover(answers, population=4)
    assert found == [(1, 0, 4)] and "past the 4 clients" in logged[0]
