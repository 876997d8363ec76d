"""rounds.validate: what devices send back is checked against the expected types."""

import fractions

import federated_language as fl
import numpy as np
import pytest
from federated_language.common_libs import structure
from hypothesis import example, given, settings, strategies as st

from fax_bridge.errors import FleetError
from fax_bridge.rounds import partials, validate
from fax_bridge.runtime import aggregation, exact
from fax_bridge.runtime.double_sums import DoubleSum
from fax_bridge.v1 import device_pb2 as pb

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


def _limbs(partial: aggregation.Partial) -> aggregation.Partial:
    """The partial with every float64-form sum as limbs (the form the limb checks read)."""
    def form(leaf):
        return leaf.exact() if isinstance(leaf, DoubleSum) else leaf

    partial.leaves = [form(leaf) for leaf in partial.leaves]
    partial.weights = None if partial.weights is None else form(partial.weights)
    return partial


def _answer(kind, members, weights=None, limbs=True):
    """The answer in the exact form, even over one client (whose devices send addends:
    tests/test_rounds_partials.py)."""
    partial = aggregation.partial_of(kind, members, weights)
    partial = _limbs(partial) if limbs else partial
    out = pb.AggregateResponse(num_clients=partial.count)
    for leaf in partial.leaves:
        partials.leaf_message(leaf, out.leaves.add())
    if partial.weights is not None:
        partials.leaf_message(partial.weights, out.weight_leaves.add())
    return out


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
    with pytest.raises(FleetError, match="2 limbs from limb 0; a sum of 1 int32 values has one"):
        validate.check_partial(ints, "sum", validate.leaf_types(fl.TensorType(np.int32, [3])),
                               [], 1, "d0")


# -- partials no honest device could send ----------------------------------------------
# An honest partial over n clients sums n finite values: |sum| <= n * largest finite
# (`max_units`, in units of the smallest subnormal). Its limbs lie from limb 0 up to the
# one that sum reaches, the digits below the top in [0, 2^32), the top within the sum's
# bound; the tests build stacks at that bound, and just beyond it.

_FLOATS = ["float16", "bfloat16", "float32", "float64"]


def _np_dtype(name: str) -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _message(dtype, shape, count, base, rows, flags=b"") -> pb.AggregateResponse:
    answer = pb.AggregateResponse(num_clients=count)
    leaf = answer.leaves.add(dtype=dtype.name, base_limb=base, num_limbs=len(rows),
                             limbs=np.array(rows, "<i8").tobytes(), nonfinite=flags)
    leaf.shape.extend(shape)
    return answer


@st.composite
def _at_the_bound(draw, count=None):
    """(dtype, count, base, rows [num, 2]) an honest device's limbs may reach: the top
    limb and the digits at their extremes or anywhere between."""
    dtype = _np_dtype(draw(st.sampled_from(_FLOATS)))
    count = count or draw(st.one_of(st.integers(1, 9), st.integers(1, 2**40)))
    units = exact.max_units(dtype, count)
    last = (units.bit_length() - 1) // exact.LIMB_BITS
    base = draw(st.integers(0, last))
    num = draw(st.integers(1, last + 1 - base))
    most = units >> (exact.LIMB_BITS * (base + num - 1))
    high, low = min(most, exact.TOP_LIMIT - 1), -min(most + 1, exact.TOP_LIMIT - 1)
    digit = st.one_of(st.sampled_from([0, 2**32 - 1]), st.integers(0, 2**32 - 1))
    top = st.one_of(st.sampled_from([high, low, 0]), st.integers(low, high))
    rows = [[draw(digit) for _ in range(2)] for _ in range(num - 1)]
    rows.append([draw(top) for _ in range(2)])
    return dtype, count, base, rows


def _value(base, rows) -> list[int]:
    return [sum(int(r[j]) << (exact.LIMB_BITS * (base + k)) for k, r in enumerate(rows))
            for j in range(2)]


@settings(max_examples=150, deadline=None)
@given(_at_the_bound(), st.sampled_from(["top_up", "top_down", "digit_up", "digit_down",
                                          "base_down", "limbs_up"]))
