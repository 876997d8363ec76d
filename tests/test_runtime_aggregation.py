"""runtime.aggregation: each kind against numpy, partials in any split equal the whole to
the bit (exact zeros, cancellations, subnormals, signed zeros included), and errors."""

import numpy as np
import pytest
from federated_language.common_libs import structure
from hypothesis import given, settings, strategies as st

import federated_language as fl

from fax_bridge.errors import AggregationError, ComputationError, WeightError
from fax_bridge.rounds import partials, validate
from fax_bridge.runtime import aggregation
from fax_bridge.runtime.backend import leaves

RNG = np.random.default_rng(1)
XS = [RNG.normal(size=(2, 3)).astype(np.float32) for _ in range(7)]
WS = [np.float32(w) for w in RNG.uniform(0.5, 2.0, size=7)]


@pytest.mark.parametrize("kind,closed_form", [
    ("sum", lambda x: x.sum(0)),
    ("mean", lambda x: x.mean(0)),
    ("min", lambda x: x.min(0)),
    ("max", lambda x: x.max(0)),
])
def test_kinds_match_numpy(kind, closed_form):
    out = aggregation.reduce(kind, XS)
    np.testing.assert_allclose(out, closed_form(np.stack(XS)), rtol=1e-6)
    assert out.dtype == np.float32


def test_sums_are_rounded_once():
    members = [np.float32(1e8), np.float32(1.0), np.float32(-1e8)]
    assert aggregation.reduce("sum", members) == np.float32(1.0)  # in-order adds give 0


def test_weighted_mean_over_structs():
    members = [structure.Struct([("a", x), ("b", x[0])]) for x in XS]
    out = aggregation.reduce("weighted_mean", members, WS)
    w = np.array(WS)
    want = (np.stack(XS) * w[:, None, None]).sum(0) / w.sum()
    np.testing.assert_allclose(out.a, want, rtol=1e-5)
    np.testing.assert_allclose(out.b, want[0], rtol=1e-5)
    assert structure.name_list(out) == ["a", "b"]


# Values where exact sums are delicate: exact zeros of both signs, cancelling pairs,
# subnormals, the largest finite values.
_SPECIAL = [0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, 1.2e-38, 3.4e38, -3.4e38, 0.5, -2.0]
_values = st.one_of(st.sampled_from(_SPECIAL),
                    st.floats(width=32, allow_nan=False, allow_infinity=False))
_KINDS = ("sum", "mean", "weighted_mean", "min", "max")


def _types(member) -> list:
    return [fl.TensorType(x.dtype, x.shape) for x in leaves(member)]


def _split_partial(kind, members, weights, cuts):
    """The aggregate as devices would give it: partials per block, through the wire,
    each one passing the coordinator's checks of what an honest device sends."""
    bounds = [0, *sorted({c % (len(members) + 1) for c in cuts}), len(members)]
    total = aggregation.Partial(kind=kind, leaves=[])
    for lo, hi in zip(bounds, bounds[1:]):
        part = aggregation.partial_of(kind, members[lo:hi],
                                      None if weights is None else weights[lo:hi])
        message = partials.to_message(part)
        if hi > lo:
            validate.check_partial(message, kind, _types(members[0]),
                                   _types(weights[0]) if weights else [], hi - lo, "d")
        aggregation.merge(total, partials.from_message(kind, message))
    return aggregation.finish(total)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(_KINDS), st.integers(1, 3), st.data())
