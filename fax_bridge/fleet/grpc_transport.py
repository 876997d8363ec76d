"""The device fleet as a round transport: one `Round` request per device per round.

`GrpcTransport` carries a `round_split.RoundSplit`'s client part for `engine.run_round`
over a `GrpcClientsBackend`: one stream to each device holding clients (the round's
client part loaded once per device, by content hash; the broadcast value; the device's
block of the cohort, as values or as population ids), one answer per device with an
exact partial per aggregation, which the engine checks and merges in client order. A
device's request that fits in one message (the head with its clients or their
population ids, the common case) goes as one unary `RoundOnce` call instead, which
costs less than a stream (`DevicePool.call_each`). Lost devices raise `DeviceLostError`
as on the phase path, so rounds finish on the survivors the same way; a device whose
answer is for other clients or aggregations than it was sent, or names a segment it was
not given, comes back as a `LostHolder` naming what was wrong (given the round's client
ids), which the engine's policy drops. Token and TLS are the backend's channels. Devices that share this host's memory with the coordinator
(`DevicePool.shares_memory`: those `LocalFleet` started) get the broadcast's large
tensors in one shared-memory segment written once for all of them, and put their
partials' large payloads in a segment each (`shared_memory`). Every segment of a round
is removed when the round ends, however it ends, but a device's answer segment after a
round that ended well with nothing read from it alive (`end_round`): that one is kept,
and the device writes its next answer over it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Iterator, Optional

import numpy as np
from federated_language.common_libs import structure

from fax_bridge.errors import FaxBridgeError, FleetError
from fax_bridge.fleet import put_messages, shared_memory
from fax_bridge.rounds import client_runtime as runtimes
from fax_bridge.rounds import partials, wire
from fax_bridge.rounds.engine import Answers, HolderAnswer, LostHolder
from fax_bridge.rounds.round_split import RoundSplit
from fax_bridge.fleet.pool import Serialized
from fax_bridge.runtime import population
from fax_bridge.runtime.backend import as_numpy
from fax_bridge.runtime.population import PopulationRef
from fax_bridge.v1 import device_pb2 as pb

_SHA256 = re.compile(r"[0-9a-f]{64}")


def check_inputs(split: RoundSplit, arg: Any) -> None:
    """FleetError unless the round's CLIENTS inputs are all given as values, or all read
    from the devices' population (the same clients, each input's stored arrays named, or
    one input whose tensor is the store's only array): what one `Round` request per
    device can carry."""
    inputs = [arg[i] for i in split.client_inputs]
    refs = [isinstance(v, PopulationRef) for v in inputs]
    if not any(refs):
        return
    if not all(refs):
        raise FleetError(
            "a round's CLIENTS arguments are all values or all read from the devices' "
            f"population; here {sum(refs)} of {len(refs)} are PopulationRefs. Pass every "
            "CLIENTS argument as a PopulationRef (keys= naming its stored arrays), or "
            "every one as values")
    if len({v.name for v in inputs}) > 1:
        raise FleetError(
            f"a round reads one population; its CLIENTS arguments name "
            f"{sorted({str(v.name) for v in inputs})}")
    ids = [np.asarray(v.client_ids, np.int64).reshape(-1) for v in inputs]
    if any(not np.array_equal(ids[0], i) for i in ids[1:]):
        raise FleetError("a round's PopulationRefs name the same clients (each client's "
                         "arguments are read together); give them the same client_ids")
    try:
        keys = [population.default_keys(t, v.keys) for t, v in zip(split.input_types, inputs)]
    except FaxBridgeError as e:
        raise FleetError(str(e)) from None
    if len(inputs) > 1 and not all(keys):
        raise FleetError(
            f"{len(inputs)} CLIENTS arguments read from the population: name each one's "
            "stored arrays with PopulationRef(keys=[...]) (only a single argument may "
            "leave the choice to a store of one array)")


def _store_member(split: RoundSplit, inputs: list) -> tuple:
    """(the client's inputs' struct type, serialized; the stored array of each tensor,
    depth first), made once per split and keys."""
    import federated_language

    key = tuple(None if v.keys is None else tuple(v.keys) for v in inputs)
    found = split.store_members.get(key)
    if found is None:
        keys = [k for t, v in zip(split.input_types, inputs)
                for k in population.default_keys(t, v.keys)]
        member_type = federated_language.StructType([(None, t) for t in split.input_types])
        found = (member_type.to_proto().SerializeToString(deterministic=True), keys)
        if len(split.store_members) < 64:  # a few key spellings per split, not a leak
            split.store_members[key] = found
    return found


class _Members(Sequence):
    """Client i's inputs as one Struct, made when asked for (nothing per client is kept)."""

    def __init__(self, inputs: list):
        self._inputs = inputs

    def __len__(self) -> int:
        return len(self._inputs[0])

    def __getitem__(self, i):
        return structure.Struct([(None, column[i]) for column in self._inputs])


