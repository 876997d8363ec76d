"""A round's LiteRT tensors are named by the program's pytree paths: every algorithm of
`fax_bridge.algorithms` and every example, broadcasts of a part of the state, merged
weighted means, broadcasts of computed values. Names come from the export and one trace
of the program. The models a fleet's devices convert from the client part alone take
the names the round gave it on their machine, and a trip's model of a round of several
trips the paths its map's types carry, running bit for bit as index-named ones."""

from __future__ import annotations

import pathlib

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import federated_language
from federated_language.common_libs import structure

import fax_bridge as fb
from fax_bridge.language import pytree_names
from fax_bridge.litert import (convert, lowering, manifest, model_cache, phases, runner,
                               tensor_names)
from fax_bridge.rounds import round_split, server_steps
from fax_bridge.runtime import interpreter, values
from fax_bridge.tff.cli import load_target, resolve_program

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def _names(prog, args, placements):
    """(signature names, split or None, the record) of the program's round, traced once."""
    with pytree_names.recording_aggregands() as record:
        proto = fb.export_tff(manifest.fresh(prog), *args, placements=placements)
    split = round_split.split_of(proto)
    names = None if split is None else tensor_names.signature_names(split, record)
    return names, split, record


def _index_only(name: str) -> bool:
    """Whether a name's path below its role is indices only (`broadcast/0/1`,
    `aggregate/0/value/3`); a weight, and a value with no path, have none."""
    parts = name.split("/")
    rest = (parts[3:] if parts[0] == "aggregate" and parts[2] == "value"
            else [] if parts[0] == "aggregate" else parts[1:])
    return bool(rest) and all(p.isdigit() for p in rest)


# Rounds of several trips have no single client part (each trip's map is a model of its
# own, `litert.phases`); fed_yogi and fed_adagrad are fed_adam's `fed_opt` with another
# server optimizer: the same client part, the same names.
SKIPPED = {"learned_server_lr", "learned_client_weights", "fed_sgd", "streaming_diloco",
           "fed_yogi", "fed_adagrad"}


