"""Populations written to disk and read back a cohort at a time."""

import numpy as np
import pytest

from fax_bridge.data import ClientStore, write_population


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


def test_arrays_are_memory_mapped_not_loaded(tmp_path):
    write_population(str(tmp_path), _population())
    store = ClientStore(str(tmp_path))
    assert isinstance(store._arrays["x"], np.memmap)


def test_refuses_to_overwrite_and_checks_shapes(tmp_path):
    write_population(str(tmp_path), _population(2))
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_population(str(tmp_path), _population(2))
    bad = [{"x": np.ones((2, 3), np.float32)}, {"x": np.ones((2, 4), np.float32)}]
    with pytest.raises(ValueError, match="example shape"):
        write_population(str(tmp_path), bad, overwrite=True)
    with pytest.raises(FileNotFoundError, match="write_population"):
        ClientStore(str(tmp_path / "nothing"))
