"""A round split's server steps (prepare and result), run as local functions.

On the coordinator a SERVER value is its member, so the intrinsics a round's server
steps use have local meanings: `federated_apply(<f, x>)` is `f(x)`,
`federated_eval_at_server(f)` is `f()`, `federated_zip_at_server(s)` and
`federated_value_at_server(v)` are their argument. `compile_server` puts the split's
server prepare and server result into two local computations and compiles them once
with the runtime's local evaluator, which gives those intrinsics their meanings
(`local_eval.compile_local(at_server=True)`); a round then runs each as one call instead
of interpreting the steps. Pieces holding anything else (another intrinsic, a generic
intrinsic on placed values, a `Data` computation) keep the interpreter
(`compile_server` returns None); both give the same values, and the round's result is
checked against the computation's type either way.

`prepare` and `result` run a split's two pieces by whichever way it has.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from federated_language.common_libs import structure
from federated_language.proto import computation_pb2
from google.protobuf.message import DecodeError, EncodeError

from fax_bridge.errors import ComputationError
from fax_bridge.runtime import interpreter, local_eval
from fax_bridge.runtime.grammar import lambda_of, make_reference, make_selection

Computation = computation_pb2.Computation

_ENV = "__server_steps"  # the result piece's parameter: <arguments, prepared, aggregates>


@dataclasses.dataclass(frozen=True)
class ServerProgram:
    """The two compiled pieces: `prepare(server_arg)` returns the prepare locals (a
    Struct in `prepare_names` order); `result(<server_arg, those, aggregates>)` the
    round's result."""

    prepare_names: tuple
    prepare: Callable
    result: Callable


def _lambda(parameter: str, locals_: list, result: Computation) -> Computation:
    """Lambda(parameter) -> Block(locals_) -> result."""
    out = Computation()
    lam = lambda_of(out)
    lam.parameter_name = parameter
    for name, value in locals_:
        lam.result.block.local.add(name=name, value=value)
    lam.result.block.result.CopyFrom(result)
    return out


def compile_server(split) -> Optional[ServerProgram]:
    """The split's server pieces compiled (module docstring), or None."""
    try:
        return _compile_server(split)
    except (RecursionError, DecodeError, EncodeError):
        return None  # nested too deeply to copy or compile: the interpreter reports it


def _compile_server(split) -> Optional[ServerProgram]:
    prepare_steps, result_steps = _steps(split)
    names = [k for k, _ in prepare_steps]
    if _ENV == split.parameter_name or _ENV in {k for k, _ in split.server_locals}:
        return None
    prepared = Computation()
    prepared.struct.SetInParent()
    for name in names:
        prepared.struct.element.add(value=make_reference(name))
    prepare = _lambda(split.parameter_name, prepare_steps, prepared)
    env = make_reference(_ENV)
    unpack = [(split.parameter_name, make_selection(env, 0))]
    unpack += [(name, make_selection(make_selection(env, 1), i))
               for i, name in enumerate(names)]
    unpack += [(agg.local, make_selection(make_selection(env, 2), j))
               for j, agg in enumerate(split.aggregations)]
    result = _lambda(_ENV, unpack + result_steps, split.result)
    try:
        return ServerProgram(tuple(names), local_eval.compile_local(prepare, at_server=True),
                             local_eval.compile_local(result, at_server=True))
    except ComputationError:
        return None  # a step without a local meaning, or a name the pieces do not bind:
        #              the interpreter runs it, or says what is wrong


def _steps(split) -> tuple[list, list]:
    """(the server prepare's locals, the server result's), each [(name, Computation)]."""
    prepare_steps = [(k, v) for k, v in split.server_locals if k in split.prepare_names]
    result_steps = [(k, v) for k, v in split.server_locals if k not in split.prepare_names]
    return prepare_steps, result_steps


def prepare(split, arg: Any, backend, num_clients: int) -> dict:
    """The environment after the server prepare, from `arg` (the parameter's runtime
    value): the parameter, its CLIENTS elements left out (None), and each prepare local."""
    server_arg = structure.Struct([
        (name, None if i in split.client_inputs else value)
        for i, (name, value) in enumerate(zip(structure.name_list_with_nones(arg), arg))])
    program = split.server_program
    if program is None:
        return interpreter.evaluate_steps(_steps(split)[0], {split.parameter_name: server_arg},
                                          backend, num_clients)
    env = {split.parameter_name: server_arg}
    env.update(zip(program.prepare_names, program.prepare(server_arg)))
    return env


def result(split, env: dict, backend, num_clients: int) -> Any:
    """The round's result from `env` (`prepare`'s, with each aggregate's local set)."""
    program = split.server_program
    if program is None:
        env = interpreter.evaluate_steps(_steps(split)[1] + [("__result", split.result)],
                                         env, backend, num_clients)
        return env["__result"]
    return program.result(structure.Struct([
        (None, env[split.parameter_name]),
        (None, structure.Struct([(None, env[k]) for k in program.prepare_names])),
        (None, structure.Struct([(None, env[a.local]) for a in split.aggregations]))]))