@pytest.fixture
def targets(monkeypatch) -> dict:
    """Every round of `examples/algorithm_rounds.py` (the algorithms of
    `fax_bridge.algorithms`, less `SKIPPED`) and DP-FedAvg, at the digits examples'
    model with its parameters drawn by numpy (the names depend on the pytree only), and
    every program an example gives example arguments for (`_programs`)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import _digits
    import algorithm_rounds

    def init_mlp(seed, sizes=(64, 64, 10)):
        rng = np.random.default_rng(seed)
        return {k: rng.normal(size=shape).astype(np.float32)
                for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:]))
                for k, shape in ((f"w{i}", (m, n)), (f"b{i}", (n,)))}

    monkeypatch.setattr(_digits, "init_mlp", init_mlp)
    made = {k: v for k, v in algorithm_rounds.export_targets(2).items() if k not in SKIPPED}
    dp = fb.algorithms.dp_fed_avg(_digits.loss, optax.sgd(0.1), clients=2,
                                  noise_multiplier=1.0)
    _, (_, data, mask), _ = made["fed_avg"]
    made["dp_fed_avg"] = (dp.next, (dp.init(init_mlp(0)), data, mask), dp.placements)
    for path in sorted(EXAMPLES.glob("[!_]*.py")):
        if "example_args" not in path.read_text():
            continue
        module = load_target(f"{path}:__name__")[0]
        for name in _programs(module):
            declared = isinstance(getattr(module, name), fb.api.Program)
            made[f"{path.name}:{name}"] = resolve_program(f"{path}:{name}",
                                                          None if declared else 2)
    return made


def _programs(module) -> list:
    """The programs an example gives example arguments for: those `__exportable__`
    names (beside its `example_args`), and each `NAME` of a `NAME_example_args`."""
    names = list(getattr(module, "__exportable__", ())) if hasattr(
        module, "example_args") else []
    names += [a[:-len("_example_args")] for a in dir(module)
              if a.endswith("_example_args") and a != "_example_args"]
    return sorted(set(names))


def test_every_algorithm_and_example_names_its_tensors_by_pytree_path(targets):
    split_names = {}
    for name, (prog, args, placements) in targets.items():
        names, split, record = _names(prog, args, placements)
        assert names is not None, name
        inputs, outputs = names
        param, result = lowering.split_types(split)
        sig = lowering.client_signature(param, result, split.aggregations, names)
        assert [t.name for t in sig.inputs] == inputs, name
        assert not [n for n in inputs if _index_only(n)], (name, inputs)
        # an aggregand's leaf with a key is named by its path; only a bare array's
        # (no key anywhere) may be an index
        aggregated = [p for op, paths in record if op != "federated_broadcast" for p in paths]
        for path in aggregated:
            if any(not s.isdigit() for s in path):
                assert any(n.endswith("/" + "/".join(path)) for n in outputs), (name, path)
        assert len([n for n in outputs if _index_only(n)]) <= \
            len([p for p in aggregated if not p]), (name, outputs)
        split_names[name] = names
    assert {"fed_avg", "fed_adam", "fed_fish", "dp_fed_avg", "fed_reconstruction",
            "learned_server_lr_one_trip", "fed_sgd_one_trip", "quickstart.py:fedavg_round",
            "hierarchical_fedavg.py:hierarchical_round"} <= set(split_names)
    # the broadcast is a field of the state; the loss's weighted mean shares the
    # delta's weights (one aggregation), and is named by the result it becomes
    inputs, outputs = split_names["fed_avg"]
    assert inputs == ["broadcast/state/params/b0", "broadcast/state/params/b1",
                      "broadcast/state/params/w0", "broadcast/state/params/w1",
                      "client/batches/x", "client/batches/y", "client/mask"]
    assert outputs == ["aggregate/0/value/b0", "aggregate/0/value/b1",
                       "aggregate/0/value/w0", "aggregate/0/value/w1",
                       "aggregate/0/value/1/loss", "aggregate/0/weight"]
    # two sums of trees of the same paths merged into one: each under its call's index
    assert split_names["fed_fish"][1][:5] == [
        "aggregate/0/value/0/b0", "aggregate/0/value/0/b1", "aggregate/0/value/0/w0",
        "aggregate/0/value/0/w1", "aggregate/0/value/1/b0"]


def test_a_computed_broadcast_and_merged_means_take_their_recorded_paths():
    @fb.program(clients=2)
    def round_(state, x):
        scaled = fb.federated_map_server(lambda s: {"lr": s["lr"] * 2.0}, state)
        sent = fb.federated_broadcast(scaled)
        out = fb.federated_map_clients(
            lambda s, c: ({"w": c * s["lr"], "b": jnp.sum(c)}, jnp.mean(c),
                          jnp.float32(1.0)), (sent, x))
        update, other, weight = out
        return (fb.federated_weighted_mean(update, weight),
                fb.federated_weighted_mean(other, weight))

    args = ({"lr": np.float32(0.5)}, np.ones((2, 3), np.float32))
    (inputs, outputs), _, _ = _names(round_, args, ("server", "clients"))
    assert inputs == ["broadcast/0/lr", "client/x"]
    # the bare mean goes to the result by position only: its call's index in the merge
    assert outputs == ["aggregate/0/value/b", "aggregate/0/value/w", "aggregate/0/value/1",
                       "aggregate/0/weight"]


def test_names_that_do_not_fit_the_signature_are_refused():
    from fax_bridge.errors import ComputationError

    @fb.program(clients=2)
    def round_(w, x):
        return fb.federated_mean(fb.federated_map_clients(
            lambda p, c: c * p, (fb.federated_broadcast(w), x)))

    args = (np.float32(1.0), np.ones((2, 3), np.float32))
    split = round_split.split_of(fb.export_tff(round_, *args,
                                               placements=("server", "clients")))
    param, result = lowering.split_types(split)
    with pytest.raises(ComputationError, match="each name once"):
        lowering.client_signature(param, result, split.aggregations, (["a", "a"], ["v"]))
    with pytest.raises(ComputationError, match="1 input and 1 output names"):
        lowering.client_signature(param, result, split.aggregations, (["a"], ["v"]))


def _signature_names(model) -> tuple:
    """(input names, output names) the .tflite's signature declares, sorted."""
    from ai_edge_litert.interpreter import Interpreter

    found = Interpreter(model_content=model.tflite).get_signature_list()[model.signature]
    return sorted(found["inputs"]), sorted(found["outputs"])


def _bits(model, leaves: list) -> list:
    return [x.tobytes() for x in runner.ClientRunner(model)(leaves)]


