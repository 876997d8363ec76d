"""The Put request streams a coordinator sends: client values cut into messages by size
and by count, and reads of a device-hosted population named by id ranges."""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from fax_bridge.rounds import wire
from fax_bridge.fleet.pool import RequestStream
from fax_bridge.runtime.backend import as_numpy
from fax_bridge.v1 import device_pb2 as pb

# Clients per Put message at most: a parsed message holds a few hundred bytes per client
# however small its values, so a message of tiny clients is cut by count, not by size.
PUT_CLIENTS = 1024


def client_values(handle: int, clients: range, values: Sequence,
                  message_bytes: int) -> Iterator[pb.PutRequest]:
    """The Put messages of one device's `clients` of `values`, built one at a time, each
    at most `message_bytes` (unless one client alone is larger) and `PUT_CLIENTS` clients."""
    message = pb.PutRequest(handle=handle)
    size = 0
    for i in clients:
        item = pb.ClientValue(client_id=i)
        wire.encode_value(as_numpy(values[i]), item.value)
        item_size = item.ByteSize()
        if message.values and (size + item_size > message_bytes
                               or len(message.values) >= PUT_CLIENTS):
            yield message
            message = pb.PutRequest(handle=handle)
            size = 0
        message.values.append(item)
        size += item_size
    yield message


def payload_bytes(message) -> int:
    """Array bytes in a Put or Round message: its client values (and broadcast)."""
    total = sum(wire.payload_bytes(v.value) for v in message.values)
    if "broadcast" in message.DESCRIPTOR.fields_by_name and message.HasField("broadcast"):
        total += wire.payload_bytes(message.broadcast)
    return total


def stream(messages: Iterator, what: str = "Put") -> RequestStream:
    """A lazily made, counted request stream of Put or Round messages."""
    return RequestStream(messages, what, payload_bytes)


STORE_READ_IDS = 1 << 18  # ids per from_store message (about 2 MiB at most)


def store_reads(handle: int, ids: np.ndarray, first_client: int, member_type: bytes,
                 keys: Sequence[str], population: str) -> list:
    """The Put messages naming one device's population ids (ranges where shorter)."""
    messages = []
    for lo in range(0, max(1, len(ids)), STORE_READ_IDS):
        chunk = ids[lo:lo + STORE_READ_IDS]
        read = pb.StoreRead()
        if lo == 0:
            read.population = population
            read.first_client = first_client
            read.member_type = member_type
            read.keys.extend(keys)
        if chunk.size:
            breaks = np.flatnonzero(np.diff(chunk) != 1) + 1
            starts = np.concatenate([[0], breaks])
            if 2 * len(starts) < len(chunk):
                stops = np.concatenate([breaks, [len(chunk)]])
                for a, b in zip(starts, stops):
                    read.ranges.add(start=int(chunk[a]), stop=int(chunk[b - 1]) + 1)
            else:
                read.population_ids.extend(chunk.tolist())
        message = pb.PutRequest(handle=handle)
        message.from_store.CopyFrom(read)
        messages.append(message)
    return messages