def test_limbs_at_the_honest_bound_pass_and_beyond_it_are_refused(bound, forgery):
    dtype, count, base, rows = bound
    types = [fl.TensorType(dtype, [2])]
    validate.check_partial(_message(dtype, [2], count, base, rows), "sum", types, [], count,
                           "device 7")
    units = exact.max_units(dtype, count)
    last = (units.bit_length() - 1) // exact.LIMB_BITS
    most = units >> (exact.LIMB_BITS * (base + len(rows) - 1))
    rows = [list(r) for r in rows]
    if forgery == "top_up":
        rows[-1][1] = min(most, exact.TOP_LIMIT - 1) + 1
    elif forgery == "top_down":
        rows[-1][0] = -min(most + 1, exact.TOP_LIMIT - 1) - 1
    elif forgery in ("digit_up", "digit_down"):
        rows.insert(0, [2**32 if forgery == "digit_up" else -1, 0])
        base -= base > 0  # the same top limb, one digit more below it
    elif forgery == "base_down":
        base = -1
    else:
        rows += [[1, 1]] * (last + 2 - base - len(rows))
    pattern = {"top_up": "top limb holds", "top_down": "top limb holds",
               "digit_up": r"outside \[0, 2\^32\)", "digit_down": r"outside \[0, 2\^32\)",
               "base_down": f"limbs between 0 and {last}",
               "limbs_up": f"limbs between 0 and {last}"}[forgery]
    if forgery.startswith("digit") and len(rows) > last + 1 - base:
        pattern = f"limbs between 0 and {last}"  # no room below: refused for its length
    with pytest.raises(FleetError, match=f"device 7, sum leaf 0: .*{pattern}.*forged"):
        validate.check_partial(_message(dtype, [2], count, base, rows), "sum", types, [],
                               count, "device 7")


@settings(max_examples=40, deadline=None)
@given(st.lists(_at_the_bound(count=1), min_size=1, max_size=40).filter(
    lambda bounds: len({b[0] for b in bounds}) == 1))
def test_merging_many_partials_at_the_bound_stays_exact(bounds):
    """Any number of partials as large as validation lets through merge exactly: the
    coordinator's total equals the sum of the values they denote (Python integers)."""
    dtype = bounds[0][0]
    types = [fl.TensorType(dtype, [2])]
    total = aggregation.Partial(kind="sum", leaves=[])
    want = [0, 0]
    for _, count, base, rows in bounds:
        answer = _message(dtype, [2], count, base, rows)
        validate.check_partial(answer, "sum", types, [], count, "d0")
        aggregation.merge(total, partials.from_message("sum", answer))
        want = [w + v for w, v in zip(want, _value(base, rows))]
    acc = total.leaves[0]
    assert _value(acc.base, acc.limbs.tolist()) == want
    assert np.abs(acc.limbs).max(initial=0) < exact.TOP_LIMIT


def test_thousands_of_maximal_partials_merge_exactly():
    """Top limbs of 2^61 - 1 (the most a compacted stack holds), of either sign, from
    3,000 devices: every merge adds one to a compacted total, so nothing overflows."""
    dtype, types = np.dtype(np.float64), [fl.TensorType(np.float64, [2])]
    total = aggregation.Partial(kind="sum", leaves=[])
    top = exact.TOP_LIMIT - 1
    want = [0, 0]
    for i in range(3000):
        rows = [[2**32 - 1, 0], [top, -top if i % 3 else top]]
        answer = _message(dtype, [2], 1, 5, rows)
        validate.check_partial(answer, "sum", types, [], 1, "d0")
        aggregation.merge(total, partials.from_message("sum", answer))
        want = [w + v for w, v in zip(want, _value(5, rows))]
    assert _value(total.leaves[0].base, total.leaves[0].limbs.tolist()) == want
    exact_sums = [fractions.Fraction(v, 2**1074) for v in want]  # units: 2^-1074
    assert aggregation.finish(total)[0].tolist() == [float(v) for v in exact_sums]