def test_a_device_given_the_client_part_alone_names_its_model_as_the_round_did(
        empty_litert_cache, monkeypatch):
    @fb.program(clients=2)
    def one_round(params, x):
        return fb.federated_mean(fb.federated_map_clients(
            lambda p, c: jnp.tanh(c @ p["w"]) + p["b"], (fb.federated_broadcast(params), x)))

    args = ({"w": np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2),
             "b": np.float32([0.5, -0.25])},
            np.linspace(0, 1, 24, dtype=np.float32).reshape(2, 4, 3))
    proto = fb.export_tff(one_round, *args, placements=("server", "clients"))
    split = round_split.split_round(proto)
    monkeypatch.setattr(convert, "_NAMES", {})
    # a fleet's coordinator converts the round with its split before any client work
    runner.LiteRTClientRuntime().check_round(proto, split)
    made = convert.convert_round(split)
    named = (["broadcast/params/b", "broadcast/params/w", "client/x"], ["aggregate/0/value"])
    assert _signature_names(made) == named
    # a device process of this machine has the client part, the values and the specs
    arg = values.bind_arguments(interpreter.prepare(proto).parameter, args, {}) \
        .runtime_value()
    env = server_steps.prepare(split, arg, None, 2)
    sent = structure.Struct([(None, env[name]) for name in split.broadcasts])
    members = [structure.Struct([(None, arg[i][c]) for i in split.client_inputs])
               for c in range(2)]
    specs = [a.spec for a in split.aggregations]

    def on_a_device():
        monkeypatch.setattr(convert, "_MADE", {})
        monkeypatch.setattr(convert, "_NAMES", {})
        return runner.model_for(split.client_part, split.client_part_hash, sent, members,
                                specs)

    device = on_a_device()
    assert device.tflite == made.tflite and device.convert_s == 0.0  # the machine's model
    # a damaged record of the names is named, and the device names its model by index,
    # which computes the same bits
    record = model_cache.names_path(split.client_part_hash)
    record.write_text(record.read_text().replace("broadcast/params/b", "broadcast/params/w"))
    with pytest.warns(RuntimeWarning, match=f"{record} is damaged.*named by index"):
        indexed = on_a_device()
    assert _signature_names(indexed) == (["broadcast/0/b", "broadcast/0/w", "client/0"],
                                         ["aggregate/0/value"])
    leaves = lowering.flatten(sent, made.signature_types.parameter[0], []) + \
        lowering.flatten(members[1], made.signature_types.parameter[1], [])
    assert _bits(indexed, leaves) == _bits(made, leaves)


def test_a_trip_of_a_round_of_several_trips_names_its_model_by_its_maps_paths(
        empty_litert_cache):
    @fb.program(clients=2)
    def two_trips(params, x):
        first = fb.federated_mean(fb.federated_map_clients(
            lambda p, c: (jnp.sum(c["a"]) * p["w"], jnp.sum(c["b"])),
            (fb.federated_broadcast(params), x)))
        return fb.federated_sum(fb.federated_map_clients(
            lambda g, c: jnp.sum(g[0]) * jnp.sum(c["a"]) + g[1],
            (fb.federated_broadcast(first), x)))

    args = ({"w": np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2)},
            {"a": np.linspace(0, 1, 24, dtype=np.float32).reshape(2, 4, 3),
             "b": np.float32([1.5, 2.5])})
    proto = fb.export_tff(two_trips, *args, placements=("server", "clients"))
    assert round_split.split_of(proto) is None
    (m1, first), (m2, second) = [(m, model) for m, model in phases.convert_round(proto)
                                 if model is not None]
    # the round's parameter and the client's data carry their names; the zips and a
    # map's result none
    assert _signature_names(first) == (["client/0/w", "client/1/a", "client/1/b"],
                                       ["result/0", "result/1"])
    assert _signature_names(second) == (["client/0/0", "client/0/1", "client/1/a",
                                         "client/1/b"], ["result"])
    assert phases.model_of(m1.fn, m1.key) is first  # every device names it alike
    part, param, result = phases._wrapped(m1.fn)
    indexed = convert.convert_client_part(part, param, result, key=m1.key)
    assert _signature_names(indexed)[0] == ["client/0/0/w", "client/0/1/a", "client/0/1/b"]
    leaves = [args[0]["w"], args[1]["a"][1], args[1]["b"][1]]
    assert _bits(first, leaves) == _bits(indexed, leaves)


def test_a_client_maps_names_are_valid_and_distinct_whatever_its_types_name():
    f32 = federated_language.TensorType(np.float32)
    fn_type = federated_language.FunctionType(
        federated_language.StructType([("a b", f32), ("a_b", f32), (None, f32)]),
        federated_language.StructType([("out/x", f32)]))
    assert tensor_names.client_map_names(fn_type) == (
        ("client/a_b", "client/a_b_2", "client/2"), ("result/out_x",))
    bare = federated_language.FunctionType(None, f32)
    assert tensor_names.client_map_names(bare) == ((), ("result",))
