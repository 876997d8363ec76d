"""Parity checks shown failing: a client runtime whose answer is wrong in one element of
one client's result (`rounds.faults.Fault`) makes `check_parity` report a
mismatch on exactly the output leaf that element feeds, while the honest runtime passes:
a relative 1e-4 on a float, a NaN where jit has a number, an integer or secure sum off
by one; on LiteRT clients (held to the rounding bound) and on XLA clients (held to the
tolerances). The layer families (max and average pools, embeddings, LSTM, a transformer
block) are checked the same way in `tests/test_litert_convert.py`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from perturbed_runtime import InProcessFleet, Perturbed

import fax_bridge as fb
from fax_bridge.rounds import client_runtime as runtimes

N = 3
PLACE = ("server", "clients")


def _loss(p, d):
    h = jnp.tanh(d["x"] @ p["w"] + p["b"])
    return jnp.mean((h - d["t"]) ** 2)


@fb.program(clients=N)
def _round(params, data):
    """Two local SGD steps per client (a loop); the mean model change and loss, the
    clients' example count summed plainly and securely."""
    def local(p, d):
        def step(q, _):
            value, g = jax.value_and_grad(_loss)(q, d)
            return jax.tree.map(lambda a, b: a - 0.5 * b, q, g), value

        q, losses = jax.lax.scan(step, p, None, length=2)
        count = jnp.sum(d["t"] > -10.0).astype(jnp.int32)
        return jax.tree.map(jnp.subtract, q, p), losses[0], count

    delta, loss, count = fb.federated_map_clients(local, (fb.federated_broadcast(params),
                                                          data))
    return {"delta": fb.federated_mean(delta), "loss": fb.federated_mean(loss),
            "count": fb.federated_sum(count),
            "secure": fb.federated_secure_sum_bitwidth(count, 8)}


def _args():
    rng = np.random.default_rng(0)
    params = {"w": (rng.normal(size=(3, 2)) * 0.5).astype(np.float32),
              "b": np.zeros(2, np.float32)}
    data = {"x": rng.normal(size=(N, 4, 3)).astype(np.float32),
            "t": rng.normal(size=(N, 4, 2)).astype(np.float32)}
    return params, data


def _check(runtime):
    """(report, the fleet's result leaves) of `check_parity` against `runtime` run in
    this process."""
    fleet = InProcessFleet(runtime)
    report = fb.check_parity(_round, *_args(), placements=PLACE, fleet=fleet,
                             client_runtime=runtime)
    return report, [np.asarray(x) for x in jax.tree_util.tree_leaves(fleet.last)]


@pytest.fixture(scope="module", params=["litert", "xla"])
def honest(request):
    report, leaves = _check(runtimes.resolve(request.param))
    return request.param, report, leaves


def test_the_honest_runtime_passes(honest):
    """Every float leaf is held to a bound under 1e-4 of its largest value, on either
    runtime."""
    name, report, leaves = honest
    assert report.ok, report.table()
    assert report.client_runtime == name
    floats = 0
    for leaf, value in zip(report.leaves, leaves):  # float leaves: a bound under 1e-4
        if leaf.dtype != "float32":
            continue
        floats += 1
        top = np.float32(np.abs(value).max())
        assert leaf.bound_method and leaf.bound <= 2 * (1e-4 * top + np.spacing(top)), \
            (leaf.path, leaf.bound, top)
    assert floats == 3


@pytest.mark.parametrize("how, spec", [("relative", "mean"), ("nan", "mean"),
                                       ("plus_one", "sum"),
                                       ("plus_one", "secure_sum_bitwidth")])
def test_a_wrong_answer_in_one_element_fails_on_the_leaf_it_feeds(honest, how, spec):
    """A float 1e-4 off (relative) or NaN; the plain and the secure sum of the counts
    off by one."""
    name, _, right = honest
    wrong = Perturbed(name, how=how, client=1, aggregation=spec)
    report, got = _check(wrong)
    assert wrong.done, "nothing was perturbed"
    changed = [a.tobytes() != b.tobytes() for a, b in zip(right, got)]
    failed = [not leaf.ok for leaf in report.leaves]
    assert sum(changed) == 1 and failed == changed, (how, changed, report.table())
    assert not report.ok
    (leaf,) = [leaf for leaf in report.leaves if not leaf.ok]
    text = report.table()
    assert "PARITY MISMATCH" in text and leaf.path in text
    at = [leaf.path for leaf in report.leaves].index(leaf.path)
    if how == "nan":  # NaN where jit has a number
        assert np.isnan(got[at]).any() and not np.isnan(right[at]).any()


@fb.program(clients=N)
def _update_round(params, data):
    """A FedAvg round: the new model is the old one plus the clients' mean change, so a
    client's change reaches the output scaled down by the cohort, beside the model."""
    def local(p, d):
        g = jax.grad(_loss)(p, d)
        return jax.tree.map(lambda a: -0.05 * a, g)

    delta = fb.federated_mean(fb.federated_map_clients(
        local, (fb.federated_broadcast(params), data)))
    return fb.federated_map_server(lambda p, d: jax.tree.map(jnp.add, p, d), (params, delta))


@pytest.mark.parametrize("name", ["xla", "litert"])
def test_a_wrong_model_update_fails_where_fixed_tolerances_pass_it(name):
    """One client's update 1e-4 off moves the new model by far less than 1e-5 of its
    value: the default tolerances (rtol=1e-5, atol=1e-6) take it; the rounding bound
    does not."""
    args = _args()
    right = InProcessFleet(runtimes.resolve(name))
    honest = fb.check_parity(_update_round, *args, placements=PLACE, fleet=right,
                             client_runtime=right.client_runtime)
    assert honest.ok, honest.table()
    wrong = Perturbed(name, how="relative", client=1, aggregation="mean")
    fleet = InProcessFleet(wrong)
    report = fb.check_parity(_update_round, *args, placements=PLACE, fleet=fleet,
                             client_runtime=wrong)
    assert wrong.done and not report.ok, report.table()
    moved = [np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max()
             for a, b in zip(jax.tree_util.tree_leaves(right.last),
                             jax.tree_util.tree_leaves(fleet.last))]
    (at,) = [i for i, m in enumerate(moved) if m > 0]
    failed = [i for i, leaf in enumerate(report.leaves) if not leaf.ok]
    assert failed == [at]
    top = float(np.abs(np.asarray(jax.tree_util.tree_leaves(right.last)[at])).max())
    assert moved[at] < 1e-5 * top  # what fixed tolerances cannot see
    loose = fb.check_parity(_update_round, *args, placements=PLACE,
                            fleet=InProcessFleet(Perturbed(name, how="relative", client=1,
                                                           aggregation="mean")),
                            client_runtime=wrong, rtol=1e-5, atol=1e-6)
    assert loose.ok
