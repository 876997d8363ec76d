"""The non-IID digits loader."""

import numpy as np

from fax_bridge.data import load_federated_digits


def test_digits_split_sizes_and_test_set():
    d = load_federated_digits(num_clients=100, alpha=0.5, seed=0)
    assert len(d.clients) == 100
    assert d.sizes.sum() + len(d.test["y"]) == 1797
    assert d.sizes.min() >= 2
    assert d.test["x"].shape[1] == 64 and d.test["x"].dtype == np.float32
    assert 0.0 <= d.test["x"].min() and d.test["x"].max() <= 1.0
    # every class is represented in the held-out set, and clients are label-skewed
    assert len(np.unique(d.test["y"])) == 10
    classes_per_client = [len(np.unique(c["y"])) for c in d.clients]
    assert np.mean(classes_per_client) < 8


def test_digits_seeded():
    """The same seed gives the same split (every client's examples and the held-out
    set); another seed another split."""
    a = load_federated_digits(num_clients=10, seed=1)
    b = load_federated_digits(num_clients=10, seed=1)
    c = load_federated_digits(num_clients=10, seed=2)
    assert len(a.clients) == len(b.clients) == len(c.clients) == 10
    for x, y in zip(a.clients, b.clients):
        np.testing.assert_array_equal(x["x"], y["x"])
        np.testing.assert_array_equal(x["y"], y["y"])
    np.testing.assert_array_equal(a.test["y"], b.test["y"])
    np.testing.assert_array_equal(a.test["x"], b.test["x"])
    assert not all(np.array_equal(x["y"], z["y"]) for x, z in zip(a.clients, c.clients))


def test_the_shipped_file_is_read_as_scikit_learn_reads_it(monkeypatch):
    """`digits_arrays` reads scikit-learn's digits file without importing scikit-learn,
    with load_digits' values, dtypes and shapes; without the file it asks load_digits."""
    import sys

    from sklearn.datasets import load_digits

    from fax_bridge.data import digits

    raw = load_digits()
    pixels, labels = digits.digits_arrays()
    assert pixels.dtype == raw.data.dtype and labels.dtype == raw.target.dtype
    np.testing.assert_array_equal(pixels, raw.data)
    np.testing.assert_array_equal(labels, raw.target)
    monkeypatch.setattr(digits.os.path, "isfile", lambda path: False)
    calls = []
    monkeypatch.setattr(sys.modules["sklearn.datasets"], "load_digits",
                        lambda: calls.append(1) or raw)
    fallback = digits.digits_arrays()
    assert calls == [1] and fallback[0] is raw.data and fallback[1] is raw.target

