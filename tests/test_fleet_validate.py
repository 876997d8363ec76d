"""fleet.validate: what devices send back is checked against the expected types."""

import federated_language as fl
import numpy as np
import pytest
from federated_language.common_libs import structure

from fax_bridge.errors import FleetError
from fax_bridge.fleet import partials, validate
from fax_bridge.runtime import aggregation

V3 = fl.TensorType(np.float32, [3])
PAIR = fl.StructType([("a", V3), ("b", fl.TensorType(np.int32))])


def test_members_must_have_the_expected_structure_dtype_and_shape():
    good = structure.Struct([("a", np.ones(3, np.float32)), ("b", np.int32(1))])
    validate.check_member(good, PAIR, "here")
    for bad, message in [
            (np.ones(3, np.float32), "expected a struct of 2 elements"),
            (structure.Struct([("a", np.ones(2, np.float32)), ("b", np.int32(1))]),
             r"here\[0\]: expected float32\[3\]"),
            (structure.Struct([("a", np.ones(3, np.float64)), ("b", np.int32(1))]),
             "float64"),
    ]:
        with pytest.raises(FleetError, match=message):
            validate.check_member(bad, PAIR, "here")
    with pytest.raises(FleetError, match="expected a tensor"):
        validate.check_member(good, V3, "here")
    with pytest.raises(FleetError, match="NaN or infinity"):
        validate.check_member(np.array([1, np.nan, 2], np.float32), V3, "here",
                              reject_nonfinite=True)


def _answer(kind, members, weights=None):
    return partials.to_message(aggregation.partial_of(kind, members, weights))


def test_partials_are_checked_leaf_by_leaf():
    members = [np.ones(3, np.float32)] * 2
    types = validate.leaf_types(V3)
    validate.check_partial(_answer("sum", members), "sum", types, [], 2, "d0")
    validate.check_partial(_answer("max", members), "max", types, [], 2, "d0")
    with pytest.raises(FleetError, match="a partial over 2 clients; the device holds 3"):
        validate.check_partial(_answer("sum", members), "sum", types, [], 3, "d0")
    with pytest.raises(FleetError, match="a partial of 1 tensors for a value of 2"):
        validate.check_partial(_answer("sum", members), "sum", types * 2, [], 2, "d0")
    with pytest.raises(FleetError, match="another type"):
        validate.check_partial(_answer("sum", [np.ones(4, np.float32)]), "sum", types, [],
                               1, "d0")
    torn = _answer("sum", members)
    torn.leaves[0].limbs = torn.leaves[0].limbs[:-8]
    with pytest.raises(FleetError, match="should hold"):
        validate.check_partial(torn, "sum", types, [], 2, "d0")
    weighted = _answer("weighted_mean", members, [np.float32(1)] * 2)
    validate.check_partial(weighted, "weighted_mean", types,
                           [fl.TensorType(np.float32)], 2, "d0")
    with pytest.raises(FleetError, match="0 weight partials"):
        validate.check_partial(_answer("sum", members), "weighted_mean", types,
                               [fl.TensorType(np.float32)], 2, "d0")


def test_exact_zero_and_signed_zero_partials_are_valid_and_finite():
    zeros = _answer("sum", [np.array([-0.0, 0.0, 1.0], np.float32),
                            np.array([-0.0, 0.0, -1.0], np.float32)])
    assert zeros.leaves[0].num_limbs == 0  # every element sums to exactly zero
    validate.check_partial(zeros, "sum", validate.leaf_types(V3), [], 2, "d0",
                           reject_nonfinite=True)
    nan = _answer("sum", [np.array([np.nan, 0, 0], np.float32)])
    with pytest.raises(FleetError, match="NaN or infinity"):
        validate.check_partial(nan, "sum", validate.leaf_types(V3), [], 1, "d0",
                               reject_nonfinite=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64"])
def test_float_partials_of_any_float_dtype_may_span_several_limbs(dtype):
    import ml_dtypes

    dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    info = ml_dtypes.finfo(dtype)
    members = [np.array([info.max / 4, 1.0, -2.5], dtype),
               np.array([info.smallest_subnormal, 7.0, 1e-3], dtype)]
    answer = _answer("sum", members)
    assert answer.leaves[0].num_limbs > 1 or dtype == np.float16  # its sums fit in one
    validate.check_partial(answer, "sum", validate.leaf_types(fl.TensorType(dtype, [3])),
                           [], 2, "d0", reject_nonfinite=True)
    ints = _answer("sum", [np.arange(3, dtype=np.int32)])
    ints.leaves[0].num_limbs = 2
    ints.leaves[0].limbs += ints.leaves[0].limbs
    with pytest.raises(FleetError, match="2 limbs from limb 0; a sum of 1 int32 values has one limb at 0"):
        validate.check_partial(ints, "sum", validate.leaf_types(fl.TensorType(np.int32, [3])),
                               [], 1, "d0")
