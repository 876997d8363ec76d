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

`prepare` and `result` run a split's two pieces by whichever way it has. Where the
aggregates are jax arrays (a round on the device, `device_sums.on_device`) the compiled
result piece runs under jit, so they stay on the device; a piece that cannot be traced
runs as usual.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import numpy as np
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
    # the result piece under jit, per layout of its argument (None: it cannot be traced)
    jitted: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)


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
    aggregates = structure.Struct([(None, env[a.local]) for a in split.aggregations])
    on_device = any(isinstance(leaf, jax.Array) for leaf in _flat(aggregates)[1])
    if program is None:
        if on_device:
            env = dict(env, **{a.local: _on_host(env[a.local]) for a in split.aggregations})
        env = interpreter.evaluate_steps(_steps(split)[1] + [("__result", split.result)],
                                         env, backend, num_clients)
        return env["__result"]
    arg = structure.Struct([
        (None, env[split.parameter_name]),
        (None, structure.Struct([(None, env[k]) for k in program.prepare_names])),
        (None, aggregates)])
    return _on_device(program, arg) if on_device else program.result(arg)


def _flat(value: Any) -> tuple:
    """(the layout of a value: Struct names and nesting, None kept; its arrays)."""
    leaves: list = []

    def walk(v):
        if isinstance(v, structure.Struct):
            return tuple((name, walk(m)) for name, m in structure.iter_elements(v))
        if v is None:
            return None
        leaves.append(v)
        return "tensor"

    return walk(value), leaves


def _built(tree: Any, leaves) -> Any:
    if tree is None:
        return None
    if tree == "tensor":
        return next(leaves)
    return structure.Struct([(name, _built(t, leaves)) for name, t in tree])


def _on_host(value: Any) -> Any:
    tree, leaves = _flat(value)
    return _built(tree, iter([np.asarray(leaf) for leaf in leaves]))


def _on_device(program: ServerProgram, arg: Any) -> Any:
    """`program.result(arg)` under jit (compiled once per layout of `arg`), its result
    left on the device; as usual, on the host, where the piece cannot be traced."""
    tree, leaves = _flat(arg)
    key = (tree, tuple((np.shape(x), np.dtype(x.dtype if hasattr(x, "dtype")
                                              else np.asarray(x).dtype).str)
                       for x in leaves))
    if key not in program.jitted:
        found: dict = {}

        def traced(flat: list) -> list:
            out_tree, out = _flat(program.result(_built(tree, iter(flat))))
            found["tree"] = out_tree
            return out

        run = jax.jit(traced)
        try:
            out = run(leaves)
        except Exception:  # not traceable (a generic intrinsic, a 64-bit module)
            program.jitted[key] = None
        else:
            program.jitted[key] = (run, found["tree"])
            return _built(found["tree"], iter(out))
    entry = program.jitted[key]
    if entry is None:
        return program.result(_on_host(arg))
    run, out_tree = entry
    return _built(out_tree, iter(run(leaves)))