def _round_messages(head: pb.RoundRequest, messages: Iterator,
                    broadcast: Optional[tuple] = None) -> Iterator:
    """`messages` (Put requests) as Round requests, the first of them `head` itself.
    `broadcast`: (the head's `broadcast` field serialized, its payload bytes), made once
    for every device and appended to the head's bytes (`Serialized`), so the broadcast
    is neither copied into each device's head nor serialized again for it."""
    for put in messages:
        first = head is not None
        message, head = (pb.RoundRequest() if head is None else head), None
        if put.HasField("from_store"):
            message.from_store.CopyFrom(put.from_store)
        else:
            message.values.extend(put.values)
        if first and broadcast is not None:
            yield Serialized(message.SerializeToString() + broadcast[0],
                             put_messages.payload_bytes(message) + broadcast[1])
        else:
            yield message


def _streams(backend, split: RoundSplit, inputs: list, layout, head_of,
             broadcasts: Optional[dict] = None) -> dict:
    """Each device's request stream: its head (with `broadcasts[index]`, see
    `_round_messages`), then its clients (made as gRPC asks)."""
    out, broadcasts = {}, broadcasts or {}
    if isinstance(inputs[0], PopulationRef):
        ref = inputs[0]
        type_bytes, keys = _store_member(split, inputs)
        _, size, _ = backend.population_info(ref)
        ids = np.asarray(ref.client_ids, dtype=np.int64).reshape(-1)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= size):
            raise FleetError(f"a client id is out of range for the devices' population of "
                             f"{size} clients")
        for index, clients in layout:
            reads = put_messages.store_reads(0, ids[clients.start:clients.stop],
                                             clients.start, type_bytes, keys, ref.name or "")
            out[index] = put_messages.stream(
                _round_messages(head_of(index), iter(reads), broadcasts.get(index)), "Round")
        return out
    members = _Members(inputs)
    for index, clients in layout:
        puts = put_messages.client_values(0, clients, members, backend.message_bytes)
        out[index] = put_messages.stream(
            _round_messages(head_of(index), puts, broadcasts.get(index)), "Round")
    return out


