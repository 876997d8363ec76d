"""`DevicePool`: channels to the devices of a fleet, and calls to them with deadlines.

The pool knows devices, not values: it connects (plaintext on loopback, mutual TLS
elsewhere), waits for Health, sends unary calls to many devices at once on its own
threads, counts wire bytes per direction (`Traffic`), and turns a failed call into
`FleetError`, or `DeviceLostError` when the device is gone or missed its deadline.
`mark_lost`, `rejoin` and `add_device` change which devices take part.
`coordinator.GrpcClientsBackend` builds the clients backend on top of it.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import types
from concurrent import futures
from typing import Any, Callable, Iterable, Optional, Sequence

import grpc

from fax_bridge.errors import FleetError
from fax_bridge.rounds.policy import Traffic
from fax_bridge.fleet import security
from fax_bridge.fleet.protocol import (DEFAULT_MAX_MESSAGE_BYTES, PROTOCOL, framed_size,
                                      grpc_options, parse_address)
from fax_bridge.v1 import device_pb2 as pb

# Status codes meaning "this device is gone or too slow", not "the request was wrong".
LOST_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
              grpc.StatusCode.CANCELLED)


class DeviceLostError(FleetError):
    """Devices died or missed their deadline; `devices` lists their indices, `reasons`
    what each one's call ended with (by index, where known), `late` those whose call
    ran past its deadline."""

    def __init__(self, message: str, devices: Sequence[int],
                 reasons: Optional[dict] = None, late: Sequence[int] = ()):
        super().__init__(message)
        self.devices = sorted(set(devices))
        self.reasons = dict(reasons or {})
        self.late = sorted(set(late))


class _Device:
    def __init__(self, index: int, address: str, options: tuple,
                 tls: Optional[security.TlsConfig], count: Callable[[bool, int], None]):
        self.index = index
        self.address = address
        if tls is not None:
            self.channel = grpc.secure_channel(address, tls.channel_credentials(),
                                               options=options + tls.channel_options())
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        self.stub = _counting_stub(self.channel, count)
        self.missing: set[str] = set()  # unary methods it answered UNIMPLEMENTED
        self.shared_dir = ""  # the shared-memory directory its Health reported


_UNCOUNTED = ("Health",)  # connection checks: no part of any round's traffic


def _counting_stub(channel: grpc.Channel, count: Callable[[bool, int], None]) -> Any:
    """A stub with the generated `DeviceStub`'s methods whose serializers report the
    size of every message they handle (`count(down, serialized bytes)`): gRPC turns each
    message into bytes once, so its size comes free, where `ByteSize` would serialize a
    message (of up to a GiB) again. A request given as bytes is sent as it is (a
    `RequestStream` serialized and counted it)."""
    service = pb.DESCRIPTOR.services_by_name["Device"]
    stub = types.SimpleNamespace()
    calls = {(False, False): channel.unary_unary, (True, False): channel.stream_unary,
             (False, True): channel.unary_stream, (True, True): channel.stream_stream}
    for method in service.methods:
        response_class = getattr(pb, method.output_type.name)
        counted = method.name not in _UNCOUNTED

        def serialize(message, counted=counted) -> bytes:
            if isinstance(message, bytes):  # serialized and counted by a RequestStream
                return message
            data = message.SerializeToString()
            if counted:
                count(True, len(data))
            return data

        def deserialize(data: bytes, parse=response_class.FromString, counted=counted):
            if counted:
                count(False, len(data))
            return parse(data)

        setattr(stub, method.name, calls[(method.client_streaming, method.server_streaming)](
            f"/{service.full_name}/{method.name}", request_serializer=serialize,
            response_deserializer=deserialize, _registered_method=True))
    return stub


class _Done:
    """A call made at once in the calling thread, with a future's `result()`."""

    def __init__(self, call: Callable, *args):
        self._answer, self._error = None, None
        try:
            self._answer = call(*args)
        except Exception as e:
            self._error = e

    def result(self):
        if self._error is not None:
            raise self._error
        return self._answer


def _raise(error: Exception):
    raise error


@dataclasses.dataclass(frozen=True)
class Serialized:
    """A request message already serialized (e.g. around a part shared by several
    devices' requests, serialized once), with its payload bytes."""

    data: bytes
    payload: int


