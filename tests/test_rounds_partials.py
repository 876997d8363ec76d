"""rounds.partials: aggregate partials survive the wire exactly, whatever they hold."""

import federated_language
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fax_bridge.errors import FleetError, WeightError
from fax_bridge.rounds import partials, validate
from fax_bridge.runtime import aggregation
from fax_bridge.v1 import device_pb2 as pb

_SPECIAL = [0.0, -0.0, 1.0, -1.0, 1e-45, 3.4e38, -3.4e38, float("inf"), float("nan")]


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(aggregation.KINDS[:5]), st.integers(0, 5), st.integers(0, 3),
       st.data())
def test_every_kind_crosses_the_wire_unchanged(kind, clients, width, data):
    values = st.one_of(st.sampled_from(_SPECIAL), st.floats(width=32))
    members = [np.array(data.draw(st.lists(values, min_size=width, max_size=width)),
                        np.float32) for _ in range(clients)]
    weights = [np.float32(data.draw(st.sampled_from([0.0, 0.5, 2.0])))
               for _ in range(clients)] if kind == "weighted_mean" else None
    sent = aggregation.partial_of(kind, members, weights)
    message = pb.AggregateResponse.FromString(partials.to_message(sent).SerializeToString())
    back = partials.from_message(kind, message)
    assert back.count == clients and message.num_clients == clients
    if clients:  # the coordinator's path: each leaf checked, then decoded from its bytes
        value_types = [federated_language.TensorType(np.float32, [width])]
        weight_types = ([federated_language.TensorType(np.float32)] if weights is not None
                        else [])
        checked, payload = validate.check_partial(message, kind, value_types, weight_types,
                                                  clients, "device 0")
        assert checked.count == clients
        assert payload == sum(
            len(leaf.limbs) + len(leaf.nonfinite) + len(leaf.doubles)
            + len(leaf.extreme.data) + len(leaf.addend.data)
            for leaf in [*message.leaves, *message.weight_leaves])
        if weights is not None and not sum(weights):  # zero total: refused on every side
            for decoded in (aggregation.partial_of(kind, members, weights), back, checked):
                with pytest.raises(WeightError, match="sum to zero"):
                    aggregation.finish(decoded)
            return
        want = aggregation.finish(aggregation.partial_of(kind, members, weights))
        for decoded in (back, checked):
            got = aggregation.finish(decoded)
            assert [g.tobytes() for g in got] == [w.tobytes() for w in want]


def test_kind_numbers_cover_every_aggregation_once():
    assert sorted(partials.KIND_TO_ENUM) == sorted(aggregation.KINDS)
    assert {partials.ENUM_TO_KIND[v] for v in partials.KIND_TO_ENUM.values()} == set(
        aggregation.KINDS)


def test_integer_partials_wrap_like_the_dtype():
    members = [np.array([2**31 - 1], np.int32), np.array([1], np.int32)]
    back = partials.from_message("sum", partials.to_message(
        aggregation.partial_of("sum", members)))
    assert aggregation.finish(back)[0].tolist() == [-(2**31)]  # int32 wraps, as in XLA


# -- one client's addend in its own dtype ----------------------------------------------
# A holder of one client sends that client's addend (4 bytes an element for float32, not
# the 8 of the float64 form); the receiver builds the exact sum from it, so the round's
# bits do not depend on which holders held one client.

def _dtype(name):
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _blocks(data, clients):
    """A split of `clients` clients into holders, in client order (singletons likely)."""
    sizes, left = [], clients
    while left:
        sizes.append(data.draw(st.sampled_from([1, 1, min(2, left), left]).filter(
            lambda s: 1 <= s <= left)))
        left -= sizes[-1]
    return sizes


def _through_holders(kind, members, weights, sizes, types, weight_types, rounded=False):
    """The finished aggregate over holders of `sizes` clients each, every answer sent,
    serialized, checked and merged as the coordinator does; and the answers."""
    total, pending, checked, answers, start = None, [], [], [], 0
    for size in sizes:
        sent = aggregation.partial_of(kind, members[start:start + size],
                                      None if weights is None else weights[start:start + size])
        message = pb.AggregateResponse.FromString(
            partials.to_message(sent, rounded=rounded).SerializeToString())
        answers.append(message)
        checked.append(validate.check_partial(message, kind, types, weight_types, size,
                                              f"holder {len(answers)}", pending=pending,
                                              rounded=rounded))
        start += size
    validate.check_pending(pending)
    for partial, _ in checked:
        total = partial if total is None else aggregation.merge(total, partial)
    return aggregation.finish(total), answers, [payload for _, payload in checked]


