"""Results keep the structure jit gives them: generated pytrees of NamedTuples, registered
dataclasses, optax states, None, empty containers, lists and dicts as a round's state
(input and output) round-trip through the in-process runtime, a checkpoint and jit."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

import fax_bridge as fb
from fax_bridge.errors import ArgumentError, ComputationError
from fax_bridge.rounds import checkpoint
from fax_bridge.runtime import interpreter, result_structure, run_computation


class Empty(NamedTuple):
    pass


class Pair(NamedTuple):
    b: Any
    a: Any


class Triple(NamedTuple):
    z: Any
    y: Any
    x: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Node:
    right: Any
    left: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Tagged:
    value: Any
    tag: str = dataclasses.field(default="t", metadata=dict(static=True))


def _leaf(shape):
    return st.sampled_from(["f", "i"]).map(
        lambda kind: np.arange(np.prod(shape, dtype=int), dtype=np.float32 if kind == "f"
                               else np.int32).reshape(shape) + 1)


LEAVES = st.sampled_from([(), (2,), (1, 3)]).flatmap(_leaf)
EMPTY = st.sampled_from([None, (), [], {}, Empty()])
KEYS = st.sampled_from(["a", "b", "kz", "w"])


def _nodes(children):
    return st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(KEYS, children, max_size=3),
        st.builds(Pair, children, children),
        st.builds(Triple, children, children, children),
        st.builds(Node, children, children),
        st.builds(Tagged, children),
    )


PYTREES = st.recursive(st.one_of(LEAVES, EMPTY), _nodes, max_leaves=6)


def _round(state, extra):
    """A program of the round's shape: `state` at the server, data at the clients."""

    @fb.program(clients=3)
    def step(state, data):
        m = fb.federated_mean(data)
        new = jax.tree.map(lambda x: x * 2 + m.astype(x.dtype), state)
        out = jax.tree.map(lambda x: jnp.sum(x).astype(jnp.float32) + m, extra)
        return new, {"out": out, "at_clients": fb.federated_broadcast(m), "none": None}

    return step


DATA = np.arange(3, dtype=np.float32)


