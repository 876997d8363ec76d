"""Pytree paths as tensor names: valid as TFLite signature names and .npz keys, and
distinct, whatever the dict keys; an aggregation notes its leaves' paths while recorded."""

from __future__ import annotations

import re

import jax.numpy as jnp
from hypothesis import given, settings, strategies as st

import fax_bridge as fb
from fax_bridge.language import pytree_names


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.text(max_size=6), max_size=4), max_size=12))
def test_any_paths_give_distinct_safe_names(paths):
    names = pytree_names.tensor_names(paths)
    assert len(names) == len(paths) == len(set(names))
    for name in names:
        assert re.fullmatch(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*", name), name


def test_an_aggregation_notes_its_leaves_paths_only_while_recorded():
    @fb.program(clients=2)
    def round_(x):
        return fb.federated_mean({"dense/w": x, "b": [x, x]})

    x = jnp.ones((2, 3))
    round_(x)  # nothing recorded outside the block
    with pytree_names.recording_aggregands() as record:
        round_(x)
    assert record == [("federated_mean", [["b", "0"], ["b", "1"], ["dense/w"]])]
    assert pytree_names.tensor_names(record[0][1]) == ["b/0", "b/1", "dense_w"]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["federated_sum", "federated_mean"]),
                          st.integers(1, 4)), min_size=1, max_size=8), st.data())
def test_the_records_of_one_merged_communication_are_found(calls, data):
    """Calls of one kind merged into one communication (the exporter's merge of calls
    that share their depth and weights) are found by their kind and total leaves."""
    records = [(op, [[f"{i}", str(j)] for j in range(n)]) for i, (op, n) in enumerate(calls)]
    start = data.draw(st.integers(0, len(records) - 1))
    kind = records[start][0]
    run = [start]
    for i in range(start + 1, len(records)):  # the next calls of that kind, in order
        if records[i][0] == kind:
            if not data.draw(st.booleans()):
                break
            run.append(i)
    leaves = sum(len(records[i][1]) for i in run)
    found, after = pytree_names.match_records(records, kind.removeprefix("federated_"),
                                              leaves, start)
    assert found == [records[i] for i in run] and after == run[-1] + 1
    assert pytree_names.match_records(records, "weighted_mean", leaves) is None