def test_any_split_gives_the_same_bits(kind, width, data):
    n = data.draw(st.integers(1, 9), label="clients")
    rows = data.draw(st.lists(st.lists(_values, min_size=width, max_size=width),
                              min_size=n, max_size=n), label="values")
    if data.draw(st.booleans(), label="cancel"):  # every second client undoes the one before
        rows = [r if i % 2 == 0 else [-v for v in rows[i - 1]] for i, r in enumerate(rows)]
    members = [np.array(r, np.float32) for r in rows]
    weights = None
    if kind == "weighted_mean":
        weights = [np.float32(w) for w in data.draw(st.lists(
            st.sampled_from([0.0, 1.0, 0.5, 2.0, 1e-45]), min_size=n, max_size=n))]
    cuts = data.draw(st.lists(st.integers(0, n), max_size=4), label="device splits")
    if kind == "weighted_mean" and not any(weights):  # 0/0: refused however split
        for run in (lambda: aggregation.reduce(kind, members, weights),
                    lambda: _split_partial(kind, members, weights, cuts)):
            with pytest.raises(WeightError, match="sum to zero"):
                run()
        return
    whole = aggregation.reduce(kind, members, weights)
    split = _split_partial(kind, members, weights, cuts)[0]
    assert whole.tobytes() == split.tobytes()


def test_exact_zero_partials_and_signed_zeros():
    zeros = [np.zeros(3, np.float32)] * 2
    part = partials.from_message("sum", partials.to_message(aggregation.partial_of("sum", zeros)))
    assert part.leaves[0].values.tobytes() == np.zeros(3).tobytes()  # the float64 form
    assert part.leaves[0].exact().limbs.shape == (0, 3)  # as limbs: none at all
    assert aggregation.finish(part)[0].tobytes() == np.zeros(3, np.float32).tobytes()
    negative = [np.array([-0.0, -0.0, 1.0], np.float32)] * 2
    got = aggregation.reduce("sum", negative)
    assert np.signbit(got).tolist() == [True, True, False]  # -0 + -0 is -0, as in IEEE
    mixed = [np.float32(-0.0), np.float32(0.0)]
    assert not np.signbit(aggregation.reduce("sum", mixed))
    empty = aggregation.partial_of("sum", [np.zeros((0, 2), np.float32)])
    again = partials.from_message("sum", partials.to_message(empty))
    assert aggregation.finish(again)[0].shape == (0, 2)


def test_secure_sum_bitwidth_bounds_inputs_not_the_sum():
    members = [np.array([255, 0], np.int32), np.array([255, 1], np.int32)]
    np.testing.assert_array_equal(
        aggregation.reduce("secure_sum_bitwidth", members, bitwidth=np.int32(8)), [510, 1])
    with pytest.raises(AggregationError, match="outside"):
        aggregation.reduce("secure_sum_bitwidth", members, bitwidth=np.int32(7))
    with pytest.raises(AggregationError, match=r"\[0, 62\]"):
        aggregation.reduce("secure_sum_bitwidth", members, bitwidth=np.int32(63))
    with pytest.raises(AggregationError, match="integers"):
        aggregation.reduce("secure_sum_bitwidth", XS, bitwidth=np.int32(8))
    pair = [structure.Struct([(None, np.int32(3)), (None, np.int32(9))])] * 2
    got = aggregation.reduce("secure_sum_bitwidth", pair,
                             bitwidth=structure.Struct([(None, np.int32(2)),
                                                        (None, np.int32(4))]))
    assert [int(v) for v in got] == [6, 18]


def test_errors():
    with pytest.raises(AggregationError, match="unknown aggregation"):
        aggregation.reduce("median", XS)
    with pytest.raises(AggregationError, match="zero clients"):
        aggregation.reduce("sum", [])
    with pytest.raises(ComputationError, match="floating-point"):  # a ComputationError too
        aggregation.reduce("mean", [np.int32(1), np.int32(2)])
    with pytest.raises(AggregationError, match="one weight per client"):
        aggregation.reduce("weighted_mean", XS, WS[:2])
    with pytest.raises(AggregationError, match=r"outside \[0, max_input\] = \[0, 5\]"):
        aggregation.check_max_input([np.array([1, 7], np.int32)], np.int32(5))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["sum", "mean", "weighted_mean"]), st.integers(1, 7),
       st.lists(st.integers(0, 7), max_size=3), st.data())
