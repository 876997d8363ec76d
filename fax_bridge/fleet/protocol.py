"""What devices and coordinators agree on: protocol name, message caps, layout, addresses.

Both sides import these from here (the device server never imports the client side and
the client never imports the server). HOST:PORT strings are read by
`fax_bridge.system.addresses` and the clients' blocks cut by `data.partition.contiguous_blocks`
(re-exported here as `parse_address`, `format_address` and `partition`). Nothing here
needs gRPC.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fax_bridge.system.addresses import format_address, parse_address  # noqa: F401 (re-exported)
from fax_bridge.data.partition import contiguous_blocks as partition  # noqa: F401
from fax_bridge.errors import FleetError

PROTOCOL = "fax_bridge.v1"
DEFAULT_FETCH_BYTES = 4 << 20
MAX_DELAY_SECONDS = 600.0
# Tensors may be far above gRPC's 4 MiB default, but every message stays under a cap.
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
DEFAULT_MAX_STORED_BYTES = 32 << 30
# Per-device bounds on what callers may make a device spend (device flags of these names).
DEFAULT_MAX_CLIENTS = 1 << 20           # client ids in one value
DEFAULT_MAX_CONNECTIONS = 4096          # open connections, idle or not (~13 KB each)
DEFAULT_MAX_CONCURRENT_CALLS = 64       # calls in progress; more are refused at once
DEFAULT_IDLE_TIMEOUT_S = 300.0          # a connection without calls is closed after this
DEFAULT_MAX_CALL_SECONDS = 3600.0       # compute time of one Map or Aggregate
HANDSHAKE_TIMEOUT_MS = 10_000           # a connection must finish its handshake by then



@dataclasses.dataclass(frozen=True)
class DeviceLimits:
    """What callers may make one device spend: the `fax-bridge device` flags of these
    names (`--max-message-bytes`, ...), read once into this object and handed whole to
    `device_process.serve`; `flags()` writes them back for a launcher.

    Attributes:
      max_message_bytes: cap on every gRPC message, each direction.
      max_stored_bytes: bytes of values the device holds, results included.
      max_clients: client ids in one value.
      max_connections: open connections, idle or not.
      max_concurrent_calls: calls in progress; more are refused at once.
      idle_timeout_s: a connection without calls is closed after this.
      max_call_seconds: compute time of one Map, Aggregate or Round.
      max_delay_seconds: the longest emulated client delay a call may ask for.
    """

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_stored_bytes: int = DEFAULT_MAX_STORED_BYTES
    max_clients: int = DEFAULT_MAX_CLIENTS
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_concurrent_calls: int = DEFAULT_MAX_CONCURRENT_CALLS
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    max_call_seconds: float = DEFAULT_MAX_CALL_SECONDS
    max_delay_seconds: float = MAX_DELAY_SECONDS

    @classmethod
    def from_flags(cls, namespace: Any) -> "DeviceLimits":
        """The limits an argparse namespace holds (attributes named as the fields)."""
        return cls(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls)})

    def flags(self) -> list[str]:
        """The device command-line flags of the limits that differ from the defaults."""
        default = DeviceLimits()
        return [x for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(default, f.name)
                for x in (f"--{f.name.replace('_', '-')}", str(getattr(self, f.name)))]


GRPC_PREFIX_BYTES = 5        # compressed flag + length in front of every gRPC message
HTTP2_FRAME_BYTES = 9        # header of each HTTP/2 DATA frame
HTTP2_FRAME_PAYLOAD = 16384  # default maximum DATA frame payload


def grpc_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> tuple:
    """Channel/server options: messages in both directions capped at `max_message_bytes`."""
    size = int(max_message_bytes)
    if not 0 < size < 1 << 31:
        raise FleetError(f"max_message_bytes={size} must lie in [1, 2^31 - 1] (protobuf's "
                         "own limit is 2 GiB)")
    return (("grpc.max_send_message_length", size),
            ("grpc.max_receive_message_length", size))


GRPC_OPTIONS = grpc_options()


def wire_size(message) -> int:
    """Bytes a message takes on the wire: serialized form, gRPC prefix, HTTP/2 DATA frames.
    (`ByteSize` serializes the message: for one already serialized, `framed_size`.)"""
    return framed_size(message.ByteSize())


def framed_size(serialized_bytes: int) -> int:
    """Bytes on the wire of a message whose serialized form has `serialized_bytes`."""
    body = serialized_bytes + GRPC_PREFIX_BYTES
    return body + HTTP2_FRAME_BYTES * max(1, -(-body // HTTP2_FRAME_PAYLOAD))