@settings(max_examples=120, deadline=None)
@given(st.sampled_from(["sum", "mean", "weighted_mean"]),
       st.sampled_from(["float32", "bfloat16", "float16", "float64", "int32"]),
       st.integers(1, 6), st.integers(0, 4), st.data())
def test_one_client_holders_send_their_addend_and_the_bits_stay(kind, dtype, clients,
                                                                 width, data):
    if dtype == "int32" and kind != "sum":
        kind = "sum"  # means need floats
    dtype = _dtype(dtype)
    if dtype.kind == "i":
        values = st.integers(-2**31, 2**31 - 1)
    else:
        values = st.one_of(st.sampled_from(_SPECIAL), st.floats(width=32),
                           st.floats(-1e4, 1e4, width=32))
    with np.errstate(over="ignore"):  # float32 values past float16's range: infinities
        members = [np.array(data.draw(st.lists(values, min_size=width, max_size=width)),
                            np.float64 if dtype.kind != "i" else np.int64).astype(dtype)
                   for _ in range(clients)]
    weights = ([np.float32(data.draw(st.sampled_from([0.0, 0.5, 2.0, 3.25])))
                for _ in range(clients)] if kind == "weighted_mean" else None)
    types = [federated_language.TensorType(dtype, [width])]
    weight_types = [federated_language.TensorType(np.float32)] if weights else []
    sizes = _blocks(data, clients)
    try:
        want = aggregation.finish(aggregation.partial_of(kind, members, weights))
    except WeightError:
        with pytest.raises(WeightError):
            _through_holders(kind, members, weights, sizes, types, weight_types)
        return
    got, answers, payloads = _through_holders(kind, members, weights, sizes, types,
                                              weight_types)
    assert [g.tobytes() for g in got] == [w.tobytes() for w in want]
    for size, answer, payload in zip(sizes, answers, payloads):
        leaves = [*answer.leaves, *answer.weight_leaves]
        if size == 1:  # the client's own dtype: as many bytes as its values
            assert leaves and all(leaf.addend.dtype and not leaf.doubles and not leaf.limbs
                                  for leaf in leaves)
            assert payload == width * dtype.itemsize + (4 if weights else 0)
        else:
            assert not any(leaf.addend.dtype for leaf in leaves)


def test_an_addend_standing_for_several_clients_is_refused_unless_the_round_rounds():
    members = [np.array([1.5, -2.0], np.float32), np.array([0.25, 8.0], np.float32)]
    types = [federated_language.TensorType(np.float32, [2])]
    message = partials.to_message(aggregation.partial_of("sum", members), rounded=True)
    assert message.leaves[0].addend.dtype == "float32"
    with pytest.raises(FleetError, match="a partial over 2 clients sent as one addend"):
        validate.check_partial(message, "sum", types, [], 2, "holder 0")
    checked, payload = validate.check_partial(message, "sum", types, [], 2, "holder 0",
                                              rounded=True)
    assert payload == 8 and aggregation.finish(checked)[0].tolist() == [1.75, 6.0]
    ints = partials.to_message(aggregation.partial_of(
        "sum", [np.array([1], np.int32), np.array([2], np.int32)]), rounded=True)
    assert not ints.leaves[0].addend.dtype  # integer sums are never rounded
    forged = partials.to_message(aggregation.partial_of("sum", members[:1]))
    forged.leaves[0].doubles = b"\0" * 16
    with pytest.raises(FleetError, match="both as an addend and in another form"):
        validate.check_partial(forged, "sum", types, [], 1, "holder 0")
    secure = partials.to_message(aggregation.partial_of(
        "secure_sum_bitwidth", [np.array([1], np.int32)], bitwidth=np.int32(2)))
    secure.leaves[0].addend.data = np.array([9], np.int32).tobytes()
    with pytest.raises(FleetError, match=r"secure sum's addend holds 9 .. 9"):
        validate.check_partial(secure, "secure_sum_bitwidth",
                               [federated_language.TensorType(np.int32, [1])], [], 1, "h",
                               tops=[3])


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["sum", "mean", "weighted_mean"]), st.integers(2, 8),
       st.integers(1, 4), st.data())
