"""`GrpcClientsBackend`: the coordinator's view of client values living on device processes.

Clients 0..n-1 of a clients value are split over the devices in a fixed order (device d
holds a contiguous block), so every value of n clients is laid out the same way. Each
operation goes to every device that holds clients, in parallel, each RPC with a
deadline. Aggregations are pre-aggregated by default: each device sends one exact partial
over its own clients, so uplink bytes grow with devices, not clients; with
`preaggregate=False` every per-client member comes back and the coordinator reduces
them itself. Partials are exact sums merged in client order, so both ways, and any
number of devices, give the same bits. Wire bytes are counted per direction.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import weakref
from typing import Optional, Sequence

import federated_language
import grpc
import numpy as np
from federated_language.common_libs import structure
from federated_language.proto import computation_pb2

from fax_bridge.errors import FleetError
from fax_bridge.fleet import partials, wire
from fax_bridge.fleet.device import GRPC_OPTIONS, PROTOCOL
from fax_bridge.runtime.backend import AGGREGATIONS, ClientsBackend, ClientsValue, as_numpy
from fax_bridge.v1 import device_pb2 as pb
from fax_bridge.v1 import device_pb2_grpc as pb_grpc

GRPC_PREFIX_BYTES = 5       # compressed flag + length in front of every gRPC message
HTTP2_FRAME_BYTES = 9       # header of each HTTP/2 DATA frame
HTTP2_FRAME_PAYLOAD = 16384  # default maximum DATA frame payload
RELEASE_BATCH = 256


def wire_size(message) -> int:
    """Bytes a message takes on the wire: serialized form, gRPC prefix, HTTP/2 DATA frames."""
    body = message.ByteSize() + GRPC_PREFIX_BYTES
    return body + HTTP2_FRAME_BYTES * max(1, -(-body // HTTP2_FRAME_PAYLOAD))


def partition(num_clients: int, num_devices: int) -> list[range]:
    """The clients of each device: contiguous blocks in client order, sizes within one."""
    return [range(d * num_clients // num_devices, (d + 1) * num_clients // num_devices)
            for d in range(num_devices)]


@dataclasses.dataclass
class Traffic:
    """Bytes and RPCs between the coordinator and its devices.

    `down`: coordinator to devices (placing data, broadcasts, computations, requests);
    `up`: devices to coordinator (results, partials, acknowledgements). `*_payload`
    counts only array data inside those messages; the rest is protocol overhead.
    """

    bytes_down: int = 0
    bytes_up: int = 0
    payload_down: int = 0
    payload_up: int = 0
    rpcs: int = 0
    compute_seconds: float = 0.0

    def __sub__(self, other: "Traffic") -> "Traffic":
        return Traffic(*(getattr(self, f.name) - getattr(other, f.name)
                         for f in dataclasses.fields(self)))

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class GrpcClientsValue(ClientsValue):
    """A clients value whose members live on devices under one handle."""

    def __init__(self, backend: "GrpcClientsBackend", handle: int, num_clients: int,
                 member_type: federated_language.Type, shared=None, is_shared: bool = False):
        self.handle = handle
        self._num_clients = num_clients
        self._type = member_type
        self.shared = shared
        self.is_shared = is_shared
        self._backend_id = id(backend)
        weakref.finalize(self, backend._queue_release, handle)

    @property
    def num_clients(self) -> int:
        return self._num_clients

    @property
    def type_signature(self) -> federated_language.Type:
        return self._type

    def __repr__(self) -> str:
        return f"GrpcClientsValue(handle={self.handle}, clients={self._num_clients}, {self._type})"


class _Device:
    def __init__(self, index: int, address: str):
        self.index = index
        self.address = address
        self.channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        self.stub = pb_grpc.DeviceStub(self.channel)


class GrpcClientsBackend(ClientsBackend):
    """Runs CLIENTS-placed work on device processes reached over gRPC.

    Args:
      addresses: HOST:PORT of each device, in the fixed order clients are assigned.
      preaggregate: reduce on each device first (default); False fetches every member.
      rpc_timeout_s: deadline of every RPC (a Map's emulated delay is added to it).
      connect_timeout_s: how long to wait for each device to answer Health.
      message_bytes: target size of the messages of streamed per-client transfers.
    """

    def __init__(self, addresses: Sequence[str], *, preaggregate: bool = True,
                 rpc_timeout_s: float = 60.0, connect_timeout_s: float = 30.0,
                 message_bytes: int = 4 << 20):
        if not addresses:
            raise FleetError("GrpcClientsBackend needs at least one device address")
        self.preaggregate = preaggregate
        self.rpc_timeout_s = float(rpc_timeout_s)
        self.message_bytes = int(message_bytes)
        self.traffic = Traffic()
        self._devices = [_Device(i, a) for i, a in enumerate(addresses)]
        self._handles = itertools.count(1)
        self._loaded: set[tuple[int, str]] = set()
        self._hashes: dict[int, str] = {}
        self._pending_release: list[int] = []
        self._release_lock = threading.Lock()
        self._delays: Optional[list[float]] = None
        self._closed = False
        self.wait_ready(connect_timeout_s)

    # -- plumbing -----------------------------------------------------------------

    @property
    def addresses(self) -> list[str]:
        return [d.address for d in self._devices]

    @property
    def num_devices(self) -> int:
        return len(self._devices)

    def wait_ready(self, timeout_s: float) -> list[pb.HealthResponse]:
        """Waits until every device answers Health (SERVING, same protocol)."""
        deadline = time.monotonic() + timeout_s
        answers = []
        for device in self._devices:
            remaining = max(0.1, deadline - time.monotonic())
            try:
                grpc.channel_ready_future(device.channel).result(timeout=remaining)
                remaining = max(0.1, deadline - time.monotonic())
                answer = device.stub.Health(pb.HealthRequest(), timeout=remaining)
            except (grpc.FutureTimeoutError, grpc.RpcError) as e:
                raise FleetError(
                    f"device {device.index} at {device.address} did not become healthy "
                    f"within {timeout_s:.0f}s ({_describe(e)}); check that it is running "
                    "and listening on that address") from None
            if answer.status != "SERVING" or answer.protocol != PROTOCOL:
                raise FleetError(
                    f"device {device.index} at {device.address} answered status "
                    f"{answer.status!r}, protocol {answer.protocol!r}; expected SERVING, "
                    f"{PROTOCOL}")
            answers.append(answer)
        return answers

    def health(self) -> list[pb.HealthResponse]:
        """Health of every device, in device order."""
        return [self._unary(d, "Health", pb.HealthRequest()) for d in self._devices]

    def _count(self, down=(), up=(), payload_down: int = 0, payload_up: int = 0) -> None:
        self.traffic.bytes_down += sum(wire_size(m) for m in down)
        self.traffic.bytes_up += sum(wire_size(m) for m in up)
        self.traffic.payload_down += payload_down
        self.traffic.payload_up += payload_up

    def _fail(self, device: _Device, method: str, error: Exception) -> FleetError:
        hint = ""
        if isinstance(error, grpc.RpcError):
            code = error.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                hint = f"; it did not answer within the deadline (rpc_timeout_s={self.rpc_timeout_s})"
            elif code == grpc.StatusCode.UNAVAILABLE:
                hint = "; the device process is not reachable (did it exit? see its log)"
        return FleetError(
            f"device {device.index} at {device.address}: {method} failed: "
            f"{_describe(error)}{hint}")

    def _unary(self, device: _Device, method: str, request, timeout: Optional[float] = None):
        self.traffic.rpcs += 1
        try:
            response = getattr(device.stub, method)(request, timeout=timeout or self.rpc_timeout_s)
        except grpc.RpcError as e:
            raise self._fail(device, method, e) from None
        self._count(down=[request], up=[response])
        return response

    def _parallel(self, method: str, requests: dict[int, object],
                  timeout: Optional[float] = None) -> dict[int, object]:
        """Sends one unary request per device index at once; waits for all answers."""
        calls = {}
        for index, request in requests.items():
            device = self._devices[index]
            self.traffic.rpcs += 1
            calls[index] = getattr(device.stub, method).future(
                request, timeout=timeout or self.rpc_timeout_s)
        answers = {}
        first_error = None
        for index, call in calls.items():
            try:
                answers[index] = call.result()
            except grpc.RpcError as e:
                first_error = first_error or self._fail(self._devices[index], method, e)
        if first_error is not None:
            raise first_error
        self._count(down=requests.values(), up=answers.values())
        return answers

    def _layout(self, num_clients: int) -> list[tuple[int, range]]:
        """(device index, client range) of each device that holds clients."""
        return [(d, r) for d, r in enumerate(partition(num_clients, len(self._devices)))
                if len(r)]

    def _new_value(self, num_clients: int, member_type, **kw) -> GrpcClientsValue:
        self._flush_releases()
        return GrpcClientsValue(self, next(self._handles), num_clients, member_type, **kw)

    def _queue_release(self, handle: int) -> None:
        with self._release_lock:
            self._pending_release.append(handle)

    def _flush_releases(self, force: bool = False) -> None:
        with self._release_lock:
            if not self._pending_release or (
                    not force and len(self._pending_release) < RELEASE_BATCH):
                return
            handles, self._pending_release = self._pending_release, []
        if self._closed:
            return
        request = pb.ReleaseRequest(handles=handles)
        self._parallel("Release", {d.index: request for d in self._devices})

    def _check(self, value: ClientsValue) -> GrpcClientsValue:
        if not isinstance(value, GrpcClientsValue):
            raise FleetError(
                f"GrpcClientsBackend got a {type(value).__name__}; values must come from "
                "the same backend (do not mix backends within one evaluation)")
        return value

    # -- round hooks --------------------------------------------------------------

    def set_delays(self, delays: Optional[Sequence[float]]) -> None:
        """Per-client emulated delays (seconds) applied by the next map (then cleared)."""
        self._delays = None if delays is None else [float(x) for x in delays]

    def collect(self) -> None:
        """Releases, on the devices, every value no longer referenced here."""
        self._flush_releases(force=True)

    # -- ClientsBackend -----------------------------------------------------------

    def put(self, member_type: federated_language.Type,
            values: Sequence) -> GrpcClientsValue:
        values = list(values)
        result = self._new_value(len(values), member_type)
        calls = {}
        sent = {}
        for index, clients in self._layout(len(values)):
            messages = list(self._put_messages(result.handle, clients, values))
            sent[index] = messages
            self.traffic.rpcs += 1
            calls[index] = self._devices[index].stub.Put.future(
                iter(messages), timeout=self.rpc_timeout_s)
        answers = []
        for index, call in calls.items():
            try:
                answers.append(call.result())
            except grpc.RpcError as e:
                raise self._fail(self._devices[index], "Put", e) from None
        for messages in sent.values():
            payload = sum(wire.payload_bytes(v.value) for m in messages for v in m.values)
            self._count(down=messages, payload_down=payload)
        self._count(up=answers)
        return result

    def _put_messages(self, handle: int, clients: range, values: list):
        message = pb.PutRequest(handle=handle)
        size = 0
        for i in clients:
            item = pb.ClientValue(client_id=i)
            wire.encode_value(as_numpy(values[i]), item.value)
            item_size = item.ByteSize()
            if message.values and size + item_size > self.message_bytes:
                yield message
                message = pb.PutRequest(handle=handle)
                size = 0
            message.values.append(item)
            size += item_size
        yield message

    def broadcast(self, member_type: federated_language.Type, value,
                  num_clients: int) -> GrpcClientsValue:
        value = as_numpy(value)
        result = self._new_value(num_clients, member_type, shared=value, is_shared=True)
        encoded = wire.to_message(value)
        requests = {}
        for index, clients in self._layout(num_clients):
            request = pb.BroadcastRequest(handle=result.handle, client_ids=clients)
            request.value.CopyFrom(encoded)
            requests[index] = request
        self._parallel("Broadcast", requests)
        self.traffic.payload_down += wire.payload_bytes(encoded) * len(requests)
        return result

    def _ensure_loaded(self, fn: computation_pb2.Computation, devices: list[int]) -> str:
        from fax_bridge.runtime.local_eval import content_hash

        key = content_hash(fn)
        missing = [d for d in devices if (d, key) not in self._loaded]
        if missing:
            request = pb.LoadRequest(computation_hash=key,
                                     computation=fn.SerializeToString(deterministic=True))
            self._parallel("Load", {d: request for d in missing})
            self._loaded.update((d, key) for d in missing)
        return key

    def map(self, fn: computation_pb2.Computation, fn_type: federated_language.FunctionType,
            arg: ClientsValue) -> GrpcClientsValue:
        arg = self._check(arg)
        layout = self._layout(arg.num_clients)
        key = self._ensure_loaded(fn, [d for d, _ in layout])
        result = self._new_value(arg.num_clients, fn_type.result)
        delays, self._delays = self._delays, None
        requests = {}
        longest = 0.0
        for index, clients in layout:
            delay = 0.0
            if delays is not None:
                delay = max((delays[i] for i in clients if i < len(delays)), default=0.0)
            longest = max(longest, delay)
            requests[index] = pb.MapRequest(computation_hash=key, arg=arg.handle,
                                            result=result.handle, delay_seconds=delay,
                                            no_argument=fn_type.parameter is None)
        answers = self._parallel("Map", requests, timeout=self.rpc_timeout_s + longest)
        self.traffic.compute_seconds += sum(a.compute_seconds for a in answers.values())
        return result

    def zip(self, values: Sequence[ClientsValue],
            names: Sequence[Optional[str]]) -> GrpcClientsValue:
        values = [self._check(v) for v in values]
        names = list(names)
        if not values or len(names) != len(values):
            raise FleetError(
                f"zip needs one name (or None) per value; got {len(names)} names for "
                f"{len(values)} values")
        counts = {v.num_clients for v in values}
        if len(counts) != 1:
            raise FleetError(
                f"zip of clients values with different numbers of clients {sorted(counts)}; "
                "every zipped value must be placed on the same clients")
        n = counts.pop()
        member_type = federated_language.StructType(
            [(name, v.type_signature) for name, v in zip(names, values)])
        if all(v.is_shared for v in values):
            shared = structure.Struct([(name, v.shared) for name, v in zip(names, values)])
            result = self._new_value(n, member_type, shared=shared, is_shared=True)
        else:
            result = self._new_value(n, member_type)
        fields = [pb.ZipField(handle=v.handle, name=name) if name is not None
                  else pb.ZipField(handle=v.handle) for v, name in zip(values, names)]
        request = pb.ZipRequest(fields=fields, result=result.handle)
        self._parallel("Zip", {d: request for d, _ in self._layout(n)})
        return result

    def aggregate(self, value: ClientsValue, kind: str,
                  weights: Optional[ClientsValue] = None, bitwidth=None):
        value = self._check(value)
        if kind not in AGGREGATIONS:
            raise FleetError(f"unknown aggregation {kind!r}; expected one of {AGGREGATIONS}")
        if kind == "weighted_mean":
            if weights is None:
                raise FleetError("weighted_mean needs a clients value of weights")
            weights = self._check(weights)
            if weights.num_clients != value.num_clients:
                raise FleetError(
                    f"weighted_mean: {value.num_clients} values but {weights.num_clients} "
                    "weights; give one weight per client")
        if kind == "secure_sum_bitwidth" and bitwidth is None:
            raise FleetError("federated_secure_sum_bitwidth needs a bitwidth")
        if self.preaggregate:
            total = self._aggregate_on_devices(value, kind, weights, bitwidth)
        else:
            members = self.get(value)
            weight_members = self.get(weights) if weights is not None else None
            total = partials.partial_of(kind, members, weight_members, bitwidth)
        return self._assemble(value.type_signature, partials.finish(total))

    def _aggregate_on_devices(self, value: GrpcClientsValue, kind: str,
                              weights: Optional[GrpcClientsValue],
                              bitwidth=None) -> partials.Partial:
        request = pb.AggregateRequest(value=value.handle, kind=partials.KIND_TO_ENUM[kind],
                                      weights=weights.handle if weights is not None else 0)
        if bitwidth is not None:
            wire.encode_value(as_numpy(bitwidth), request.bitwidth)
        layout = self._layout(value.num_clients)
        answers = self._parallel("Aggregate", {d: request for d, _ in layout})
        total = partials.Partial(kind=kind, leaves=[])
        for index, _ in layout:  # device order is client order
            answer = answers[index]
            self.traffic.payload_up += partials.payload_bytes(answer)
            partials.merge(total, partials.from_message(kind, answer))
        return total

    @staticmethod
    def _assemble(member_type: federated_language.Type, flat: list[np.ndarray]):
        template = _template(member_type)
        count = len(wire.leaves(template)) if isinstance(template, structure.Struct) else 1
        if count != len(flat):
            raise FleetError(
                f"the aggregate has {len(flat)} tensors but its type {member_type} has "
                f"{count}; the devices returned values of another type")
        if not isinstance(template, structure.Struct):
            return flat[0]
        return wire.unflatten_like(template, flat)

    def get(self, value: ClientsValue) -> list:
        value = self._check(value)
        if value.is_shared:
            return [value.shared] * value.num_clients
        members: list = []
        for index, clients in self._layout(value.num_clients):
            device = self._devices[index]
            request = pb.FetchRequest(handle=value.handle, max_message_bytes=self.message_bytes)
            self.traffic.rpcs += 1
            received = []
            try:
                for message in device.stub.Fetch(request, timeout=self.rpc_timeout_s):
                    received.append(message)
            except grpc.RpcError as e:
                raise self._fail(device, "Fetch", e) from None
            ids = [item.client_id for m in received for item in m.values]
            if ids != list(clients):
                raise FleetError(
                    f"device {index} at {device.address} returned clients {ids[:5]}... for "
                    f"handle {value.handle}; expected {clients}")
            self._count(down=[request], up=received,
                        payload_up=sum(wire.payload_bytes(i.value)
                                       for m in received for i in m.values))
            members.extend(wire.decode_value(item.value) for m in received for item in m.values)
        return members

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._flush_releases(force=True)
        except FleetError:
            pass  # a device that is gone holds nothing any more
        self._closed = True
        for device in self._devices:
            device.channel.close()

    def __enter__(self) -> "GrpcClientsBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _template(member_type: federated_language.Type):
    """A Struct skeleton (names kept, leaves None) of a member type; None for a tensor."""
    if isinstance(member_type, federated_language.StructType):
        return structure.Struct([(name, _template(t)) for name, t in member_type.items()])
    return None


def _describe(error: Exception) -> str:
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"
