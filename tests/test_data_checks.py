"""Every public data helper refuses a bad argument with a DataError that names the
argument and the value, never a raw numpy, ZeroDivision or Key error (hypothesis over
bad values, each given to one argument of an otherwise valid call)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from fax_bridge import data as fd
from fax_bridge.errors import DataError

_LABELS = np.arange(40) % 4
_ARRAYS = {"x": np.arange(40.0).reshape(40, 1), "y": _LABELS}
_CLIENTS = [{"x": np.ones((3, 2), np.float32)}, {"x": np.zeros((5, 2), np.float32)}]

_BAD_SCALARS = st.one_of(
    st.sampled_from([0, -1, -(2 ** 40), 2 ** 62, 1.5, 3.0, float("nan"), float("inf"),
                     -float("inf"), "3", None, True, [2], np.float64(2.0), np.int64(-3),
                     1e-320]),
    st.integers(-5, 100), st.floats(allow_nan=True, allow_infinity=True))
_BAD_ARRAYS = st.one_of(
    _BAD_SCALARS,
    st.sampled_from([np.array([]), np.array([[1, 2]]), np.array([1.5, 2.5]),
                     np.array([-1, 0]), np.array([0, 99]), np.array([np.nan, 1.0, 2.0]),
                     np.array(["a", None], object), [[1], [1, 2]], np.ones((2, 3)),
                     {"x": 1}, "abc", np.array([1e308, 1e308, 1e308, 1e308]),
                     np.array([1e-320, 1.0, 1.0, 1.0])]),
    st.lists(st.integers(-3, 50), max_size=6).map(np.asarray))


def _store(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pop")
    fd.write_population(str(folder), _CLIENTS)
    return fd.ClientStore(str(folder))


# (helper, argument name, call given the argument's value)
_CALLS = {
    ("sample_cohort", "num_clients"): lambda v, s: fd.sample_cohort(v, 2, 0),
    ("sample_cohort", "cohort_size"): lambda v, s: fd.sample_cohort(4, v, 0),
    ("sample_cohort", "round_index"): lambda v, s: fd.sample_cohort(4, 2, v),
    ("sample_cohort", "seed"): lambda v, s: fd.sample_cohort(4, 2, 0, seed=v),
    ("sample_cohort", "weights"): lambda v, s: fd.sample_cohort(4, 2, 0, weights=v),
    ("CohortSampler", "cohort_size"): lambda v, s: fd.CohortSampler(4, v)(0),
    ("CohortSampler", "round_index"): lambda v, s: fd.CohortSampler(4, 2)(v),
    ("PoissonSampler", "rate"): lambda v, s: fd.PoissonSampler(10, v, 10)(0),
    ("PoissonSampler", "capacity"): lambda v, s: fd.PoissonSampler(10, 0.5, v)(0),
    ("PoissonSampler", "num_clients"): lambda v, s: fd.PoissonSampler(v, 0.5, 1)(0),
    ("PoissonSampler", "round_index"): lambda v, s: fd.PoissonSampler(10, 0.5, 10)(v),
    ("dirichlet_label_skew", "labels"): lambda v, s: fd.dirichlet_label_skew(v, 2, 1.0),
    ("dirichlet_label_skew", "num_clients"): lambda v, s: fd.dirichlet_label_skew(
        _LABELS, v, 1.0),
    ("dirichlet_label_skew", "alpha"): lambda v, s: fd.dirichlet_label_skew(_LABELS, 4, v),
    ("dirichlet_label_skew", "min_size"): lambda v, s: fd.dirichlet_label_skew(
        _LABELS, 4, 1.0, min_size=v),
    ("dirichlet_label_skew", "max_tries"): lambda v, s: fd.dirichlet_label_skew(
        _LABELS, 4, 1.0, max_tries=v),
    ("partition_dirichlet", "label_key"): lambda v, s: fd.partition_dirichlet(
        _ARRAYS, v, 4, 1.0),
    ("partition_dirichlet", "arrays"): lambda v, s: fd.partition_dirichlet(
        {"y": v}, "y", 2, 1.0, min_size=0),
    ("partition_by_key", "keys"): lambda v, s: fd.partition_by_key(_ARRAYS, v),
    ("partition_by_key", "arrays"): lambda v, s: fd.partition_by_key({"x": v}, [0, 1]),
    ("split_clients", "indices"): lambda v, s: fd.split_clients(_ARRAYS, [v]),
    ("pad_clients", "size"): lambda v, s: fd.pad_clients(_CLIENTS, size=v),
    ("pad_clients", "multiple_of"): lambda v, s: fd.pad_clients(_CLIENTS, multiple_of=v),
    ("pad_clients", "clients"): lambda v, s: fd.pad_clients([_CLIENTS[0], {"x": v}]),
    ("to_batches", "batch_size"): lambda v, s: fd.to_batches(fd.pad_clients(_CLIENTS), v),
    ("to_batches", "padded"): lambda v, s: fd.to_batches(v, 2),
    ("ClientStore.client", "i"): lambda v, s: s.client(v),
    ("ClientStore.cohort", "ids"): lambda v, s: s.cohort(v),
    ("ClientStore.rows", "key"): lambda v, s: s.rows(v, np.array([0]), np.array([1])),
    ("load_federated_digits", "test_fraction"): lambda v, s: fd.load_federated_digits(
        10, test_fraction=v),
    ("load_federated_digits", "seed"): lambda v, s: fd.load_federated_digits(10, seed=v),
    ("write_population", "clients"): lambda v, s: fd.write_population(
        s.directory + "-w", v, overwrite=True),
}


@settings(max_examples=250, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(call=st.sampled_from(sorted(_CALLS)), value=_BAD_ARRAYS)
def test_bad_arguments_get_a_data_error_naming_them(tmp_path_factory, call, value):
    store = _store(tmp_path_factory) if call[0].startswith(("ClientStore", "write")) \
        else None
    helper, name = call
    try:
        _CALLS[call](value, store)
    except DataError as e:
        text = str(e)
        named = {"PoissonSampler": ("capacity",), "to_batches": ("padded", "PaddedClients"),
                 "pad_clients": ("client",), "write_population": ("client",),
                 "partition_dirichlet": ("arrays", "label")}.get(helper, ())
        assert name in text or any(word in text for word in named), (call, value, text)
        assert "Traceback" not in text and len(text) < 600
    # otherwise the value was a valid one (e.g. cohort_size 2): nothing to refuse


def test_the_messages_give_the_fix():
    with pytest.raises(DataError, match=r"batch_size must be >= 1, got 0; pass the number "
                                        r"of examples per local step"):
        fd.to_batches(fd.pad_clients(_CLIENTS), 0)
    with pytest.raises(DataError, match=r"weights must be 4 finite non-negative"):
        fd.sample_cohort(4, 2, 0, weights=[1.0, np.nan, 1.0, 1.0])
    with pytest.raises(DataError, match=r"client 1's 'x' has examples of float64\[3\], "
                                        r"client 0's float32\[2\]"):
        fd.pad_clients([_CLIENTS[0], {"x": np.zeros((2, 3))}])
    with pytest.raises(DataError, match=r"indices\[0\] must hold positions in \[0, 40\)"):
        fd.split_clients(_ARRAYS, [np.array([-1, 2])])  # not wrapped to the last example
    with pytest.raises(DataError, match=r"indices\[0\] must be a 1-D array of integer"):
        fd.split_clients(_ARRAYS, [np.array([1.7])])  # not truncated to 1
    with pytest.raises(DataError, match=r"size 10 is not a multiple of multiple_of 4"):
        fd.pad_clients(_CLIENTS, size=10, multiple_of=4)
