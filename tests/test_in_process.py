"""`runtime.run_computation`: rounds through the round engine in process, everything else
interpreted, with the interpreter's bits and refusals either way."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import fax_bridge as fb
from fax_bridge.errors import ArgumentError, ComputationError, WeightError
from fax_bridge.runtime import device_sums, interpreter
from fax_bridge import in_process as run
from fax_bridge.runtime.population import PopulationRef

D = 3


def _round(params, data):
    """One weighted FedAvg-style round: a step on each client, means back at the server."""
    def local(p, d):
        g = jax.grad(lambda q: jnp.mean((d["x"] @ q - d["y"]) ** 2))(p)
        return p - 0.1 * g, d["n"], jnp.sum(g * g)

    new, n, norm = fb.federated_map_clients(local, (fb.federated_broadcast(params), data))
    return fb.federated_weighted_mean(new, n), fb.federated_sum(norm), fb.federated_mean(n)


def _args(rng, clients: int, counts):
    params = rng.standard_normal((D, D)).astype(np.float32)
    data = {"x": rng.standard_normal((clients, 4, D)).astype(np.float32),
            "y": rng.standard_normal((clients, 4, D)).astype(np.float32),
            "n": np.asarray(counts, np.float32)}
    return params, data


def _proto(clients: int):
    rng = np.random.default_rng(0)
    args = _args(rng, clients, [1.0] * clients)
    return fb.export_tff(fb.program(clients=clients)(_round), *args,
                         placements=("server", "clients"))


PROTOS = {n: _proto(n) for n in (1, 3, 5)}


def _bits(tree):
    return [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(tree)]


def test_a_round_is_split_and_other_computations_are_not():
    assert run.round_split_of(interpreter.prepare(PROTOS[3])) is not None

    @fb.program(clients=3)
    def no_round(x):
        return fb.federated_sum(x)

    proto = fb.export_tff(no_round, np.ones((3, 2), np.float32), placements=("clients",))
    assert np.array_equal(run.run_computation(proto, np.ones((3, 2), np.float32)),
                          np.full(2, 3.0, np.float32))


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(sorted(PROTOS)), st.integers(0, 2**32 - 1), st.data())
def test_rounds_through_the_engine_have_the_interpreters_bits(clients, seed, data):
    counts = data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 3.0, 1e-3, 7.0]),
                                min_size=clients, max_size=clients))
    params, batch = _args(np.random.default_rng(seed), clients, counts)
    proto = PROTOS[clients]
    if sum(counts) == 0:  # the weights rule, on both paths
        for runner in (fb.runtime.run_computation, interpreter.interpret):
            with pytest.raises(WeightError):
                runner(proto, params, batch)
        return
    got = run.run_computation(proto, params, batch)
    want = interpreter.interpret(proto, params, batch)
    assert _bits(got) == _bits(want)
    jitted = jax.jit(fb.program(clients=clients)(_round))(params, batch)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(jitted)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_round_given_a_backend_or_population_references_is_interpreted(monkeypatch):
    params, batch = _args(np.random.default_rng(1), 3, [1.0, 2.0, 3.0])
    calls = []
    monkeypatch.setattr(run, "run_in_process",
                        lambda *a, **k: calls.append(a) or pytest.fail("engine used"))
    from fax_bridge.runtime.local_backend import LocalClientsBackend

    want = interpreter.interpret(PROTOS[3], params, batch)
    got = run.run_computation(PROTOS[3], params, batch, backend=LocalClientsBackend())
    assert _bits(got) == _bits(want) and not calls
    split = run.round_split_of(interpreter.prepare(PROTOS[3]))
    arg = [params, PopulationRef("p", [0, 1, 2])]
    assert run._engine_clients(split, arg) == 0


# -- the device path (`device_sums.on_device`): the host path's bits ---------------------


@functools.lru_cache(maxsize=None)
def _example_targets(clients: int) -> dict:
    """examples/algorithm_rounds.py's targets, built once a module (every algorithm's
    initial state is computed to build them: seconds)."""
    import importlib.util
    import os
    import sys

    folder = os.path.join(os.path.dirname(__file__), os.pardir, "examples")
    sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location(
            "algorithm_rounds", os.path.join(folder, "algorithm_rounds.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.export_targets(clients)
    finally:
        sys.path.remove(folder)


@pytest.mark.parametrize("name", ["fed_avg", "learned_client_weights"])
def test_example_rounds_on_the_device_path_have_the_host_bits(name, monkeypatch):
    original = device_sums.finish
    program, args, placements = _example_targets(3)[name]
    proto = fb.export_tff(program, *args, placements=placements)
    host = run.run_computation(proto, *args, on_device=False)
    finished = []
    monkeypatch.setattr(device_sums, "finish", lambda *a: finished.append(a[0])
                        or original(*a))
    is_round = run.round_split_of(interpreter.prepare(proto)) is not None
    if not is_round:  # on_device=True is refused where no round runs
        with pytest.raises(ArgumentError, match="on_device=True"):
            run.run_computation(proto, *args, on_device=True)
        monkeypatch.setenv(device_sums.ENV_VAR, "1")  # the environment's: no refusal
    device = run.run_computation(proto, *args, on_device=True if is_round else None)
    assert _bits(device) == _bits(host)
    if is_round:  # its aggregates were summed on the device
        assert finished


@pytest.mark.parametrize("sample", [
    dict(name="scaled_aggregate", kind="sum"), dict(name="scaled_aggregate", kind="mean"),
    dict(name="scaled_aggregate", kind="max"),
    dict(name="scaled_aggregate", kind="sum", dtype=np.int32),
    dict(name="scaled_aggregate", kind="mean", dtype=np.float16),
    dict(name="weighted_mean"), dict(name="linear_regression_step")])
def test_sample_rounds_on_the_device_path_have_the_host_bits(sample, monkeypatch):
    import sample_computations as samples

    proto = samples.make(**sample)
    rng = np.random.default_rng(1)
    if sample["name"] == "scaled_aggregate":
        dtype = sample.get("dtype", np.float32)
        x = (rng.standard_normal((5, 3)) * 2.0 ** rng.integers(-12, 12, (5, 3)))
        args = (x.astype(dtype), np.asarray([1.5, -3, 0.25]).astype(dtype))
    elif sample["name"] == "weighted_mean":
        args = (rng.standard_normal((5, 3)).astype(np.float32),
                rng.integers(0, 9, 5).astype(np.float32))
    else:
        args = (rng.standard_normal(8).astype(np.float32),
                rng.standard_normal((4, 16, 8)).astype(np.float32),
                rng.standard_normal((4, 16)).astype(np.float32))
    host = run.run_computation(proto, *args, on_device=False)
    monkeypatch.setenv("FAX_BRIDGE_ON_DEVICE", "1")  # the environment's choice, once
    device = run.run_computation(proto, *args)
    assert _bits(device) == _bits(host)


@pytest.mark.parametrize("value", ["0", "false", "no", "False", "1", 0, 1, 1.0, []],
                         ids=repr)
def test_on_device_takes_only_true_false_or_none(value):
    """A string, number or other value is refused by name (a non-empty string would
    otherwise read as True), before any client work; so is True where no round runs."""
    params, data = _args(np.random.default_rng(0), 3, [1.0] * 3)
    with pytest.raises(ArgumentError, match=r"on_device=.*expected True"):
        run.run_computation(PROTOS[3], params, data, on_device=value)
    with pytest.raises(ArgumentError, match="num_clients"):
        run.run_computation(PROTOS[3], params, data, num_clients=3, on_device=True)


def test_the_device_path_takes_and_returns_jax_arrays_and_the_host_path_numpy():
    @fb.program(clients=3)
    def fedavg(params, data):
        deltas = fb.federated_map_clients(
            lambda p, x: jax.tree.map(lambda w: w * jnp.sum(x), p),
            (fb.federated_broadcast(params), data))
        return jax.tree.map(jnp.add, params, fb.federated_mean(deltas))

    params = {"a": jnp.arange(4.0), "b": jnp.ones((2, 3), jnp.bfloat16)}
    data = jnp.arange(6.0).reshape(3, 2)
    proto = fb.export_tff(fedavg, params, data, placements=("server", "clients"))
    device = run.run_computation(proto, params, data, on_device=True)
    host = run.run_computation(proto, params, data, on_device=False)
    model = jax.tree.structure(params)  # the round returns the model's tree
    assert jax.tree.structure(device) == model and jax.tree.structure(host) == model
    device_leaves, host_leaves = jax.tree.leaves(device), jax.tree.leaves(host)
    assert len(device_leaves) == len(host_leaves) == 2
    assert all(isinstance(leaf, jax.Array) for leaf in device_leaves)
    assert all(type(leaf) is np.ndarray for leaf in host_leaves)
    assert _bits(device) == _bits(host)
    # a model given as numpy, or a wrong shape, is read and checked as before
    assert _bits(run.run_computation(proto, jax.tree.map(np.asarray, params), data,
                                     on_device=True)) == _bits(host)
    with pytest.raises(ComputationError, match=r"expected shape \[4\]"):
        run.run_computation(proto, dict(params, a=jnp.zeros(5)), data, on_device=True)
