"""A round plan's server pieces (prepare and result), run as local functions.

On the coordinator a SERVER value is its member, so the intrinsics a round's server
steps use have local meanings: `federated_apply(<f, x>)` is `f(x)`,
`federated_eval_at_server(f)` is `f()`, `federated_zip_at_server(s)` and
`federated_value_at_server(v)` are their argument. `compile_server` translates the
plan's server prepare and server result into two local computations by those meanings
and compiles them once (`local_eval.compile_local`); a round then runs each as one call
instead of interpreting the steps. Pieces holding anything else (another intrinsic, a
generic intrinsic on placed values, a `Data` computation) keep the interpreter
(`compile_server` returns None); both give the same values, and the round's result is
checked against the computation's type either way.

`prepare` and `result` run a plan's two pieces by whichever way it has.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from federated_language.common_libs import structure
from federated_language.compiler import intrinsic_defs as defs
from federated_language.proto import computation_pb2
from federated_language.types import type_analysis

from fax_bridge.errors import ComputationError
from fax_bridge.runtime import interpreter, local_eval
from fax_bridge.runtime.grammar import make_reference, make_selection, struct_elements

Computation = computation_pb2.Computation

_CALLS = defs.FEDERATED_APPLY.uri
_CALLS_WITHOUT_ARG = defs.FEDERATED_EVAL_AT_SERVER.uri
_SAME = (defs.FEDERATED_ZIP_AT_SERVER.uri, defs.FEDERATED_VALUE_AT_SERVER.uri)
_ENV = "__plan_server"  # the result piece's parameter: <arguments, prepared, aggregates>


@dataclasses.dataclass(frozen=True)
class ServerProgram:
    """The two compiled pieces: `prepare(server_arg)` returns the prepare locals (a
    Struct in `prepare_names` order); `result(<server_arg, those, aggregates>)` the
    round's result."""

    prepare_names: tuple
    prepare: Callable
    result: Callable


def _local(comp: Computation) -> Optional[Computation]:
    """`comp` with every SERVER intrinsic replaced by its local meaning; None when it
    holds a computation without one."""
    kind = comp.WhichOneof("computation")
    out = Computation()
    if kind == "call":
        fn = comp.call.function
        uri = fn.intrinsic.uri if fn.WhichOneof("computation") == "intrinsic" else None
        arg = comp.call.argument if comp.call.HasField("argument") else None
        if uri in _SAME and arg is not None:
            return _local(arg)
        if uri == _CALLS_WITHOUT_ARG and arg is not None:
            inner = _local(arg)
            if inner is None:
                return None
            out.call.function.CopyFrom(inner)
            return out
        if uri == _CALLS:
            pair = struct_elements(arg, 2)
            if pair is None:
                return None
            pieces = [_local(e) for e in pair]
            if None in pieces:
                return None
            out.call.function.CopyFrom(pieces[0])
            out.call.argument.CopyFrom(pieces[1])
            return out
        inner = _local(fn)
        if inner is None:
            return None
        out.call.function.CopyFrom(inner)
        if arg is not None:
            inner = _local(arg)
            if inner is None:
                return None
            out.call.argument.CopyFrom(inner)
        return out
    if kind == "intrinsic":
        type_ = local_eval.parse_type(comp.type)
        if comp.intrinsic.uri not in local_eval.GENERIC_URIS or (
                type_ is not None and type_analysis.contains_federated_types(type_)):
            return None
        out.CopyFrom(comp)
        return out
    if kind in ("xla", "literal", "reference"):
        out.CopyFrom(comp)
        return out
    if kind == "selection":
        source = _local(comp.selection.source)
        if source is None:
            return None
        out.selection.source.CopyFrom(source)
        out.selection.index = comp.selection.index
        return out
    if kind == "struct":
        out.struct.SetInParent()  # an empty struct is still a struct
        for element in comp.struct.element:
            value = _local(element.value)
            if value is None:
                return None
            added = out.struct.element.add(value=value)
            if element.name:
                added.name = element.name
        return out
    if kind == "lambda":
        lam = getattr(comp, "lambda")
        body = _local(lam.result)
        if body is None:
            return None
        getattr(out, "lambda").parameter_name = lam.parameter_name
        getattr(out, "lambda").result.CopyFrom(body)
        return out
    if kind == "block":
        for local in comp.block.local:
            value = _local(local.value)
            if value is None:
                return None
            out.block.local.add(name=local.name, value=value)
        result = _local(comp.block.result)
        if result is None:
            return None
        out.block.result.CopyFrom(result)
        return out
    return None  # data, placement