def test_inconsistent_fields_and_counts_are_refused():
    f32, i32 = fl.TensorType(np.float32, [2]), fl.TensorType(np.int32, [2])
    f32_open = fl.TensorType(np.float32, [None])
    ok = _message(np.dtype(np.float32), [2], 3, 4, [[1, 2]])
    validate.check_partial(ok, "sum", [f32], [], 3, "d1")
    cases = [
        (_message(np.dtype(np.float32), [2], 10**18, 4, [[1, 2]]), [f32], 3,
         "over 1000000000000000000 clients; the device holds 3"),
        (_message(np.dtype(np.int32), [2], 3, 1, [[1, 2]]), [i32], 3, "one limb at 0"),
        (_message(np.dtype(np.int32), [2], 3, 0, [[1, 2]], b"\0\0"), [i32], 3,
         "2 non-finite flags for 2 int32 elements; expected none"),
        (_message(np.dtype(np.int32), [2], 3, 0, [[3 * 2**31, 2]]), [i32], 3,
         r"top limb holds 2 .. 6442450944; .* keeps it in \[-6442450944, 6442450941\]"),
        (_message(np.dtype(np.float32), [2], 3, 4, [[1, 2]], b"\x10\0"), [f32], 3,
         "flags are inconsistent"),
        (_message(np.dtype(np.float32), [2], 3, 4, [[1, 2]], b"\x09\0"), [f32], 3,
         "flags are inconsistent"),  # NaN seen, yet only -0 added
        (_message(np.dtype(np.float32), [2], 3, 4, [[1, 0]], b"\x08\0"), [f32], 3,
         "flags are inconsistent"),  # only -0 added, yet a nonzero sum
        (_message(np.dtype(np.float32), [-2], 3, 4, []), [f32_open], 3,
         "negative dimension"),
        (_message(np.dtype(np.float32), [2**40, 2**40], 3, 4, []),
         [fl.TensorType(np.float32, [None, None])], 3, "above the cap"),
    ]
    for answer, types, count, pattern in cases:
        with pytest.raises(FleetError, match=pattern):
            validate.check_partial(answer, "sum", types, [], count, "d1")
    negative_zero = _message(np.dtype(np.float32), [2], 3, 4, [[0, 2]], b"\x08\0")
    validate.check_partial(negative_zero, "sum", [f32], [], 3, "d1")
    weighted = _answer("weighted_mean", [np.ones(2, np.float32)] * 3, [np.float32(2)] * 3)
    weight = weighted.weight_leaves[0]  # 3 float32 weights stay below 3 * 2^21 in limb 8
    weight.base_limb, weight.num_limbs = 8, 1
    weight.limbs = np.array([3 * 2**21 + 1], "<i8").tobytes()
    with pytest.raises(FleetError, match="d1, weight: .*top limb"):
        validate.check_partial(weighted, "weighted_mean", [f32], [fl.TensorType(np.float32)],
                               3, "d1")


