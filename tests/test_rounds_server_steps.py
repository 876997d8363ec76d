"""A round split's server pieces as compiled local functions: the same values as the
interpreter, and the interpreter kept where a piece has no local meaning."""

from __future__ import annotations

import federated_language as fl
import numpy as np
from federated_language.compiler import building_blocks as bb
from hypothesis import given, settings, strategies as st

import fax_bridge as fb
from fax_bridge import in_process
from fax_bridge.rounds import round_split as P
from fax_bridge.rounds import server_steps
from sample_computations import clients, server
from fax_bridge.runtime import interpreter, values
from fax_bridge.tff.xla import typed_xla_computation

N = 4
PLACE = ("server", "clients", "clients")


@fb.program(clients=N)
def _server_heavy(params, x, counts):
    """Server work before the broadcast and after the aggregates, nested structs."""
    scaled = {"a": params * 2.0, "b": (params - 1.0, params.sum())}
    at = fb.federated_broadcast(scaled)
    out = fb.federated_map_clients(
        lambda s, x: ((s["a"] + x.sum(), s["b"][0] * x), s["b"][1] + x.mean()), (at, x))
    mean = fb.federated_weighted_mean(out[0], counts)
    total = fb.federated_sum(out[1])
    return {"new": mean[0] * 0.5 + params, "kept": (mean[1], total - scaled["b"][1])}


def _args(seed: int):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=3).astype(np.float32),
            rng.normal(size=(N, 3)).astype(np.float32),
            rng.uniform(1, 5, size=N).astype(np.float32))


PROTO = fb.export_tff(_server_heavy, *_args(0), placements=PLACE)


def _bits(value, type_) -> list:
    import jax

    return [np.asarray(v).tobytes()
            for v in jax.tree_util.tree_leaves(values.to_pytree(value, type_))]


def _same_as_interpreter(proto, arg) -> None:
    split = P.split_round(proto)
    prepared = interpreter.prepare(proto)
    want = interpreter.evaluate(prepared, arg)
    got = values.check_value(in_process.run_in_process(split, arg), prepared.result, "result")
    assert _bits(got, prepared.result) == _bits(want, prepared.result)


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_compiled_server_pieces_give_the_interpreters_bits(seed):
    split = P.split_round(PROTO)
    assert split.server_program is not None
    assert split.server_program.prepare_names  # the broadcast value is prepared here
    prepared = interpreter.prepare(PROTO)
    arg = values.bind_arguments(prepared.parameter, _args(seed), {}).runtime_value()
    _same_as_interpreter(PROTO, arg)


def _generic_plus_at_server():
    """(x={f32[3]}@CLIENTS, s=f32[3]@SERVER) -> generic_plus(<sum(x * s), s>) at SERVER:
    a server step (generic_plus on placed values) with no local translation."""
    member = fl.TensorType(np.float32, [3])
    param = fl.StructType([("x", clients(member)), ("s", server(member))])
    arg = bb.Reference("arg", param)

    def call(uri, argument, result_type):
        return bb.Call(bb.Intrinsic(uri, fl.FunctionType(argument.type_signature,
                                                         result_type)), argument)

    at = call("federated_broadcast", bb.Selection(arg, name="s"), clients(member, True))
    pair = fl.StructType([("x", member), ("s", member)])
    zipped = call("federated_zip_at_clients",
                  bb.Struct([("x", bb.Selection(arg, name="x")), ("s", at)]), clients(pair))
    fn = bb.CompiledComputation(typed_xla_computation(lambda x, s: x * s, pair))
    mapped = call("federated_map", bb.Struct([fn, zipped]), clients(member))
    total = call("federated_sum", mapped, server(member))
    plus = call("generic_plus", bb.Struct([total, bb.Selection(arg, name="s")]),
                server(member))
    return bb.Lambda("arg", param, plus).to_proto()


def test_a_server_step_without_a_local_meaning_keeps_the_interpreter():
    proto = _generic_plus_at_server()
    split = P.split_round(proto)
    assert split is not None and split.server_program is None
    rng = np.random.default_rng(1)
    arg = values.check_value(
        fb_struct(x=[rng.normal(size=3).astype(np.float32) for _ in range(3)],
                  s=rng.normal(size=3).astype(np.float32)),
        interpreter.prepare(proto).parameter)
    _same_as_interpreter(proto, arg)


def fb_struct(**elements):
    from federated_language.common_libs import structure

    return structure.Struct(list(elements.items()))


def test_intrinsics_without_a_local_meaning_are_not_compiled_at_the_server():
    import pytest
    from federated_language.proto import computation_pb2

    from fax_bridge.errors import ComputationError
    from fax_bridge.runtime import local_eval

    def at_server(body):
        fn = computation_pb2.Computation()
        getattr(fn, "lambda").parameter_name = "s"
        getattr(fn, "lambda").result.CopyFrom(body)
        return local_eval.compile_local(fn, at_server=True)

    comp = computation_pb2.Computation()
    comp.data.uri = "somewhere"
    with pytest.raises(ComputationError):
        at_server(comp)
    broadcast = computation_pb2.Computation()
    broadcast.call.function.intrinsic.uri = "federated_broadcast"
    broadcast.call.argument.reference.name = "s"
    with pytest.raises(ComputationError, match="federated_broadcast"):
        at_server(broadcast)


def test_server_pieces_nested_past_the_recursion_limit_keep_the_interpreter():
    """A server step nested deeper than Python's recursion limit is not translated (no
    bare RecursionError); the interpreter then takes the round and reports what it
    can."""
    import sys

    from federated_language.proto import computation_pb2

    split = P.split_round(PROTO)
    deep = computation_pb2.Computation()
    node = deep
    for _ in range(sys.getrecursionlimit() + 100):
        node = node.struct.element.add().value
    node.reference.name = split.parameter_name
    name, _ = split.server_locals[0]
    split.server_locals[0] = (name, deep)
    assert server_steps.compile_server(split) is None