class GrpcTransport:
    """The devices of a `GrpcClientsBackend` as an `engine.Transport` (module docstring).

    `arg`: the round's parameter value (its CLIENTS inputs: values, or `PopulationRef`s
    naming the cohort's ids); `num_clients`: how many (the round plan's participants,
    counted once by the caller); `delays`: each client's emulated delay, in client order
    (a device waits for its slowest client's); `client_runtime`: the name of the client
    runtime the devices must answer with (`RoundResponse.client_runtime`), None to take
    any; `served` (the round report's) gets, for each device that answers, the client
    runtime and LiteRT model its answer names (`client_runtime.served`), keyed by the
    device's address.
    """

    def __init__(self, backend, split: RoundSplit, arg: Any, num_clients: int,
                 delays: Optional[np.ndarray] = None, client_runtime: Optional[str] = None,
                 ids: Optional[np.ndarray] = None, served: Optional[dict] = None):
        self.backend = backend
        self.served = {} if served is None else served
        self.ids = ids  # the round's clients' population ids, in client order
        self.client_runtime = client_runtime
        self.inputs = [arg[i] for i in split.client_inputs]
        self.num_clients = num_clients
        self.delays = delays
        self.reject_nonfinite = backend.reject_nonfinite
        self.rounded_partials = backend.rounded_partials
        self.traffic = backend.traffic
        self._answer_segments: list = []  # (device address, name, mapped Segment)

    def run_clients(self, split: RoundSplit, sent: structure.Struct) -> Answers:
        backend = self.backend
        layout = backend.layout(self.num_clients)
        key = backend.ensure_loaded(split.client_part, [d for d, _ in layout],
                                    split.client_part_hash)
        shared = backend.shared_memory
        sharing = {d for d, _ in layout if backend.shares_memory(d)}
        segments = {}  # device index -> its answer segment's (name, generation)
        ok = False
        try:
            answers = self._run(split, sent, layout, key, shared, sharing, segments)
            ok = True
            return answers
        finally:  # the mapped answers' segments wait for `end_round`
            mapped = {name for _, name, _ in self._answer_segments}
            for name, _ in segments.values():
                if not (ok and name in mapped):
                    shared.unlink(name)

    def end_round(self, ok: bool) -> None:
        """After the engine's round (`ok`: it ended well): each answer segment read in it
        is kept for its device's next answer where nothing read from it is alive any
        more, else removed."""
        shared = self.backend.shared_memory
        answers, self._answer_segments = self._answer_segments, []
        for address, name, segment in answers:
            if ok and segment.close():
                shared.keep(address, name)
            else:
                shared.unlink(name)

    def _run(self, split: RoundSplit, sent: structure.Struct, layout, key: str,
             shared, sharing: set, segments: dict) -> Answers:
        """`run_clients` once the client part is loaded; `segments` collects the names of
        the segments made for the round (the caller removes them)."""
        backend, delays = self.backend, self.delays
        blocks = dict(layout)
        value = structure.Struct([(None, as_numpy(v)) for v in sent])
        broadcasts, segment_ref = {}, None
        if sharing:
            writer = shared_memory.Writer()
            encoded = wire.to_message(value, writer)
            if writer.length:
                name, generation = shared.new_name("b")
                segments[-1] = (name, generation)
                try:
                    segment_ref = writer.write(shared, name, generation)
                except OSError as e:
                    raise FleetError(
                        f"cannot write the broadcast's shared-memory segment in "
                        f"{shared.path}: {e.strerror}; free memory there, or start the "
                        "fleet with shared_memory=False") from None
            broadcast = _broadcast_field(encoded)
            broadcasts.update((d, broadcast) for d in sharing)
        if len(sharing) < len(layout):
            broadcast = _broadcast_field(wire.to_message(value))
            broadcasts.update((d, broadcast) for d, _ in layout if d not in sharing)
        del value
        specs = []
        for agg in split.aggregations:
            spec = pb.RoundAggregation(kind=partials.KIND_TO_ENUM[agg.kind],
                                       value_index=agg.value_index)
            if agg.weight_index is not None:
                spec.weight_index = agg.weight_index
            if agg.secure:
                wire.encode_value(as_numpy(agg.bound), spec.bound)
            specs.append(spec)
        longest = 0.0

        def head_of(index: int) -> pb.RoundRequest:
            nonlocal longest
            clients = blocks[index]
            delay = 0.0
            if delays is not None:
                mine = delays[clients.start:min(clients.stop, len(delays))]
                delay = float(mine.max()) if mine.size else 0.0
            longest = max(longest, delay)
            head = pb.RoundRequest(computation_hash=key, aggregations=specs,
                                   delay_seconds=delay,
                                   rounded_partials=backend.rounded_partials)
            if index in sharing:
                if segment_ref is not None:
                    head.broadcast_segment.CopyFrom(segment_ref)
                name, generation = shared.new_name("a")
                name = shared.kept(backend.addresses[index]) or name
                segments[index] = (name, generation)
                head.answer_segment.name, head.answer_segment.generation = name, generation
            return head

        streams = _streams(backend, split, self.inputs, layout, head_of, broadcasts)
        answers = backend.call_each("Round", streams,
                                    timeout=backend.rpc_timeout_s + longest, once="RoundOnce")
        out = Answers([])
        for index, clients in layout:  # device order is client order
            answer = answers[index]
            where = f"device {index} at {backend.addresses[index]}"
            if self.client_runtime is not None and \
                    answer.client_runtime != self.client_runtime:
                raise FleetError(
                    f"{where} ran the client part with client runtime "
                    f"{answer.client_runtime or 'unnamed'!r}, but this fleet runs client "
                    f"parts with {self.client_runtime!r}; start its devices with "
                    f"--client-runtime {self.client_runtime}")
            ids = None if self.ids is None else self.ids[clients.start:clients.stop]
            try:
                out.answered.append(self._answer(split, answer, index, clients, where,
                                                 sharing, segments, segment_ref, ids))
            except FleetError as e:  # an answer no honest device sends: it leaves
                if ids is None:
                    raise
                out.lost.append(LostHolder(f"{e} (an impossible answer)", ids,
                                           refused=True))
        return out

    def _answer(self, split: RoundSplit, answer, index: int, clients, where: str,
                sharing: set, segments: dict, segment_ref, ids) -> HolderAnswer:
        """Device `index`'s answer as a `HolderAnswer` (its partials viewed in its answer
        segment, if any); FleetError naming it when the answer is for other clients or
        aggregations than it was sent, or names a segment it was not given."""
        backend, shared = self.backend, self.backend.shared_memory
        if answer.num_clients != len(clients) or \
                len(answer.partials) != len(split.aggregations):
            raise FleetError(
                f"{where} answered a round for {answer.num_clients} clients with "
                f"{len(answer.partials)} partials; it was sent {len(clients)} clients "
                f"and {len(split.aggregations)} aggregations")
        digest = answer.model_sha256
        if (answer.client_runtime == "litert") != bool(digest) or \
                (digest and not _SHA256.fullmatch(digest)):
            raise FleetError(
                f"{where} answered as client runtime {answer.client_runtime or 'unnamed'!r} "
                f"with LiteRT model sha256 {digest[:80]!r}: a LiteRT answer names its "
                "model's sha256 (64 lowercase hex digits), any other none")
        segment = None
        if answer.HasField("segment"):
            if index not in sharing:
                raise FleetError(f"{where} answered through shared-memory segment "
                                 f"{answer.segment.name[:40]!r}, which it was not asked "
                                 "to use")
            segment = shared_memory.open_segment(shared, answer.segment, where,
                                                 expect=segments[index])
            self._answer_segments.append((backend.addresses[index],
                                          segments[index][0], segment))
            self.traffic.shared_up += segment.length
        if index in sharing and segment_ref is not None:
            self.traffic.shared_down += segment_ref.length
        self.served[backend.addresses[index]] = runtimes.served(
            answer.client_runtime or "xla", digest)
        return HolderAnswer(
            where, len(clients),
            [shared_memory.view_partial(p, segment, where) for p in answer.partials],
            answer.compute_seconds, clients=ids)


def _broadcast_field(encoded: pb.Value) -> tuple:
    """(The request's `broadcast` field holding `encoded`, serialized; its payload bytes),
    made once for every device it goes to and appended to each head's bytes."""
    return (wire.message_field(pb.RoundRequest.BROADCAST_FIELD_NUMBER,
                               encoded.SerializeToString()), wire.payload_bytes(encoded))
