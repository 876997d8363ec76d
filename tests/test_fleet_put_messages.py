"""Put streams: client values cut by count and by size, population reads as id ranges,
encoding errors kept for the caller."""

import numpy as np
import pytest

from fax_bridge.errors import FleetError
from fax_bridge.fleet import put_messages


def test_tiny_clients_are_cut_by_count():
    """A parsed message costs a few hundred bytes a client, so size alone is no bound."""
    values = [np.float32(i) for i in range(2 * put_messages.PUT_CLIENTS + 5)]
    messages = list(put_messages.client_values(9, range(len(values)), values, 4 << 20))
    assert [len(m.values) for m in messages] == [put_messages.PUT_CLIENTS] * 2 + [5]
    assert [v.client_id for m in messages for v in m.values] == list(range(len(values)))
    assert {m.handle for m in messages} == {9}


def test_large_clients_are_cut_by_size_and_a_lone_large_client_still_goes():
    values = [np.zeros(1000, np.float32) for _ in range(10)]   # ~4 KB each
    messages = list(put_messages.client_values(1, range(2, 8), values, 9000))
    assert [len(m.values) for m in messages] == [2, 2, 2]
    assert [v.client_id for m in messages for v in m.values] == list(range(2, 8))
    alone = list(put_messages.client_values(1, range(1), values, 100))
    assert [len(m.values) for m in alone] == [1]


def test_stream_counts_bytes_and_keeps_an_encoding_error():
    stream = put_messages.stream(
        put_messages.client_values(1, range(3), [np.ones(4, np.float32)] * 3, 1 << 20))
    assert len(list(stream)) == 1 and stream.messages == 1
    assert stream.payload == 3 * 16 and stream.bytes > stream.payload
    broken = put_messages.stream(
        put_messages.client_values(1, range(1), [object()], 1 << 20))
    with pytest.raises(FleetError, match="only numeric and bool tensors") as info:
        list(broken)
    assert broken.error is info.value


def test_store_reads_name_consecutive_ids_as_ranges():
    ids = np.arange(100, 200, dtype=np.int64)
    (message,) = put_messages.store_reads(3, ids, 0, b"t", ["x"], "pop")
    read = message.from_store
    assert [(r.start, r.stop) for r in read.ranges] == [(100, 200)]
    assert read.population == "pop" and list(read.keys) == ["x"] and not read.population_ids
    scattered = np.array([5, 1, 9], dtype=np.int64)
    (message,) = put_messages.store_reads(3, scattered, 7, b"t", ["x"], "pop")
    assert list(message.from_store.population_ids) == [5, 1, 9]
    assert message.from_store.first_client == 7
