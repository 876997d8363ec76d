"""Local (unplaced) computations as python callables: the evaluator with local meanings.

A local computation is an `Xla` computation, or a `Lambda`/`Block`/`Call`/`Struct`/
`Selection`/`Reference`/`Literal` composition of local parts, possibly using the generic
intrinsics (`generic_plus`, `generic_multiply`, `generic_divide`, `generic_zero`).
`compile_local` turns one into a callable on local values (numpy arrays, or `Struct`s of
them) with the runtime's one evaluator (`runtime/evaluator.py`) and the intrinsic table
`LOCAL`, compiling it once per content hash and per process. The same callable runs on
jax tracers too: `client_map` traces it once to run it over many clients in one XLA call.
On the coordinator a SERVER value is its member, so a round's server steps compile here
too (`compile_local(at_server=True)`, the table `AT_SERVER`): `federated_apply(<f, x>)`
is `f(x)`, `federated_eval_at_server(f)` is `f()`, `federated_zip_at_server(s)` and
`federated_value_at_server(v)` are their argument.

`parse_type`, `read_literal` and `select_element` are the evaluator's, named here too for
the modules that read local values.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any, Callable, Optional

import federated_language
import numpy as np
from federated_language.common_libs import structure
from federated_language.compiler import intrinsic_defs
from federated_language.proto import computation_pb2
from federated_language.types import type_analysis

from fax_bridge.errors import ComputationError
from fax_bridge.runtime import evaluator
from fax_bridge.runtime.evaluator import parse_type, read_literal, select_element

__all__ = ["AT_SERVER", "GENERIC_BINARY", "GENERIC_URIS", "GENERIC_ZERO", "LOCAL",
           "SERVER_LOCAL_URIS", "cast_to_type", "compile_local", "content_hash",
           "evaluate_local", "make_generic_binary", "parse_type", "read_literal",
           "select_element", "zeros_of_type"]

LocalValue = Any  # np.ndarray | structure.Struct of LocalValue
LocalFn = Callable[..., LocalValue]

# The generic intrinsics a local computation may use (the rest place values).
GENERIC_BINARY = {intrinsic_defs.GENERIC_PLUS.uri: np.add,
                  intrinsic_defs.GENERIC_MULTIPLY.uri: np.multiply,
                  intrinsic_defs.GENERIC_DIVIDE.uri: np.divide}
GENERIC_ZERO = intrinsic_defs.GENERIC_ZERO.uri
GENERIC_URIS = (*GENERIC_BINARY, GENERIC_ZERO)

_APPLY = intrinsic_defs.FEDERATED_APPLY.uri
_EVAL_AT_SERVER = intrinsic_defs.FEDERATED_EVAL_AT_SERVER.uri
# The SERVER intrinsics a round's server steps use, which have local meanings where a
# SERVER value is its member (`compile_local(at_server=True)`).
SERVER_LOCAL_URIS = frozenset({_APPLY, _EVAL_AT_SERVER,
                               intrinsic_defs.FEDERATED_ZIP_AT_SERVER.uri,
                               intrinsic_defs.FEDERATED_VALUE_AT_SERVER.uri})

_lock = threading.Lock()
_compiled: dict[str, LocalFn] = {}


def content_hash(proto: computation_pb2.Computation) -> str:
    """Hex sha256 of the proto's deterministic serialization."""
    return hashlib.sha256(proto.SerializeToString(deterministic=True)).hexdigest()


def compile_local(fn: computation_pb2.Computation, at_server: bool = False) -> LocalFn:
    """Returns a callable `f(arg)` (or `f()` without a parameter) running `fn` locally.

    `at_server`: `fn` runs on the coordinator, where a SERVER value is its member, so
    the SERVER intrinsics with a local meaning (`SERVER_LOCAL_URIS`) may appear in it too.
    Raises `ComputationError` if `fn` is not a local functional computation (at the
    server), uses names it does not bind, or holds an Xla part that XLA cannot read.
    """
    if not isinstance(fn, computation_pb2.Computation):
        raise ComputationError(
            f"compile_local takes a federated_language Computation proto, got "
            f"{type(fn).__name__}"
        )
    key = ("server:" if at_server else "") + content_hash(fn)
    with _lock:
        cached = _compiled.get(key)
    if cached is not None:
        return cached
    value = evaluator.compile_node(fn, AT_SERVER if at_server else LOCAL)({})
    if not callable(value):
        raise ComputationError(
            f"compile_local needs a functional computation, got a "
            f"{fn.WhichOneof('computation')} computation of type {parse_type(fn.type)}"
        )
    value = evaluator.counted(value, "a local computation")
    with _lock:
        _compiled.setdefault(key, value)
        return _compiled[key]


def evaluate_local(comp: computation_pb2.Computation) -> LocalValue:
    """Evaluates a closed local computation (functional or not) to its value."""
    return evaluator.compile_node(comp, LOCAL)({})


# ---------------------------------------------------------------------------------------
# The local intrinsic tables.


def _generic_zero(comp, type_):
    zero = zeros_of_type(type_)
    return lambda env: zero


def _generic_binary(at_server: bool):
    def build(comp, type_):
        uri = comp.intrinsic.uri
        if at_server and type_ is not None and type_analysis.contains_federated_types(type_):
            raise ComputationError(
                f"`{uri}` on placed values has no local meaning at the server (type {type_})")
        result_type = type_.result if isinstance(type_, federated_language.FunctionType) else None
        value = evaluator.IntrinsicFunction(
            uri, type_, make_generic_binary(GENERIC_BINARY[uri], result_type, uri))
        return lambda env: value
    return build


