"""Tests of fax_bridge.runtime.values: pytree conversions, type checks, argument binding."""

import federated_language as fl
import numpy as np
import pytest
from federated_language.common_libs import structure

from fax_bridge.errors import ComputationError
from fax_bridge.runtime import values
from sample_computations import clients, server

F32 = np.float32
V2 = fl.TensorType(F32, [2])


def test_dicts_become_named_structs_in_type_order():
    t = fl.StructType([("b", V2), ("a", np.int32)])
    v = values.to_local({"a": 3, "b": [1.0, 2.0]}, t)
    assert structure.name_list(v) == ["b", "a"]
    assert v.b.dtype == F32 and v.a.dtype == np.int32
    assert values.local_to_pytree(v) == {"b": pytest.approx(np.array([1.0, 2.0])),
                                         "a": 3}


def test_tuples_are_unnamed_structs_and_round_trip():
    t = fl.StructType([(None, V2), (None, fl.StructType([("k", np.int32)]))])
    v = values.to_local(([1, 2], {"k": 5}), t)
    back = values.local_to_pytree(v)
    assert isinstance(back, tuple) and back[1] == {"k": 5}
    np.testing.assert_array_equal(back[0], [1.0, 2.0])


def test_clients_values_unstack_and_stack():
    t = fl.StructType([("x", clients(fl.StructType([("w", V2), ("n", np.int32)]))),
                       ("s", server(F32))])
    stacked = {"x": {"w": np.arange(6, dtype=F32).reshape(3, 2), "n": np.arange(3)},
               "s": 1.0}
    v = values.from_pytree(stacked, t)
    assert isinstance(v.x, values.ClientRows) and len(v.x) == 3
    np.testing.assert_array_equal(v.x[1].w, [2.0, 3.0])
    np.testing.assert_array_equal(v.x[-1].n, 2)
    assert [int(m.n) for m in v.x] == [0, 1, 2]  # one member per client, made on access
    assert values.check_value(v, t).x is v.x  # checked once, as a whole
    assert values.num_clients_of(v, t) == 3
    back = values.to_pytree(v, t)
    np.testing.assert_array_equal(back["x"]["w"], stacked["x"]["w"])
    np.testing.assert_array_equal(back["x"]["n"], np.arange(3))


def test_errors_name_path_expected_and_actual():
    t = fl.StructType([("x", fl.StructType([(None, V2), ("z", np.int32)]))])
    with pytest.raises(ComputationError, match=r"`x\.0`: expected shape \[2\].*float32"
                                               r".*got float64\[3\]"):
        values.to_local({"x": (np.zeros(3), 1)}, t)
    with pytest.raises(ComputationError, match=r"`x\.z`: expected dtype int32"):
        values.to_local({"x": (np.zeros(2), 1.5)}, t)
    with pytest.raises(ComputationError, match=r"`x`: expected 2 elements"):
        values.to_local({"x": (np.zeros(2),)}, t)
    with pytest.raises(ComputationError, match=r"missing \['x'\], unexpected \['y'\]"):
        values.to_local({"y": 1}, t)
    with pytest.raises(ComputationError, match="expected a tensor"):
        values.to_local({"x": ({"a": 1}, 1)}, t)
    with pytest.raises(ComputationError, match="leading clients axis differs"):
        values.from_pytree({"a": np.zeros((2, 2)), "b": np.zeros((3, 2))},
                           clients(fl.StructType([("a", V2), ("b", V2)])))


def test_check_value_for_per_client_lists():
    t = clients(V2)
    checked = values.check_value([np.zeros(2), [1, 2]], t)
    assert [(c.dtype, c.tolist()) for c in checked] == [(F32, [0, 0]), (F32, [1, 2])]
    with pytest.raises(ComputationError, match=r"\[client 1\]"):
        values.check_value([np.zeros(2), np.zeros(3)], t)
    with pytest.raises(ComputationError, match="one member per client"):
        values.check_value(np.zeros((2, 2)), t)


# -- binding arguments ----------------------------------------------------------------

PARAM = fl.StructType([("x", clients(V2)), ("lr", server(F32))])


def test_bind_arguments_positional_then_by_name():
    xs = np.ones((4, 2), F32)
    for args, kwargs in (((xs, 0.1), {}), ((xs,), {"lr": 0.1}), ((), {"x": xs, "lr": 0.1})):
        bound = values.bind_arguments(PARAM, args, kwargs)
        assert bound.num_clients() == 4
        assert len(bound.runtime_value()[0]) == 4
    with pytest.raises(ComputationError, match=r"missing \['lr'\]"):
        values.bind_arguments(PARAM, (xs,), {})
    with pytest.raises(ComputationError, match="unexpected keyword"):
        values.bind_arguments(PARAM, (xs, 0.1), {"y": 1})
    with pytest.raises(ComputationError, match="takes 2 arguments"):
        values.bind_arguments(PARAM, (xs, 0.1, 3), {})
    with pytest.raises(ComputationError, match="takes no arguments"):
        values.bind_arguments(None, (xs,), {})
    assert values.bind_arguments(server(F32), (1.0,), {}).num_clients() is None


def test_select_clients_keeps_only_the_chosen_rows_of_clients_values():
    xs = np.arange(10, dtype=F32).reshape(5, 2)
    bound = values.bind_arguments(PARAM, (xs, 0.5), {})
    picked = bound.select_clients(np.array([1, 3]))
    assert picked.num_clients() == 2
    members = picked.runtime_value()[0]
    np.testing.assert_array_equal(np.stack(members), xs[[1, 3]])
    assert float(picked.runtime_value()[1]) == 0.5
    with pytest.raises(ComputationError, match="disagree on the number of clients"):
        values.bind_arguments(fl.StructType([("a", clients(V2)), ("b", clients(V2))]),
                              (np.ones((2, 2), F32), np.ones((3, 2), F32)), {}).num_clients()


def test_named_tuples_match_named_elements_by_name():
    import collections

    Pair = collections.namedtuple("Pair", ["b", "a"])
    t = fl.StructType([("a", F32), ("b", V2)])
    v = values.to_local(Pair(b=np.ones(2), a=2.0), t)
    assert float(v.a) == 2.0 and v.b.shape == (2,)


class _CountingKey(str):
    """A dict key that counts its comparisons (a str subclass: Python asks it first)."""

    compared = 0

    def __eq__(self, other):
        type(self).compared += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


@pytest.mark.parametrize("keys", [50, 400])
def test_a_dict_is_matched_to_its_type_in_comparisons_linear_in_its_keys(keys):
    """Each key of a dict argument is looked up among the type's names once: a list of
    names searched for every key was quadratic in the keys (a dict of 10,000 parameters:
    50 million comparisons). At most a few comparisons per key, whatever the count."""
    names = [f"p{i:05d}" for i in range(keys)]
    type_ = fl.StructType([(n, fl.TensorType(np.float32, [2])) for n in names])
    value = {_CountingKey(n): np.full(2, i, np.float32) for i, n in enumerate(names)}
    _CountingKey.compared = 0
    local = values.to_local(value, type_)
    assert _CountingKey.compared <= 4 * keys
    assert [n for n, _ in structure.iter_elements(local)] == names
    np.testing.assert_array_equal(local[keys - 1], np.full(2, keys - 1, np.float32))
