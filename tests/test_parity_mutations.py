"""Parity checks shown failing: a client runtime whose answer is wrong in one element of
one client's result (`perturbed_runtime.Perturbed`) makes `check_parity` report a
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
    name, report, leaves = honest
    assert report.ok, report.table()
    assert report.client_runtime == name
    if name != "litert":
        return
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
    wrong = Perturbed(name, how=how, client=1, spec=spec)
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
