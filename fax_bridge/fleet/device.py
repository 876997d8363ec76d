"""The device server: one process hosting virtual clients, their data and their results.

`fax-bridge device --listen 127.0.0.1:0` (or `python -m fax_bridge.fleet.device_cli`) serves
the fax_bridge.v1 `Device` service. Every call must carry the fleet token (read from the
FAX_BRIDGE_FLEET_TOKEN environment variable or `--token-file`, see `security`); `--tls-*`
adds mutual TLS; addresses other than loopback need `--allow-remote`. Messages and the
bytes held on the device are capped (`--max-message-bytes`, `--max-stored-bytes`).
`--population DIR` hosts a population written by `fax_bridge.data.stream.write_population`:
the coordinator then sends only client ids (a Put stream of `from_store` reads) and
the device reads those clients' rows from its store (a store file changed on disk makes
such a read FAILED_PRECONDITION, naming the file and the change; the device serves on).
Computations arrive once, by content hash; client values stay here behind coordinator-chosen handles until
they are fetched, aggregated (partials over this device's own clients) or released. A
round by split (`Round`, or `RoundOnce` for a request of one message) is served by
`device_round` and keeps nothing. Once listening, the process
prints one JSON line on stdout, e.g. `{"listening": "127.0.0.1:41234", "port": 41234,
"pid": 4242, "device_id": "device-0"}`, and nothing else; logs go to stderr.

This module is the service (`DeviceServicer`); `device_process` runs it as a process and
`device_cli` reads its command line. What the service shares with `device_round` (the
status-coded `RpcError`, `value_bytes`) is in `device_common`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import logging
import os
import sys
import threading
import time
from typing import Callable, Optional, Sequence, Union

import grpc
import numpy as np
from federated_language.common_libs import structure
from federated_language.proto import computation_pb2

from fax_bridge.errors import DataError, FaxBridgeError, FleetError
from fax_bridge.fleet import memory
from fax_bridge.rounds import partials, wire
from fax_bridge.rounds import client_runtime as runtimes
from fax_bridge.rounds.client_runtime import ClientRuntime
from fax_bridge.fleet.shared_memory import SharedDir
from fax_bridge.fleet.device_common import RpcError, value_bytes
from fax_bridge.runtime import aggregation
from fax_bridge.fleet.protocol import (DEFAULT_FETCH_BYTES, DEFAULT_MAX_CALL_SECONDS,
                                      DEFAULT_MAX_CLIENTS, DEFAULT_MAX_STORED_BYTES,
                                      MAX_DELAY_SECONDS, PROTOCOL)
from fax_bridge.v1 import device_pb2 as pb
from fax_bridge.v1 import device_pb2_grpc as pb_grpc

log = logging.getLogger("fax_bridge.device")


@dataclasses.dataclass
class Stored:
    """A clients value held on this device: per-client members, or one shared member."""

    client_ids: list
    members: Optional[list] = None
    shared: object = None
    nbytes: int = 0

    def member_list(self) -> list:
        if self.members is not None:
            return self.members
        return [self.shared] * len(self.client_ids)


def _abort(self, context, method: Callable, error: Exception) -> None:
    """Reports an exception of a servicer method as a gRPC status with clear details."""
    if isinstance(error, RpcError):
        context.abort(error.code, f"{self.device_id}: {error}")
    if isinstance(error, FaxBridgeError):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"{self.device_id}: {type(error).__name__}: {error}")
    # Anything else is reported to the coordinator instead of killing the device.
    log.error("%s failed", method.__name__, exc_info=error)
    context.abort(grpc.StatusCode.INTERNAL, f"{self.device_id}: {method.__name__} failed: "
                  f"{type(error).__name__}: {error}")


def _rpc(method: Callable) -> Callable:
    """Maps exceptions of a servicer method (unary, or a generator for streamed answers)
    onto gRPC status codes with clear details."""
    if inspect.isgeneratorfunction(method):
        @functools.wraps(method)
        def stream(self, request, context):
            try:
                yield from method(self, request, context)
            except Exception as e:
                _abort(self, context, method, e)
            finally:
                self.moved.settle()  # a large call's buffers go back to the system

        return stream

    @functools.wraps(method)
    def unary(self, request, context):
        try:
            return method(self, request, context)
        except Exception as e:
            _abort(self, context, method, e)
        finally:
            self.moved.settle()

    return unary


class DeviceServicer(pb_grpc.DeviceServicer):
    """Holds this device's clients values and computations; serves the Device service."""

    def __init__(self, device_id: str = "device",
                 max_stored_bytes: int = DEFAULT_MAX_STORED_BYTES,
                 population: Optional[str] = None,
                 population_name: Optional[str] = None, *,
                 max_clients: int = DEFAULT_MAX_CLIENTS,
                 max_call_seconds: float = DEFAULT_MAX_CALL_SECONDS,
                 max_delay_seconds: float = MAX_DELAY_SECONDS,
                 shared_memory: Optional[str] = None,
                 client_runtime: Union[str, ClientRuntime] = "xla"):
        self.device_id = device_id
        # What runs a round's client part (`rounds.client_runtime`), parsed once here.
        self.client_runtime = runtimes.resolve(client_runtime)
        # The launcher's directory of shared-memory segments (`--shared-memory`), if any.
        self.shared_memory = None if shared_memory is None else SharedDir(shared_memory)
        self.max_stored_bytes = int(max_stored_bytes)
        self.max_clients = int(max_clients)
        self.max_call_seconds = float(max_call_seconds)
        self.max_delay_seconds = float(max_delay_seconds)
        self.stopping = threading.Event()  # set on shutdown: waits and long calls end
        # (serialized member type, keys) of from_store reads -> (Type, the columns to read)
        self._read_plans: dict = {}
        self.population = None
        self.population_name = ""
        self.population_digest = ""
        if population is not None:
            from fax_bridge.runtime import population as pop

            try:
                self.population = pop.open_store(population)
                self.population_digest = pop.store_digest(population)
            except (FaxBridgeError, OSError, ValueError) as e:
                raise FleetError(f"--population {population}: {e}") from None
            self.population_name = population_name or pop.default_name(population)
        self._stored_bytes = 0
        self._handles: dict[int, Stored] = {}
        self._computations: dict[str, computation_pb2.Computation] = {}
        self._lock = threading.Lock()          # guards the two dicts
        self.moved = memory.MovedBytes()  # request and answer bytes, for release_memory
        self.computing = threading.Lock()      # one computing request at a time

    # -- helpers ------------------------------------------------------------------

    def _check_clients(self, count: int, what: str) -> None:
        if count > self.max_clients:
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{what} names {count} clients, above this device's cap of "
                           f"{self.max_clients} (--max-clients)")

    def check_room(self, extra: int, what: str) -> None:
        """RESOURCE_EXHAUSTED unless `extra` more bytes fit under --max-stored-bytes."""
        with self._lock:
            held = self._stored_bytes
        if held + extra > self.max_stored_bytes:
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{what} would hold {extra} more bytes, above this device's cap "
                           f"of {self.max_stored_bytes} bytes ({held} held); release values "
                           "or raise --max-stored-bytes")

    def check_time(self, start: float, context, what: str) -> None:
        """Ends a long call: the device is stopping, the caller gave up, or time ran out."""
        if self.stopping.is_set():
            raise RpcError(grpc.StatusCode.UNAVAILABLE, f"{what}: the device is shutting down")
        if context is not None and not context.is_active():
            raise RpcError(grpc.StatusCode.CANCELLED, f"{what}: the caller went away")
        if time.monotonic() - start > self.max_call_seconds:
            raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"{what} ran past this device's cap of {self.max_call_seconds:g}s "
                           "per call (--max-call-seconds)")

    def check_delay(self, delay: float, what: str) -> float:
        """`delay` if it lies in 0..--max-delay-seconds, else INVALID_ARGUMENT (NaN too)."""
        if not 0.0 <= delay <= self.max_delay_seconds:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"{what}: delay_seconds={delay} is outside "
                           f"0..{self.max_delay_seconds:g} (--max-delay-seconds)")
        return delay

    def loaded(self, computation_hash: str, what: str) -> computation_pb2.Computation:
        """The computation loaded under `computation_hash`, else FAILED_PRECONDITION."""
        with self._lock:
            fn = self._computations.get(computation_hash)
        if fn is None:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"{what}: computation {computation_hash[:12]} is not loaded; "
                           "send it with Load first")
        return fn

    def _get(self, handle: int) -> Stored:
        with self._lock:
            stored = self._handles.get(handle)
        if stored is None:
            raise RpcError(grpc.StatusCode.NOT_FOUND,
                           f"no value with handle {handle} on this device (released, or "
                           "placed on another device)")
        return stored

    def _store(self, handle: int, stored: Stored) -> None:
        if stored.members is not None:
            stored.nbytes = sum(value_bytes(m) for m in stored.members)
        else:
            stored.nbytes = value_bytes(stored.shared)
        stored.nbytes += CLIENT_ID_BYTES * len(stored.client_ids)
        with self._lock:
            if handle in self._handles:
                raise RpcError(grpc.StatusCode.ALREADY_EXISTS,
                               f"handle {handle} is already in use on this device; the "
                               "coordinator must pick a fresh handle per value")
            if self._stored_bytes + stored.nbytes > self.max_stored_bytes:
                raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"storing {stored.nbytes} more bytes would exceed this "
                               f"device's cap of {self.max_stored_bytes} bytes "
                               f"({self._stored_bytes} held); release values or raise "
                               "--max-stored-bytes")
            self._handles[handle] = stored
            self._stored_bytes += stored.nbytes

    # -- service ------------------------------------------------------------------

    @_rpc
    def Health(self, request, context):
        with self._lock:
            clients = {c for s in self._handles.values() for c in s.client_ids}
            return pb.HealthResponse(
                status="SERVING", device_id=self.device_id, pid=os.getpid(),
                protocol=PROTOCOL, num_handles=len(self._handles),
                num_computations=len(self._computations), num_clients=len(clients),
                population_name=self.population_name,
                population_clients=(self.population.num_clients
                                    if self.population is not None else 0),
                population_digest=self.population_digest,
                shared_memory_dir=(self.shared_memory.path
                                   if self.shared_memory is not None else ""))

    @_rpc
    def Load(self, request, context):
        # The hash names the computation for every later Map, and for every coordinator
        # sharing this device: bytes that do not hash to it are refused, so no caller can
        # register other code under a computation's name.
        body = request.computation  # each read of a bytes field copies it: read it once
        self.moved.add(len(body))
        digest = hashlib.sha256(body).hexdigest()
        if digest != request.computation_hash:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"Load: computation_hash {request.computation_hash[:16]!r} is not "
                           f"the sha256 of the computation's bytes ({digest[:16]}...); "
                           "send the hex sha256 of exactly the bytes sent")
        with self._lock:
            if request.computation_hash in self._computations:
                return pb.LoadResponse(already_loaded=True)
        from fax_bridge.runtime.local_eval import compile_local

        proto = computation_pb2.Computation()
        try:
            proto.ParseFromString(body)
        except Exception as e:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"Load: the bytes of computation {request.computation_hash[:12]} "
                           f"are not a serialized federated_language Computation ({e})")
        del body
        compile_local(proto)  # refused here, at Load, when it cannot run
        with self._lock:
            self._computations[request.computation_hash] = proto
        return pb.LoadResponse(already_loaded=False)

    def read_clients(self, messages, what: str, check=None):
        """Reads a stream of client messages (Put, Round): client values, or `from_store`
        reads of the hosted population, never both; the client and byte caps are checked
        as each message arrives. `check(first, message)` may refuse a message. Returns
        the first message, the client ids, the members, the reads and the bytes received."""
        first = None
        ids: list = []
        members: list = []
        reads: list = []
        received = 0
        for message in messages:
            before = received
            if first is None:
                first = message
            elif check is not None:
                check(first, message)
            if message.HasField("from_store"):
                if message.values or members:
                    raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"{what} stream mixes client values and from_store reads")
                received += message.from_store.ByteSize()
                self.check_room(received, f"{what} from_store stream")
                reads.append(message.from_store)
                continue
            if reads and message.values:
                raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"{what} stream mixes client values and from_store reads")
            self._check_clients(len(members) + len(message.values), what)
            for item in message.values:
                ids.append(item.client_id)
                members.append(wire.decode_value(item.value))  # a copy of the bytes
                received += value_bytes(members[-1])
            self.moved.add(received - before)
            self.check_room(received, what)
            message.ClearField("values")  # the decoded copies are all that is kept
        if first is None:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"{what} stream sent no message")
        check_unique_ids(ids, what)
        return first, ids, members, reads, received

    @_rpc
    def Put(self, request_iterator, context):
        def same_handle(first, message):
            if message.handle != first.handle:
                raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"Put stream mixes handles {first.handle} and {message.handle}")

        head, ids, members, reads, _ = self.read_clients(request_iterator, "Put", same_handle)
        if reads:
            return self._put_from_store(head.handle, reads)
        self._store(head.handle, Stored(client_ids=ids, members=members))
        return pb.PutResponse(num_clients=len(ids))

    @_rpc
    def Broadcast(self, request, context):
        count = len(request.client_ids)
        if request.HasField("client_range"):
            first, stop = request.client_range.start, request.client_range.stop
            if count or not 0 <= first <= stop:
                raise FleetError(
                    f"Broadcast: client_range [{first}, {stop}) must satisfy 0 <= start <= "
                    "stop and come without client_ids")
            count = stop - first
        self._check_clients(count, "Broadcast")
        value = wire.decode_value(request.value)  # sized from the copy, not re-encoded
        self.moved.add(value_bytes(value))
        self.check_room(value_bytes(value) + CLIENT_ID_BYTES * count, "Broadcast")
        ids = (list(range(first, stop)) if request.HasField("client_range")
               else list(request.client_ids))
        check_unique_ids(ids, "Broadcast")
        self._store(request.handle, Stored(client_ids=ids, shared=value))
        return pb.BroadcastResponse()

    def _put_from_store(self, handle: int, reads: list) -> pb.PutResponse:
        """Stores the members a Put stream of `StoreRead`s names, read from the population."""
        first, members = self.read_store(reads)
        self._store(handle, Stored(client_ids=list(range(first, first + len(members))),
                                   members=members))
        return pb.PutResponse(num_clients=len(members))

    def read_store(self, reads: list) -> tuple[int, list]:
        """(first client, members) of a stream of `StoreRead`s, read from the population."""
        from fax_bridge.runtime import population as pop

        if self.population is None:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                           "from_store: this device hosts no population; start it with "
                           "--population DIR (a directory written by write_population)")
        head = reads[0]
        if head.population and head.population != self.population_name:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"from_store asks for population {head.population!r} but "
                           f"this device hosts {self.population_name!r}")
        member_type, columns = self._read_plan(head.member_type, tuple(head.keys))
        if head.first_client < 0:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"from_store: first_client {head.first_client} is negative")
        store = self.population
        limit = min(store.num_clients * 4 + 1024, self.max_clients)
        chunks, count = [], 0
        for read in reads:
            if read.ranges:
                spans = [(r.start, r.stop) for r in read.ranges]
                if any(lo < 0 or hi < lo for lo, hi in spans):
                    raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                                   "from_store: a client range has start < 0 or "
                                   "stop < start")
                count += sum(hi - lo for lo, hi in spans)
                if count > limit:
                    break
                chunks.extend(np.arange(lo, hi, dtype=np.int64) for lo, hi in spans)
            else:
                count += len(read.population_ids)
                chunks.append(np.asarray(read.population_ids, dtype=np.int64))
        if count > limit:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"from_store names {count} clients, far more than the "
                           f"{store.num_clients} this population holds")
        ids = np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
        pop.check_ids(store, ids)
        self.check_room(pop.rows_bytes(store, columns, ids), f"reading {len(ids)} clients")
        try:
            members = pop.read_members(store, member_type, columns, ids)
        except DataError as e:  # a store file changed on disk: this read only is refused
            log.error("population %r: %s", self.population_name, e)
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"from_store: the hosted population {self.population_name!r} "
                           f"changed on disk: {e}") from None
        return int(head.first_client), members

    def _read_plan(self, member_type_bytes: bytes, keys: tuple) -> tuple:
        """(member Type, `population.plan_columns`) of a from_store read, kept for the few
        (type, keys) pairs a fleet's rounds read: both depend only on them and the store."""
        from fax_bridge.runtime import local_eval
        from fax_bridge.runtime import population as pop

        found = self._read_plans.get((member_type_bytes, keys))
        if found is not None:
            return found
        type_proto = computation_pb2.Type()
        try:
            type_proto.ParseFromString(member_type_bytes)
        except Exception as e:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"from_store: member_type is not a serialized Type ({e})")
        member_type = local_eval.parse_type(type_proto)
        if member_type is None:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "from_store: member_type is empty")
        found = (member_type, pop.plan_columns(self.population, member_type, list(keys)))
        if len(self._read_plans) < 64:
            self._read_plans[(member_type_bytes, keys)] = found
        return found

    @_rpc
    def Map(self, request, context):
        delay = self.check_delay(request.delay_seconds, "Map")
        fn = self.loaded(request.computation_hash, "Map")
        arg = self._get(request.arg)
        from fax_bridge.runtime import client_map

        ids_bytes = CLIENT_ID_BYTES * len(arg.client_ids)
        with self.computing:
            start = time.perf_counter()
            clock = time.monotonic()
            members = [None] * len(arg.client_ids) if request.no_argument else arg.member_list()
            guard = client_map.Guard(
                tick=lambda: self.check_time(clock, context, "Map"),
                room=lambda produced: self.check_room(ids_bytes + produced, "Map's results"),
                size=value_bytes)
            results = self.client_runtime.map_clients(  # LiteRT: a model per client map
                fn, members, key=request.computation_hash, no_argument=request.no_argument,
                guard=guard)
            elapsed = time.perf_counter() - start
        if delay > 0 and self.stopping.wait(delay):
            raise RpcError(grpc.StatusCode.UNAVAILABLE, "Map: the device is shutting down")
        self._store(request.result, Stored(client_ids=list(arg.client_ids), members=results))
        return pb.MapResponse(num_clients=len(results), compute_seconds=elapsed,
                              client_runtime=self.client_runtime.name)

    @_rpc
    def Zip(self, request, context):
        fields = [(f.name if f.HasField("name") else None, self._get(f.handle))
                  for f in request.fields]
        if not fields:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "Zip needs at least one field")
        ids = fields[0][1].client_ids
        for name, stored in fields[1:]:
            if stored.client_ids != ids:
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"Zip fields hold different clients ({len(ids)} vs "
                               f"{len(stored.client_ids)} clients, or another order)")
        if all(stored.members is None for _, stored in fields):
            shared = structure.Struct([(n, s.shared) for n, s in fields])
            self._store(request.result, Stored(client_ids=list(ids), shared=shared))
        else:
            columns = [(n, s.member_list()) for n, s in fields]
            members = [structure.Struct([(n, column[i]) for n, column in columns])
                       for i in range(len(ids))]
            self._store(request.result, Stored(client_ids=list(ids), members=members))
        return pb.ZipResponse(num_clients=len(ids))

    @_rpc
    def Aggregate(self, request, context):
        kind = partials.ENUM_TO_KIND.get(request.kind)
        if kind is None:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"Aggregate: unknown aggregation number {request.kind}")
        stored = self._get(request.value)
        weights = None
        if kind == "weighted_mean":
            weight_store = self._get(request.weights)
            if weight_store.client_ids != stored.client_ids:
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                               "weighted_mean: weights and values hold different clients")
            weights = weight_store.member_list()
        bitwidth = (wire.decode_value(request.bitwidth)
                     if request.HasField("bitwidth") else None)
        with self.computing:
            partial = aggregation.partial_of(kind, stored.member_list(), weights, bitwidth)
        return partials.to_message(partial)

    @_rpc
    def Round(self, request_iterator, context):
        from fax_bridge.fleet import device_round

        return device_round.run_round(self, request_iterator, context)

    @_rpc
    def RoundOnce(self, request, context):
        # The same round as a Round stream of this one message, by the same code.
        from fax_bridge.fleet import device_round

        return device_round.run_round(self, iter((request,)), context, "RoundOnce")

    @_rpc
    def Fetch(self, request, context):
        stored = self._get(request.handle)
        budget = request.max_message_bytes or DEFAULT_FETCH_BYTES
        message = pb.FetchResponse()
        size = 0
        for client_id, member in zip(stored.client_ids, stored.member_list()):
            item = pb.ClientValue(client_id=client_id)
            wire.encode_value(member, item.value)
            item_size = item.ByteSize()
            if message.values and size + item_size > budget:
                yield message
                message = pb.FetchResponse()
                size = 0
            message.values.append(item)
            size += item_size
            self.moved.add(item_size)
        yield message

    @_rpc
    def Release(self, request, context):
        released = 0
        with self._lock:
            for handle in request.handles:
                stored = self._handles.pop(handle, None)
                if stored is not None:
                    self._stored_bytes -= stored.nbytes
                    released += 1
        return pb.ReleaseResponse(released=released)


# ---------------------------------------------------------------------------------------
# Client ids


CLIENT_ID_BYTES = 32        # a client id in a list (the int and its slot)


def check_unique_ids(ids: Sequence[int], what: str) -> None:
    """INVALID_ARGUMENT naming a client id that `ids` holds more than once: a value holds
    one member per client, so a repeated id would count that client's data twice."""
    if len(ids) < 2:
        return
    order = np.asarray(ids, np.int64)
    if bool((order[1:] > order[:-1]).all()):  # the usual case: ids in increasing order
        return
    order = np.sort(order)
    repeated = order[1:][order[1:] == order[:-1]]
    if repeated.size:
        first = int(repeated[0])
        times = int(np.count_nonzero(order == first))
        raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                       f"{what} names client id {first} {times} times (and "
                       f"{np.unique(repeated).size} repeated ids in all); every client "
                       "id of a value must be distinct")


if __name__ == "__main__":
    sys.exit("python -m fax_bridge.fleet.device: this module is the device service, not a "
             "command; start a device with `fax-bridge device ...` or `python -m "
             "fax_bridge.fleet.device_cli ...`")
