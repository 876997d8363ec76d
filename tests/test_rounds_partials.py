"""rounds.partials: aggregate partials survive the wire exactly, whatever they hold."""

import federated_language
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fax_bridge.errors import WeightError
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
            + len(leaf.extreme.data) for leaf in [*message.leaves, *message.weight_leaves])
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
