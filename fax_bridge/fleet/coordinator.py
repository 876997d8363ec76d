"""`GrpcClientsBackend`: the coordinator's view of client values living on device processes.

Clients 0..n-1 of a clients value are split over the devices in a fixed order (device d
holds a contiguous block), so every value of n clients is laid out the same way. Each
operation goes to every device that holds clients, in parallel, each RPC with a
deadline. Aggregations are pre-aggregated: each device sends one exact partial over its
own clients, so uplink bytes grow with devices, not clients. Partials are exact sums
merged in client order, so any number of devices gives the same bits. Wire bytes are counted per direction.

Faults: an RPC that fails because its device is gone or missed its deadline raises
`DeviceLostError` naming those devices; `mark_lost` takes them out of the layout (the
launcher then reruns the round on the survivors) and `rejoin` / `add_device` bring a
device (back) in. Every answer is checked against the type it should have (structure,
dtypes, shapes, partial sizes) before it is used; `reject_nonfinite` also refuses NaN
and infinite values. Calls carry the fleet token; `tls` switches to mutual TLS.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import weakref
from typing import Optional, Sequence

import federated_language
import grpc
import numpy as np
from federated_language.common_libs import structure
from federated_language.proto import computation_pb2

from fax_bridge.errors import AggregationError, FleetError
from fax_bridge.fleet import put_messages, security
from fax_bridge.rounds import engine, partials, validate, wire
from fax_bridge.fleet.pool import DeviceLostError, DevicePool
from fax_bridge.fleet.protocol import DEFAULT_MAX_MESSAGE_BYTES, partition
from fax_bridge.runtime import aggregation, population
from fax_bridge.runtime.backend import ClientsBackend, ClientsValue, as_numpy, from_leaves
from fax_bridge.runtime.local_eval import content_hash
from fax_bridge.v1 import device_pb2 as pb

RELEASE_BATCH = 256


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


class GrpcClientsBackend(DevicePool, ClientsBackend):
    """Runs CLIENTS-placed work on device processes reached over gRPC.

    Args:
      addresses: HOST:PORT of each device, in the fixed order clients are assigned.
      rpc_timeout_s: deadline of every RPC (a Map's emulated delay is added to it).
      connect_timeout_s: how long to wait for each device to answer Health.
      message_bytes: target size of the messages of streamed per-client transfers.
      token: the fleet token sent with every call (see `security`); None sends none.
      tls: mutual TLS (`security.TlsConfig`); None uses plaintext channels.
      max_message_bytes: cap on every gRPC message, each direction.
      reject_nonfinite: refuse NaN/inf in device answers (default: they propagate, as
        on the local path).
      shared_memory: a `shared_memory.SharedDir` for devices on this host that report
        it (see `DevicePool`).
    """

    def __init__(self, addresses: Sequence[str], *, rpc_timeout_s: float = 60.0, connect_timeout_s: float = 30.0,
                 message_bytes: int = 4 << 20, token: Optional[str] = None,
                 tls: Optional[security.TlsConfig] = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 reject_nonfinite: bool = False, shared_memory=None):
        super().__init__(addresses, rpc_timeout_s=rpc_timeout_s,
                         connect_timeout_s=connect_timeout_s, token=token, tls=tls,
                         max_message_bytes=max_message_bytes, shared_memory=shared_memory)
        self.message_bytes = int(message_bytes)
        self.reject_nonfinite = bool(reject_nonfinite)
        # Set by the fleet from its policy (`RoundPolicy.rounded_partials`).
        self.rounded_partials = False
        # Set by the fleet: the client runtime its devices must name in Map answers
        # (`MapResponse.client_runtime`); None takes what they run.
        self.client_runtime: Optional[str] = None
        # A random start keeps this backend's handles apart from those an earlier
        # coordinator (crashed, or closed with values still referenced) left behind.
        self._handles = itertools.count(1 + secrets.randbelow(1 << 52))
        self._loaded: set[tuple[int, str]] = set()
        self._pending_release: list[int] = []
        self._release_lock = threading.Lock()
        self._delays: Optional[np.ndarray] = None
        self._populations: dict[int, tuple[str, int, str]] = {}
        self.wait_ready(connect_timeout_s)

    def _forget(self, indices: set) -> None:
        self._loaded = {(d, k) for d, k in self._loaded if d not in indices}
        for index in indices:
            self._populations.pop(index, None)

    def take_handles(self, other: "GrpcClientsBackend") -> None:
        """Continues `other`'s handle sequence: after a reconnect, devices that survived
        may still hold values of `other`, so their handles are never reused."""
        self._handles = other._handles

    # -- plumbing -----------------------------------------------------------------

    def layout(self, num_clients: int,
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
        layout = self.layout(value.num_clients, value.devices)
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
            self.call_each("Release", {d: request for d in self._active})
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
        self._delays = None if delays is None else np.asarray(delays, np.float64).reshape(-1)

    def take_delays(self) -> Optional[np.ndarray]:
        """The per-client delays set for the next map (or round by split), clearing them."""
        delays, self._delays = self._delays, None
        return delays

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
        streams = {index: put_messages.stream(put_messages.client_values(
                       result.handle, clients, values, self.message_bytes))
                   for index, clients in self.layout(len(values), result.devices)}
        answers = self.call_each("Put", streams)
        for index, clients in self.layout(len(values), result.devices):
            got = answers[index].num_clients
            if got != len(clients):
                raise FleetError(
                    f"device {index} at {self._devices[index].address} stored {got} "
                    f"clients of handle {result.handle}; {len(clients)} were sent")
        return result

    # -- populations hosted by the devices ------------------------------------------

    def population_info(self, ref=None) -> tuple[str, int, str]:
        """(name, clients, digest) of the population every active device hosts.

        Raises FleetError when a device hosts none, when they disagree, or when `ref`
        names another population. Asked once per device (Health) and remembered.
        """
        missing = [d for d in self._active if d not in self._populations]
        if missing:
            answers = self.call_each("Health", {d: pb.HealthRequest() for d in missing})
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
        _, size, _ = self.population_info(ref)
        ids = np.asarray(client_ids, dtype=np.int64).reshape(-1)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= size):
            bad = ids[(ids < 0) | (ids >= size)]
            raise FleetError(f"client id {int(bad[0])} is out of range for the devices' "
                             f"population of {size} clients")
        keys = population.default_keys(member_type, getattr(ref, "keys", None))
        type_bytes = member_type.to_proto().SerializeToString(deterministic=True)
        result = self._new_value(len(ids), member_type)
        layout = self.layout(len(ids), result.devices)
        requests = {index: put_messages.store_reads(
                        result.handle, ids[clients.start:clients.stop], clients.start,
                        type_bytes, keys, getattr(ref, "name", None) or "")
                    for index, clients in layout}
        answers = self.call_each("Put", requests)
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
        for index, clients in self.layout(num_clients, result.devices):
            request = pb.BroadcastRequest(handle=result.handle)
            request.client_range.start, request.client_range.stop = clients.start, clients.stop
            request.value.CopyFrom(encoded)
            requests[index] = request
        self.call_each("Broadcast", requests)
        self.traffic.payload_down += wire.payload_bytes(encoded) * len(requests)
        return result

    def ensure_loaded(self, fn: computation_pb2.Computation, devices: list[int],
                      key: Optional[str] = None) -> str:
        """Loads `fn` on those of `devices` that do not hold it yet; returns its
        content hash, the key requests name it by (`key`: that hash, known already)."""
        key = key or content_hash(fn)
        missing = [d for d in devices if (d, key) not in self._loaded]
        if missing:
            request = pb.LoadRequest(computation_hash=key,
                                     computation=fn.SerializeToString(deterministic=True))
            self.call_each("Load", {d: request for d in missing})
            self._loaded.update((d, key) for d in missing)
        return key

    def map(self, fn: computation_pb2.Computation, fn_type: federated_language.FunctionType,
            arg: ClientsValue) -> GrpcClientsValue:
        arg = self._check(arg)
        layout = self._value_layout(arg)
        key = self.ensure_loaded(fn, [d for d, _ in layout])
        result = self._new_value(arg.num_clients, fn_type.result)
        result.devices = arg.devices
        delays = self.take_delays()
        requests = {}
        longest = 0.0
        for index, clients in layout:
            delay = 0.0
            if delays is not None:
                mine = delays[clients.start:min(clients.stop, len(delays))]
                delay = float(mine.max()) if mine.size else 0.0
            longest = max(longest, delay)
            requests[index] = pb.MapRequest(computation_hash=key, arg=arg.handle,
                                            result=result.handle, delay_seconds=delay,
                                            no_argument=fn_type.parameter is None)
        answers = self.call_each("Map", requests, timeout=self.rpc_timeout_s + longest)
        for index, clients in layout:
            if answers[index].num_clients != len(clients):
                raise FleetError(
                    f"device {index} at {self._devices[index].address} mapped "
                    f"{answers[index].num_clients} clients; it holds {len(clients)}")
            ran = answers[index].client_runtime or "unnamed"
            if self.client_runtime is not None and ran != self.client_runtime:
                raise FleetError(
                    f"device {index} at {self._devices[index].address} ran a client map "
                    f"with client runtime {ran!r}, but this fleet runs client work with "
                    f"{self.client_runtime!r}; start its devices with --client-runtime "
                    f"{self.client_runtime}")
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
        self.call_each("Zip", {d: request for d, _ in layout})
        return result

    def aggregate(self, value: ClientsValue, kind: str,
                  weights: Optional[ClientsValue] = None, bitwidth=None):
        value = self._check(value)
        aggregation.check_kind(kind)
        if kind == "weighted_mean":
            if weights is None:
                raise AggregationError("weighted_mean needs a clients value of weights")
            weights = self._check(weights)
            if weights.num_clients != value.num_clients:
                raise AggregationError(
                    f"weighted_mean: {value.num_clients} values but {weights.num_clients} "
                    "weights; give one weight per client")
        if kind == "secure_sum_bitwidth" and bitwidth is None:
            raise AggregationError("federated_secure_sum_bitwidth needs a bitwidth")
        if kind == "secure_sum" and bitwidth is None:
            raise AggregationError("federated_secure_sum needs a max_input")
        total = self._aggregate_on_devices(value, kind, weights, bitwidth)
        return from_leaves(value.type_signature,
                           aggregation.finish(total, value.type_signature))

    def _aggregate_on_devices(self, value: GrpcClientsValue, kind: str,
                              weights: Optional[GrpcClientsValue],
                              bitwidth=None) -> aggregation.Partial:
        request = pb.AggregateRequest(value=value.handle, kind=partials.KIND_TO_ENUM[kind],
                                      weights=weights.handle if weights is not None else 0)
        if bitwidth is not None:
            wire.encode_value(as_numpy(bitwidth), request.bitwidth)
        layout = self._value_layout(value)
        if weights is not None:
            self._value_layout(weights)
        leaf_types = validate.leaf_types(value.type_signature)
        weight_type = validate.leaf_types(weights.type_signature) if weights is not None else []
        tops = (aggregation.secure_bounds(kind, bitwidth, len(leaf_types))  # checked here
                if kind in ("secure_sum_bitwidth", "secure_sum") else None)
        answers = self.call_each("Aggregate", {d: request for d, _ in layout})
        found = [engine.HolderAnswer(f"device {index} at {self._devices[index].address}",
                                     len(clients), [answers[index]])
                 for index, clients in layout]  # device order is client order
        return engine.check_and_merge([(kind, leaf_types, weight_type, tops)], found,
                                      self.reject_nonfinite, self.traffic)[0]

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
        super().close()

    def __enter__(self) -> "GrpcClientsBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
