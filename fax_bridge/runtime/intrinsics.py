"""What each intrinsic of federated_language means in a placed computation: the
evaluator's placed intrinsic table (`PLACED`), over a clients backend.

`IMPLEMENTATIONS` is keyed by federated_language's `intrinsic_defs`; each implementation
is called as `impl(it, type_signature, argument, uri)`, where `it` is the running
evaluation (`interpreter.Run`): its `backend` (where CLIENTS values live),
`clients(what)` (the number of clients), `call(fn, arg)`, `closed_proto(fn, what)` (a
function as a proto to send to the clients) and `local_arg(value, what)` (a value checked
to be SERVER-placed or unplaced). `PLACED` gives the evaluator (`runtime/evaluator.py`)
these meanings by URI, `generic_zero` (placed values' zeros), and the meanings of `Data`
computations (inputs named by URI) and `Placement` literals; its nodes find the running
evaluation in their environment under `evaluator.RUN`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import federated_language
from federated_language.common_libs import structure
from federated_language.compiler import intrinsic_defs
from federated_language.proto import computation_pb2

from fax_bridge.errors import ComputationError
from fax_bridge.language.primitive_facts import AGGREGATION_KINDS, SECURE_KINDS
from fax_bridge.runtime import aggregation, evaluator, local_eval
from fax_bridge.runtime.backend import ClientsValue

Computation = computation_pb2.Computation


def is_clients(type_) -> bool:
    """Whether `type_` is placed at CLIENTS (all-equal or not)."""
    return (isinstance(type_, federated_language.FederatedType)
            and type_.placement is federated_language.CLIENTS)


def _elements(arg, n: int, uri: str) -> list:
    if not isinstance(arg, structure.Struct) or len(arg) != n:
        raise ComputationError(f"`{uri}` takes a struct of {n} arguments")
    return list(arg)


def _clients_arg(value, uri: str) -> ClientsValue:
    if not isinstance(value, ClientsValue):
        raise ComputationError(
            f"`{uri}` needs a CLIENTS-placed value, got {type(value).__name__}")
    return value


def _broadcast(it, t, arg, uri: str):
    return it.backend.broadcast(t.result.member, it.local_arg(arg, uri), it.clients(uri))


def _identity_local(it, t, arg, uri: str):
    return it.local_arg(arg, uri)


def _eval_at_server(it, t, arg, uri: str):
    return it.call(arg, None, has_arg=False)


def _eval_at_clients(it, t, arg, uri: str):
    proto = it.closed_proto(arg, uri)
    fn_type = t.parameter
    seed = it.backend.broadcast(federated_language.StructType([]), structure.Struct([]),
                                it.clients(uri))
    return it.backend.map(proto, fn_type, seed)


def _map(it, t, arg, uri: str):
    fn, value = _elements(arg, 2, uri)
    value_type = t.parameter[1]
    if is_clients(value_type):
        proto = it.closed_proto(fn, uri)
        return it.backend.map(proto, t.parameter[0], _clients_arg(value, uri))
    return it.call(fn, it.local_arg(value, uri))


def _apply(it, t, arg, uri: str):
    fn, value = _elements(arg, 2, uri)
    return it.call(fn, it.local_arg(value, uri))


def _aggregation(kind: str):
    def impl(it, t, arg, uri: str):
        return it.backend.aggregate(_clients_arg(arg, uri), kind)
    return impl


def _weighted_mean(it, t, arg, uri: str):
    value, weight = _elements(arg, 2, uri)
    return it.backend.aggregate(_clients_arg(value, uri), "weighted_mean",
                                weights=_clients_arg(weight, uri))


def _tensor_dtypes(type_) -> list:
    """The dtypes of a local type's tensors, depth first."""
    if isinstance(type_, federated_language.StructType):
        return [d for _, t in type_.items() for d in _tensor_dtypes(t)]
    if isinstance(type_, federated_language.TensorType):
        return [type_.dtype]
    raise ComputationError(f"a clients member of type {type_} is neither a tensor nor a struct")


def _secure(kind: str):
    """A secure sum: its bound checked against the clients and the dtypes (no value may
    wrap the sum), then each client's values against the bound by the backend."""
    def impl(it, t, arg, uri: str):
        value, bound = _elements(arg, 2, uri)
        value, bound = _clients_arg(value, uri), it.local_arg(bound, uri)
        aggregation.check_secure_fits(kind, bound, _tensor_dtypes(value.type_signature),
                                      value.num_clients)
        return it.backend.aggregate(value, kind, bitwidth=bound)
    return impl


def _zip_at_clients(it, t, arg, uri: str):
    """Zips a (possibly nested) struct of CLIENTS values, innermost structs first."""

    def zip_struct(value):
        if isinstance(value, ClientsValue):
            return value
        if not isinstance(value, structure.Struct):
            raise ComputationError(
                f"`{uri}` takes a struct of CLIENTS values, got {type(value).__name__}")
        if len(value) == 0:
            return it.backend.broadcast(federated_language.StructType([]),
                                        structure.Struct([]), it.clients(uri))
        return it.backend.zip([zip_struct(v) for v in value],
                              structure.name_list_with_nones(value))

    if not isinstance(arg, structure.Struct):
        raise ComputationError(f"`{uri}` takes a struct of CLIENTS values")
    return zip_struct(arg)


def _zip_at_server(it, t, arg, uri: str):
    if not isinstance(arg, structure.Struct):
        raise ComputationError(f"`{uri}` takes a struct of SERVER values")
    return it.local_arg(arg, uri)


