"""Compact client id sets and delays: round trips, list behaviour, and plans they carry."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fax_bridge.errors import FleetError
from fax_bridge.rounds.ids import ClientDelays, ClientIds
from fax_bridge.rounds.policy import RoundPolicy, plan_round

id_sets = st.lists(st.integers(0, 400), max_size=120).map(lambda v: sorted(set(v)))


@settings(max_examples=150, deadline=None)
@given(id_sets, st.integers(-130, 130))
def test_client_ids_read_like_the_list_they_encode(ids, index):
    got = ClientIds(ids)
    assert got == ids and list(got) == ids and len(got) == len(ids)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ids, np.int64))
    assert [i for r in got.ranges() for i in range(*r)] == ids
    if -len(ids) <= index < len(ids):
        assert got[index] == ids[index]
    else:
        with pytest.raises(IndexError):
            got[index]
    for probe in (index, index + 1, 0, 400):
        assert (probe in got) == (probe in ids)
    np.testing.assert_array_equal(got.positions(ids), np.arange(len(ids)))
    assert got[2:9] == ids[2:9]
    removed = ids[::3]
    assert got.without(removed) == [c for c in ids if c not in removed]
    assert ClientIds(got.array()) == got


def test_ranges_are_kept_when_shorter_than_the_ids():
    whole = ClientIds(np.arange(100_000))
    assert whole.nbytes < 100 and whole.ranges() == [(0, 100_000)]
    assert ClientIds.span(5, 100_005) == whole.array() + 5
    blocks = ClientIds(np.r_[0:500, 800:1000])
    assert blocks.ranges() == [(0, 500), (800, 1000)] and blocks.nbytes < 100
    scattered = ClientIds(np.arange(0, 2000, 2))
    assert scattered.nbytes == 8 * 1000
    assert not ClientIds() and ClientIds.span(3, 3) == []


def test_unsorted_or_repeated_ids_are_refused():
    with pytest.raises(FleetError, match="ascending"):
        ClientIds([3, 1])
    with pytest.raises(FleetError, match="distinct"):
        ClientIds([1, 1])


def test_delays_read_like_a_dict_and_none_means_zero():
    cohort = ClientIds([2, 5, 9])
    delays = ClientDelays(cohort, [0.5, 0.0, 2.0])
    assert dict(delays) == {2: 0.5, 5: 0.0, 9: 2.0}
    np.testing.assert_array_equal(delays.of([9, 2]), [2.0, 0.5])
    with pytest.raises(KeyError):
        delays[3]
    assert dict(ClientDelays(cohort)) == {2: 0.0, 5: 0.0, 9: 0.0}
    with pytest.raises(FleetError, match="2 delays for a cohort of 3"):
        ClientDelays(cohort, [1.0, 2.0])


def _reference_plan(policy: RoundPolicy, population: int, round_index: int):
    """The plan written with Python lists and a dict, the same draws in the same order."""
    rng = np.random.default_rng([policy.seed, round_index])
    size = population if policy.cohort_size is None else policy.cohort_size
    cohort = sorted(int(i) for i in rng.choice(population, size=size, replace=False))
    drops = rng.random(size) < policy.dropout
    delays = (rng.exponential(policy.straggler_delay_s, size)
              if policy.straggler_delay_s > 0 else np.zeros(size))
    late = (delays > policy.round_deadline_s if policy.round_deadline_s is not None
            else np.zeros(size, bool))
    return (cohort, [c for c, d in zip(cohort, drops) if d],
            [c for c, d, l in zip(cohort, drops, late) if l and not d],
            [c for c, d, l in zip(cohort, drops, late) if not d and not l],
            {c: float(t) for c, t in zip(cohort, delays)})


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.data())
def test_plans_choose_exactly_the_clients_the_list_form_chooses(population, data):
    policy = RoundPolicy(
        cohort_size=data.draw(st.one_of(st.none(), st.integers(1, population))),
        dropout=data.draw(st.sampled_from([0.0, 0.3])),
        straggler_delay_s=data.draw(st.sampled_from([0.0, 1.0])),
        round_deadline_s=data.draw(st.sampled_from([None, 0.8])),
        seed=data.draw(st.integers(0, 5)))
    r = data.draw(st.integers(0, 3))
    plan = plan_round(policy, population, r)
    cohort, dropped, late, participants, delays = _reference_plan(policy, population, r)
    assert (plan.cohort, plan.dropped, plan.late, plan.participants) == (
        cohort, dropped, late, participants)
    assert dict(plan.delays_s) == delays  # the same float64 bits


def test_a_whole_population_plan_holds_no_per_client_objects():
    plan = plan_round(RoundPolicy(), 100_000, 0)
    assert plan.participants is plan.cohort and plan.cohort.ranges() == [(0, 100_000)]
    assert plan.cohort.nbytes < 100 and plan.delays_s.of([7]) == [0.0]
