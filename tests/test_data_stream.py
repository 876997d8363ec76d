"""Populations written to disk and read back a cohort at a time."""

import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fax_bridge.data import ClientStore, write_population
from fax_bridge.errors import DataError


def _population(n=7):
    rng = np.random.default_rng(0)
    for i in range(n):
        m = int(rng.integers(1, 6))
        yield {"x": rng.normal(size=(m, 3)).astype(np.float32),
               "y": np.full(m, i, dtype=np.int32)}


def test_round_trip(tmp_path):
    clients = list(_population())
    assert write_population(str(tmp_path), iter(clients)) == 7
    store = ClientStore(str(tmp_path))
    assert store.num_clients == 7 and store.keys == ["x", "y"]
    np.testing.assert_array_equal(store.sizes, [len(c["y"]) for c in clients])
    for i, c in enumerate(clients):
        got = store.client(i)
        np.testing.assert_array_equal(got["x"], c["x"])
        assert got["y"].dtype == np.int32 and (got["y"] == i).all()
    cohort = store.cohort([5, 2], multiple_of=4)
    assert cohort.data["x"].shape[1] % 4 == 0
    np.testing.assert_array_equal(cohort.counts, [len(clients[5]["y"]), len(clients[2]["y"])])
    np.testing.assert_array_equal(cohort.data["x"][0, : cohort.counts[0]], clients[5]["x"])


def test_arrays_are_read_on_demand_not_loaded(tmp_path):
    write_population(str(tmp_path), _population())
    with ClientStore(str(tmp_path)) as store:
        held = [v for v in vars(store).values() if isinstance(v, np.ndarray)]
        assert [a.size for a in held] == [store.num_clients + 1]  # the offsets only
        o = store.offsets  # examples 1..2 of client 3, then client 0's first one
        np.testing.assert_array_equal(store.rows("x", [o[3] + 1, o[0]], [2, 1]),
                                      [*store.client(3)["x"][1:3], store.client(0)["x"][0]])


def test_refuses_to_overwrite_and_checks_shapes(tmp_path):
    write_population(str(tmp_path), _population(2))
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_population(str(tmp_path), _population(2))
    bad = [{"x": np.ones((2, 3), np.float32)}, {"x": np.ones((2, 4), np.float32)}]
    with pytest.raises(ValueError, match="example shape"):
        write_population(str(tmp_path), bad, overwrite=True)
    with pytest.raises(FileNotFoundError, match="write_population"):
        ClientStore(str(tmp_path / "nothing"))


@settings(max_examples=20, deadline=None)
@given(ids=st.lists(st.integers(0, 6), min_size=1, max_size=5), keep=st.floats(0, 0.99))
def test_a_file_truncated_while_rows_are_read_fails_that_read(tmp_path_factory, ids, keep):
    """Whether the read runs past the new end (a short read) or not (the file checked
    again after reading), rows of a file truncated under the reader are never returned;
    a mapping would have raised SIGBUS in the reading process instead."""
    directory = str(tmp_path_factory.mktemp("truncated"))
    write_population(directory, _population())
    path = os.path.join(directory, "x.bin")
    with ClientStore(directory) as store:
        checked = store.check

        def check_then_truncate(keys=None):  # the file changes between check and read
            checked(keys)
            os.truncate(path, int(os.path.getsize(path) * keep))

        store.check = check_then_truncate
        starts = store.offsets[np.asarray(ids)]
        with pytest.raises(DataError, match=f"population file {path} changed .*truncated"):
            store.read(["x"], starts, store.offsets[np.asarray(ids) + 1] - starts)
