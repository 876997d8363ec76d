"""Interprets federated_language `Computation` protos on the coordinator.

The interpreter is the runtime's one evaluator of the grammar (`runtime/evaluator.py`)
with the placed intrinsic table (`intrinsics.PLACED`), a clients backend, and the checks
and conversions of values at its boundary (`values`). `evaluate(proto, arg)` compiles a
computation once (per `Prepared`) into nodes and runs them with a `Run`: unplaced and
SERVER-placed work runs in this process (Xla parts through `xla_function`); every
CLIENTS-placed operation goes to a `ClientsBackend` (broadcast, map, zip, aggregate,
get, put), so client values can live elsewhere. Runtime values: local values (numpy
arrays / `Struct`s) for unplaced and SERVER values, `ClientsValue` handles for CLIENTS
values, and the evaluator's function values.

At the boundary a CLIENTS value is a list with one member per client; `run_computation`
takes and returns python pytrees instead (CLIENTS leaves stacked on a leading axis).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Optional, Sequence, Union

import federated_language
import numpy as np
from federated_language.common_libs import structure
from federated_language.compiler import array as fl_array
from federated_language.proto import computation_pb2

from fax_bridge.errors import ClientCountError, ComputationError, FaxBridgeError
from fax_bridge.runtime import (declared_types, evaluator, grammar, intrinsics, limits,
                                local_eval, result_structure, values)
from fax_bridge.runtime.backend import ClientsBackend, ClientsValue
from fax_bridge.runtime.local_backend import LocalClientsBackend
from fax_bridge.runtime.population import PopulationRef

Computation = computation_pb2.Computation


_FUNCTION_VALUES = evaluator.FUNCTION_VALUES


class Run:
    """One evaluation: the backend, the number of clients and the Data inputs; what the
    placed intrinsics (`intrinsics.IMPLEMENTATIONS`) work with."""

    def __init__(self, backend: ClientsBackend, num_clients: Optional[int],
                 data: Mapping[str, Any]):
        self.backend = backend
        self.num_clients = num_clients
        self.data = data

    def step(self, count: int = 1) -> None:
        """Counts work against `max_eval_steps` (see `runtime/limits.py`)."""
        evaluator.count_steps(count)

    def clients(self, what: str) -> int:
        if self.num_clients is None:
            raise ClientCountError(
                f"{what} needs the number of clients, but no argument is placed at CLIENTS "
                "to fix it; give it (num_clients=N in Python, --clients N on the command "
                "line)")
        return self.num_clients

    def local_arg(self, value, what: str):
        """`value`, checked to be SERVER-placed or unplaced (not CLIENTS, not a function)."""
        if evaluator.has_leaf(value, (ClientsValue,) + _FUNCTION_VALUES):
            raise ComputationError(f"`{what}` needs a SERVER-placed or unplaced value")
        return value

    def call(self, fn, arg, has_arg: bool = True):
        """A call of a function value, as a Call computation makes it."""
        return evaluator.apply(fn, arg) if has_arg else evaluator.apply(fn)

    def data_value(self, uri: str, type_):
        """The value of a Data computation naming `uri`, checked against `type_`."""
        if uri not in self.data:
            raise ComputationError(
                f"Data computation names `{uri}`, which is not among the inputs given "
                f"(data={sorted(self.data)})")
        value = self.data[uri]
        if type_ is None:
            return value
        return self.import_value(values.check_value(value, type_, uri), type_)

    # -- function values as standalone protos -------------------------------------------

    def closed_proto(self, fn, what: str) -> Computation:
        """A self-contained proto for a function value (free names bound as Literals).

        Its size is checked against `max_proto_bytes`: captured values and closures may
        share parts that a proto has to spell out.
        """
        proto = self._closed_proto(fn, what)
        size = proto.ByteSize()
        if size > limits.LIMITS.max_proto_bytes:
            raise ComputationError(
                f"{what}: the per-client function with the values it captures is a proto of "
                f"{size} bytes, above the cap of {limits.LIMITS.max_proto_bytes} "
                "(FAX_BRIDGE_MAX_PROTO_BYTES); pass large values as arguments instead")
        return proto

    def _closed_proto(self, fn, what: str) -> Computation:
        self.step()
        if isinstance(fn, evaluator.LocalFunction):
            return fn.comp
        if isinstance(fn, evaluator.IntrinsicFunction):
            if fn.uri in local_eval.GENERIC_BINARY:
                return Computation(type=fn.type_signature.to_proto(),
                                   intrinsic=computation_pb2.Intrinsic(uri=fn.uri))
            raise ComputationError(f"{what}: intrinsic `{fn.uri}` cannot run per client")
        if not isinstance(fn, evaluator.Closure):
            raise ComputationError(f"{what} needs a function, got {type(fn).__name__}")
        free = grammar.free_references(fn.comp)
        if not free:
            return fn.comp
        locals_ = []
        for name in sorted(free):
            if name not in fn.env:
                raise ComputationError(f"{what}: reference to unbound name `{name}`")
            for type_proto in free[name]:
                if values._contains_federated(local_eval.parse_type(type_proto)):
                    raise ComputationError(
                        f"{what}: the function refers to `{name}`, a federated value; "
                        "per-client functions may only use local values")
            value = fn.env[name]
            if isinstance(value, _FUNCTION_VALUES):
                proto = self._closed_proto(value, what)
            else:
                self.step(_expanded_size(value))
                proto = _value_proto(value, name, what)
            locals_.append(computation_pb2.Block.Local(name=name, value=proto))
        return Computation(type=fn.comp.type, block=computation_pb2.Block(
            local=locals_, result=fn.comp))

    # -- values at placements -----------------------------------------------------------

    def zero(self, type_):
        if isinstance(type_, federated_language.FederatedType):
            member = local_eval.zeros_of_type(type_.member)
            if intrinsics.is_clients(type_):
                return self.backend.broadcast(type_.member, member,
                                              self.clients("generic_zero at CLIENTS"))
            return member
        return local_eval.zeros_of_type(type_)

    def import_value(self, value, type_):
        """Moves the CLIENTS parts of a checked boundary value into the backend."""
        if isinstance(value, ClientsValue):
            return value
        if intrinsics.is_clients(type_):
            if isinstance(value, PopulationRef):
                return self.backend.put_from_store(type_.member, value, value.client_ids)
            return self.backend.put(type_.member, value)
        if isinstance(type_, federated_language.StructType) and values._contains_federated(
                type_):
            names = structure.name_list_with_nones(value)
            return structure.Struct([
                (n, self.import_value(v, t))
                for n, v, (_, t) in zip(names, value, type_.items())])
        return value

    def conform(self, value, type_, what: str):
        """`value` rebuilt along its declared `type_` (a tree as large as the type).

        Struct values may share parts (`<x, x>`); walking them as trees would take time
        exponential in the proto's size. Rebuilt along the type a proto spells out, a value
        costs no more than its type, so everything downstream stays linear.
        """
        if isinstance(type_, federated_language.StructType):
            if not isinstance(value, structure.Struct):
                raise ComputationError(
                    f"{what}: expected a struct {type_}, got {type(value).__name__}")
            items = list(type_.items())
            if len(value) != len(items):
                raise ComputationError(
                    f"{what}: expected a struct of {len(items)} elements ({type_}), got "
                    f"{len(value)}")
            self.step(len(items))
            names = structure.name_list_with_nones(value)
            return structure.Struct([(n, self.conform(v, t, what))
                                     for n, v, (_, t) in zip(names, value, items)])
        if isinstance(type_, federated_language.FederatedType) and not intrinsics.is_clients(type_):
            return self.conform(value, type_.member, what)
        if isinstance(type_, federated_language.TensorType) and isinstance(
                value, structure.Struct):
            raise ComputationError(f"{what}: expected a tensor {type_}, got a struct")
        return value

    def export_value(self, value, memo: Optional[dict] = None):
        """Brings CLIENTS parts back as per-client lists (shared parts stay shared)."""
        if isinstance(value, ClientsValue):
            return self.backend.get(value)
        if isinstance(value, structure.Struct):
            memo = {} if memo is None else memo
            if id(value) not in memo:
                names = structure.name_list_with_nones(value)
                memo[id(value)] = (structure.Struct(
                    [(n, self.export_value(v, memo)) for n, v in zip(names, value)]), value)
            return memo[id(value)][0]
        if isinstance(value, _FUNCTION_VALUES):
            raise ComputationError("the computation returned a function, not a value")
        return value


def _expanded_size(value) -> int:
    """The number of parts `value` has once written out as a tree (shared parts counted
    each time they appear), computed without writing it out."""
    sizes: dict[int, int] = {}

    def size(v) -> int:
        if not isinstance(v, structure.Struct):
            return 1
        if id(v) not in sizes:
            sizes[id(v)] = 1 + sum(size(x) for x in v)
        return sizes[id(v)]

    return size(value)


def _value_proto(value, name: str, what: str) -> Computation:
    """A Literal (or Struct of Literals) proto holding a local value."""
    if isinstance(value, structure.Struct):
        elements = [computation_pb2.Struct.Element(name=n or "",
                                                   value=_value_proto(v, name, what))
                    for n, v in zip(structure.name_list_with_nones(value), value)]
        type_ = federated_language.StructType(
            [(n, local_eval.parse_type(e.value.type)) for n, e in
             zip(structure.name_list_with_nones(value), elements)])
        return Computation(type=type_.to_proto(),
                           struct=computation_pb2.Struct(element=elements))
    if isinstance(value, (ClientsValue, intrinsics.PlacementValue)) or value is None:
        raise ComputationError(
            f"{what}: the function refers to `{name}`, a federated value; per-client "
            "functions may only use local values")
    arr = np.asarray(value)
    type_ = federated_language.TensorType(arr.dtype, arr.shape)
    return Computation(type=type_.to_proto(),
                       literal=computation_pb2.Literal(value=fl_array.to_proto(arr)))


# ---------------------------------------------------------------------------------------
# Public entry points.


def as_proto(proto: Union[Computation, bytes]) -> Computation:
    if isinstance(proto, (bytes, bytearray)):
        try:
            return Computation.FromString(bytes(proto))
        except Exception as e:
            raise ComputationError(f"the bytes are not a serialized Computation: {e}") from e
    if not isinstance(proto, Computation):
        raise ComputationError(
            f"expected a federated_language Computation proto (or its bytes), got "
            f"{type(proto).__name__}")
    return proto


def computation_type(proto: Union[Computation, bytes]) -> Optional[federated_language.Type]:
    """The type signature a computation proto declares."""
    return prepare(proto).type


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A computation proto with its type signature, parsed once (see `prepare`).

    `structure`: the jax treedef of the program's output when known
    (`runtime.result_structure`); results then come back with it.
    """

    proto: Computation
    type: Optional[federated_language.Type]
    structure: Any = None

    @property
    def parameter(self) -> Optional[federated_language.Type]:
        return self.type.parameter if isinstance(
            self.type, federated_language.FunctionType) else None

    @property
    def result(self) -> Optional[federated_language.Type]:
        return self.type.result if isinstance(
            self.type, federated_language.FunctionType) else self.type

    @functools.cached_property
    def program(self) -> evaluator.Node:
        """The proto compiled by the evaluator with the placed intrinsics, once: a node
        of an environment holding the running evaluation under `evaluator.RUN`."""
        return evaluator.compile_node(self.proto, intrinsics.PLACED)