def test_float64_form_partials_are_checked_like_limbs():
    """A sum sent as float64 values passes when an honest device could have sent it and
    is refused, naming the leaf, when no honest device could."""
    members = [np.array([1.5, -0.0, 3e38], np.float32), np.array([2.0, -0.0, 1e38],
                                                                 np.float32)]
    types = validate.leaf_types(V3)
    good = _answer("sum", members, limbs=False)
    assert good.leaves[0].doubles and not good.leaves[0].limbs
    validate.check_partial(good, "sum", types, [], 2, "d0")
    weighted = _answer("weighted_mean", members, [np.float32(2)] * 2, limbs=False)
    validate.check_partial(weighted, "weighted_mean", types, [fl.TensorType(np.float32)], 2,
                           "d0")

    def forged(change):
        answer = _answer("sum", members, limbs=False)
        change(answer.leaves[0])
        return answer

    def values(*v):
        return np.array(v, "<f8").tobytes()

    cases = [
        (forged(lambda leaf: setattr(leaf, "doubles", values(1.5, 0.0))), "should hold"),
        (forged(lambda leaf: setattr(leaf, "doubles", values(1.5, np.nan, 1.0))),
         "not finite whole multiples"),
        (forged(lambda leaf: setattr(leaf, "doubles", values(1.5, 2.0**-150, 1.0))),
         "not finite whole multiples"),  # below float32's smallest subnormal
        (forged(lambda leaf: setattr(leaf, "doubles", values(1.5, 0.0, 7e38))),
         "not finite whole multiples"),  # more than 2 float32 values can add up to
        (forged(lambda leaf: setattr(leaf, "num_limbs", 1)), "both as float64 values"),
        (forged(lambda leaf: setattr(leaf, "nonfinite", b"\1\0\0")),
         "both as float64 values"),
    ]
    for answer, pattern in cases:
        with pytest.raises(FleetError, match="d0, sum leaf 0: .*" + pattern):
            validate.check_partial(answer, "sum", types, [], 2, "d0")
    wide = pb.AggregateResponse(num_clients=2)
    wide.leaves.add(dtype="float64", shape=[3], doubles=values(1.0, 2.0, 3.0))
    with pytest.raises(FleetError, match="float64 sum sent as float64 values"):
        validate.check_partial(wide, "sum", [fl.TensorType(np.float64, [3])], [], 2, "d0")
    assert 6e38 < 2 * float(np.finfo(np.float32).max) < 7e38  # the bound is the sum's
    validate.check_partial(forged(lambda leaf: setattr(leaf, "doubles", values(1.5, 0.0, 6e38))),
                           "sum", types, [], 2, "d0")


@settings(max_examples=120, deadline=None)
@given(st.sampled_from(["secure_sum_bitwidth", "secure_sum"]),
       st.sampled_from([np.int32, np.int64, np.uint8]), st.integers(0, 30),
       st.integers(1, 1000), st.sampled_from(["at_top", "at_zero", "above", "negative"]))
def test_secure_sum_partials_stay_within_what_clients_in_bound_reach(kind, dtype, bound,
                                                                     count, where_to):
    """A secure sum's partial over `count` clients lies in [0, count * top] (top:
    2**bitwidth - 1, or max_input); a device answering past it is refused, naming it."""
    dtype = np.dtype(dtype)
    bound_value = np.int32(bound)
    top, = aggregation.secure_bounds(kind, bound_value, 1)
    most = count * top
    value = {"at_top": most, "at_zero": 0, "above": most + 1, "negative": -1}[where_to]
    types = [fl.TensorType(dtype, [2])]
    message = _message(dtype, [2], count, 0, [[0, value]])
    info = np.iinfo(dtype)
    in_dtype = count * int(info.min) <= value <= count * int(info.max)
    if where_to in ("at_top", "at_zero") and in_dtype:
        validate.check_partial(message, kind, types, [], count, "device 3", tops=[top])
        return
    # Past the integer type's own range its bound refuses first; within it, this one.
    reason = "secure sum's partial" if in_dtype else "top limb holds"
    with pytest.raises(FleetError, match=f"device 3, {kind} leaf 0: .*{reason}.*forged"):
        validate.check_partial(message, kind, types, [], count, "device 3", tops=[top])