def _same(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        assert np.asarray(g).dtype == np.asarray(w).dtype


@settings(max_examples=6, deadline=None)
@given(state=PYTREES, extra=PYTREES)
def test_runtime_results_have_the_structure_jit_gives(state, extra):
    step = _round(state, extra)
    jitted = jax.jit(step)
    want = jitted(state, DATA)
    proto = fb.export_tff(step, state, DATA, placements=("server", "clients"))
    got = run_computation(proto, state, DATA)
    _same(got, want)
    # The runtime's state is the next round's input, for jit and for the runtime.
    _same(run_computation(proto, got[0], DATA), jitted(got[0], DATA))
    # Without the program (a copy, as if read from a file): the generic structure.
    copy = type(proto).FromString(proto.SerializeToString())
    generic = run_computation(copy, state, DATA)
    nodes = list(_nodes_of(generic))  # the (state, outputs) pair and the outputs' dict
    assert len(nodes) >= 2 and all(type(node) in (dict, tuple) for node in nodes), nodes
    _same(result_structure.with_structure(generic, jax.tree.structure(want)), want)
    _same(run_computation(interpreter.prepare(copy, jax.tree.structure(want)), state,
                          DATA), want)


def _nodes_of(tree):
    """The containers of a generic result (dicts and tuples), outermost first."""
    if isinstance(tree, (dict, tuple, list)) or tree is None:
        children = tree.values() if isinstance(tree, dict) else (tree or ())
        yield tree
        for child in children:
            yield from _nodes_of(child)


@settings(max_examples=25, deadline=None)
@given(state=PYTREES)
def test_checkpoints_give_back_the_state_s_structure(state, tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpt")
    checkpoint.save(directory, 4, state, {"k": 1})
    saved = checkpoint.load(directory, like=state)
    assert saved.round == 4 and saved.meta == {"k": 1}
    _same(saved.state, state)
    generic = checkpoint.load(directory).state  # no structure given: plain containers
    assert len(jax.tree.leaves(generic)) == len(jax.tree.leaves(state))


def test_an_optax_state_round_trips_through_the_runtime():
    params = {"w": jnp.ones(3), "b": jnp.zeros(())}
    opt = optax.chain(optax.clip(1.0), optax.adam(0.1))

    @fb.program(clients=3)
    def step(state, data):
        params, opt_state = state
        grads = jax.tree.map(lambda p: p * fb.federated_mean(data), params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), None

    state = (params, opt.init(params))
    proto = fb.export_tff(step, state, DATA, placements=("server", "clients"))
    got = run_computation(proto, state, DATA)
    jitted = jax.jit(step)
    _same(got, jitted(state, DATA))
    _same(jitted(got[0], DATA), run_computation(proto, got[0], DATA))


def test_a_structure_of_another_program_is_refused():
    with pytest.raises(ComputationError, match="another program"):
        result_structure.with_structure((np.ones(2), np.ones(1)),
                                        jax.tree.structure([1, 2, 3]))
    with pytest.raises(ArgumentError, match="jax.tree.structure"):
        interpreter.prepare(b"", structure=[1, 2])


@settings(max_examples=60, deadline=None)
@given(tree=PYTREES)
def test_a_structure_written_as_json_is_read_back_as_jit_gives_it(tree):
    import json

    want = jax.tree.structure(jax.jit(lambda t: t)(tree))
    text = json.dumps(result_structure.structure_to_json(want))
    assert result_structure.structure_from_json(json.loads(text)) == want


def test_a_node_whose_class_is_not_imported_here_comes_back_as_a_tuple():
    import json

    tree = {"p": Pair(1, [2, None]), "t": Tagged(3, tag="x")}
    text = json.dumps(result_structure.structure_to_json(jax.tree.structure(tree)))
    text = text.replace(f"{__name__}:", "a_module_never_imported:")
    got = result_structure.structure_from_json(json.loads(text))
    assert got == jax.tree.structure({"p": (1, [2, None]), "t": (3,)})
    assert "a_module_never_imported" not in __import__("sys").modules


def _dict_node(keys: list) -> dict:
    return {"format": 1, "tree": {"type": "dict", "data": {"list": keys},
                                  "children": ["*"] * len(keys)}}


@pytest.mark.parametrize("hostile", [
    None, {"format": 2, "tree": "*"}, {"format": 1, "tree": {"type": "tuple"}},
    {"format": True, "tree": "*"}, {"format": 1.0, "tree": "*"},
    {"format": 1, "tree": {"type": "dict", "data": {"list": ["a"]}, "children": []}},
    {"format": 1, "tree": {"type": "tuple", "data": {"set": [1]}, "children": []}},
    # keys one dict cannot hold apart: a dict of them would drop a child
    _dict_node([1, 1.0]), _dict_node([True, 1]), _dict_node([0, False, "x"]),
    _dict_node(["a", "a"]), _dict_node([{"list": [1]}, 2]),
    _dict_node([{"tuple": [1, 2]}, {"tuple": [1.0, 2]}]),
])
def test_json_not_of_the_schema_is_refused(hostile):
    with pytest.raises(ValueError, match="result structure"):
        result_structure.structure_from_json(hostile)


def test_a_structure_too_deep_is_refused_before_it_is_built():
    tree: Any = "*"
    for _ in range(300):
        tree = {"type": "list", "children": [tree]}
    with pytest.raises(ValueError, match="levels deep"):
        result_structure.structure_from_json({"format": 1, "tree": tree})


def test_distinct_dict_keys_come_back_whole():
    import json

    tree = {"a": {1: 1, 2: 2}, "b": {(1, 2): 3, (2, 1): 4}, "c": {1.5: 5, 2.5: 6}}
    want = jax.tree.structure(tree)
    data = json.loads(json.dumps(result_structure.structure_to_json(want)))
    got = result_structure.structure_from_json(data)
    assert got == want and jax.tree.unflatten(got, jax.tree.leaves(tree)) == tree


def test_a_class_name_never_runs_a_modules_lazy_import_hook():
    """The text names classes; a module's `__getattr__` (a package's lazy imports, such
    as fax_bridge's own) would import what it names: names are looked up in the
    modules' own dictionaries, so nothing new is imported and no hook runs."""
    import sys
    import types

    calls = []
    lazy = types.ModuleType("fax_bridge_test_lazy_module")
    lazy.__getattr__ = lambda name: calls.append(name) or Pair
    sys.modules[lazy.__name__] = lazy
    try:
        names = [f"{lazy.__name__}:Pair", f"{lazy.__name__}:Pair.b", "fax_bridge:LocalFleet",
                 "fax_bridge:multihost.Fake", "concurrent.futures:ProcessPoolExecutor",
                 "fax_bridge:tracing.trace"]
        before = set(sys.modules)
        for name in names:
            node = {"format": 1, "tree": {"type": name, "children": ["*", "*"]}}
            assert result_structure.structure_from_json(node) == jax.tree.structure((1, 2))
        assert calls == [] and set(sys.modules) == before
    finally:
        del sys.modules[lazy.__name__]
    # a class of a module already imported still comes back as itself
    node = result_structure.structure_to_json(jax.tree.structure(Pair(1, 2)))
    assert result_structure.structure_from_json(node) == jax.tree.structure(Pair(1, 2))
