"""Padding clients of unequal size to a common shape with masks."""

import numpy as np
import pytest

from fax_bridge.data import pad_clients, to_batches


def _clients():
    return [{"x": np.ones((n, 2), np.float32) * (i + 1), "y": np.arange(n)}
            for i, n in enumerate([3, 1, 5])]


def test_pad_to_largest_with_masks_and_counts():
    p = pad_clients(_clients())
    assert p.data["x"].shape == (3, 5, 2)
    np.testing.assert_array_equal(p.counts, [3, 1, 5])
    np.testing.assert_array_equal(p.mask.sum(1), [3, 1, 5])
    assert p.mask[0].tolist() == [True, True, True, False, False]
    assert (p.data["x"][1, 1:] == 0).all() and (p.data["x"][1, 0] == 2).all()
    assert p.num_clients == 3


def test_multiple_of_and_batches():
    p = to_batches(pad_clients(_clients(), multiple_of=4), batch_size=4)
    assert p.data["x"].shape == (3, 2, 4, 2)
    assert p.mask.shape == (3, 2, 4)
    assert p.mask[1].tolist() == [[True, False, False, False], [False] * 4]
    np.testing.assert_array_equal(p.mask.sum((1, 2)), p.counts)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="more than the padded size"):
        pad_clients(_clients(), size=2)
    with pytest.raises(ValueError, match="multiple of batch_size"):
        to_batches(pad_clients(_clients()), batch_size=2)
    with pytest.raises(ValueError, match="keys"):
        pad_clients([{"x": np.ones(2)}, {"z": np.ones(2)}])
