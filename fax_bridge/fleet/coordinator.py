"""`GrpcClientsBackend`: the coordinator's view of client values living on device processes.

Clients 0..n-1 of a clients value are split over the devices in a fixed order (device d
holds a contiguous block), so every value of n clients is laid out the same way. Each
operation goes to every device that holds clients, in parallel, each RPC with a
deadline. Aggregations are pre-aggregated by default: each device sends one exact partial
over its own clients, so uplink bytes grow with devices, not clients; with
`preaggregate=False` every per-client member comes back and the coordinator reduces
them itself. Partials are exact sums merged in client order, so both ways, and any
number of devices, give the same bits. Wire bytes are counted per direction.

Faults: an RPC that fails because its device is gone or missed its deadline raises
`DeviceLostError` naming those devices; `mark_lost` takes them out of the layout (the
launcher then reruns the round on the survivors) and `rejoin` / `add_device` bring a
device (back) in. Every answer is checked against the type it should have (structure,
dtypes, shapes, partial sizes) before it is used; `reject_nonfinite` also refuses NaN
and infinite values. Calls carry the fleet token; `tls` switches to mutual TLS.
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
import threading
from concurrent import futures
import time
import weakref
from typing import Callable, Optional, Sequence

import federated_language
import grpc
import numpy as np
from federated_language.common_libs import structure
from federated_language.proto import computation_pb2

from fax_bridge.errors import FleetError
from fax_bridge.fleet import partials, security, validate, wire
from fax_bridge.fleet.device import DEFAULT_MAX_MESSAGE_BYTES, PROTOCOL, grpc_options
from fax_bridge.runtime.backend import AGGREGATIONS, ClientsBackend, ClientsValue, as_numpy
from fax_bridge.v1 import device_pb2 as pb
from fax_bridge.v1 import device_pb2_grpc as pb_grpc

GRPC_PREFIX_BYTES = 5       # compressed flag + length in front of every gRPC message
HTTP2_FRAME_BYTES = 9       # header of each HTTP/2 DATA frame
HTTP2_FRAME_PAYLOAD = 16384  # default maximum DATA frame payload
RELEASE_BATCH = 256
# Status codes meaning "this device is gone or too slow", not "the request was wrong".
LOST_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
              grpc.StatusCode.CANCELLED)


class DeviceLostError(FleetError):
    """Devices died or missed their deadline; `devices` lists their indices."""

    def __init__(self, message: str, devices: Sequence[int]):
        super().__init__(message)
        self.devices = sorted(set(devices))


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
        self.devices: Optional[tuple] = None  # set by the backend that places it
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
    def __init__(self, index: int, address: str, options: tuple,
                 tls: Optional[security.TlsConfig]):
        self.index = index
        self.address = address
        if tls is not None:
            self.channel = grpc.secure_channel(address, tls.channel_credentials(),
                                               options=options + tls.channel_options())
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        self.stub = pb_grpc.DeviceStub(self.channel)


def _host(address: str) -> str:
    host, _, _ = address.rpartition(":")
    return host.strip("[]") or address


class _Done:
    """A call made in the calling thread, with a future's `result()` (one device)."""

    def __init__(self, rpc, request, kwargs):
        self._rpc, self._request, self._kwargs = rpc, request, kwargs

    def result(self):
        return self._rpc(self._request, **self._kwargs)


