"""Round planning: seeded cohorts, dropout, straggler deadlines and min_clients; what a
round's report adds up."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from fax_bridge.errors import FleetError
from fax_bridge.fleet.pool import Traffic
from fax_bridge.rounds.policy import RoundPolicy, RoundReport, check_min_clients, plan_round


def test_same_seed_and_round_give_the_same_plan():
    policy = RoundPolicy(cohort_size=7, dropout=0.3, straggler_delay_s=0.5,
                         round_deadline_s=0.4, seed=11)
    first, again = plan_round(policy, 50, 3), plan_round(policy, 50, 3)
    assert first == again
    assert first.cohort == sorted(first.cohort) and len(first.cohort) == 7
    assert set(first.participants) | set(first.dropped) | set(first.late) == set(first.cohort)
    assert not set(first.dropped) & set(first.late)
    other_rounds = {tuple(plan_round(policy, 50, r).cohort) for r in range(6)}
    assert len(other_rounds) > 1


def test_late_clients_are_those_past_the_deadline():
    policy = RoundPolicy(straggler_delay_s=1.0, round_deadline_s=0.5, seed=2)
    plan = plan_round(policy, 40, 0)
    assert plan.late and plan.participants
    assert all(plan.delays_s[c] > 0.5 for c in plan.late)
    assert all(plan.delays_s[c] <= 0.5 for c in plan.participants)


def test_min_clients_and_bad_policies_raise_fleet_errors():
    policy = RoundPolicy(dropout=0.9, min_clients=5, seed=0)
    plan = plan_round(policy, 10, 0)
    assert len(plan.participants) < 5
    with pytest.raises(FleetError, match="min_clients=5"):
        check_min_clients(policy, plan, 0)
    with pytest.raises(FleetError, match="exceeds the population"):
        plan_round(RoundPolicy(cohort_size=11), 10, 0)
    with pytest.raises(FleetError, match="dropout"):
        RoundPolicy(dropout=1.0)


@settings(max_examples=60, deadline=None)
@given(population=st.integers(1, 30), cohort=st.one_of(st.none(), st.integers(1, 30)),
       dropout=st.sampled_from([0.0, 0.3, 0.9]),
       delay=st.sampled_from([0.0, 0.5, 2.0]),
       deadline=st.one_of(st.none(), st.sampled_from([0.1, 1.0])),
       min_clients=st.integers(0, 40), seed=st.integers(0, 5))
def test_min_clients_messages_name_only_what_happened(population, cohort, dropout, delay,
                                                      deadline, min_clients, seed):
    policy = RoundPolicy(cohort_size=cohort, dropout=dropout, straggler_delay_s=delay,
                         round_deadline_s=deadline, min_clients=min_clients, seed=seed)
    if cohort is not None and cohort > population:
        return
    plan = plan_round(policy, population, 0)
    if len(plan.participants) >= min_clients:
        check_min_clients(policy, plan, 0)
        return
    with pytest.raises(FleetError) as info:
        check_min_clients(policy, plan, 0)
    message = str(info.value)
    assert "None" not in message
    assert f"min_clients={min_clients}" in message
    assert ("dropped out" in message) == bool(len(plan.dropped))
    assert ("deadline" in message) == bool(len(plan.late))
    if len(plan.late):
        assert f"deadline of {deadline:g}s" in message
    assert ("smaller than min_clients" in message) == (len(plan.cohort) < min_clients)


def test_a_round_without_deadline_never_blames_one():
    policy = RoundPolicy(dropout=0.9, min_clients=5, seed=0)
    with pytest.raises(FleetError) as info:
        check_min_clients(policy, plan_round(policy, 10, 0), 0)
    assert "deadline" not in str(info.value) and "None" not in str(info.value)
    assert "dropped out" in str(info.value) and "lower dropout" in str(info.value)


_TRY = st.builds(Traffic, *[st.integers(0, 10 ** 9)] * 5, st.floats(0, 10.0))


@settings(max_examples=30, deadline=None, database=None)
@given(st.lists(_TRY, max_size=4))
def test_a_report_adds_up_every_tries_traffic(tries):
    """A report's traffic is the sum of its tries' `Traffic` differences, and reads under
    the report's names, as attributes and in `as_dict`."""
    plan = plan_round(RoundPolicy(), 3, 0)
    rep = RoundReport(round=0, population=3, cohort=plan.cohort, dropped=plan.dropped,
                      late=plan.late, participants=plan.participants,
                      delays_s=plan.delays_s, devices=1)
    for spent in tries:
        rep.add_traffic(spent)
    names = {"bytes_down": "bytes_down", "bytes_up": "bytes_up",
             "payload_down": "payload_down", "payload_up": "payload_up", "rpcs": "rpcs",
             "compute_s": "compute_seconds"}
    row = rep.as_dict()
    assert "traffic" not in row
    for name, counter in names.items():
        total = sum((getattr(t, counter) for t in tries), type(getattr(Traffic(), counter))())
        assert getattr(rep, name) == pytest.approx(total) == row[name]
        assert getattr(rep.traffic, counter) == getattr(rep, name)