def _lambda(parameter: str, locals_: list, result: Computation) -> Optional[Computation]:
    """Lambda(parameter) -> Block(locals_) -> result, translated; None if a part has no
    local meaning."""
    out = Computation()
    lam = getattr(out, "lambda")
    lam.parameter_name = parameter
    for name, value in locals_:
        translated = _local(value)
        if translated is None:
            return None
        lam.result.block.local.add(name=name, value=translated)
    lam.result.block.result.CopyFrom(result)
    return out


def compile_server(plan) -> Optional[ServerProgram]:
    """The plan's server pieces compiled (module docstring), or None."""
    try:
        return _compile_server(plan)
    except RecursionError:
        return None  # nested too deeply to translate: the interpreter reports it


def _compile_server(plan) -> Optional[ServerProgram]:
    prepare_steps, result_steps = _steps(plan)
    names = [k for k, _ in prepare_steps]
    if _ENV == plan.parameter_name or _ENV in {k for k, _ in plan.server_locals}:
        return None
    prepared = Computation()
    prepared.struct.SetInParent()
    for name in names:
        prepared.struct.element.add(value=make_reference(name))
    prepare = _lambda(plan.parameter_name, prepare_steps, prepared)
    env = make_reference(_ENV)
    unpack = [(plan.parameter_name, make_selection(env, 0))]
    unpack += [(name, make_selection(make_selection(env, 1), i))
               for i, name in enumerate(names)]
    unpack += [(agg.local, make_selection(make_selection(env, 2), j))
               for j, agg in enumerate(plan.aggregations)]
    final = _local(plan.result)
    if prepare is None or final is None:
        return None
    result = _lambda(_ENV, result_steps, final)
    if result is None:
        return None
    block = getattr(result, "lambda").result.block
    head = [computation_pb2.Block.Local(name=n, value=v) for n, v in unpack]
    rest = list(block.local)
    del block.local[:]
    block.local.extend(head + rest)
    try:
        return ServerProgram(tuple(names), local_eval.compile_local(prepare),
                             local_eval.compile_local(result))
    except ComputationError:
        return None  # e.g. a name the pieces do not bind: the interpreter says what


def _steps(plan) -> tuple[list, list]:
    """(the server prepare's locals, the server result's), each [(name, Computation)]."""
    prepare_steps = [(k, v) for k, v in plan.server_locals if k in plan.prepare_names]
    result_steps = [(k, v) for k, v in plan.server_locals if k not in plan.prepare_names]
    return prepare_steps, result_steps


def prepare(plan, arg: Any, backend, num_clients: int) -> dict:
    """The environment after the server prepare, from `arg` (the parameter's runtime
    value): the parameter, its CLIENTS elements left out (None), and each prepare local."""
    server_arg = structure.Struct([
        (name, None if i in plan.client_inputs else value)
        for i, (name, value) in enumerate(zip(structure.name_list_with_nones(arg), arg))])
    program = plan.server_program
    if program is None:
        return interpreter.evaluate_steps(_steps(plan)[0], {plan.parameter_name: server_arg},
                                          backend, num_clients)
    env = {plan.parameter_name: server_arg}
    env.update(zip(program.prepare_names, program.prepare(server_arg)))
    return env


def result(plan, env: dict, backend, num_clients: int) -> Any:
    """The round's result from `env` (`prepare`'s, with each aggregate's local set)."""
    program = plan.server_program
    if program is None:
        env = interpreter.evaluate_steps(_steps(plan)[1] + [("__result", plan.result)],
                                         env, backend, num_clients)
        return env["__result"]
    return program.result(structure.Struct([
        (None, env[plan.parameter_name]),
        (None, structure.Struct([(None, env[k]) for k in program.prepare_names])),
        (None, structure.Struct([(None, env[a.local]) for a in plan.aggregations]))]))
