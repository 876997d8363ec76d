"""Client maps of every shape through every LiteRT entry point: a map of no operands (as
the DP aggregator's count of present clients), of no outputs, of one input or several,
of nested pytrees and scalars. The rounding bounds (`parity.rounding`, which `fax-bridge
litert` and `check_parity(client_runtime="litert")` use) are made for all of them, and
the round converts and runs alike in `fax-bridge litert`, in process, on a LiteRT
fleet and where `fax-bridge flower --litert` writes an app."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import fax_bridge as fb
from fax_bridge import in_process, privacy
from fax_bridge.parity import rounding as parity_rounding
from fax_bridge.language import tracing
from fax_bridge.fleet.launcher import LocalFleet
from fax_bridge.litert import carried, manifest, runner
from fax_bridge.parity.check import check_parity
from fax_bridge.rounds import round_split
from fax_bridge.runtime import interpreter, values

N = 3
PLACE = ("server", "clients", "clients", "clients")
# What the main client map gives: one scalar, one vector, several, a nested pytree.
OUTS = {
    "scalar": lambda y: y,
    "vector": lambda y: y * jnp.arange(1, 4, dtype=jnp.float32),
    "several": lambda y: (y, 2.0 * y, y * jnp.ones(2, jnp.float32)),
    "nested": lambda y: {"a": y, "b": {"c": y * jnp.ones(2, jnp.float32), "d": -y}},
}


def round_of(used: tuple, out: str, constant_map: bool, empty_map: bool):
    """A round whose main client map reads the broadcast and the client inputs `used`
    marks (a scalar, a vector, a nested dict) and gives `OUTS[out]`; `constant_map` adds
    a map of no operands (its argument unread), `empty_map` one of no outputs."""

    def client(p, s, v, n):
        y = jnp.sum(p)
        for leaf_tree, use in zip((s, v, n), used):
            if use:
                y = y + sum(jnp.sum(leaf) for leaf in jax.tree.leaves(leaf_tree))
        return OUTS[out](y)

    @fb.program(clients=N)
    def one_round(p, s, v, n):
        result = [fb.federated_sum(fb.federated_map_clients(
            client, (fb.federated_broadcast(p), s, v, n)))]
        if constant_map:
            ones = fb.federated_map_clients(lambda leaf: jnp.ones((), jnp.float32), s)
            result.append(fb.federated_sum(ones))
        if empty_map:
            fb.federated_map_clients(lambda leaf: (), v)
        return tuple(result)

    return one_round


def args_of():
    rng = np.random.default_rng(1)
    return (rng.normal(size=2).astype(np.float32),
            rng.normal(size=N).astype(np.float32),
            rng.normal(size=(N, 3)).astype(np.float32),
            {"a": rng.normal(size=(N, 2)).astype(np.float32),
             "b": {"c": rng.normal(size=N).astype(np.float32)}})


SHAPES = st.tuples(st.tuples(st.booleans(), st.booleans(), st.booleans()),
                   st.sampled_from(sorted(OUTS)), st.booleans(), st.booleans())


def _ceiling(values) -> float:
    """1e-4 x the largest |value| plus the float32 spacing there: a bound above it would
    pass an answer wrong by 1e-4."""
    top = np.float32(np.max(np.abs(np.asarray(values, np.float64)), initial=0.0))
    return 1e-4 * float(top) + float(np.spacing(top))


@settings(max_examples=6, deadline=None)
@given(SHAPES)
def test_rounding_bounds_cover_client_maps_of_every_shape(shape):
    """Every output's bound holds jit's float32 result to the float64 one, and is under
    1e-4 of the output's values; each aggregation's per-client bounds likewise."""
    prog, args = round_of(*shape), args_of()
    comp = tracing.trace(prog, *args, placements=PLACE)
    bounds = parity_rounding.evaluation_bounds(comp, args)
    local = jax.tree_util.tree_leaves(jax.jit(prog)(*args))
    with jax.enable_x64(True):
        exact = jax.tree_util.tree_leaves(prog(*jax.tree.map(
            lambda a: np.asarray(a, np.float64), args)))
    assert [np.shape(b) for b in bounds] == [np.shape(x) for x in local]
    for got, want, bound in zip(local, exact, bounds):
        diff = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
        assert np.all(diff <= bound), (diff, bound)
        assert np.max(bound) <= _ceiling(got), (np.max(bound), _ceiling(got))
    found = parity_rounding.aggregand_bounds(comp, args)
    leaves = len(jax.tree.leaves(OUTS[shape[1]](jnp.float32(1))))  # a sum per leaf
    assert [kind for kind, _ in found] == ["sum"] * (leaves + shape[2])
    assert all(np.shape(e)[:1] == (N,) for _, errs in found for e in errs)
    for (_, [errs]), total in zip(found, local):  # each client's value is under its sum's
        assert np.max(errs) <= _ceiling(total), (np.max(errs), _ceiling(total))


def test_a_client_map_of_no_operands_takes_its_clients_from_the_map():
    @fb.program(clients=4)
    def count(x):
        return fb.federated_sum(fb.federated_map_clients(
            lambda leaf: jnp.ones((), jnp.float32), x))

    x = np.ones(4, np.float32)
    comp = tracing.trace(count, x, placements="clients")
    (bound,) = parity_rounding.evaluation_bounds(comp, (x,))
    assert 0 <= bound <= _ceiling(4.0)  # a sum of four ones
    [(kind, [errs])] = parity_rounding.aggregand_bounds(comp, (x,))
    assert kind == "sum" and np.shape(errs) == (4,)
    assert np.all(errs == 0)  # a constant: the same on every path


@pytest.fixture(scope="module")
def litert_fleet():
    with LocalFleet(devices=2, client_runtime="litert") as fleet:
        yield fleet


def _ran(split) -> int:
    return runner.loaded().get(split.client_part_hash, 0)


@settings(max_examples=4, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(SHAPES)
def test_every_litert_entry_point_takes_client_maps_of_every_shape(litert_fleet, tmp_path,
                                                                   shape):
    prog, args = round_of(*shape), args_of()
    proto = fb.export_tff(prog, *args, placements=PLACE)
    split = round_split.split_of(proto)
    comp = tracing.trace(prog, *args, placements=PLACE)
    # fax-bridge litert: the model, its bounds and its manifest
    model = runner.model_for(split.client_part, split.client_part_hash, None, None,
                             [a.spec for a in split.aggregations], split)
    bounds = manifest.output_bounds(split, model,
                                    parity_rounding.aggregand_bounds(comp, args))
    prepared = interpreter.prepare(proto)
    arg = values.bind_arguments(prepared.parameter, args, {}).runtime_value()
    written = manifest.write(tmp_path / "out", split, model, "sig", manifest.example_client(
        split, arg), bounds)
    assert len(written["outputs"]) == len(model.outputs)
    # in process, counted by the runner
    before = _ran(split)
    in_process.run_in_process(split, arg, client_runtime="litert")
    assert _ran(split) == before + N
    # a LiteRT fleet, checked by check_parity (every device answered "litert")
    report = check_parity(prog, *args, placements=PLACE, fleet=litert_fleet,
                          client_runtime="litert")
    assert report.ok, report.table()
    # fax-bridge flower --litert: the model the app carries (`app_dir.litert_models`)
    [(name, text)] = [carried.pack(round_split.split_round(proto, secure=True),
                                   str(prepared.type))]
    assert split.client_part_hash in name and text


def test_the_readme_dp_round_converts_and_runs_in_litert(litert_fleet, tmp_path):
    dp = privacy.gaussian_adaptive(noise_multiplier=0.5, clients_per_round=N)

    @fb.program(clients=N)
    def dp_round(params, dp_state, x):
        delta = fb.federated_map_clients(lambda p, x: p * 0 + jnp.mean(x),
                                         (fb.federated_broadcast(params), x))
        mean, new_state, _ = dp.aggregate(dp_state, delta)
        return params + mean, new_state

    args = (np.ones(3, np.float32), dp.init(0),
            np.arange(N * 3, dtype=np.float32).reshape(N, 3))
    place = ("server", "server", "clients")
    report = check_parity(dp_round, *args, placements=place, fleet=litert_fleet,
                          client_runtime="litert")
    assert report.ok, report.table()