def test_spilled_elements_of_a_float64_form_sum_are_checked():
    """A float64-form partial with spilled elements passes as an honest device sends
    it; positions out of order or range, too many, a nonzero value where one spilled,
    or limbs that do not match the positions are refused."""
    stack = np.ones((3, 1000), np.float32)
    stack[0, [4, 70]], stack[1, [4, 70]] = 3e38, 1e-45
    types = validate.leaf_types(fl.TensorType(np.float32, [1000]))
    honest = partials.to_message(aggregation.partial_of_columns("sum", [stack], 3))
    got, _ = validate.check_partial(honest, "sum", types, [], 3, "d0")
    assert got.leaves[0].cols.tolist() == [4, 70]

    def forged(change) -> pb.AggregateResponse:
        message = pb.AggregateResponse()
        message.CopyFrom(honest)
        change(message.leaves[0])
        return message

    def values_at(leaf, col, value):
        values = np.frombuffer(leaf.doubles, "<f8").copy()
        values[col] = value
        leaf.doubles = values.tobytes()

    for change, message in [
            (lambda leaf: setattr(leaf, "spilled", np.array([70, 4], "<i8").tobytes()),
             "spilled positions"),
            (lambda leaf: setattr(leaf, "spilled", np.array([4, 1000], "<i8").tobytes()),
             "spilled positions"),
            (lambda leaf: setattr(leaf, "spilled", np.arange(40, dtype="<i8").tobytes()),
             "at most 15"),
            (lambda leaf: values_at(leaf, 70, 1.0), "spilled positions"),
            (lambda leaf: values_at(leaf, 4, -0.0), "spilled positions"),
            (lambda leaf: setattr(leaf, "spilled", np.array([4], "<i8").tobytes()),
             "should hold"),
    ]:
        with pytest.raises(FleetError, match=message):
            validate.check_partial(forged(change), "sum", types, [], 3, "d0")


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(0, 199), st.sampled_from([np.nan, 2.0**-150, 7e38]))
def test_large_float64_form_partials_are_checked_in_spans_wherever_a_forgery_sits(
        workers, at, bad):
    """A large partial's values are checked in spans on the worker threads: an honest
    one passes on any number of threads, and a value no honest device sends is refused,
    naming the leaf, wherever it sits."""
    from unittest import mock

    from fax_bridge.runtime import threads

    values = np.linspace(-3e38, 3e38, 200).astype(np.float32).astype("<f8")
    with mock.patch.object(threads, "workers", lambda: workers), \
            mock.patch.object(threads, "MIN_SPAN_BLOCKS", 1), \
            mock.patch.object(validate, "BLOCK_ELEMENTS", 16):
        honest = pb.AggregateResponse(num_clients=2)
        honest.leaves.add(dtype="float32", shape=[200], doubles=values.tobytes())
        types = [fl.TensorType(np.float32, [200])]
        validate.check_partial(honest, "sum", types, [], 2, "d0")
        forged = values.copy()
        forged[at] = bad
        honest.leaves[0].doubles = forged.tobytes()
        with pytest.raises(FleetError, match="d0, sum leaf 0: .*not finite whole multiples"):
            validate.check_partial(honest, "sum", types, [], 2, "d0")


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from([np.float32, np.float64, np.float16, np.int32]),
       weights=st.lists(st.one_of(st.integers(-6, 6), st.floats(-3, 3, width=16),
                                  st.sampled_from([-0.0, float("-inf"), float("inf")])),
                        min_size=1, max_size=4),
       limbs=st.booleans())
@example(dtype=np.float32, weights=[float("inf"), -5], limbs=True)
@example(dtype=np.float32, weights=[float("inf"), -5], limbs=False)
@example(dtype=np.float32, weights=[-5, -0.5], limbs=False)
@example(dtype=np.float64, weights=[-0.0, 0], limbs=True)
@example(dtype=np.int32, weights=[2, -3], limbs=True)
def test_a_weight_partial_below_zero_is_refused_naming_the_device(dtype, weights, limbs):
    """Every client's weight is >= 0, so no honest partial of weights has a finite part
    below 0 or holds -inf: a forged weight partial (the exact sum of any weights, in
    either form) is refused exactly then, naming the device; -0 and 0 pass."""
    if np.dtype(dtype).kind == "i":
        weights = [int(w) if np.isfinite(w) else 1 for w in weights]
    w = [np.asarray(x, dtype) for x in weights]
    members = [np.ones(3, np.float32)] * len(w)
    answer = _answer("weighted_mean", members, [np.abs(x) for x in w], limbs)
    forged = _answer("sum", w, limbs=limbs).leaves[0]
    answer.weight_leaves[0].CopyFrom(forged)
    exact = sum(fractions.Fraction(float(x)) for x in w if np.isfinite(x))
    negative = exact < 0 or any(np.isneginf(x) for x in w)  # honest finite parts >= 0
    args = (answer, "weighted_mean", validate.leaf_types(V3), [fl.TensorType(dtype)],
            len(w), "device 3")
    if negative:
        with pytest.raises(FleetError, match="device 3, weight: a partial sum of weights "
                                             r"holds .*>= 0"):
            validate.check_partial(*args)
    else:
        validate.check_partial(*args)