def test_values_of_several_dtypes_aggregate_as_each_tensor_alone(kind, n, cuts, data):
    """The tensors of one dtype are summed and rounded together; each tensor's result is
    the one it gets aggregated on its own, whatever the split into partials."""
    import ml_dtypes

    dtypes = [np.float32, np.float16, ml_dtypes.bfloat16, np.float32, np.float64]
    shapes = [(2, 3), (4,), (), (), (2,)]
    values = st.one_of(st.sampled_from([0.0, -0.0, 1.0, -1.0, 1e-45, 6e-8, 3e38, np.inf]),
                       st.floats(-1e4, 1e4), st.floats(-1e-30, 1e-30))

    def tensor(dtype, shape):
        flat = data.draw(st.lists(values, min_size=int(np.prod(shape)),
                                  max_size=int(np.prod(shape))))
        with np.errstate(over="ignore"):
            return np.array(flat, np.float64).astype(dtype).reshape(shape)

    members = [structure.Struct([(None, tensor(d, s)) for d, s in zip(dtypes, shapes)])
               for _ in range(n)]
    weights = None
    if kind == "weighted_mean":
        weights = [np.float32(data.draw(st.sampled_from([0.5, 1.0, 3.0, 1e-3])))
                   for _ in range(n)]
    whole = aggregation.reduce(kind, members, weights)
    split = _split_partial(kind, members, weights, cuts)
    for i in range(len(dtypes)):
        alone = aggregation.reduce(kind, [m[i] for m in members], weights)
        assert whole[i].tobytes() == alone.tobytes() == split[i].tobytes()
        assert whole[i].dtype == alone.dtype == np.dtype(dtypes[i])


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(_KINDS), st.integers(1, 9), st.data())
def test_columns_give_the_partial_of_the_members(kind, n, data):
    """`partial_of_columns` over stacked values is `partial_of` over the members, bit for
    bit, and leaves its columns as they were."""
    rows = data.draw(st.lists(st.lists(_values, min_size=3, max_size=3),
                              min_size=n, max_size=n), label="values")
    members = [structure.Struct([(None, np.array(r[:2], np.float32)),
                                 (None, np.float32(r[2]))]) for r in rows]
    weights = None
    if kind == "weighted_mean":
        weights = [np.float32(w) for w in data.draw(st.lists(
            st.sampled_from([0.0, 1.0, 0.5, 2.0, 1e-45]), min_size=n, max_size=n))]
    columns = [np.stack([m[0] for m in members]), np.stack([m[1] for m in members])]
    before = [c.copy() for c in columns]
    got = aggregation.partial_of_columns(
        kind, columns, n, None if weights is None else [np.stack(weights).reshape(n, 1)])
    want = aggregation.partial_of(kind, members, weights)
    if kind == "weighted_mean" and not any(weights):  # 0/0: both refuse to finish
        for partial in (got, want):
            with pytest.raises(WeightError, match="sum to zero"):
                aggregation.finish(partial)
    else:
        for g, w in zip(aggregation.finish(got), aggregation.finish(want)):
            assert g.tobytes() == w.tobytes()
    for c, b in zip(columns, before):
        assert c.tobytes() == b.tobytes()


def test_columns_errors():
    col = np.ones((3, 2), np.float32)
    with pytest.raises(AggregationError, match="does not hold 4 clients"):
        aggregation.partial_of_columns("sum", [col], 4)
    with pytest.raises(AggregationError, match="one scalar tensor per client"):
        aggregation.partial_of_columns("weighted_mean", [col], 3, [col])
    with pytest.raises(AggregationError, match="one scalar tensor per client; got none"):
        aggregation.partial_of_columns("weighted_mean", [col], 3)
    with pytest.raises(AggregationError, match="federated_secure_sum needs a max_input"):
        aggregation.partial_of_columns("secure_sum", [col.astype(np.int32)], 3)
    with pytest.raises(ComputationError, match="floating-point"):
        aggregation.partial_of_columns("mean", [col.astype(np.int32)], 3)
    assert aggregation.partial_of_columns("max", [col[:0]], 0).count == 0
    assert aggregation.partial_of_columns("weighted_mean", [col[:0]], 0,
                                          [np.zeros(0, np.float32)]).count == 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.5, 1.0, 3.0, -0.0, -1.0, -1e-45]), min_size=1,
                max_size=6), st.integers(0, 6))
