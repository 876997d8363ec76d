"""Nested placements: a program over `workers` inside the per-client function of a
program over `clients` (hierarchical FedAvg). Same values as the flat computation, the
same derivatives under grad / jacfwd / jacrev / vmap, export with the outer placement as
TFF CLIENTS (read back by federated_language, run by the runtime), clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from federated_language.compiler import building_blocks

import fax_bridge as fb
from fax_bridge.runtime import run_computation

GROUPS, WORKERS = 4, 3


def local(w, x):
    return w - 0.1 * jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)


@fb.program(placements={"workers": WORKERS})
def group(w, x):
    return fb.federated_mean(fb.federated_map_clients(local, (fb.federated_broadcast(w), x)))


@fb.program(clients=GROUPS)
def hierarchical(w, x):
    return fb.federated_mean(fb.federated_map_clients(group, (fb.federated_broadcast(w), x)))


def reference(w, x):
    per_worker = jax.vmap(jax.vmap(local, (None, 0)), (None, 0))(w, x)
    return jnp.mean(jnp.mean(per_worker, 1), 0)


W = jnp.full((3, 2), 0.3, jnp.float32)
X = jnp.asarray(np.random.default_rng(0).normal(size=(GROUPS, WORKERS, 5, 3)), jnp.float32)


def test_values_and_derivatives_match_the_flat_computation():
    np.testing.assert_allclose(jax.jit(hierarchical)(W, X), reference(W, X), rtol=1e-5,
                               atol=1e-6)

    def f(w):
        return jnp.sum(jnp.sin(hierarchical(w, X)))

    def f_ref(w):
        return jnp.sum(jnp.sin(reference(w, X)))

    expect = jax.grad(f_ref)(W)
    for got in (jax.jit(jax.grad(f))(W), jax.jit(jax.jacfwd(f))(W), jax.jit(jax.jacrev(f))(W)):
        np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-6)
    batched = jax.jit(jax.vmap(lambda w: hierarchical(w, X)))(jnp.stack([W, 2 * W]))
    np.testing.assert_allclose(batched[1], reference(2 * W, X), rtol=1e-5, atol=1e-6)


def test_gradient_stays_a_federated_program_over_the_outer_placement():
    comp = fb.trace(jax.grad(lambda w, x: jnp.sum(hierarchical(w, x))), W, X,
                    placements=("server", "clients"))
    assert comp.axis == "clients" and comp.clients == GROUPS and not comp.violations
    inner = [e for e in comp.jaxpr.jaxpr.eqns if e.primitive.name == "federated_map"]
    assert inner and all(e.params["axis"] == "clients" for e in inner)


def test_export_puts_inner_placements_inside_the_per_client_xla():
    proto = fb.export_tff(hierarchical, W, X, placements=("server", "clients"))
    block = building_blocks.ComputationBuildingBlock.from_proto(proto)
    assert str(block.type_signature) == \
        "(<w=float32[3,2]@SERVER,x={float32[3,5,3]}@CLIENTS> -> float32[3,2]@SERVER)"
    np.testing.assert_allclose(run_computation(proto, W, X), reference(W, X), rtol=1e-5,
                               atol=1e-6)


def test_placements_side_by_side_are_refused_with_the_fix():
    @fb.program(placements={"workers": WORKERS})
    def via_workers(w):
        return fb.federated_sum(fb.federated_broadcast(w))

    @fb.program(clients=GROUPS)
    def side_by_side(w, x):
        return fb.federated_mean(x), via_workers(w)

    args = (W, jnp.ones((GROUPS, 2)))
    with pytest.raises(fb.PlacementError, match="Nest them"):
        fb.trace(side_by_side, *args, placements=("server", "clients"))
    with pytest.raises(fb.ExportError, match="one CLIENTS placement.*outermost"):
        fb.export_tff(side_by_side, *args, placements=("server", "clients"))


def test_one_name_with_two_sizes_is_refused():
    @fb.program(clients=GROUPS + 1)
    def inner(x):
        return fb.federated_sum(x)

    @fb.program(clients=GROUPS)
    def outer(x):
        return fb.federated_map_clients(inner, x)

    with pytest.raises(fb.PlacementError, match="same number of members"):
        outer(jnp.ones((GROUPS, GROUPS + 1)))