def test_rounded_partials_agree_within_their_rounding(kind, clients, width, data):
    values = st.floats(-1e6, 1e6, width=32)
    members = [np.array(data.draw(st.lists(values, min_size=width, max_size=width)),
                        np.float32) for _ in range(clients)]
    weights = ([np.float32(data.draw(st.sampled_from([0.5, 2.0, 3.25])))
                for _ in range(clients)] if kind == "weighted_mean" else None)
    types = [federated_language.TensorType(np.float32, [width])]
    weight_types = [federated_language.TensorType(np.float32)] if weights else []
    sizes = _blocks(data, clients)
    got = _through_holders(kind, members, weights, sizes, types, weight_types,
                           rounded=True)[0][0].astype(np.float64)
    want = aggregation.finish(aggregation.partial_of(kind, members, weights))[0]
    # Each holder's sum rounded once to float32 (half an ulp, 2^-24 of its magnitude),
    # then the exact total rounded once: the bound on what rounded partials move.
    scale = np.array([float(w) for w in weights]) if weights else np.ones(clients)
    products = np.stack([m.astype(np.float64) * s for m, s in zip(members, scale)])
    start, moved = 0, np.zeros(width)
    for size in sizes:
        moved += np.abs(products[start:start + size].sum(axis=0)) * 2.0 ** -24
        start += size
    moved = (moved + np.abs(products).sum(axis=0) * 2.0 ** -24) / (
        scale.sum() if kind == "weighted_mean" else clients if kind == "mean" else 1)
    assert np.all(np.abs(got - want.astype(np.float64)) <= 2 * moved + 1e-30)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["sum", "mean", "weighted_mean"]), st.sampled_from(["float16",
                                                                          "bfloat16"]),
       st.integers(2, 9), st.integers(1, 3), st.data())
def test_narrow_float_partials_of_a_rounded_round_are_rounded_once(kind, dtype, clients,
                                                                   width, data):
    """float16/bfloat16 sums and means accumulate in at least float32 and round once in a
    round of rounded partials too: the exact path's bits, within half an ulp of the
    float64 reference."""
    dtype = _dtype(dtype)
    values = st.floats(-300, 300, width=16).filter(lambda v: v == 0 or abs(v) > 1e-3)
    members = [np.array(data.draw(st.lists(values, min_size=width, max_size=width)),
                        np.float64).astype(dtype) for _ in range(clients)]
    weights = ([np.float32(data.draw(st.sampled_from([0.5, 2.0, 3.25])))
                for _ in range(clients)] if kind == "weighted_mean" else None)
    types = [federated_language.TensorType(dtype, [width])]
    weight_types = [federated_language.TensorType(np.float32)] if weights else []
    sizes = _blocks(data, clients)
    got = _through_holders(kind, members, weights, sizes, types, weight_types,
                           rounded=True)[0][0]
    exact = _through_holders(kind, members, weights, sizes, types, weight_types)[0][0]
    assert got.tobytes() == exact.tobytes()
    # float64 reference: a weighted mean's products are rounded to the dtype first
    scale = [float(w) for w in weights] if weights else [1.0] * clients
    terms = np.stack([(m.astype(np.float64) * s).astype(dtype).astype(np.float64)
                      if weights else m.astype(np.float64) for m, s in zip(members, scale)])
    by = sum(scale) if kind == "weighted_mean" else clients if kind == "mean" else 1
    reference = terms.sum(axis=0) / by
    spacing = np.array([float(np.spacing(dtype.type(abs(v)))) for v in got.reshape(-1)])
    error = np.abs(got.astype(np.float64) - reference).reshape(-1)
    assert np.all(error <= 0.5 * spacing * (1 + 2.0 ** -8) + 1e-30), (got, reference)