def _aggregate(it, t, arg, uri: str):
    value, zero, accumulate, merge, report = _elements(arg, 5, uri)
    members = it.backend.get(_clients_arg(value, uri))
    acc = it.local_arg(zero, uri)
    for member in members:  # one group in client order: merge is never needed
        acc = it.call(accumulate, structure.Struct([(None, acc), (None, member)]))
    return it.call(report, acc)


def _generic(it, t, arg, uri: str):
    a, b = _elements(arg, 2, uri)
    result_type = t.result
    if is_clients(result_type):
        member = result_type.member
        member_fn = Computation(
            type=federated_language.FunctionType([member, member], member).to_proto(),
            intrinsic=computation_pb2.Intrinsic(uri=uri))
        zipped = it.backend.zip([_clients_arg(a, uri), _clients_arg(b, uri)],
                                [None, None])
        return it.backend.map(member_fn, local_eval.parse_type(member_fn.type), zipped)
    local_type = (result_type.member
                  if isinstance(result_type, federated_language.FederatedType)
                  else result_type)
    fn = local_eval.make_generic_binary(local_eval.GENERIC_BINARY[uri], local_type, uri)
    return fn(structure.Struct([(None, it.local_arg(a, uri)), (None, it.local_arg(b, uri))]))


# What the runtime does for each intrinsic of federated_language it supports.
IMPLEMENTATIONS: dict[intrinsic_defs.IntrinsicDef, Callable] = {
    intrinsic_defs.FEDERATED_BROADCAST: _broadcast,
    intrinsic_defs.FEDERATED_VALUE_AT_CLIENTS: _broadcast,
    intrinsic_defs.FEDERATED_VALUE_AT_SERVER: _identity_local,
    intrinsic_defs.FEDERATED_EVAL_AT_SERVER: _eval_at_server,
    intrinsic_defs.FEDERATED_EVAL_AT_CLIENTS: _eval_at_clients,
    intrinsic_defs.FEDERATED_MAP: _map,
    intrinsic_defs.FEDERATED_MAP_ALL_EQUAL: _map,
    intrinsic_defs.FEDERATED_APPLY: _apply,
    # every aggregation by its kind (`primitive_facts.AGGREGATION_KINDS`)
    **{d: (_weighted_mean if kind == "weighted_mean" else
           _secure(kind) if kind in SECURE_KINDS else _aggregation(kind))
       for d, kind in AGGREGATION_KINDS.items()},
    intrinsic_defs.FEDERATED_ZIP_AT_CLIENTS: _zip_at_clients,
    intrinsic_defs.FEDERATED_ZIP_AT_SERVER: _zip_at_server,
    intrinsic_defs.FEDERATED_AGGREGATE: _aggregate,
    intrinsic_defs.GENERIC_PLUS: _generic,
    intrinsic_defs.GENERIC_MULTIPLY: _generic,
    intrinsic_defs.GENERIC_DIVIDE: _generic,
}
BY_URI = {definition.uri: impl for definition, impl in IMPLEMENTATIONS.items()}

SUPPORTED_INTRINSICS = tuple(sorted([*BY_URI, local_eval.GENERIC_ZERO]))


@dataclasses.dataclass(frozen=True)
class PlacementValue:
    """The value of a `Placement` computation: its URI."""

    uri: str


def _placed(impl: Callable):
    """The node builder of an intrinsic implemented by `impl`: its value calls `impl` in
    the running evaluation, on the argument rebuilt along the declared parameter type."""

    def build(comp, type_):
        uri = comp.intrinsic.uri
        if not isinstance(type_, federated_language.FunctionType):
            raise ComputationError(f"intrinsic `{uri}` has non-functional type {type_}")
        parameter = type_.parameter

        def node(env):
            it = env[evaluator.RUN]

            def call(*arg):
                value = arg[0] if arg else None
                if arg and parameter is not None:
                    value = it.conform(value, parameter, f"`{uri}`")
                return impl(it, type_, value, uri)

            return evaluator.IntrinsicFunction(uri, type_, call)

        return node

    return build


def _zero(comp, type_):
    return lambda env: env[evaluator.RUN].zero(type_)


def _data(comp):
    if comp.data.WhichOneof("data") != "uri":
        raise ComputationError(
            "only Data computations that name an input by uri are supported (this one "
            "holds inline content); pass the value with evaluate(..., data={uri: value})")
    uri, type_ = comp.data.uri, local_eval.parse_type(comp.type)
    return lambda env: env[evaluator.RUN].data_value(uri, type_)


def _placement(comp):
    value = PlacementValue(comp.placement.uri)
    return lambda env: value


def _local_guard(arg) -> None:
    if evaluator.has_leaf(arg, (ClientsValue,) + evaluator.FUNCTION_VALUES):
        raise ComputationError(
            "a local computation was called on a federated or functional value; use "
            "federated_map/federated_apply to run it at a placement")


PLACED = evaluator.IntrinsicTable(
    name="the computation",
    intrinsics={local_eval.GENERIC_ZERO: _zero,
                **{uri: _placed(impl) for uri, impl in BY_URI.items()}},
    refusal=lambda uri: (f"unknown or unsupported intrinsic `{uri}`; supported: "
                         f"{', '.join(SUPPORTED_INTRINSICS)}"),
    typed=True, data=_data, placement=_placement, defer_xla=True,
    local_guard=_local_guard)