def prepare(proto: "Union[Computation, bytes, Prepared]",
            structure: Any = None) -> Prepared:
    """Parses a computation (proto or bytes) and its type once, for repeated runs; the
    declared type must be the body's (`declared_types.check`).

    `structure` (a jax treedef) gives results the program's output structure; by
    default the one the exporter recorded for this proto object, if any.
    """
    structure = result_structure.checked_structure(structure)
    if isinstance(proto, Prepared):
        return proto if structure is None else dataclasses.replace(proto, structure=structure)
    proto = as_proto(proto)
    if structure is None:
        structure = result_structure.kept_structure(proto)
    declared = local_eval.parse_type(proto.type)
    declared_types.check(proto, declared)
    return Prepared(proto, declared, structure)


def evaluate(proto: Union[Computation, bytes, Prepared], arg: Any = None,
             backend: Optional[ClientsBackend] = None, *,
             num_clients: Optional[int] = None,
             data: Optional[Mapping[str, Any]] = None) -> Any:
    """Evaluates a computation (called on `arg` when it is functional).

    `arg` is the TFF value of the parameter: local values as arrays/`Struct`s, SERVER
    values as their member, CLIENTS values as a list with one member per client. The
    result comes back the same way, checked against the type the proto declares.
    `num_clients` is needed only when no CLIENTS input fixes it; `data` maps the URIs of
    `Data` computations to their values. A CLIENTS
    value may also be a `PopulationRef`: its rows are read where the clients run
    (`ClientsBackend.put_from_store`), so only client ids leave this process.
    """
    prepared = prepare(proto)
    backend = backend if backend is not None else LocalClientsBackend()
    try:
        return evaluator.counted(_evaluate, "the computation")(
            prepared, arg, Run(backend, num_clients, dict(data or {})))
    except FaxBridgeError:
        raise
    except RecursionError as e:
        raise ComputationError("the computation is nested too deeply to interpret") from e
    except Exception as e:  # a malformed proto must not surface as a bare crash
        raise ComputationError(
            f"the computation could not be interpreted ({type(e).__name__}: {e}); it is "
            "likely malformed or ill-typed") from e