class GrpcClientsBackend(ClientsBackend):
    """Runs CLIENTS-placed work on device processes reached over gRPC.

    Args:
      addresses: HOST:PORT of each device, in the fixed order clients are assigned.
      preaggregate: reduce on each device first (default); False fetches every member.
      rpc_timeout_s: deadline of every RPC (a Map's emulated delay is added to it).
      connect_timeout_s: how long to wait for each device to answer Health.
      message_bytes: target size of the messages of streamed per-client transfers.
      token: the fleet token sent with every call (see `security`); None sends none.
      tls: mutual TLS (`security.TlsConfig`); None uses plaintext channels.
      max_message_bytes: cap on every gRPC message, each direction.
      reject_nonfinite: refuse NaN/inf in device answers (default: they propagate, as
        on the local path).
    """

    def __init__(self, addresses: Sequence[str], *, preaggregate: bool = True,
                 rpc_timeout_s: float = 60.0, connect_timeout_s: float = 30.0,
                 message_bytes: int = 4 << 20, token: Optional[str] = None,
                 tls: Optional[security.TlsConfig] = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 reject_nonfinite: bool = False):
        if not addresses:
            raise FleetError("GrpcClientsBackend needs at least one device address")
        self.preaggregate = preaggregate
        self.rpc_timeout_s = float(rpc_timeout_s)
        self.message_bytes = int(message_bytes)
        self.reject_nonfinite = bool(reject_nonfinite)
        self.traffic = Traffic()
        self._tls = tls
        self._options = grpc_options(max_message_bytes)
        self._metadata = security.call_metadata(token)
        self._devices: list[_Device] = []
        for address in addresses:
            self._devices.append(self._connect(len(self._devices), address))
        self._active = list(range(len(self._devices)))
        self._pool = futures.ThreadPoolExecutor(max_workers=max(2, min(32, len(addresses))),
                                                thread_name_prefix="fax-bridge-fetch")
        # A random start keeps this backend's handles apart from those an earlier
        # coordinator (crashed, or closed with values still referenced) left behind.
        self._handles = itertools.count(1 + secrets.randbelow(1 << 52))
        self._loaded: set[tuple[int, str]] = set()
        self._hashes: dict[int, str] = {}
        self._pending_release: list[int] = []
        self._release_lock = threading.Lock()
        self._delays: Optional[list[float]] = None
        self._populations: dict[int, tuple[str, int, str]] = {}
        self._closed = False
        self.wait_ready(connect_timeout_s)

    # -- plumbing -----------------------------------------------------------------

    @property
    def addresses(self) -> list[str]:
        return [d.address for d in self._devices]

    @property
    def num_devices(self) -> int:
        return len(self._devices)

    @property
    def active_devices(self) -> list[int]:
        """Indices of the devices clients are placed on (lost ones left out)."""
        return list(self._active)

    def _connect(self, index: int, address: str) -> _Device:
        if self._tls is None and not security.is_loopback(_host(address)):
            security.log.warning("device %s is reached without TLS: the fleet token and "
                                 "all values travel in clear text", address)
        return _Device(index, address, self._options, self._tls)

    def mark_lost(self, indices: Sequence[int]) -> None:
        """Stops placing clients on these devices (they died or missed a deadline)."""
        lost = set(indices)
        self._active = [d for d in self._active if d not in lost]
        self._loaded = {(d, k) for d, k in self._loaded if d not in lost}

    def rejoin(self, index: int, address: Optional[str] = None,
               timeout_s: float = 30.0) -> pb.HealthResponse:
        """Brings device `index` back (at `address` when it moved) once it answers Health.

        The device is treated as new: computations are loaded again on first use.
        """
        if not 0 <= index < len(self._devices):
            raise FleetError(f"rejoin: no device {index}; this backend has "
                             f"{len(self._devices)} (use add_device for a new one)")
        if address is not None and address != self._devices[index].address:
            self._devices[index].channel.close()
            self._devices[index] = self._connect(index, address)
        answer = self._wait_one(self._devices[index], time.monotonic() + timeout_s, timeout_s)
        self._populations.pop(index, None)
        self._loaded = {(d, k) for d, k in self._loaded if d != index}
        self._active = sorted(set(self._active) | {index})
        return answer

    def add_device(self, address: str, timeout_s: float = 30.0) -> int:
        """Adds a device at `address` (after the others in client order); returns its index."""
        device = self._connect(len(self._devices), address)
        try:
            self._wait_one(device, time.monotonic() + timeout_s, timeout_s)
        except FleetError:
            device.channel.close()
            raise
        self._devices.append(device)
        self._active.append(device.index)
        return device.index

    def _wait_one(self, device: _Device, deadline: float, timeout_s: float):
        remaining = max(0.1, deadline - time.monotonic())
        try:
            grpc.channel_ready_future(device.channel).result(timeout=remaining)
            remaining = max(0.1, deadline - time.monotonic())
            answer = device.stub.Health(pb.HealthRequest(), timeout=remaining,
                                        metadata=self._metadata)
        except (grpc.FutureTimeoutError, grpc.RpcError) as e:
            hint = ("; the device refused the fleet token (is it the same fleet's?)"
                    if isinstance(e, grpc.RpcError)
                    and e.code() == grpc.StatusCode.UNAUTHENTICATED else
                    "; check that it is running and listening on that address")
            raise FleetError(
                f"device {device.index} at {device.address} did not become healthy "
                f"within {timeout_s:.0f}s ({_describe(e)}){hint}") from None
        if answer.status != "SERVING" or answer.protocol != PROTOCOL:
            raise FleetError(
                f"device {device.index} at {device.address} answered status "
                f"{answer.status!r}, protocol {answer.protocol!r}; expected SERVING, "
                f"{PROTOCOL}")
        return answer

    def probe(self, timeout_s: float) -> list[bool]:
        """Whether each device answers Health within `timeout_s` (asked in parallel)."""
        calls = [d.stub.Health.future(pb.HealthRequest(), timeout=timeout_s,
                                      metadata=self._metadata) for d in self._devices]
        alive = []
        for call in calls:
            try:
                alive.append(call.result().status == "SERVING")
            except grpc.RpcError:
                alive.append(False)
        return alive

    def wait_ready(self, timeout_s: float) -> list[pb.HealthResponse]:
        """Waits until every active device answers Health (SERVING, same protocol)."""
        deadline = time.monotonic() + timeout_s
        return [self._wait_one(self._devices[d], deadline, timeout_s) for d in self._active]

    def health(self) -> list[pb.HealthResponse]:
        """Health of every active device, in device order."""
        return [self._unary(self._devices[d], "Health", pb.HealthRequest())
                for d in self._active]

    def _count(self, down=(), up=(), payload_down: int = 0, payload_up: int = 0) -> None:
        self.traffic.bytes_down += sum(wire_size(m) for m in down)
        self.traffic.bytes_up += sum(wire_size(m) for m in up)
        self.traffic.payload_down += payload_down
        self.traffic.payload_up += payload_up

    def _fail(self, device: _Device, method: str, error: Exception) -> FleetError:
        hint = ""
        lost = False
        if isinstance(error, grpc.RpcError):
            code = error.code()
            lost = code in LOST_CODES
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                hint = f"; it did not answer within the deadline (rpc_timeout_s={self.rpc_timeout_s})"
            elif code == grpc.StatusCode.UNAVAILABLE:
                hint = "; the device process is not reachable (did it exit? see its log)"
            elif code == grpc.StatusCode.UNAUTHENTICATED:
                hint = "; the device refused the fleet token"
        message = (f"device {device.index} at {device.address}: {method} failed: "
                   f"{_describe(error)}{hint}")
        return DeviceLostError(message, [device.index]) if lost else FleetError(message)

    def _unary(self, device: _Device, method: str, request, timeout: Optional[float] = None):
        self.traffic.rpcs += 1
        try:
            response = getattr(device.stub, method)(
                request, timeout=timeout or self.rpc_timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            raise self._fail(device, method, e) from None
        self._count(down=[request], up=[response])
        return response

    @staticmethod
    def _raise_first(errors: list) -> None:
        """Raises the collected errors: all lost devices together, else the first error."""
        if not errors:
            return
        lost = [e for e in errors if isinstance(e, DeviceLostError)]
        if lost:
            raise DeviceLostError("; ".join(str(e) for e in lost),
                                  [d for e in lost for d in e.devices])
        raise errors[0]

    def _parallel(self, method: str, requests: dict[int, object],
                  timeout: Optional[float] = None) -> dict[int, object]:
        """Sends one unary request per device index at once; waits for all answers."""
        # Blocking calls on the backend's own threads: a gRPC future would start a new
        # thread per channel on every call when none is in flight.
        calls = {}
        for index, request in requests.items():
            device = self._devices[index]
            self.traffic.rpcs += 1
            rpc = getattr(device.stub, method)
            kwargs = dict(timeout=timeout or self.rpc_timeout_s, metadata=self._metadata)
            calls[index] = (self._pool.submit(rpc, request, **kwargs) if len(requests) > 1
                            else _Done(rpc, request, kwargs))
        answers = self._answers(calls, method)
        self._count(down=requests.values(), up=answers.values())
        return answers

    def _answers(self, calls: dict, method: str,
                 own_error: Optional[Callable[[int], Optional[Exception]]] = None) -> dict:
        """Waits for every device's call; then raises the first failure, if any.

        `own_error(index)` may name a failure of ours behind a device's error (e.g. an
        encoding error that cancelled a stream), reported instead of the RPC status.
        """
        answers, errors = {}, []
        for index, call in calls.items():
            try:
                answers[index] = call.result()
            except grpc.RpcError as e:
                mine = own_error(index) if own_error is not None else None
                errors.append(mine if mine is not None
                              else self._fail(self._devices[index], method, e))
        self._raise_first(errors)
        return answers

    def _layout(self, num_clients: int,
                devices: Optional[Sequence[int]] = None) -> list[tuple[int, range]]:
        """(device index, client range) of each device that holds clients."""
        devices = self._active if devices is None else devices
        if not devices:
            raise FleetError("no device is left to place clients on (all were lost); "
                             "rejoin or add devices")
        return [(d, r) for d, r in zip(devices, partition(num_clients, len(devices)))
                if len(r)]

    def _value_layout(self, value: "GrpcClientsValue") -> list[tuple[int, range]]:
        """The layout a value was placed with; DeviceLostError if one of them is gone."""
        layout = self._layout(value.num_clients, value.devices)
        gone = [d for d, _ in layout if d not in self._active]
        if gone:
            raise DeviceLostError(
                f"value {value.handle} has clients on lost devices {gone}", gone)
        return layout

    def _new_value(self, num_clients: int, member_type, **kw) -> GrpcClientsValue:
        self._flush_releases()
        value = GrpcClientsValue(self, next(self._handles), num_clients, member_type, **kw)
        value.devices = tuple(self._active)
        return value

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
        try:
            self._parallel("Release", {d: request for d in self._active})
        except DeviceLostError:
            pass  # a device that is gone holds nothing any more; the next round notices

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
        """Streams each device's members to it, one message of the stream at a time.

        The messages of a device are built by a generator as gRPC asks for them and
        counted as they go, so at most one message per device is held here besides
        what gRPC has in flight; `values` itself is never copied.
        """
        if not isinstance(values, Sequence):
            values = list(values)
        result = self._new_value(len(values), member_type)
        calls = {}
        streams = {}
        for index, clients in self._layout(len(values), result.devices):
            stream = _PutStream(self, result.handle, clients, values)
            streams[index] = stream
            self.traffic.rpcs += 1
            calls[index] = self._devices[index].stub.Put.future(
                iter(stream), timeout=self.rpc_timeout_s, metadata=self._metadata)
        try:
            # A failure while encoding cancels the stream: report that, not CANCELLED.
            answers = self._answers(calls, "Put", lambda index: streams[index].error)
        finally:
            for stream in streams.values():
                self.traffic.bytes_down += stream.bytes
                self.traffic.payload_down += stream.payload
        for index, clients in self._layout(len(values), result.devices):
            got = answers[index].num_clients
            if got != len(clients):
                raise FleetError(
                    f"device {index} at {self._devices[index].address} stored {got} "
                    f"clients of handle {result.handle}; {len(clients)} were sent")
        self._count(up=answers.values())
        return result

    def _put_messages(self, handle: int, clients: range, values: Sequence):
        """The Put messages of one device's clients, built one at a time."""
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

    # -- populations hosted by the devices ------------------------------------------

    def population_info(self, ref=None) -> tuple[str, int, str]:
        """(name, clients, digest) of the population every active device hosts.

        Raises FleetError when a device hosts none, when they disagree, or when `ref`
        names another population. Asked once per device (Health) and remembered.
        """
        missing = [d for d in self._active if d not in self._populations]
        if missing:
            answers = self._parallel("Health", {d: pb.HealthRequest() for d in missing})
            for d, answer in answers.items():
                self._populations[d] = (answer.population_name,
                                        int(answer.population_clients),
                                        answer.population_digest)
        seen = {d: self._populations[d] for d in self._active}
        if not seen:
            raise FleetError("no device is left to read the population (all were lost)")
        bare = [d for d, (_, _, digest) in seen.items() if not digest]
        if bare:
            raise FleetError(
                "devices " + ", ".join(f"{d} at {self._devices[d].address}" for d in bare)
                + " host no population; start every device with --population DIR (the "
                "same population on each) to read CLIENTS inputs by client id")
        if len({v for v in seen.values()}) > 1:
            listed = "; ".join(f"device {d} at {self._devices[d].address}: {n!r}, {c} "
                               f"clients, digest {g[:12]}" for d, (n, c, g) in seen.items())
            raise FleetError(
                f"the devices host different populations ({listed}); every device must "
                "host the same population (a copy of the same directory)")
        name, clients, digest = next(iter(seen.values()))
        wanted = getattr(ref, "name", None)
        if wanted and wanted != name:
            raise FleetError(
                f"the run asks for population {wanted!r} but the devices host {name!r}; "
                "name the population they host, or start them with --population-name")
        return name, clients, digest

    def population_size(self, ref=None) -> int:
        """How many clients the population the devices host holds."""
        return self.population_info(ref)[1]

    def put_from_store(self, member_type: federated_language.Type, ref,
                       client_ids: Sequence[int]) -> GrpcClientsValue:
        """Has each device read its block of `client_ids` from the population it hosts.

        Only the ids travel (as ranges where they are consecutive); the devices check
        the member type against their stored arrays and read just those rows.
        """
        from fax_bridge.runtime import population

        _, size, _ = self.population_info(ref)
        ids = np.asarray(client_ids, dtype=np.int64).reshape(-1)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= size):
            bad = ids[(ids < 0) | (ids >= size)]
            raise FleetError(f"client id {int(bad[0])} is out of range for the devices' "
                             f"population of {size} clients")
        keys = population.default_keys(member_type, getattr(ref, "keys", None))
        type_bytes = member_type.to_proto().SerializeToString(deterministic=True)
        result = self._new_value(len(ids), member_type)
        layout = self._layout(len(ids), result.devices)
        calls = {}
        for index, clients in layout:
            messages = _store_reads(result.handle, ids[clients.start:clients.stop],
                                    clients.start, type_bytes, keys,
                                    getattr(ref, "name", None) or "")
            self.traffic.rpcs += 1
            self._count(down=messages)
            calls[index] = self._devices[index].stub.Put.future(
                iter(messages), timeout=self.rpc_timeout_s, metadata=self._metadata)
        answers = self._answers(calls, "Put from_store")
        self._count(up=answers.values())
        for index, clients in layout:
            if answers[index].num_clients != len(clients):
                raise FleetError(
                    f"device {index} at {self._devices[index].address} read "
                    f"{answers[index].num_clients} clients; it was asked for {len(clients)}")
        return result

    def broadcast(self, member_type: federated_language.Type, value,
                  num_clients: int) -> GrpcClientsValue:
        value = as_numpy(value)
        result = self._new_value(num_clients, member_type, shared=value, is_shared=True)
        encoded = wire.to_message(value)
        requests = {}
        for index, clients in self._layout(num_clients, result.devices):
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
        layout = self._value_layout(arg)
        key = self._ensure_loaded(fn, [d for d, _ in layout])
        result = self._new_value(arg.num_clients, fn_type.result)
        result.devices = arg.devices
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
        for index, clients in layout:
            if answers[index].num_clients != len(clients):
                raise FleetError(
                    f"device {index} at {self._devices[index].address} mapped "
                    f"{answers[index].num_clients} clients; it holds {len(clients)}")
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
        placements = {v.devices or tuple(self._active) for v in values}
        if len(placements) != 1:
            raise DeviceLostError("zip of values placed on different sets of devices",
                                  [d for p in placements for d in p
                                   if d not in self._active])
        n = counts.pop()
        layout = self._value_layout(values[0])
        member_type = federated_language.StructType(
            [(name, v.type_signature) for name, v in zip(names, values)])
        if all(v.is_shared for v in values):
            shared = structure.Struct([(name, v.shared) for name, v in zip(names, values)])
            result = self._new_value(n, member_type, shared=shared, is_shared=True)
        else:
            result = self._new_value(n, member_type)
        result.devices = values[0].devices or tuple(self._active)
        fields = [pb.ZipField(handle=v.handle, name=name) if name is not None
                  else pb.ZipField(handle=v.handle) for v, name in zip(values, names)]
        request = pb.ZipRequest(fields=fields, result=result.handle)
        self._parallel("Zip", {d: request for d, _ in layout})
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
        layout = self._value_layout(value)
        if weights is not None:
            self._value_layout(weights)
        answers = self._parallel("Aggregate", {d: request for d, _ in layout})
        leaf_types = validate.leaf_types(value.type_signature)
        weight_type = validate.leaf_types(weights.type_signature) if weights is not None else []
        total = partials.Partial(kind=kind, leaves=[])
        for index, clients in layout:  # device order is client order
            answer = answers[index]
            where = f"device {index} at {self._devices[index].address}"
            validate.check_partial(answer, kind, leaf_types, weight_type, len(clients),
                                   where, self.reject_nonfinite)
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

    def _fetch(self, index: int, clients: range, value: GrpcClientsValue) -> tuple:
        """Streams one device's members of `value`; returns (messages, members)."""
        device = self._devices[index]
        request = pb.FetchRequest(handle=value.handle, max_message_bytes=self.message_bytes)
        received = []
        try:
            for message in device.stub.Fetch(request, timeout=self.rpc_timeout_s,
                                             metadata=self._metadata):
                received.append(message)
        except grpc.RpcError as e:
            raise self._fail(device, "Fetch", e) from None
        ids = [item.client_id for m in received for item in m.values]
        if ids != list(clients):
            raise FleetError(
                f"device {index} at {device.address} returned clients {ids[:5]}... for "
                f"handle {value.handle}; expected {clients}")
        where = f"device {index} at {device.address}"
        members = []
        for m in received:
            for item in m.values:
                try:
                    member = wire.decode_value(item.value)
                except FleetError as e:
                    raise FleetError(f"{where}, client {item.client_id}: {e}") from None
                validate.check_member(member, value.type_signature,
                                      f"{where}, client {item.client_id}",
                                      self.reject_nonfinite)
                members.append(member)
        return request, received, members

    def get(self, value: ClientsValue) -> list:
        value = self._check(value)
        if value.is_shared:
            return [value.shared] * value.num_clients
        layout = self._value_layout(value)
        self.traffic.rpcs += len(layout)
        jobs = [self._pool.submit(self._fetch, index, clients, value)
                for index, clients in layout]
        members: list = []
        errors = []
        for job in jobs:  # every fetch has its own deadline, so each job ends
            try:
                request, received, got = job.result()
            except FleetError as e:
                errors.append(e)
                continue
            self._count(down=[request], up=received,
                        payload_up=sum(wire.payload_bytes(i.value)
                                       for m in received for i in m.values))
            members.extend(got)
        self._raise_first(errors)
        return members

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._flush_releases(force=True)
        except FleetError:
            pass  # a device that is gone holds nothing any more
        self._closed = True
        self._pool.shutdown(wait=False)
        for device in self._devices:
            device.channel.close()

    def __enter__(self) -> "GrpcClientsBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _PutStream:
    """The request stream of one device's Put: messages made lazily, bytes counted.

    gRPC pulls the messages on its own thread; an encoding error is kept in `error`
    and raised into gRPC, which cancels the call (the device stores nothing), so `put`
    can report the error itself rather than the cancellation.
    """

    def __init__(self, backend: "GrpcClientsBackend", handle: int, clients: range,
                 values: Sequence):
        self._messages = backend._put_messages(handle, clients, values)
        self.bytes = 0
        self.payload = 0
        self.messages = 0
        self.error: Optional[Exception] = None

    def __iter__(self):
        return self

    def __next__(self):
        try:
            message = next(self._messages)
        except StopIteration:
            raise
        except Exception as e:
            self.error = e if isinstance(e, FleetError) else FleetError(
                f"Put: cannot encode a client value ({type(e).__name__}: {e})")
            raise
        self.messages += 1
        self.bytes += wire_size(message)
        self.payload += sum(wire.payload_bytes(v.value) for v in message.values)
        return message


STORE_READ_IDS = 1 << 18  # ids per from_store message (about 2 MiB at most)


def _store_reads(handle: int, ids: np.ndarray, first_client: int, member_type: bytes,
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


def _template(member_type: federated_language.Type):
    """A Struct skeleton (names kept, leaves None) of a member type; None for a tensor."""
    if isinstance(member_type, federated_language.StructType):
        return structure.Struct([(name, _template(t)) for name, t in member_type.items()])
    return None


def _describe(error: Exception) -> str:
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"
