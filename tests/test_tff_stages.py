"""stages.plan: the exporter's stage planning as a pure function of a traced program."""

import jax.numpy as jnp
import numpy as np

import fax_bridge as fb
from fax_bridge.language.placements import Placement
from fax_bridge.tff import stages

N = 4
W = np.ones(3, np.float32)
X = np.ones((N, 3), np.float32)


def _plan(fn, *args):
    comp = fb.trace(fn, *args, placements=("server", "clients"))
    return comp, stages.plan(comp.jaxpr.jaxpr, comp.placement_of, set())


def _shape(steps):
    return [("comm", s.eqns[0].primitive.name, len(s.eqns)) if isinstance(s, stages.Communicate)
            else (s.placement.name, len(s.eqns)) for s in steps]


def test_work_between_communications_fuses_into_one_stage_per_placement():
    @fb.program(clients=N)
    def f(w, x):
        b = jnp.exp(jnp.sin(w) * 2.0) + w
        d = fb.federated_map_clients(lambda u, v: jnp.tanh(u * v), (fb.federated_broadcast(b), x))
        return fb.federated_sum(d + 1.0) * 3.0

    comp, steps = _plan(f, W, X)
    shape = _shape(steps)
    assert [s[0] for s in shape] == ["SERVER", "comm", "CLIENTS", "comm", "SERVER"]
    assert shape[1][1] == "federated_broadcast" and shape[3][1] == "federated_sum"
    # The server stage before the broadcast hands on only what the broadcast reads.
    first = steps[0]
    assert first.needed == {steps[1].eqns[0].invars[0]}
    assert _plan(f, W, X)[1] is not steps and _shape(_plan(f, W, X)[1]) == shape  # pure


def test_communications_of_one_kind_and_depth_are_batched():
    @fb.program(clients=N)
    def g(x):
        return fb.federated_sum(x), fb.federated_sum(x * 2.0), fb.federated_mean(x)

    comp = fb.trace(g, X, placements=("clients",))
    steps = stages.plan(comp.jaxpr.jaxpr, comp.placement_of, set())
    comms = [s for s in steps if isinstance(s, stages.Communicate)]
    assert sorted((s.eqns[0].primitive.name, len(s.eqns)) for s in comms) == [
        ("federated_mean", 1), ("federated_sum", 2)]
    work = [(s.placement, len(s.eqns)) for s in steps if isinstance(s, stages.Stage)]
    assert work == [(Placement.CLIENTS, 1)]  # `x * 2.0`, before the sums that read it
