"""rounds.wire: local values to fax_bridge.v1 messages and back, and refusals."""

import numpy as np
import pytest
from federated_language.common_libs import structure
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from fax_bridge.errors import FleetError
from fax_bridge.rounds import wire
from fax_bridge.runtime.backend import leaves
from fax_bridge.v1 import device_pb2 as pb

_dtypes = st.sampled_from([np.float32, np.float64, np.int32, np.int64, np.uint8, np.bool_,
                           np.int8, np.complex64])
_arrays = _dtypes.flatmap(lambda d: hnp.arrays(d, hnp.array_shapes(min_dims=0, max_dims=3,
                                                                   max_side=4)))


def _values(depth):
    if depth == 0:
        return _arrays
    return st.one_of(_arrays, st.lists(st.tuples(st.one_of(st.none(), st.sampled_from(
        ["a", "b", "c"])), _values(depth - 1)), max_size=3).map(
            lambda items: structure.Struct(_unique_names(items))))


def _unique_names(items):
    seen, out = set(), []
    for name, v in items:
        out.append((None if name in seen else name, v))
        seen.add(name)
    return out


@settings(max_examples=80, deadline=None)
@given(_values(2))
def test_values_round_trip_bit_for_bit(value):
    message = wire.to_message(value)
    back = wire.decode_value(pb.Value.FromString(message.SerializeToString()))
    assert [x.tobytes() for x in leaves(back)] == [x.tobytes() for x in leaves(value)]
    assert [x.dtype for x in leaves(back)] == [x.dtype for x in leaves(value)]
    assert wire.payload_bytes(message) == sum(x.nbytes for x in leaves(value))
    if isinstance(value, structure.Struct):
        assert structure.name_list_with_nones(back) == structure.name_list_with_nones(value)


def test_big_endian_arrays_travel_as_little_endian():
    value = np.arange(3, dtype=">i4")
    back = wire.decode_value(wire.to_message(value))
    assert back.dtype == np.dtype("<i4") and back.tolist() == [0, 1, 2]


def test_refusals_name_the_problem():
    with pytest.raises(FleetError, match="only numeric and bool"):
        wire.to_message(np.array(["x"]))
    with pytest.raises(FleetError, match="unknown tensor dtype"):
        wire.dtype_from_name("object")
    bad = wire.to_message(np.ones(3, np.float32))
    bad.tensor.data = bad.tensor.data[:-1]
    with pytest.raises(FleetError, match="should hold 12 bytes"):
        wire.decode_value(bad)
    with pytest.raises(FleetError, match="neither a tensor nor a struct"):
        wire.decode_value(pb.Value())
    huge = pb.Value()
    huge.tensor.dtype = "float32"
    huge.tensor.shape.extend([1 << 40, 1 << 20])
    with pytest.raises(FleetError, match="above the cap"):
        wire.decode_value(huge)
    deep = value = np.float32(1)
    for _ in range(wire.MAX_STRUCT_DEPTH + 1):
        deep = structure.Struct([(None, deep)])
    with pytest.raises(FleetError, match="deeper than"):
        wire.decode_value(wire.to_message(deep))
    twice = wire.to_message(structure.Struct([("a", value), ("b", value)]))
    twice.struct.elements[1].name = "a"
    with pytest.raises(FleetError, match="repeats element names"):
        wire.decode_value(twice)


@pytest.mark.parametrize("size", [0, 1, 31, 32, 4095, 70_000])
def test_a_message_field_appended_to_serialized_bytes_sets_that_field(size):
    """`message_field` writes a message field as protobuf does: a head serialized without
    its broadcast plus the broadcast's field parses as the head with it, byte for byte."""
    value = wire.to_message(np.arange(size, dtype=np.float32))
    head = pb.RoundRequest(computation_hash="h", delay_seconds=1.5)
    data = head.SerializeToString() + wire.message_field(
        pb.RoundRequest.BROADCAST_FIELD_NUMBER, value.SerializeToString())
    head.broadcast.CopyFrom(value)
    assert pb.RoundRequest.FromString(data) == head and len(data) == head.ByteSize()