class RequestStream:
    """The messages of one client-streaming call, made lazily and counted as they go.

    gRPC pulls the messages on its own thread, so at most the message being sent is
    held besides what gRPC has in flight (`call_each` with a unary alternative makes
    the first two itself, to learn whether there is more than one). An error while
    making one is kept in `error` and raised into gRPC, which cancels the call (the
    device keeps nothing), so the caller reports that error rather than the
    cancellation. `payload(message)` gives the array bytes inside a message (the rest
    is protocol overhead). The stream gives each message serialized (and counted), so
    gRPC sends those bytes without serializing, or sizing, the message again.
    """

    def __init__(self, messages: Iterable, what: str,
                 payload: Callable[[object], int] = lambda message: 0):
        self._messages = iter(messages)
        self._what = what
        self._payload = payload
        self.bytes = 0
        self.payload = 0
        self._resent_payload = 0  # the payload of the first message, for `count_again`
        self.messages = 0
        self.resent = 0  # calls made again (a unary call the device did not know)
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
                f"{self._what}: cannot encode a client value ({type(e).__name__}: {e})")
            raise
        self.messages += 1
        if isinstance(message, Serialized):
            payload, data = message.payload, message.data
        else:
            payload = self._payload(message)
            data = message.SerializeToString()  # gRPC sends these bytes as they are
        if self.messages == 1:
            self._resent_payload = payload
        self.payload += payload
        self.bytes += framed_size(len(data))
        return data

    def head(self, count: int) -> list:
        """Up to `count` next messages (fewer: the stream ends); raises `error` when one
        cannot be made."""
        try:
            return list(itertools.islice(self, count))
        except Exception:
            if self.error is None:
                raise
            raise self.error from None

    def count_again(self, message: bytes) -> None:
        """Counts the first message (as this stream gave it) sent once more, in a call of
        its own."""
        self.resent += 1
        self.bytes += framed_size(len(message))
        self.payload += self._resent_payload


REFUSED_GRACE_S = 3.0  # how long a refused connection is retried before giving up