def _evaluate(prepared: Prepared, arg: Any, it: Run) -> Any:
    fn_type = prepared.type
    env = {evaluator.RUN: it}
    if not isinstance(fn_type, federated_language.FunctionType):
        if arg is not None:
            raise ComputationError(
                f"the computation is not a function (type {fn_type}); it takes no argument")
        return _checked_result(it, prepared.program(env), fn_type)
    if fn_type.parameter is None:
        if arg is not None:
            raise ComputationError(f"the computation {fn_type} takes no argument")
        result = it.call(prepared.program(env), None, has_arg=False)
    else:
        checked = values.check_value(arg, fn_type.parameter,
                                     population_size=it.backend.population_size)
        found = values.num_clients_of(checked, fn_type.parameter)
        if found is not None:
            if it.num_clients is not None and it.num_clients != found:
                raise ComputationError(
                    f"num_clients={it.num_clients} but the CLIENTS inputs hold {found} "
                    "clients")
            it.num_clients = found
        result = it.call(prepared.program(env), it.import_value(checked, fn_type.parameter))
    return _checked_result(it, result, fn_type.result)


def evaluate_steps(steps: Sequence[tuple[str, Computation]], env: Mapping[str, Any],
                   backend: Optional[ClientsBackend] = None,
                   num_clients: Optional[int] = None) -> dict:
    """Evaluates named computations in order, each seeing `env` and those before it;
    returns the extended environment (the locals of a Block, evaluated a few at a time
    by a round plan's server pieces)."""
    it = Run(backend if backend is not None else LocalClientsBackend(), num_clients, {})

    def run() -> dict:
        scope = {**env, evaluator.RUN: it}
        for name, comp in steps:
            node = evaluator.compile_node(comp, intrinsics.PLACED,
                                          [k for k in scope if k is not evaluator.RUN])
            scope[name] = node(scope)
        del scope[evaluator.RUN]
        return scope

    return evaluator.counted(run, "the computation")()


