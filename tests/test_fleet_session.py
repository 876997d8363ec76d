"""Fleet rounds keep the structure jit gives a program's results (an algorithm's
NamedTuple state with its optax state, dataclasses, None, lists), through `run_loop`, its
checkpoints and parity; `run_loop` shows per-round progress. One LocalFleet, three
fleet rounds."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fax_bridge as fb
from fax_bridge.algorithms import fed_avg

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
