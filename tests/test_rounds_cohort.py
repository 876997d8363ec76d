"""A round's cohort is derived once (`rounds.cohort`): every transport's round sees the
cohort the owner computes, and every disagreement is refused by name before any client
work runs. One LocalFleet for the module."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import sample_computations as sc
from fax_bridge import in_process
from fax_bridge.data import CohortSampler
from fax_bridge.errors import ComputationError, FleetError
from fax_bridge.fleet.launcher import LocalFleet
from fax_bridge.rounds import cohort, round_split
from fax_bridge.errors import CohortError
from fax_bridge.rounds.cohort import Cohort
from fax_bridge.rounds.policy import RoundPolicy, plan_round
from fax_bridge.runtime import interpreter, values
from fax_bridge.runtime.population import PopulationRef

PROTO = sc.scaled_aggregate((2,), "sum")
PREPARED = interpreter.prepare(PROTO)
SPLIT = round_split.split_of(PROTO)
S = np.float32([1.0, -2.0])


@pytest.fixture(scope="module")
def fleet():
    with LocalFleet(devices=2) as running:
        yield running


def _clients(population: int, seed: int) -> np.ndarray:
    # small whole numbers: any sum of them is exact, so a cohort shows in the bits
    return np.random.default_rng(seed).integers(-9, 9, (population, 2)).astype(np.float32)


@settings(max_examples=40, deadline=None)
@given(population=st.integers(0, 30), size=st.one_of(st.none(), st.integers(1, 40)))
def test_the_owner_takes_a_cohort_within_its_population_and_refuses_by_name(population,
                                                                          size):
    if size is not None and size > population:
        with pytest.raises(CohortError, match=re.escape(
                f"run config cohort-size={size} exceeds the population of {population} "
                "clients (the nodes); lower run config cohort-size to at most "
                f"{population}")):
            Cohort.of(size, population, "the nodes", "run config cohort-size")
        return
    got = Cohort.of(size, population, "the nodes")
    assert (got.population, got.size) == (population, population if size is None else size)
    assert got.everyone == (got.size == population)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=2, max_size=2))
def test_a_round_counts_its_clients_once_from_every_input(counts):
    """The one count of a round's runtime argument: the CLIENTS inputs' members (or the
    ids a PopulationRef names), refused naming both counts when they disagree."""
    split = round_split.split_of(sc.weighted_mean())
    xs, ws = list(range(counts[0])), list(range(counts[1]))
    arg = [None] * (max(split.client_inputs) + 1)
    arg[split.client_inputs[0]], arg[split.client_inputs[1]] = xs, PopulationRef(
        client_ids=ws)
    if counts[0] == counts[1]:
        assert cohort.clients_of(split, arg) == counts[0]
    else:
        with pytest.raises(ComputationError, match=re.escape(
                f"disagree on the number of clients: {sorted(set(counts))}")):
            cohort.clients_of(split, arg)


def test_num_clients_must_agree_with_the_clients_arguments():
    bound = values.bind_arguments(PREPARED.parameter, (_clients(4, 0), S), {})
    assert cohort.population_of(bound) == (4, cohort.FROM_ARGUMENTS)
    assert cohort.population_of(bound, 4) == (4, cohort.FROM_ARGUMENTS)
    with pytest.raises(CohortError, match=r"num_clients=3 but the CLIENTS arguments' "
                                          r"leading axis holds 4 clients; drop num_clients="):
        cohort.population_of(bound, 3)
    none = values.bind_arguments(None, (), {})
    assert cohort.population_of(none, 5) == (5, cohort.FROM_NUM_CLIENTS)
    assert cohort.population_of(none) == (None, cohort.FROM_NOTHING)


def test_a_policy_cohort_size_must_be_a_whole_number():
    for bad in (0, -1, 2.5, True, "3"):
        with pytest.raises(FleetError, match="must be a whole number of at least 1"):
            RoundPolicy(cohort_size=bad)


def test_a_cohort_derived_for_another_policy_is_refused():
    with pytest.raises(CohortError, match="cohort_size=3; derive it from that policy"):
        plan_round(RoundPolicy(cohort_size=3), Cohort.of(2, 10), 0)


@settings(max_examples=10, deadline=None)
@given(population=st.integers(1, 9), size=st.one_of(st.none(), st.integers(1, 11)),
       seed=st.integers(0, 2**16), round_index=st.integers(0, 5),
       dropout=st.sampled_from([0.0, 0.3]), extra=st.booleans())
def test_every_transport_sees_the_owners_cohort_or_nothing_runs(
        fleet, population, size, seed, round_index, dropout, extra):
    """For generated populations, policies and samplers: the sampler, the plan, the fleet
    round and the in-process round all see the owner's cohort; a cohort size over the
    population, or a num_clients= other than the arguments', is refused before any
    device is asked anything."""
    policy = RoundPolicy(cohort_size=size, seed=seed, dropout=dropout, min_clients=0)
    fleet.policy, fleet.next_round = policy, round_index
    xs = _clients(population, seed)
    given_n = population + 1 if extra else None  # num_clients= that disagrees
    before = fleet.backend.traffic.rpcs
    if (size is not None and size > population) or extra:
        with pytest.raises(CohortError, match="cohort_size" if not extra else "num_clients"):
            fleet.run(PROTO, xs, S, num_clients=given_n)
        assert fleet.backend.traffic.rpcs == before  # nothing was sent to a device
        return
    owner = Cohort.of(size, population, cohort.FROM_ARGUMENTS)
    plan = plan_round(policy, owner, round_index)
    if size is not None:  # the data layer's sampler draws the same clients
        assert list(CohortSampler(population, size, seed)(round_index)) == list(plan.cohort)
    assert len(plan.cohort) == owner.size
    ids = plan.participants.array()
    got, rep = fleet.run(PROTO, xs, S, report=True)
    assert rep.population == owner.population and rep.cohort == plan.cohort
    assert rep.participants == plan.participants
    if not len(ids):  # every client dropped (min_clients=0): a sum over none is zero
        assert got.dtype == xs.dtype and got.shape == xs.shape[1:] and not got.any()
        return
    arg = values.bind_arguments(PREPARED.parameter, (xs, S), {}).select_clients(ids)
    want = in_process.run_in_process(SPLIT, arg.runtime_value())
    np.testing.assert_array_equal(got, np.asarray(want))
    np.testing.assert_array_equal(got, (xs[ids] * S).sum(axis=0))


def test_a_fleet_refuses_min_clients_0_for_a_mean_before_any_device_is_asked(fleet):
    """A mean has no value over zero clients: with min_clients=0 the fleet refuses the
    program before its round runs, whatever the round would draw, and reports it."""
    fleet.policy, fleet.next_round = RoundPolicy(min_clients=0), 5
    before = fleet.backend.traffic.rpcs
    with pytest.raises(FleetError, match=r"^round 5: min_clients=0 lets a round run with "
                                         r"no clients, but federated_mean has no value "
                                         r"over zero clients"):
        fleet.run(sc.scaled_aggregate((2,), "mean"), _clients(4, 0), S)
    assert fleet.backend.traffic.rpcs == before
    assert fleet.reports[-1].error.startswith("round 5: min_clients=0")
    fleet.policy = RoundPolicy(min_clients=1)
    got = fleet.run(sc.scaled_aggregate((2,), "mean"), _clients(4, 0), S)
    np.testing.assert_array_equal(got, (_clients(4, 0) * S).mean(axis=0))


def _forge_round_answers(fleet, monkeypatch, devices: list, forgery: str) -> None:
    """Makes the round answers of `devices` impossible as `forgery` says: for other
    clients than sent, a partial over other clients, or a partial with a tensor more."""
    real = fleet.backend.call_each

    def forging(method, requests, **kwargs):
        answers = real(method, requests, **kwargs)
        if method == "Round":
            for answer in (answers[d] for d in devices if d in answers):
                if forgery == "clients":
                    answer.num_clients += 1
                elif forgery == "partial":
                    answer.partials[0].num_clients += 1
                elif forgery == "served":  # XLA's answer naming a LiteRT model
                    answer.model_sha256 = "ab" * 32
                else:
                    answer.partials[0].leaves.add().CopyFrom(answer.partials[0].leaves[0])
        return answers

    monkeypatch.setattr(fleet.backend, "call_each", forging)


@pytest.mark.parametrize("forgery", ["clients", "partial", "tensors", "served"])
def test_a_device_with_an_impossible_round_answer_leaves_the_round_named(
        fleet, monkeypatch, forgery):
    """A device is not trusted: its well-formed answer for other clients than it was
    sent (to the transport), or with a partial no honest device sends (to the engine's
    checks), is refused naming the device and what was wrong; the device's clients
    leave the round as a lost device's do, and the round has the honest device's bits
    unless too few clients are left for min_clients."""
    xs = _clients(6, 1)
    _forge_round_answers(fleet, monkeypatch, [1], forgery)
    fleet.policy, fleet.next_round = RoundPolicy(min_clients=3), 0
    got, rep = fleet.run(PROTO, xs, S, report=True)
    np.testing.assert_array_equal(got, (xs[:3] * S).sum(axis=0))
    assert list(rep.participants) == [0, 1, 2] and list(rep.lost_clients) == [3, 4, 5]
    assert len(rep.lost_devices) == 1 and rep.error is None
    assert rep.lost_devices[0].startswith("device 1 at ")
    assert rep.lost_devices[0].endswith("(an impossible answer)")
    if forgery == "served":
        assert "with LiteRT model sha256 'abab" in rep.lost_devices[0]
    if forgery in ("clients", "served"):  # refused by the transport: not named as served
        assert list(rep.served) == fleet.addresses[:1]
    fleet.policy = RoundPolicy(min_clients=4)
    with pytest.raises(FleetError, match=r"round 1: lost device 1 at .*an impossible "
                                         r"answer.* only 3 clients are left but "
                                         r"min_clients=4"):
        fleet.run(PROTO, xs, S)
    assert "min_clients=4" in fleet.reports[-1].error


@pytest.mark.parametrize("how", ["killed", "clients", "partial", "tensors"])
def test_a_round_every_device_left_sums_to_zero_with_min_clients_0_else_is_refused(
        fleet, monkeypatch, how):
    """Every device of the fleet lost (killed) or answering what no honest device sends:
    with min_clients=0 the round finishes over no clients, as one whose clients all
    dropped out does (its sum the zero of its type), and the report names every device
    lost with why; with min_clients=1 the round fails naming min_clients and them."""
    xs = _clients(6, 2)
    if how == "killed":
        fleet.kill_device(0)
        fleet.kill_device(1)
    else:
        _forge_round_answers(fleet, monkeypatch, [0, 1], how)
    try:
        fleet.policy, fleet.next_round = RoundPolicy(min_clients=0), 0
        got, rep = fleet.run(PROTO, xs, S, report=True)
        assert got.dtype == xs.dtype and got.shape == xs.shape[1:] and not got.any()
        assert rep.error is None and len(rep.participants) == 0
        assert list(rep.lost_clients) == list(range(6))
        if how == "killed":  # each address, with what its call ended with
            assert [w.split(": ")[0] for w in rep.lost_devices] == fleet.addresses
            assert all("no Health answer" in w for w in rep.lost_devices)
        else:
            assert [w.split(" at ")[0] for w in rep.lost_devices] == ["device 0",
                                                                    "device 1"]
            assert all(w.endswith("(an impossible answer)") for w in rep.lost_devices)
        fleet.policy = RoundPolicy(min_clients=1)
        with pytest.raises(FleetError, match=r"^round 1: lost .* only 0 clients are left "
                                             r"but min_clients=1"):
            fleet.run(PROTO, xs, S)
        assert len(fleet.reports[-1].lost_devices) == 2
        assert "min_clients=1" in fleet.reports[-1].error
    finally:
        if how == "killed":
            fleet.restart_device(0)
            fleet.restart_device(1)
    monkeypatch.undo()
    fleet.policy = RoundPolicy()
    np.testing.assert_array_equal(fleet.run(PROTO, xs, S), (xs * S).sum(axis=0))