def _checked_result(it: Run, result: Any, type_) -> Any:
    """The exported result, checked against (and cast to) the type the proto declares."""
    exported = it.export_value(result)
    if type_ is None:
        return exported
    try:
        return values.check_value(exported, type_, "result")
    except ComputationError as e:
        raise ComputationError(
            f"the computation declares its result as {type_}, but its value does not "
            f"match: {e}") from None


def interpret(proto: Union[Computation, bytes, Prepared], *args: Any,
              backend: Optional[ClientsBackend] = None,
              num_clients: Optional[int] = None, **kwargs: Any) -> Any:
    """Interprets a computation on python pytrees, one per parameter element, phase by
    phase; returns a pytree. (`runtime.run_computation`, the public entry, runs rounds
    through the round engine instead, with the same bits, and everything else here.)

    CLIENTS arguments and results carry a leading clients axis. Named parameter elements
    may be passed by keyword (`values.bind_arguments`). `num_clients` is needed only when
    no argument is placed at CLIENTS and the computation places values there itself.
    The result has the structure jit gives the program when the proto was exported in
    this process (or `prepare(proto, structure=)` gave one), else the generic one
    (`runtime.result_structure`).
    """
    prepared = prepare(proto)
    bound = values.bind_arguments(prepared.parameter, args, kwargs)
    result = evaluate(prepared, bound.runtime_value(), backend, num_clients=num_clients)
    return values.to_pytree(result, prepared.result, prepared.structure)