class DevicePool:
    """Channels to `addresses` (in client-assignment order), all answering Health.

    Args:
      addresses: HOST:PORT of each device.
      rpc_timeout_s: deadline of every call.
      connect_timeout_s: how long to wait for each device to answer Health.
      token: the fleet token sent with every call (see `security`); None sends none.
      tls: mutual TLS (`security.TlsConfig`); None uses plaintext channels.
      max_message_bytes: cap on every gRPC message, each direction.
      shared_memory: this coordinator's `shared_memory.SharedDir`, through which devices
        that report it in Health (those `LocalFleet` started) get large payloads;
        None sends every payload over gRPC.
    """

    def __init__(self, addresses: Sequence[str], *, rpc_timeout_s: float = 60.0,
                 connect_timeout_s: float = 30.0, token: Optional[str] = None,
                 tls: Optional[security.TlsConfig] = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 shared_memory=None):
        if not addresses:
            raise FleetError(f"{type(self).__name__} needs at least one device address")
        self.rpc_timeout_s = float(rpc_timeout_s)
        self.traffic = Traffic()
        self.shared_memory = shared_memory
        self._traffic_lock = threading.Lock()
        self._tls = tls
        self._options = grpc_options(max_message_bytes)
        self._metadata = security.call_metadata(token)
        self._devices: list[_Device] = []
        for address in addresses:
            self._devices.append(self._connect(len(self._devices), address))
        self._active = list(range(len(self._devices)))
        self._pool = futures.ThreadPoolExecutor(max_workers=max(2, min(32, len(addresses))),
                                                thread_name_prefix="fax-bridge-fetch")
        self._closed = False

    def _forget(self, indices: set) -> None:
        """Drops what is remembered about these devices (they are lost or new)."""

    @property
    def addresses(self) -> list[str]:
        return [d.address for d in self._devices]

    @property
    def num_devices(self) -> int:
        return len(self._devices)

    def shares_memory(self, index: int) -> bool:
        """Whether device `index` reported this coordinator's shared-memory directory."""
        return (self.shared_memory is not None
                and self._devices[index].shared_dir == self.shared_memory.path)

    @property
    def active_devices(self) -> list[int]:
        """Indices of the devices clients are placed on (lost ones left out)."""
        return list(self._active)

    def _connect(self, index: int, address: str) -> _Device:
        if self._tls is None and not security.is_loopback(_host(address)):
            security.log.warning("device %s is reached without TLS: the fleet token and "
                                 "all values travel in clear text", address)
        return _Device(index, address, self._options, self._tls, self._count_message)

    def mark_lost(self, indices: Sequence[int]) -> None:
        """Stops placing clients on these devices (they died or missed a deadline)."""
        lost = set(indices)
        self._active = [d for d in self._active if d not in lost]
        self._forget(lost)

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
        self._devices[index].missing.clear()  # it may run a newer version now
        answer = self._wait_one(self._devices[index], time.monotonic() + timeout_s, timeout_s)
        self._forget({index})
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
        """Health of `device`, waiting up to `deadline`; fails fast when nothing listens.

        A refused connection (no process at the address) is retried for
        REFUSED_GRACE_S only, and a refused token not at all: neither improves by waiting.
        A device that accepts the connection but has not answered yet is waited for.
        """
        refused_until = time.monotonic() + min(REFUSED_GRACE_S, timeout_s)
        while True:
            remaining = max(0.1, deadline - time.monotonic())
            try:
                answer = device.stub.Health(pb.HealthRequest(), timeout=min(remaining, 5.0),
                                            metadata=self._metadata, wait_for_ready=False)
                break
            except grpc.RpcError as e:
                code = e.code()
                now = time.monotonic()
                if code == grpc.StatusCode.UNAUTHENTICATED:
                    raise FleetError(
                        f"device {device.index} at {device.address} did not become healthy: "
                        f"it refused the fleet token ({_describe(e)}); give the coordinator "
                        "the same fleet's token") from None
                if code == grpc.StatusCode.UNAVAILABLE and now >= refused_until:
                    tls = "SSL" in str(e.details()) or "andshake" in str(e.details())
                    raise FleetError(
                        f"device {device.index} at {device.address} did not become healthy: "
                        f"nothing answers there ({_describe(e)}, for "
                        f"{min(REFUSED_GRACE_S, timeout_s):.0f}s); " + (
                            "the TLS handshake failed: check the certificates and that "
                            "both sides use TLS" if tls else
                            "check that the device is running and listening on that "
                            "address")) from None
                if now >= deadline:
                    raise FleetError(
                        f"device {device.index} at {device.address} did not become healthy "
                        f"within {timeout_s:.0f}s ({_describe(e)}); it accepts connections "
                        "but may be hung or overloaded") from None
                if code == grpc.StatusCode.UNAVAILABLE:
                    time.sleep(0.1)
        if answer.status != "SERVING" or answer.protocol != PROTOCOL:
            raise FleetError(
                f"device {device.index} at {device.address} answered status "
                f"{answer.status!r}, protocol {answer.protocol!r}; expected SERVING, "
                f"{PROTOCOL}")
        device.shared_dir = answer.shared_memory_dir
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
        """Adds payload bytes to `traffic` (the messages `down` and `up` themselves were
        counted as gRPC serialized them, `_count_message`)."""
        self.traffic.payload_down += payload_down
        self.traffic.payload_up += payload_up

    def _count_message(self, down: bool, serialized_bytes: int) -> None:
        """Counts one message on the wire (called by gRPC's serializers, on any thread)."""
        size = framed_size(serialized_bytes)
        with self._traffic_lock:
            if down:
                self.traffic.bytes_down += size
            else:
                self.traffic.bytes_up += size

    def _fail(self, device: _Device, method: str, error: Exception,
              timeout_s: Optional[float] = None) -> FleetError:
        """The error of a failed call; `timeout_s` the deadline it had (default the
        fleet's `rpc_timeout_s`; longer for a round with emulated delays)."""
        hint = ""
        lost = late = False
        if isinstance(error, grpc.RpcError):
            code = error.code()
            lost = code in LOST_CODES
            late = code == grpc.StatusCode.DEADLINE_EXCEEDED
            if late:
                waited = self.rpc_timeout_s if timeout_s is None else timeout_s
                extra = (" plus the round's emulated delays" if waited > self.rpc_timeout_s
                         else "")
                hint = (f"; it did not answer {method} within its deadline of {waited:g}s "
                        f"(rpc_timeout_s={self.rpc_timeout_s:g}{extra})")
            elif code == grpc.StatusCode.UNAVAILABLE:
                hint = "; the device process is not reachable (did it exit? see its log)"
            elif code == grpc.StatusCode.UNAUTHENTICATED:
                hint = "; the device refused the fleet token"
        reason = f"{method} failed: {_describe(error)}{hint}"
        message = f"device {device.index} at {device.address}: {reason}"
        return (DeviceLostError(message, [device.index], {device.index: reason},
                                [device.index] if late else [])
                if lost else FleetError(message))

    def _unary(self, device: _Device, method: str, request, timeout: Optional[float] = None):
        self.traffic.rpcs += 1
        try:
            response = getattr(device.stub, method)(
                request, timeout=timeout or self.rpc_timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            raise self._fail(device, method, e, timeout or self.rpc_timeout_s) from None
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
                                  [d for e in lost for d in e.devices],
                                  {i: r for e in lost for i, r in e.reasons.items()},
                                  [d for e in lost for d in e.late])
        raise errors[0]

    def call_each(self, method: str, requests: dict[int, object],
                  timeout: Optional[float] = None,
                  once: Optional[str] = None) -> dict[int, object]:
        """Sends one request per device index at once; waits for all answers (counted
        in `traffic`). A request given as a list of messages, or as a `RequestStream`,
        goes as one client stream; with `once` (a unary method taking the same request
        as `method`'s stream), a `RequestStream` that makes only one message goes by
        `once` instead, counted the same. Raises DeviceLostError naming every lost
        device, else the first FleetError (a stream's own encoding error before its
        RPC's).
        """
        # Blocking calls on the backend's own threads, the last one in this thread: a
        # gRPC future would start a new thread per channel on every call when none is in
        # flight.
        calls, sent, streams, unaries = {}, [], {}, {}
        last = next(reversed(requests), None)
        for index, request in requests.items():
            device = self._devices[index]
            self.traffic.rpcs += 1
            kwargs = dict(timeout=timeout or self.rpc_timeout_s, metadata=self._metadata)
            if isinstance(request, list):
                sent.extend(request)
                request = iter(request)
            elif isinstance(request, RequestStream):
                streams[index] = request
            else:
                sent.append(request)
            unary = once if index in streams and once not in device.missing else None
            head = None
            if unary is not None:
                # Made here, before the call goes to its thread: that thread then needs
                # the GIL only to send, so the devices' requests leave close together.
                try:
                    head = request.head(2)
                except Exception as e:  # reported with the other devices' answers
                    calls[index] = _Done(_raise, e)
                    continue
                if len(head) == 1:
                    unaries[index] = unary
            args = (device, method, unary, request, kwargs, head)
            calls[index] = (_Done(self._call, *args) if index == last
                            else self._pool.submit(self._call, *args))
        try:
            answers = self._answers(
                calls, method, lambda index: streams[index].error if index in streams else None,
                unaries, timeout or self.rpc_timeout_s)
        finally:
            for stream in streams.values():
                self.traffic.rpcs += stream.resent
                self.traffic.bytes_down += stream.bytes
                self.traffic.payload_down += stream.payload
        self._count(down=sent, up=answers.values())
        return answers

    @staticmethod
    def _call(device: _Device, method: str, once: Optional[str], request, kwargs: dict,
              head: Optional[list] = None):
        """One device's call of `call_each`: a `RequestStream` whose `head` (its first
        messages, up to two, made by the caller, not on a gRPC thread: counted as sent)
        is one message goes by the unary `once` (then by `method`'s stream if the device
        does not know it); without `once` the request goes by `method` as it is."""
        if once is None or head is None:
            return getattr(device.stub, method)(request, **kwargs)
        if len(head) != 1:
            return getattr(device.stub, method)(itertools.chain(head, request), **kwargs)
        try:
            return getattr(device.stub, once)(head[0], **kwargs)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
        device.missing.add(once)  # a device from before `once`: streams from now on
        request.count_again(head[0])
        return getattr(device.stub, method)(iter(head), **kwargs)

    def _answers(self, calls: dict, method: str,
                 own_error: Optional[Callable[[int], Optional[Exception]]] = None,
                 unaries: Optional[dict] = None,
                 timeout_s: Optional[float] = None) -> dict:
        """Waits for every device's call; then raises the first failure, if any.

        `own_error(index)` may name a failure of ours behind a device's error (e.g. an
        encoding error that cancelled a stream), reported instead of the RPC status.
        `unaries[index]`: the unary method a device's call went by instead of `method`
        (the name its failure carries, unless the device did not know it).
        """
        answers, errors = {}, []
        for index, call in calls.items():
            try:
                answers[index] = call.result()
            except grpc.RpcError as e:
                mine = own_error(index) if own_error is not None else None
                device = self._devices[index]
                called = (unaries or {}).get(index)
                if called is None or called in device.missing:
                    called = method
                errors.append(mine if mine is not None
                              else self._fail(device, called, e, timeout_s))
            except FleetError as e:  # a request stream could not make its first messages
                errors.append(e)
        self._raise_first(errors)
        return answers

    def close(self) -> None:
        """Closes every channel (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=False)
        for device in self._devices:
            device.channel.close()


def _host(address: str) -> str:
    try:
        return parse_address(address)[0]
    except FleetError:
        return address


def _describe(error: Exception) -> str:
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"