def _server_meaning(meaning: Callable):
    """The node builder of a SERVER intrinsic whose local meaning is `meaning(uri, arg)`."""
    def build(comp, type_):
        uri = comp.intrinsic.uri

        def call(*arg):
            if not arg:
                raise ComputationError(f"`{uri}` was called without an argument")
            return meaning(uri, arg[0])

        value = evaluator.IntrinsicFunction(uri, type_, call)
        return lambda env: value
    return build


def _apply_at_server(uri: str, arg):
    if not isinstance(arg, structure.Struct) or len(arg) != 2:
        raise ComputationError(f"`{uri}` takes a struct <function, value> at the server")
    return evaluator.apply(arg[0], arg[1])


def _direct_apply(nodes: list) -> evaluator.Node:
    if len(nodes) != 2:
        raise ComputationError(f"`{_APPLY}` takes a struct <function, value> at the server")
    fn, value = nodes
    return lambda env: evaluator.apply(fn(env), value(env))


def _local_refusal(uri: str) -> str:
    return (f"intrinsic `{uri}` cannot run in a local computation; local parts may use "
            f"only {', '.join(GENERIC_URIS)}")


def _server_refusal(uri: str) -> str:
    return (f"intrinsic `{uri}` has no local meaning at the server; server steps may use "
            f"only {', '.join(sorted(SERVER_LOCAL_URIS))} and {', '.join(GENERIC_URIS)}")


LOCAL = evaluator.IntrinsicTable(
    name="a local computation",
    intrinsics={GENERIC_ZERO: _generic_zero,
                **{uri: _generic_binary(False) for uri in GENERIC_BINARY}},
    refusal=_local_refusal)
AT_SERVER = evaluator.IntrinsicTable(
    name="a server step",
    intrinsics={GENERIC_ZERO: _generic_zero,
                **{uri: _generic_binary(True) for uri in GENERIC_BINARY},
                _APPLY: _server_meaning(_apply_at_server),
                _EVAL_AT_SERVER: _server_meaning(lambda uri, fn: evaluator.apply(fn)),
                intrinsic_defs.FEDERATED_ZIP_AT_SERVER.uri: _server_meaning(
                    lambda uri, value: value),
                intrinsic_defs.FEDERATED_VALUE_AT_SERVER.uri: _server_meaning(
                    lambda uri, value: value)},
    refusal=_server_refusal,
    direct_calls={_APPLY: _direct_apply})


# ---------------------------------------------------------------------------------------
# Generic intrinsics on local values.


def zeros_of_type(type_: Optional[federated_language.Type]) -> LocalValue:
    """The zero of a tensor or struct type (as `generic_zero` defines it)."""
    if isinstance(type_, federated_language.TensorType):
        if any(d is None for d in type_.shape or ()):
            raise ComputationError(f"generic_zero needs a fully defined shape, got {type_}")
        return np.zeros(type_.shape or (), dtype=type_.dtype)
    if isinstance(type_, federated_language.StructType):
        return structure.Struct([(n, zeros_of_type(t)) for n, t in type_.items()])
    raise ComputationError(f"generic_zero is defined for tensors and structs, not {type_}")


def _combine(op, a, b, memo=None):
    """`op` leaf by leaf; a part shared in the inputs is combined once and stays shared."""
    if memo is None:
        memo = {}
    if not (isinstance(a, structure.Struct) or isinstance(b, structure.Struct)):
        with np.errstate(divide="ignore", invalid="ignore"):
            return op(np.asarray(a), np.asarray(b))
    key = (id(a), id(b))
    if key not in memo:
        memo[key] = (_combine_struct(op, a, b, memo), a, b)  # a, b kept alive with the key
    return memo[key][0]


def _combine_struct(op, a, b, memo):
    if isinstance(a, structure.Struct) and isinstance(b, structure.Struct):
        if len(a) != len(b):
            raise ComputationError(
                f"a generic operation got structs of {len(a)} and {len(b)} elements"
            )
        names = structure.name_list_with_nones(a)
        return structure.Struct(
            [(n, _combine(op, x, y, memo)) for n, x, y in zip(names, a, b)]
        )
    if isinstance(a, structure.Struct):
        names = structure.name_list_with_nones(a)
        return structure.Struct([(n, _combine(op, x, b, memo)) for n, x in zip(names, a)])
    names = structure.name_list_with_nones(b)
    return structure.Struct([(n, _combine(op, a, y, memo)) for n, y in zip(names, b)])


def cast_to_type(value: LocalValue, type_: Optional[federated_language.Type]) -> LocalValue:
    """Casts the tensors of `value` to the dtypes of `type_` (when `type_` is given)."""
    if isinstance(type_, federated_language.TensorType):
        return np.asarray(value, dtype=type_.dtype)
    if isinstance(type_, federated_language.StructType) and isinstance(
            value, structure.Struct):
        names = structure.name_list_with_nones(value)
        return structure.Struct(
            [(n, cast_to_type(v, t)) for n, v, (_, t) in zip(names, value, type_.items())]
        )
    return value


def make_generic_binary(op, result_type, uri: str) -> LocalFn:
    """A local function taking the struct `<a, b>` and returning `op(a, b)` leaf by leaf."""

    def fn(arg=None):
        if not isinstance(arg, structure.Struct) or len(arg) != 2:
            raise ComputationError(f"`{uri}` takes a struct of two values, got {arg!r}")
        return cast_to_type(_combine(op, arg[0], arg[1]), result_type)

    return fn
