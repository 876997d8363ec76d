"""runtime.limits: sizes computed without overflow and checked against the caps first."""

import federated_language as fl
import numpy as np
import pytest
from hypothesis import given, strategies as st

from fax_bridge.errors import ComputationError
from fax_bridge.runtime import limits


@given(st.lists(st.integers(0, 1 << 40), max_size=6), st.sampled_from([1, 2, 4, 8]))
def test_tensor_bytes_is_exact_or_refused(shape, itemsize):
    exact = int(np.prod(shape, dtype=object)) * itemsize if shape else itemsize
    span = int(np.prod([max(d, 1) for d in shape], dtype=object)) * itemsize
    if max(exact, span) <= limits.LIMITS.max_tensor_bytes:
        assert limits.tensor_bytes(shape, itemsize, "t") == exact
    else:
        with pytest.raises(ComputationError, match="above the cap"):
            limits.tensor_bytes(shape, itemsize, "t")


def test_rank_unknown_and_negative_dimensions():
    with pytest.raises(ComputationError, match="rank 65"):
        limits.tensor_bytes([1] * 65, 4, "t")
    with pytest.raises(ComputationError, match="negative dimension"):
        limits.tensor_bytes([2, -1], 4, "t")
    assert limits.tensor_bytes([None, 3], 4, "t") == 0


def test_type_bytes_walks_every_kind_of_type():
    t = fl.StructType([("a", fl.FederatedType(fl.TensorType(np.float32, [3]), fl.CLIENTS)),
                       ("b", fl.FunctionType(fl.TensorType(np.int64, [2]),
                                             fl.TensorType(np.int8)))])
    assert limits.type_bytes(t) == 12 + 16 + 1


def test_set_limits_returns_the_previous_caps():
    before = limits.set_limits(max_tensor_bytes=100)
    try:
        with pytest.raises(ComputationError, match="cap of 100 bytes"):
            limits.tensor_bytes([26], 4, "t")
        assert limits.tensor_bytes([25], 4, "t") == 100
    finally:
        restored = limits.set_limits(max_tensor_bytes=before.max_tensor_bytes)
    assert restored.max_tensor_bytes == 100
    assert "FAX_BRIDGE_MAX_EVAL_STEPS" in str(limits.too_many_steps("x"))
