"""Rounds of several trips in LiteRT: each trip's client computation a model of its own.

A round whose clients are asked more than once (a broadcast of a value computed from an
aggregate: the learned server learning rate's evaluation and hypergradient trips,
federated AD's backward trip) or that keeps state at the clients has no single client
part (`round_split.why_not_split`); it runs phase by phase, and each federated map of a
CLIENTS value (`round_split.client_maps`) is what every client computes in one trip. A
LiteRT runtime runs each such map as a model of its own, keyed by the map function's
content hash (`model_of`), its tensors named by their paths in the map's types
(`tensor_names.client_map_names`: the element names they carry, else indices):

  inputs   `client/<path>`: the leaves of the map's argument, which holds what the
           server broadcast in this trip, the client's data, its state (a CLIENTS
           argument of the round) and what an earlier trip left at the client
           (federated AD's residuals), zipped as the round zips them (`client/0/b`,
           `client/1/x`, `client/2`: a zip's elements carry no names);
  outputs  `result/<path>`: the leaves of the map's result, which the round aggregates,
           keeps at the client for a later trip, or returns as the client's new state.

The names come from the map alone, so every device and check names one map's model
alike.

So client state and values carried between trips travel as a model's inputs and
outputs; nothing but the interpreter's zips and selections sits between two models. A
map that only selects or regroups values (`ClientMap.computes` False: reading a model's
named outputs on a phone) runs no model. `convert_round(proto)` converts every trip's
model before any client work (what `LiteRTClientRuntime.check_round` does for a round
with no split), refusing one LiteRT cannot run by its local and trip.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import federated_language
from federated_language.common_libs import structure
from federated_language.proto import computation_pb2

from fax_bridge.errors import ComputationError
from fax_bridge.litert import carried, convert, lowering, tensor_names
from fax_bridge.rounds import round_split
from fax_bridge.runtime import local_eval
from fax_bridge.runtime.backend import as_numpy
from fax_bridge.runtime.grammar import lambda_of, make_reference, make_selection

_X = "__map_x"  # the wrapped map's parameter: <<>, <the map's argument>>


def _wrapped(fn: computation_pb2.Computation) -> tuple:
    """(the map as a client part of no broadcasts, its parameter type, its result type):
    `x -> <fn(x[1][0])>`, whose leaves are the map's argument's and result's, in order
    (`model_of` names them)."""
    fn_type = local_eval.parse_type(fn.type)
    if not isinstance(fn_type, federated_language.FunctionType):
        raise ComputationError(f"a client map of type {fn_type}, not a function")
    inner = fn_type.parameter
    param = federated_language.StructType([
        federated_language.StructType([]),
        federated_language.StructType([] if inner is None else [(None, inner)])])
    result = federated_language.StructType([(None, fn_type.result)])
    part = computation_pb2.Computation()
    lambda_of(part).parameter_name = _X
    call = computation_pb2.Computation()
    call.call.function.CopyFrom(fn)
    if inner is not None:
        call.call.argument.CopyFrom(make_selection(make_selection(make_reference(_X), 1), 0))
    lambda_of(part).result.struct.element.add().value.CopyFrom(call)
    return part, param, result


def model_of(fn: computation_pb2.Computation, key: Optional[str] = None,
             models: Optional[str] = None) -> convert.ClientModel:
    """The LiteRT model of client map `fn` (content hash `key`): carried in `models`
    where that directory holds one of this hash (named as its manifest names it), else
    converted (`convert`) with its tensors named by path (module docstring)."""
    key = key or local_eval.content_hash(fn)
    part, param, result = _wrapped(fn)
    if models and key in carried.versions(models):
        found = carried.find(models, key, lowering.client_signature(param, result))
        if found is not None:
            return found
    names = tensor_names.client_map_names(local_eval.parse_type(fn.type))
    return convert.convert_client_part(part, param, result, key=key, names=names)


def map_clients(fn: computation_pb2.Computation, members: Any, load: Callable,
                key: Optional[str] = None, no_argument: bool = False, guard: Any = None,
                models: Optional[str] = None) -> list:
    """`client_map.map_clients` with the map run by the LiteRT interpreter, one client at
    a time (module docstring): one local value per client, in client order. `load`:
    the process's loaded runner of a model (`runner.runner_for`)."""
    if not len(members):
        return []
    if not round_split.computes(fn):
        run = local_eval.compile_local(fn)
        return [as_numpy(run() if no_argument else run(m)) for m in members]
    model = model_of(fn, key, models)
    model_runner = load(model)
    param, result = (model.signature_types.parameter[1],
                     model.signature_types.result[0])
    out, produced = [], 0
    for i, member in enumerate(members):
        if guard is not None:
            guard.tick()
        leaves = [] if no_argument else lowering.flatten(
            structure.Struct([(None, member)]), param, [])
        value = lowering.build(result, iter(model_runner(leaves, where=f"client {i}")))
        if guard is not None:
            produced += guard.size(value)
            guard.room(produced)
        out.append(value)
    return out


def convert_round(proto: computation_pb2.Computation,
                  models: Optional[str] = None) -> list:
    """[(ClientMap, its model or None where it computes nothing)] of every client map of
    a round run phase by phase, each converted (or found carried) once, before any
    client work; a map LiteRT cannot run is refused naming its local and trip."""
    out = []
    for m in round_split.client_maps(proto):
        if not m.computes:
            out.append((m, None))
            continue
        try:
            out.append((m, model_of(m.fn, m.key, models)))
        except ComputationError as e:
            e.args = (f"the client computation of trip {m.trip} ({m.local}): {e}",)
            raise
    return out


__all__ = ["convert_round", "map_clients", "model_of"]
