"""A round's LiteRT tensors are named by the program's pytree paths: every algorithm of
`fax_bridge.algorithms` and every example, broadcasts of a part of the state, merged
weighted means, broadcasts of computed values. Names come from the export and one trace
of the program; nothing is converted here."""

from __future__ import annotations

import pathlib

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fax_bridge as fb
from fax_bridge.language import pytree_names
from fax_bridge.litert import lowering, manifest, tensor_names
from fax_bridge.rounds import round_split
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
