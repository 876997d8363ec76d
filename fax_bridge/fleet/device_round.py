"""A device's side of a round by split: one `Round` stream in, one partial per aggregation out.

The stream's first message names the round's client part (loaded before with `Load`,
by content hash), the broadcast value and the aggregations; its messages bring this
device's clients of the round (values, or `from_store` reads of the population the
device hosts). The client part runs on <broadcast, member> for each client, in order,
by the device's client runtime (`rounds.client_runtime`: XLA, one call for all of them
where it can, or the LiteRT interpreter), which the answer names, and each
aggregation's exact partial over those clients is the answer (`runtime.aggregation`,
`rounds.partials`). Nothing stays stored on the device. `RoundOnce` serves a request of
one message by the same code, as a stream of that one message. A device started with
`--shared-memory` reads a broadcast the coordinator put in a segment, and writes its
answer's large payloads in the segment the request names (`shared_memory`).
"""

from __future__ import annotations

import time

import grpc

from fax_bridge.errors import FleetError
from fax_bridge.fleet import shared_memory
from fax_bridge.language.primitive_facts import SECURE_KINDS
from fax_bridge.rounds import client_runtime as runtimes
from fax_bridge.rounds import partials, wire
from fax_bridge.fleet.device_common import RpcError, value_bytes
from fax_bridge.runtime import client_map
from fax_bridge.v1 import device_pb2 as pb


def run_round(device, request_iterator, context, method: str = "Round") -> pb.RoundResponse:
    """Serves one `Round` stream (or `RoundOnce` request, as a stream of one) on
    `device` (a `DeviceServicer`); errors name `method`, the RPC called."""
    head, _, members, reads, received = device.read_clients(request_iterator, method)
    delay = device.check_delay(head.delay_seconds, method)
    fn = device.loaded(head.computation_hash, method)
    specs = []
    for spec in head.aggregations:
        kind = partials.ENUM_TO_KIND.get(spec.kind)
        if kind is None:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"{method}: aggregation number {spec.kind} cannot run in a round "
                           "split")
        if (kind == "weighted_mean") != spec.HasField("weight_index"):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"{method}: a {kind} aggregation must name a weight_index exactly "
                           "when it is a weighted mean")
        if (kind in SECURE_KINDS) != spec.HasField("bound"):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"{method}: a {kind} aggregation must carry a bound exactly when "
                           "it is a secure sum")
        specs.append((kind, spec.value_index,
                      spec.weight_index if kind == "weighted_mean" else None,
                      wire.decode_value(spec.bound) if kind in SECURE_KINDS else None))
    if reads:
        _, members = device.read_store(reads)
    sent = wire.decode_value(head.broadcast, segment=_broadcast_segment(device, head, method))
    writer = None
    if head.HasField("answer_segment"):
        _shared_dir(device, method)
        shared_memory.check_name(head.answer_segment.name, method)
        writer = shared_memory.Writer()
    with device.computing:
        start = time.perf_counter()
        clock = time.monotonic()
        guard = client_map.Guard(
            tick=lambda: device.check_time(clock, context, method),
            room=lambda produced: device.check_room(received + produced,
                                                    f"{method}'s client results"),
            size=value_bytes)
        runtime = device.client_runtime
        found = runtime.client_partials(fn, head.computation_hash, sent, members, specs,
                                        guard)
        answer = pb.RoundResponse(num_clients=len(members), client_runtime=runtime.name,
                                  model_sha256=runtimes.model_served(
                                      runtime, head.computation_hash) or "")
        for partial in found:
            partials.to_message(partial, answer.partials.add(), writer,
                                rounded=head.rounded_partials)
        del found
        if writer is not None and writer.length:
            try:
                answer.segment.CopyFrom(writer.write(  # over its last answer's, if named
                    device.shared_memory, head.answer_segment.name,
                    head.answer_segment.generation, over=True))
            except OSError as e:
                raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{method}: cannot write shared-memory segment "
                               f"{head.answer_segment.name}: {e.strerror}") from None
        answer.compute_seconds = time.perf_counter() - start
    if delay > 0 and device.stopping.wait(delay):
        raise RpcError(grpc.StatusCode.UNAVAILABLE, f"{method}: the device is shutting down")
    return answer


def _shared_dir(device, method: str) -> shared_memory.SharedDir:
    """The device's shared-memory directory, else FAILED_PRECONDITION."""
    if device.shared_memory is None:
        raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                       f"{method}: the request passes payloads through shared memory, but "
                       "this device was started without --shared-memory; send them in "
                       "the message")
    return device.shared_memory


def _broadcast_segment(device, head: pb.RoundRequest, method: str):
    """The mapped segment of the request's broadcast, or None when it names none."""
    if not head.HasField("broadcast_segment"):
        return None
    try:
        return shared_memory.open_segment(_shared_dir(device, method), head.broadcast_segment,
                                          f"{method}'s broadcast")
    except FleetError as e:
        raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