def test_weights_are_nonnegative_and_not_all_zero_however_split(weights, cut):
    """One rule wherever the weights are concrete: a negative weight is refused by the
    partial that holds it (a device), a zero total where the partials meet."""
    n = len(weights)
    members = [np.full(2, i + 1, np.float32) for i in range(n)]
    w = [np.float32(x) for x in weights]
    negative, zero = min(weights) < 0, not any(weights)
    runs = [lambda: aggregation.reduce("weighted_mean", members, w),
            lambda: _split_partial("weighted_mean", members, w, [cut]),
            lambda: aggregation.finish(aggregation.partial_of_columns(
                "weighted_mean", [np.stack(members)], n, [np.array(w)]))]
    for run in runs:
        if negative or zero:
            with pytest.raises(WeightError, match="negative" if negative else "sum to zero"):
                run()
        else:
            got = run()
            got = got[0] if isinstance(got, list) else got
            want = sum(wi * m for wi, m in zip(weights, members)) / sum(weights)
            np.testing.assert_allclose(got, want, rtol=1e-6)
    assert issubclass(WeightError, ValueError) and issubclass(WeightError, AggregationError)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32]),
       st.sampled_from(["secure_sum_bitwidth", "secure_sum"]), st.integers(1, 40),
       st.integers(0, 40))
def test_secure_sums_refuse_bounds_whose_sum_could_wrap(dtype, kind, clients, bits):
    """clients * top must fit the dtype (the sum keeps it): else refused before any value
    is read; when it fits, clients at the top sum exactly."""
    bits = min(bits, np.iinfo(dtype).bits)
    top = 2 ** bits - 1
    bound = np.int32(bits) if kind == "secure_sum_bitwidth" else np.int64(top)
    fits = clients * top <= np.iinfo(dtype).max
    if not fits:
        with pytest.raises(AggregationError, match=f"more than {np.dtype(dtype).name} holds"):
            aggregation.check_secure_fits(kind, bound, [np.dtype(dtype)], clients)
        return
    aggregation.check_secure_fits(kind, bound, [np.dtype(dtype)], clients)
    members = [np.array([top, 0], dtype)] * clients
    got = aggregation.reduce(kind, members, bitwidth=bound)
    assert got.dtype == dtype and got.tolist() == [clients * top, 0]


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(["secure_sum_bitwidth", "secure_sum"]), st.integers(0, 6),
       st.integers(0, 9), st.data())
def test_secure_columns_give_the_partial_of_the_members(kind, n, bound, data):
    """A secure sum's stacked columns are checked against its bound as its members are,
    and sum to the same bits."""
    top = 2 ** bound - 1 if kind == "secure_sum_bitwidth" else bound
    rows = data.draw(st.lists(st.lists(st.integers(0, top + 1), min_size=3, max_size=3),
                              min_size=n, max_size=n), label="values")
    members = [structure.Struct([(None, np.array(r[:2], np.int32)), (None, np.int32(r[2]))])
               for r in rows]
    columns = [np.array([r[:2] for r in rows], np.int32).reshape(n, 2),
               np.array([r[2] for r in rows], np.int32).reshape(n)]
    b = np.int32(bound)
    if any(v > top for r in rows for v in r):
        for call in (lambda: aggregation.partial_of(kind, members, None, b),
                     lambda: aggregation.partial_of_columns(kind, columns, n, None, b)):
            with pytest.raises(AggregationError, match="lies outside"):
                call()
        return
    got = aggregation.partial_of_columns(kind, columns, n, None, b)
    want = aggregation.partial_of(kind, members, None, b)
    assert got.count == want.count == n
    if n:
        assert [g.tobytes() for g in aggregation.finish(got)] == \
            [w.tobytes() for w in aggregation.finish(want)]
    with pytest.raises(AggregationError, match="needs a"):
        aggregation.partial_of_columns(kind, columns, n)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.sampled_from(["sum", "mean", "weighted_mean"]),
       st.lists(st.one_of(st.floats(width=32), st.sampled_from([0.0, -0.0, 3e38, -3e38])),
                min_size=1, max_size=120), st.integers(0, 3))
