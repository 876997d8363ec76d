"""`fax_bridge.drjax` against DrJAX 0.2.1 itself: DrJAX's tutorial programs, weighted
means, dtypes, nesting and errors give the same numbers with one import changed, and the
ported programs export to TFF and run in the runtime."""

import logging

import drjax as real
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fax_bridge as fb
from fax_bridge import drjax as ours
from fax_bridge.runtime import run_computation

logging.getLogger("absl").setLevel(logging.ERROR)  # DrJAX warns when no mesh is set

BOTH = pytest.mark.parametrize("drjax", [real, ours], ids=["drjax", "fax_bridge"])


def tutorial(drjax):
    """DrJAX's introduction tutorial, as written for DrJAX."""

    def add_constant(x):
        return x + jnp.array([1.0, 2.0])

    @drjax.program(placements={"data_groups": 3})
    def partitioned_add_one(x):
        return drjax.map_fn(add_constant, x)

    @drjax.program(placements={"data_groups": 3})
    def broadcast(x):
        return drjax.broadcast(x)

    @drjax.program(placements={"data_groups": 3})
    def broadcast_and_sum(x):
        return drjax.reduce_sum(drjax.broadcast(x))

    def compute_loss(x, y):
        return 0.5 * jnp.square(jnp.dot(x, y) - 1.0)

    @drjax.program(placements={"data_groups": 3})
    def partitioned_eval(model, partitioned_data):
        broadcast_vector = drjax.broadcast(model)
        losses = drjax.map_fn(compute_loss, (broadcast_vector, partitioned_data))
        return drjax.reduce_mean(losses)

    grad_fn = jax.grad(partitioned_eval, argnums=0)

    @drjax.program(placements={"data_groups": 3})
    def distributed_sgd_step(model, partitioned_data):
        return model - 0.01 * grad_fn(model, partitioned_data)

    model = jnp.array([2.0, -1.0])
    data = jnp.array([[1.0, 2.0], [3.0, -4.0], [-7.0, 6.0]])
    stepped = distributed_sgd_step(model, data)
    return {
        "map": partitioned_add_one(jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])),
        "broadcast": broadcast(jnp.array([-1.0, 1.0])),
        "broadcast_and_sum": broadcast_and_sum(2.0),
        "grad_broadcast_and_sum": jax.grad(broadcast_and_sum)(2.0),
        "eval": partitioned_eval(model, data),
        "grad": grad_fn(model, data),
        "jacfwd": jax.jacfwd(partitioned_eval)(model, data),
        "sgd_eval": partitioned_eval(stepped, data),
    }


def test_tutorial_gives_drjax_numbers():
    want, got = tutorial(real), tutorial(ours)
    np.testing.assert_allclose(want["eval"], 87.16667, rtol=1e-6)  # the tutorial's figure
    np.testing.assert_allclose(want["sgd_eval"], 35.551258, rtol=1e-6)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6, err_msg=key)
        assert jnp.asarray(got[key]).dtype == jnp.asarray(want[key]).dtype, key


def aggregates(drjax):
    @drjax.program(clients=3)
    def f(x, w, b, i, tree, tree_w):
        return (drjax.reduce_weighted_mean(x, w), drjax.reduce_weighted_mean(x, x + 1.0),
                drjax.reduce_sum(b), drjax.reduce_mean(i), drjax.reduce_sum(i),
                drjax.reduce_weighted_mean(i, i), drjax.reduce_weighted_mean(tree, tree_w))

    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    tree = {"a": x, "b": np.array([1.0, 2.0, 3.0], np.float32)}
    tree_w = {"a": x + 1, "b": np.array([3.0, 2.0, 1.0], np.float32)}
    return f(x, np.array([1.0, 2.0, 3.0], np.float32), np.array([True, False, True]),
             np.array([1, 2, 4], np.int8), tree, tree_w)


def test_weighted_means_and_dtypes_match_drjax():
    for w, g in zip(jax.tree.leaves(aggregates(real)), jax.tree.leaves(aggregates(ours))):
        np.testing.assert_allclose(g, w, rtol=1e-6)
        assert g.dtype == w.dtype


def nested(drjax):
    @drjax.program(placements={"workers": 2})
    def inner(m, x):
        mapped = drjax.map_fn(lambda a, b: jnp.tanh(a * b), (drjax.broadcast(m), x))
        return drjax.reduce_mean(mapped)

    @drjax.program(placements={"clients": 3})
    def outer(m, x):
        return drjax.reduce_sum(drjax.map_fn(inner, (drjax.broadcast(m), x)))

    x = jnp.arange(12.0).reshape(3, 2, 2) / 10
    m = jnp.array([0.5, -1.0])
    return outer(m, x), jax.grad(lambda m: jnp.sum(outer(m, x) ** 2))(m)


def test_nested_programs_match_drjax():
    for w, g in zip(nested(real), nested(ours)):
        np.testing.assert_allclose(g, w, rtol=1e-5)


def test_ported_program_exports_and_runs_in_the_runtime():
    def compute_loss(x, y):
        return 0.5 * jnp.square(jnp.dot(x, y) - 1.0)

    @ours.program(placements={"clients": 3})
    def partitioned_eval(model, data):
        return ours.reduce_mean(ours.map_fn(compute_loss, (ours.broadcast(model), data)))

    model = np.array([2.0, -1.0], np.float32)
    data = np.array([[1.0, 2.0], [3.0, -4.0], [-7.0, 6.0]], np.float32)
    proto = fb.export_tff(partitioned_eval, model, data, placements=("server", "clients"))
    np.testing.assert_allclose(run_computation(proto, model, data), 87.16667, rtol=1e-6)


def test_errors():
    with pytest.raises(ours.OperatorUndefinedError, match="only defined in the context"):
        ours.broadcast(1.0)
    with pytest.raises(ValueError, match="single keyword argument"):
        ours.program(clients=2, workers=3)
    with pytest.raises(ValueError, match="single-element dict"):
        ours.program(placements={"clients": 2, "workers": 3})

    @ours.program(clients=2)
    def f(x, w):
        return ours.reduce_weighted_mean(x, w)

    with pytest.raises(fb.PlacementError, match="structure"):
        f({"a": np.ones(2)}, {"b": np.ones(2)})
