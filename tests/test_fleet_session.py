"""Fleet rounds keep the structure jit gives a program's results (an algorithm's
NamedTuple state with its optax state, dataclasses, None, lists), through `run_loop`, its
checkpoints and parity; `run_loop` shows per-round progress. One LocalFleet, three
fleet rounds. A failed try loses the devices that died and those that missed their
deadline, each named with why."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

import fax_bridge as fb
from fax_bridge.algorithms import fed_avg
from fax_bridge.fleet.pool import DeviceLostError
from fax_bridge.fleet.protocol import partition
from fax_bridge.fleet.session import FleetRounds
from fax_bridge.rounds import engine
from fax_bridge.rounds.ids import ClientIds
from fax_bridge.rounds.policy import RoundPolicy

CLIENTS = 4


@pytest.fixture(scope="module")
def fleet():
    with fb.LocalFleet(devices=2, progress=True) as running:
        yield running


def _loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def _cohort(round_index):
    rng = np.random.default_rng(round_index)
    x = rng.normal(size=(CLIENTS, 2, 3, 2)).astype(np.float32)
    return {"x": x, "y": (x @ np.float32([1.0, -1.0])).astype(np.float32)}, \
        np.ones((CLIENTS, 2, 3), bool)


def _same(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_run_loop_state_feeds_jit_and_resumes_with_its_structure(fleet, tmp_path, capsys):
    alg = fed_avg(_loss, optax.sgd(0.1), clients=CLIENTS, server_optimizer=optax.adam(0.05))
    state0 = alg.init({"w": jnp.zeros(2), "b": jnp.zeros(())})
    proto = fb.export_tff(alg.next, state0, *_cohort(0), placements=alg.placements)
    results = []
    state = fleet.run_loop(proto, state0, 2, _cohort, next_state=lambda r: r[0],
                           checkpoint_dir=tmp_path,
                           on_round=lambda r, result, rep: results.append(result))
    assert "fleet rounds" in capsys.readouterr().err  # progress=True: a bar per run_loop
    step = jax.jit(alg.next)
    want = state0
    for r in range(2):
        want, metrics = step(want, *_cohort(r))
        _same(results[r], (want, metrics))
    _same(state, want)
    assert type(state.opt_state[0]).__name__ == "ScaleByAdamState"
    _same(step(state, *_cohort(2)), step(want, *_cohort(2)))  # the fleet's state feeds jit
    # A rerun resumes after the last saved round: the saved state, with its structure.
    resumed = fleet.run_loop(proto, state0, 2, _cohort, next_state=lambda r: r[0],
                             checkpoint_dir=tmp_path)
    _same(resumed, want)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Stats:
    total: Any
    per_client: Any


def test_parity_and_a_fleet_round_keep_dataclasses_none_and_lists(fleet):
    @fb.program(clients=CLIENTS)
    def summarize(scale, data):
        total = fb.federated_sum(data) * scale["k"]
        per_client = fb.federated_map_clients(lambda d: d * 2, data)
        return [Stats(total, per_client), None, ({}, ())], scale

    scale, data = {"k": jnp.float32(3)}, jnp.arange(CLIENTS * 2, dtype=jnp.float32).reshape(
        CLIENTS, 2)
    report = fb.check_parity(summarize, scale, data, placements=("server", "clients"),
                             fleet=fleet)
    assert report.ok, report.table()
    proto = fb.export_tff(summarize, scale, data, placements=("server", "clients"))
    _same(fleet.run(proto, scale, data), jax.jit(summarize)(scale, data))
    assert len(report.leaves) == 3


# ---------------------------------------------------------------------------------------
# Which devices a failed try loses: those that die, and those that miss their deadline
# even while they still answer Health (stragglers); when all of them, the fleet keeps
# their addresses (nothing to reconnect to) and the policy decides the round.

class _Probed:
    """A backend whose devices answer Health as `alive` says."""

    def __init__(self, alive):
        self.alive, self.rpc_timeout_s, self.shared_memory = list(alive), 1.0, None

    def probe(self, timeout_s):
        return list(self.alive)

    def close(self):
        pass

    def take_handles(self, old):
        pass


class _Fleet(FleetRounds):
    def __init__(self, alive):
        super().__init__(policy=RoundPolicy(), rpc_timeout_s=1.0, progress=False,
                         survive_device_loss=True, probe_timeout_s=0.5,
                         reject_nonfinite=False)
        self.addresses = [f"10.0.0.{i}:5005" for i in range(len(alive))]
        self.num_devices = len(alive)
        self.backend = _Probed(alive)

    def _connect(self, addresses, connect_timeout_s):
        return _Probed([True] * len(addresses))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_a_failed_try_loses_the_dead_and_the_late_devices_and_says_why(data):
    devices = data.draw(st.integers(1, 5))
    alive = data.draw(st.lists(st.booleans(), min_size=devices, max_size=devices))
    failed = data.draw(st.sets(st.integers(0, devices - 1)))
    late = data.draw(st.sets(st.sampled_from(sorted(failed)))) if failed else set()
    reasons = {i: ("RoundOnce failed: DEADLINE_EXCEEDED; it did not answer RoundOnce "
                   "within its deadline of 1s" if i in late else
                   "RoundOnce failed: UNAVAILABLE") for i in failed}
    error = DeviceLostError("the try failed", sorted(failed), reasons, sorted(late))
    fleet = _Fleet(alive)
    addresses = list(fleet.addresses)
    clients = data.draw(st.integers(devices, 3 * devices))
    rep = engine.open_round(RoundPolicy(), clients, 0, [], devices)
    lost = fleet._lose_unreachable_devices(ClientIds(np.arange(clients)), rep, error)

    gone = sorted({i for i in range(devices) if not alive[i]} | late)
    if not gone:  # every device answered in time
        assert lost == [] and fleet.addresses == addresses
        return
    assert [h.where.split(": ", 1)[0] for h in lost] == [addresses[i] for i in gone]
    blocks = partition(clients, devices)
    for i, holder in zip(gone, lost):
        assert list(holder.clients) == list(range(blocks[i].start, blocks[i].stop))
        why = holder.where
        assert ("deadline" in why) == (i in late), why
        if alive[i]:
            assert "still answers Health: a straggler" in why, why
        else:
            assert "no Health answer within 0.5s" in why, why
        if i not in failed:
            assert "after the round's try failed" in why, why
    if len(gone) == devices:  # none answered in time: all lost, none to reconnect to
        assert fleet.addresses == addresses and fleet.num_devices == devices
        return
    assert fleet.addresses == [a for i, a in enumerate(addresses) if i not in gone]
    assert fleet.num_devices == devices - len(gone)
