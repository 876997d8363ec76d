"""Round splits: a computation of the round shape split once into its pieces.

A computation exported by fax_bridge is a Lambda whose body is one Block of locals,
each a call of an intrinsic (or a selection of the parameter). When every CLIENTS
local is an argument, a broadcast, a per-client map or a zip, and every value that
leaves the clients is one aggregation (sum, mean, weighted mean, min, max) whose
inputs never depend on another aggregation's result, the round is

  server prepare   the SERVER locals that do not depend on an aggregate (coordinator);
  client part      ONE local computation  <broadcast values, client inputs> ->
                   <aggregand_0, weight_0?, aggregand_1, ...>  (run over the clients
                   by `runtime.client_map`: one XLA call for all of them where it can);
  aggregations     the kind of each aggregate and where its aggregand (and weights)
                   sit in the client part's result;
  server result    the remaining SERVER locals and the Block's result (coordinator).

With `secure=True` (`split_of`, which every path that runs rounds calls) a secure sum
(`federated_secure_sum_bitwidth`, `federated_secure_sum`) whose bound is a literal is
one more aggregation (`Aggregation.secure`), its bound kept with it: Flower sums it
through SecAgg+ (`flower/secagg.py`), the fleet and the in-process transport exactly,
as the other sums.

`split_round` returns None for every other computation (it keeps the phase-by-phase
path); `why_not_split` says why, naming the local that stops it. `engine.run_round`
runs a split over any transport (in process, the device fleet, Flower's SuperNodes).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Optional, Union

import federated_language
import numpy as np
from federated_language.compiler import intrinsic_defs as defs
from federated_language.proto import computation_pb2

from fax_bridge.errors import ComputationError
from fax_bridge.language.primitive_facts import KIND_OF_URI, SECURE_KINDS
from fax_bridge.runtime import aggregation, client_map, device_sums, local_eval
from fax_bridge.runtime.grammar import (free_references, intrinsic_call, lambda_of,
                                        make_reference, make_selection, reference_name,
                                        struct_elements, walk, which)
from fax_bridge.runtime.local_eval import select_element

Computation = computation_pb2.Computation

# The aggregations by kind (`primitive_facts.AGGREGATION_KINDS`). Secure sums are split
# only where asked (`split_round(secure=True)`: a Flower round, whose SecAgg+ phase sums
# them); their bound is a literal of the intrinsic's argument.
_AGGREGATIONS = {uri: kind for uri, kind in KIND_OF_URI.items() if kind not in SECURE_KINDS}
_SECURE = {uri: kind for uri, kind in KIND_OF_URI.items() if kind in SECURE_KINDS}
_BROADCAST = defs.FEDERATED_BROADCAST.uri
_MAP = defs.FEDERATED_MAP.uri
_ZIP = defs.FEDERATED_ZIP_AT_CLIENTS.uri
_EVAL = defs.FEDERATED_EVAL_AT_CLIENTS.uri  # a map of no operands: a call of no argument
_X = "__split_x"  # the client part's parameter


class Unsplit(ComputationError):
    """A round with no single client part, where one is needed (`refuse_unsplit`)."""


@dataclasses.dataclass(frozen=True)
class Aggregation:
    """One aggregate local: its kind and where its inputs sit in the client result."""

    local: str
    kind: str
    value_index: int
    weight_index: Optional[int]
    member_type: federated_language.Type
    weight_type: Optional[federated_language.Type] = None
    bound: Any = None  # a secure sum's bitwidth or max_input (a numpy scalar)

    @property
    def spec(self) -> tuple:
        """(kind, value index, weight index, bound), as `client_partials` takes it."""
        return self.kind, self.value_index, self.weight_index, self.bound

    @property
    def secure(self) -> bool:
        """A secure sum (`SECURE_KINDS`): only a `split_round(secure=True)` holds one."""
        return self.kind in SECURE_KINDS

    @functools.cached_property
    def leaf_types(self) -> tuple[list, list]:
        """(the TensorTypes of the value, of the weight), depth first, as partials hold
        their leaves (worked out once: each round checks every device's partials)."""
        from fax_bridge.rounds.validate import leaf_types

        weights = leaf_types(self.weight_type) if self.weight_type is not None else []
        return leaf_types(self.member_type), weights


@dataclasses.dataclass
class RoundSplit:
    """A round computation split at its communication points (module docstring)."""

    proto: Computation
    parameter_name: str
    server_locals: list          # [(name, Computation)] in block order
    prepare_names: frozenset     # server locals that do not depend on an aggregate
    broadcasts: list             # names of the server locals each broadcast sends
    client_inputs: list          # parameter indices of the CLIENTS arguments
    input_types: list            # their member types
    client_part: Computation     # Lambda <broadcasts, inputs> -> <aggregands...>
    aggregations: list           # [Aggregation]
    result: Computation          # the Block's result (SERVER)
    client_part_hash: str = ""
    # (serialized member type, stored array of each tensor) by the inputs' keys, made
    # once for rounds that read the devices' population (`grpc_transport`)
    store_members: dict = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.client_part_hash = local_eval.content_hash(self.client_part)

    @functools.cached_property
    def server_program(self):
        """The server prepare and result compiled once (`server_steps.compile_server`),
        or None where they keep the interpreter."""
        from fax_bridge.rounds.server_steps import compile_server

        return compile_server(self)


def _type(comp: Computation):
    return local_eval.parse_type(comp.type)


def _is_clients(type_) -> bool:
    return (isinstance(type_, federated_language.FederatedType)
            and type_.placement is federated_language.CLIENTS)


def _struct(items: list) -> Computation:
    out = Computation()
    for item in items:
        out.struct.element.add().value.CopyFrom(item)
    return out


_MADE: dict = {}  # id(proto) -> (proto, its split or None), for the last few protos run
_KEPT = 16


def split_of(proto: Computation) -> Optional[RoundSplit]:
    """`split_round(proto, secure=True)`, made once per proto object (the last `_KEPT`
    are kept): what every path that runs rounds by split calls."""
    key = id(proto)
    hit = _MADE.get(key)
    if hit is None or hit[0] is not proto:
        hit = (proto, split_round(proto, secure=True))
        if len(_MADE) >= _KEPT:
            _MADE.pop(next(iter(_MADE)))
        _MADE[key] = hit
    return hit[1]


def split_round(proto: Computation, secure: bool = False) -> Optional[RoundSplit]:
    """The split of a round-shaped computation, or None (module docstring). `secure`:
    secure sums whose bound is a literal are aggregations too (kinds `SECURE_KINDS`,
    their `bound` kept)."""
    made = _split(proto, secure)
    return made if isinstance(made, RoundSplit) else None


def why_not_split(proto: Computation, secure: bool = True) -> Optional[str]:
    """Why `split_round(proto, secure)` is None, in words naming the local that stops it
    (None when the computation splits)."""
    made = _split(proto, secure)
    return None if isinstance(made, RoundSplit) else made


def refuse_unsplit(what: str, proto: Computation) -> None:
    """Raises `Unsplit` for a round with no single client part, where `what` (a sentence
    naming the consumer and what it takes) needs one, naming the local that stops the
    split (`why_not_split`) and where such a round runs instead."""
    why = why_not_split(proto) or (
        "its CLIENTS inputs are not given (no CLIENTS argument, or only num_clients=)")
    raise Unsplit(
        f"{what} takes a round of the form broadcast -> one client part -> aggregations, "
        f"and this computation has no single client part: {why}. It runs phase by phase, "
        "each trip's client computation a LiteRT model of its own, on a fleet "
        "(LocalFleet(client_runtime=\"litert\")) or in process "
        "(run_computation(..., client_runtime=\"litert\")); or write it so that what "
        "the clients compute is aggregated once")


@dataclasses.dataclass(frozen=True)
class ClientMap:
    """One computation a round runs on each client when it runs phase by phase
    (`client_maps`): a federated map (or eval at clients) of the round's body."""

    local: str          # the round's local it computes
    fn: Computation     # the function each client runs, self-contained
    key: str            # its content hash, which a holder loads it by
    trip: int           # 1 + the aggregations its inputs wait on (a round's trips)
    computes: bool      # False: it only selects and regroups values (no op to run)
    # the earlier trips whose client-computed values it reads: what each client keeps
    # from one trip to the next (federated AD's residuals, a worker's model)
    kept_from: tuple = ()

    @property
    def fn_type(self):
        return _type(self.fn)


_MOVES_ONLY = frozenset(("reference", "selection", "struct", "lambda", "block", "call",
                         "literal"))


def computes(fn: Computation) -> bool:
    """Whether the local function `fn` runs any op: False where it only selects, regroups
    and calls functions that do the same (a client reads such a result off another's)."""
    return any(which(c) not in _MOVES_ONLY for c in walk(fn))


def client_maps(proto: Computation) -> list:
    """The client computations of a round run phase by phase, in body order: each
    federated map of a CLIENTS value and each eval at clients whose function is
    self-contained (a function that reads values around it is closed over them at run
    time, and met there), with the trip it runs in: trip 1 reads only the parameter and
    what the server computes from it, trip k + 1 reads a value computed from the
    aggregate of a trip-k map (a broadcast of it, or client values that waited for it);
    `kept_from`: the earlier trips whose maps computed client values it reads. Empty for
    what is not a function."""
    if which(proto) != "lambda" or not lambda_of(proto).parameter_name:
        return []
    body = _flattened(lambda_of(proto).result, lambda_of(proto).parameter_name)
    level: dict = {}    # local -> aggregations on the longest path into it
    clients: set = set()
    made: dict = {}     # CLIENTS local -> the trips of the maps whose results it holds
    out = []
    for local in body.block.local:
        name, value = local.name, local.value
        type_ = _type(value)
        refs = set(free_references(value))
        base = max((level[r] for r in refs if r in level), default=0)
        placed = _is_clients(type_)
        if placed:
            clients.add(name)
            made[name] = set().union(*(made[r] for r in refs if r in made))
        level[name] = base + 1 if not placed and refs & clients else base
        call = intrinsic_call(value)
        if call is None or not placed or call[0] not in (_MAP, _EVAL):
            continue
        fn = call[1] if call[0] == _EVAL else (struct_elements(call[1], 2) or [None])[0]
        if fn is None or which(fn) not in ("lambda", "xla") or free_references(fn):
            continue
        kept = tuple(sorted(t for t in made[name] if t < base + 1))
        works = computes(fn)
        if works:  # a map that only selects holds the trips of what it selects from
            made[name] = {base + 1}
        out.append(ClientMap(name, fn, local_eval.content_hash(fn), base + 1, works, kept))
    return out


def _split(proto: Computation, secure: bool) -> Union[RoundSplit, str]:
    """`split_round`'s work: the split, or why there is none."""
    if which(proto) != "lambda":
        return "it is not a function (a Lambda)"
    lam = lambda_of(proto)
    param = lam.parameter_name
    if not param:
        return "its function has no parameter"
    body = _flattened(lam.result, param)
    client: dict = {}       # client local -> its translation in the client part
    client_order: list = []
    inputs: list = []       # parameter indices of CLIENTS arguments
    members: dict = {}      # client local -> its member type
    input_names: list = []
    broadcasts: list = []
    server: list = []
    aggregates: list = []   # (local, kind, value, weight or None, member type, bound)
    depends_on_agg: set = set()
    for local in body.block.local:
        name, value = local.name, local.value
        type_ = _type(value)
        refs = set(free_references(value))
        if _is_clients(type_):
            members[name] = type_.member
        if which(value) == "selection" and \
                reference_name(value.selection.source) == param:
            if _is_clients(type_):
                client[name] = make_selection(make_selection(make_reference(_X), 1), len(inputs))
                inputs.append(value.selection.index)
                input_names.append(name)
                client_order.append(name)
            else:
                server.append((name, value))
            continue
        call = intrinsic_call(value)
        uri, arg = call if call else (None, None)
        if uri in _AGGREGATIONS:
            kind = _AGGREGATIONS[uri]
            if kind == "weighted_mean":
                pair = struct_elements(arg, 2)
                if pair is None:
                    return f"{name}: a weighted mean whose value and weight are not a pair"
                v, w = (reference_name(e) for e in pair)
            else:
                v, w = reference_name(arg), None
            if v not in client or (kind == "weighted_mean" and w not in client):
                return (f"{name}: a {kind} of a value that is not a client local of the "
                        "round's one client part")
            aggregates.append((name, kind, v, w, type_.member, None))
            depends_on_agg.add(name)
            continue
        if secure and uri in _SECURE:
            pair = struct_elements(arg, 2)
            if pair is None or which(pair[1]) != "literal":
                return f"{name}: a secure sum whose bound is not a literal"
            v = reference_name(pair[0])
            if v not in client:
                return (f"{name}: a secure sum of a value that is not a client local of the "
                        "round's one client part")
            aggregates.append((name, _SECURE[uri], v, None, type_.member,
                               local_eval.read_literal(pair[1].literal)))
            depends_on_agg.add(name)
            continue
        if uri == _BROADCAST:
            src = reference_name(arg)
            if src is None or src in client or src in depends_on_agg:
                return (f"{name}: a broadcast of a value computed from an aggregate or from "
                        "client values (two trips), or of no plain server local")
            client[name] = make_selection(make_selection(make_reference(_X), 0), len(broadcasts))
            broadcasts.append(src)
            client_order.append(name)
            continue
        if uri in (_MAP, _ZIP) or _is_clients(type_):
            if uri == _EVAL:
                if arg is None or free_references(arg):
                    return (f"{name}: a federated_eval_at_clients of a function that reads "
                            "values around it")
                out = Computation()
                out.call.function.CopyFrom(arg)
            elif uri == _MAP:
                pair = struct_elements(arg, 2)
                if pair is None:
                    return f"{name}: a federated_map whose argument is not a pair"
                fn = pair[0]
                src = _translate_zip(pair[1], client)
                if src is None or free_references(fn):
                    return (f"{name}: a federated_map of a function that reads values around "
                            "it, or of a value that is not the clients' inputs or broadcasts")
                out = Computation()
                out.call.function.CopyFrom(fn)
                out.call.argument.CopyFrom(src)
            elif uri == _ZIP:
                out = _translate_zip(arg, client)
                if out is None:
                    return f"{name}: a federated_zip of values that are not client locals"
            else:
                return (f"{name}: {uri or which(value)} places values at CLIENTS (client-placed "
                        "state, or an intrinsic a round split does not take)")
            client[name] = out
            client_order.append(name)
            continue
        if refs & set(client) or param in refs:
            return f"{name}: a server step that reads client values or the whole argument"
        if refs & depends_on_agg:
            depends_on_agg.add(name)
        server.append((name, value))
    if not aggregates or not inputs and not broadcasts:
        return "it has no aggregation of client values, or no client inputs and no broadcasts"
    if set(free_references(body.block.result)) & set(client):
        return "its result holds client-placed values"
    # The client part: the client locals, then the struct of aggregands (and weights).
    part = Computation()
    lambda_of(part).parameter_name = _X
    block = lambda_of(part).result.block
    for name in client_order:
        entry = block.local.add()
        entry.name = name
        entry.value.CopyFrom(client[name])
    outs, aggs = [], []
    for name, kind, v, w, member, bound in aggregates:
        vi = len(outs)
        outs.append(make_reference(v))
        wi = None
        if w is not None:
            wi = len(outs)
            outs.append(make_reference(w))
        aggs.append(Aggregation(name, kind, vi, wi, member,
                                None if w is None else members[w], bound))
    block.result.CopyFrom(_struct(outs))
    prepare = frozenset(n for n, _ in server if n not in depends_on_agg)
    return RoundSplit(proto=proto, parameter_name=param, server_locals=server,
                prepare_names=prepare, broadcasts=broadcasts, client_inputs=inputs,
                input_types=[members[n] for n in input_names],
                client_part=part, aggregations=aggs, result=body.block.result)


def _flattened(body: Computation, param: str) -> Computation:
    """`body` as one Block whose locals are each one intrinsic call (its operands
    references or structs of them) or one selection from the parameter: nested calls
    are lifted into locals of their own, innermost first, keeping their types."""
    out = Computation()
    out.CopyFrom(body)
    block = Computation()
    names = iter(f"__split_{i}" for i in itertools.count())

    def lift(c: Computation) -> Computation:
        kind = which(c)
        if kind == "struct":
            new = Computation()
            new.CopyFrom(c)
            for element, old in zip(new.struct.element, c.struct.element):
                element.value.CopyFrom(lift(old.value))
            return new
        is_arg = kind == "selection" and reference_name(c.selection.source) == param
        if intrinsic_call(c) is None and not is_arg:
            return c  # references, functions, and what `split_round` then refuses
        name = next(names)
        add(name, c)
        ref = make_reference(name)
        ref.type.CopyFrom(c.type)
        return ref

    def add(name: str, c: Computation) -> None:
        value = Computation()
        value.CopyFrom(c)
        if intrinsic_call(c) is not None and c.call.HasField("argument"):
            value.call.argument.CopyFrom(lift(c.call.argument))
        entry = block.block.local.add()
        entry.name = name
        entry.value.CopyFrom(value)

    if which(out) == "block":
        for local in out.block.local:
            add(local.name, local.value)
        result = out.block.result
    else:
        result = out
    block.block.result.CopyFrom(lift(result))
    return block


def _translate_zip(arg: Optional[Computation], client: dict) -> Optional[Computation]:
    """A client local, or a zip of (nested structs of) them, as the same struct of
    references."""
    if arg is None:
        return None
    call = intrinsic_call(arg)
    if call is not None:
        return _translate_zip(call[1], client) if call[0] == _ZIP \
            else None
    kind = which(arg)
    if kind == "reference":
        return make_reference(arg.reference.name) if arg.reference.name in client else None
    if kind != "struct":
        return None
    out = Computation()
    for e in arg.struct.element:
        inner = _translate_zip(e.value, client)
        if inner is None:
            return None
        element = out.struct.element.add()
        if e.name:
            element.name = e.name
        element.value.CopyFrom(inner)
    return out


def client_partials(fn: Computation, key: str, sent: Any, members: Any,
                    specs: list, guard: Any = None, least_rows: int = 0,
                    on_device: bool = False) -> list:
    """The client part `fn` over the clients' `members` (one Struct of inputs each) with
    the broadcast values `sent`, aggregated: one exact partial per
    `(kind, value_index, weight_index or None[, bound])` of `specs` (the bound of a
    secure sum, `Aggregation.spec`), over the elements of the
    client part's result those indices select. Batched clients are aggregated from
    their stacked results (`client_map.map_clients_stacked`), others one by one; the
    partials are the same. `guard`: the caller's caps (`client_map.Guard`);
    `least_rows`: `client_map.map_clients_stacked`'s. This is the client part run as
    XLA (`client_runtime.XlaClientRuntime`); a holder runs it through the client runtime
    it was given (`rounds.client_runtime`). `on_device`: the batched results stay on the
    device, and the sums, means and weighted means of tensors it sums
    (`device_sums.supports`) are partials of them there (`aggregation.device_partial`);
    the other aggregations read them back to the host."""
    stacked = client_map.map_clients_stacked(fn, members, sent, key=key, guard=guard,
                                             keep=False, least_rows=least_rows,
                                             on_device=on_device)
    if stacked is not None:
        def pick(index: int) -> list:
            return stacked.element_parts(index)
    else:
        results = client_map.map_clients(fn, members, sent, key=key, guard=guard)

        def pick(index: int) -> list:
            return [select_element(r, index) for r in results]

    out = []
    for kind, vi, wi, *bound in specs:
        bound = bound[0] if bound else None
        try:
            values, weights = pick(vi), None if wi is None else pick(wi)
        except ComputationError as e:
            raise ComputationError(f"the aggregation inputs at {vi}"
                                   f"{'' if wi is None else f' and {wi}'} are not in the "
                                   f"client part's result: {e}") from None
        if stacked is None:
            out.append(aggregation.partial_of(kind, values, weights, bound))
            continue
        if on_device:
            out.append(_device_partial(kind, values, weights, bound, stacked.counts))
            continue
        # A partial per call of the batched run, merged in client order: the calls'
        # results are never joined into one stack (a copy as large as the results).
        partial = None
        for i, count in enumerate(stacked.counts):
            part = aggregation.partial_of_columns(
                kind, values[i], count, None if weights is None else weights[i], bound)
            partial = part if partial is None else aggregation.merge(partial, part)
        out.append(partial)
    return out


def _device_partial(kind: str, values: list, weights: Optional[list], bound: Any,
                    counts: list) -> Any:
    """The partial of one aggregation over the calls' results left on the device
    (`values[i]`, `weights[i]`: call i's leaves, whole buckets of rows): kept there where
    the device finishes it, else read back and made as the host makes it."""
    leaves = [leaf for part in values for leaf in part]
    if kind in device_sums.KINDS and all(device_sums.supports(leaf.dtype)
                                         for leaf in leaves) and (
            weights is None or all(len(part) == 1 for part in weights)):
        return aggregation.device_partial(
            kind, [list(column) for column in zip(*values)], counts,
            None if weights is None else [part[0] for part in weights])
    partial = None
    for i, count in enumerate(counts):
        def host(part: list) -> list:
            return [np.asarray(leaf)[:count] for leaf in part]

        part = aggregation.partial_of_columns(
            kind, host(values[i]), count, None if weights is None else host(weights[i]),
            bound)
        partial = part if partial is None else aggregation.merge(partial, part)
    return partial