def test_large_results_rounded_and_divided_on_several_threads_give_one_threads_bits(
        workers, kind, flat, weight):
    """Finishing rounds the float64-form sums and divides a mean's in spans of blocks
    on the worker threads; the bits (overflow to infinity, NaN, signed zeros, a zero
    weight) are one thread's."""
    from unittest import mock

    from fax_bridge.runtime import exact, threads

    rows = np.array(flat, np.float32)
    members = [rows, rows[::-1].copy()]
    weights = [np.float32(weight), np.float32(1)] if kind == "weighted_mean" else None

    def finished(threads_, block):
        with mock.patch.object(threads, "workers", lambda: threads_), \
                mock.patch.object(threads, "MIN_SPAN_BLOCKS", 1), \
                mock.patch.object(exact, "BLOCK_ELEMENTS", block):
            with np.errstate(all="ignore"):
                return aggregation.finish(aggregation.partial_of(kind, members, weights))

    want = finished(1, 1 << 17)
    got = finished(workers, 8)
    assert [g.tobytes() for g in got] == [w.tobytes() for w in want]


_MEMBER_TYPES = st.sampled_from([
    fl.TensorType(np.float32), fl.TensorType(np.int32, [3]),
    fl.TensorType(np.float64, [2, 0]),
    fl.StructType([("a", fl.TensorType(np.float32, [2])),
                   ("b", fl.StructType([(None, fl.TensorType(np.uint8, [1, 2]))]))]),
])


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(aggregation.KINDS), member_type=_MEMBER_TYPES,
       splits=st.integers(0, 3))
def test_over_zero_clients_a_sum_is_the_zero_of_its_type_and_the_rest_are_refused(
        kind, member_type, splits):
    """TFF's federated_sum reduces from generic_zero: over no clients (however many
    empty partials merge) a sum or secure sum is the zero of the member type, with its
    dtypes and shapes; a mean, weighted mean, min or max has no value and is refused
    naming the aggregation and both fixes."""
    total = aggregation.Partial(kind=kind, leaves=[])
    for _ in range(splits):
        aggregation.merge(total, aggregation.Partial(kind=kind, leaves=[]))
    types = validate.leaf_types(member_type)
    if kind in aggregation.ZERO_OVER_NONE:
        got = aggregation.finish(total, member_type)
        assert [(x.dtype, x.shape) for x in got] == [(t.dtype, tuple(t.shape)) for t in types]
        assert not any(x.any() for x in got)
        back = aggregation.reduce(kind, [], member_type=member_type)
        assert [x.tobytes() for x in leaves(back)] == [x.tobytes() for x in got]
        return
    assert aggregation.empty_refusal(kind).startswith(f"federated_{kind} has no value")
    for call in (lambda: aggregation.finish(total, member_type),
                 lambda: aggregation.reduce(kind, [], member_type=member_type)):
        with pytest.raises(AggregationError, match=rf"federated_{kind} has no value over "
                                                   r"zero clients \(.*\); run it over at "
                                                   r"least one client .*min_clients=1.*"
                                                   r"or aggregate with federated_sum"):
            call()


def test_a_sum_over_zero_clients_needs_a_type_with_a_zero():
    with pytest.raises(AggregationError, match="type, which was not given"):
        aggregation.finish(aggregation.Partial(kind="sum", leaves=[]))
    with pytest.raises(AggregationError, match="which has none.*fully defined shape"):
        aggregation.reduce("sum", [], member_type=fl.TensorType(np.float32, [None]))
