"""Compiles local (unplaced) functional computations into python callables.

A local computation is an `Xla` computation, or a `Lambda`/`Block`/`Call`/`Struct`/
`Selection`/`Reference`/`Literal` composition of local parts, possibly using the generic
intrinsics (`generic_plus`, `generic_multiply`, `generic_divide`, `generic_zero`).
`compile_local` turns one into a callable on local values (numpy arrays, or `Struct`s of
them), compiling it once per content hash and per process. The same callable runs on
jax tracers too: `client_map` traces it once to run it over many clients in one XLA call.
On the coordinator a SERVER value is its member, so a round's server steps compile here
too (`compile_local(at_server=True)`): `federated_apply(<f, x>)` is `f(x)`,
`federated_eval_at_server(f)` is `f()`, `federated_zip_at_server(s)` and
`federated_value_at_server(v)` are their argument.

Xla binding (TFF's convention): the parameter binding mirrors the parameter type; each
tensor binding names the HLO parameter number of the tensor at that place of the type.
The result binding likewise names, for each tensor of the result type, its position in
the HLO module's (flattened) outputs.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import threading
from typing import Any, Callable, Optional

import federated_language
import numpy as np
from federated_language.common_libs import structure
from federated_language.compiler import array as fl_array
from federated_language.compiler import intrinsic_defs
from federated_language.proto import computation_pb2
from federated_language.types import type_analysis
from google.protobuf.message import DecodeError

from fax_bridge.errors import ComputationError
from fax_bridge.runtime import grammar, hlo, limits

LocalValue = Any  # np.ndarray | structure.Struct of LocalValue
LocalFn = Callable[..., LocalValue]

# The generic intrinsics a local computation may use (the rest place values).
GENERIC_BINARY = {intrinsic_defs.GENERIC_PLUS.uri: np.add,
                  intrinsic_defs.GENERIC_MULTIPLY.uri: np.multiply,
                  intrinsic_defs.GENERIC_DIVIDE.uri: np.divide}
GENERIC_ZERO = intrinsic_defs.GENERIC_ZERO.uri
GENERIC_URIS = (*GENERIC_BINARY, GENERIC_ZERO)

_lock = threading.Lock()
_steps = threading.local()  # calls made by the outermost local function running here
_compiled: dict[str, LocalFn] = {}
_executables: dict[str, hlo.HloExecutable] = {}


def content_hash(proto: computation_pb2.Computation) -> str:
    """Hex sha256 of the proto's deterministic serialization."""
    return hashlib.sha256(proto.SerializeToString(deterministic=True)).hexdigest()


def compile_local(fn: computation_pb2.Computation, at_server: bool = False) -> LocalFn:
    """Returns a callable `f(arg)` (or `f()` without a parameter) running `fn` locally.

    `at_server`: `fn` runs on the coordinator, where a SERVER value is its member, so
    calls of the SERVER intrinsics with a local meaning (`SERVER_LOCAL_URIS`) may appear
    in it too.
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
    value = _build(fn, _Scope(frozenset(), at_server))({})
    if not callable(value):
        raise ComputationError(
            f"compile_local needs a functional computation, got a "
            f"{fn.WhichOneof('computation')} computation of type {parse_type(fn.type)}"
        )
    value = _counted(value)
    with _lock:
        _compiled.setdefault(key, value)
        return _compiled[key]


def evaluate_local(comp: computation_pb2.Computation) -> LocalValue:
    """Evaluates a closed local computation (functional or not) to its value."""
    return _build(comp, _Scope(frozenset(), False))({})


def parse_type(type_proto) -> Optional[federated_language.Type]:
    """The federated_language Type of a `Type` proto, or None when the proto is unset.

    Parsed and size-checked once per distinct proto (types are immutable): a fleet
    round would otherwise parse the same function types again and again.
    """
    if type_proto is None or type_proto.WhichOneof("type") is None:
        return None
    return _parse_type_bytes(type_proto.SerializeToString(deterministic=True))


@functools.lru_cache(maxsize=4096)
def _parse_type_bytes(data: bytes) -> federated_language.Type:
    try:
        type_proto = computation_pb2.Type.FromString(data)
    except DecodeError:  # bytes it serialized itself: only nesting past the parser's limit
        raise ComputationError(
            "a type in the computation proto is nested too deeply (beyond the protobuf "
            "parser's nesting limit); flatten the type's structs") from None
    try:
        type_ = federated_language.Type.from_proto(type_proto)
    except RecursionError:
        raise ComputationError("a type in the computation proto is nested too deeply") from None
    except Exception as e:
        raise ComputationError(f"cannot read a type in the computation proto: {e}") from e
    try:
        limits.type_bytes(type_, "a type")
    except ComputationError as e:
        text = str(type_)
        if len(text) < 200:
            raise ComputationError(str(e).replace("a type", f"type {text}", 1)) from None
        raise
    return type_


def read_literal(literal) -> np.ndarray:
    """The array of a `Literal` proto, its declared shape checked against the caps first."""
    shape = literal.value.shape
    dims = list(shape.dim) if shape is not None else []
    limits.tensor_bytes(dims, 1, "a Literal")
    try:
        return np.asarray(fl_array.from_proto(literal.value))
    except Exception as e:
        raise ComputationError(f"cannot read a Literal's array: {e}") from e


# ---------------------------------------------------------------------------------------
# Tree compilation: each node becomes a function of the environment (a dict of names).

_Env = dict
_Node = Callable[[_Env], LocalValue]


@dataclasses.dataclass(frozen=True)
class _Scope:
    """What a node is built in: the names bound around it, and whether it runs at the
    server (`compile_local(at_server=True)`)."""

    names: frozenset
    at_server: bool

    def bind(self, name: str) -> "_Scope":
        return _Scope(self.names | {name}, self.at_server)


def select_element(value: Any, index: int) -> Any:
    """Element `index` of a struct value, as a Selection computes it."""
    if not isinstance(value, structure.Struct):
        raise ComputationError(
            f"Selection of element {index} from a value that is not a struct "
            f"({type(value).__name__})")
    if not 0 <= index < len(value):
        raise ComputationError(
            f"Selection index {index} is out of range for a struct of {len(value)} "
            "elements")
    return value[index]


def _build(comp: computation_pb2.Computation, scope: _Scope) -> _Node:
    kind = grammar.case(comp)
    builder = _BUILDERS.get(kind)
    if builder is None:
        raise ComputationError(
            f"a local computation cannot hold a `{kind}` computation; only Xla, Lambda, "
            "Block, Call, Struct, Selection, Reference, Literal and generic intrinsics run "
            "locally")
    return builder(comp, scope)


def _build_reference(comp, scope):
    name = comp.reference.name
    if name not in scope.names:
        raise ComputationError(
            f"reference to unbound name `{name}` in a local computation; bind it in an "
            "enclosing Lambda or Block"
        )
    return lambda env: env[name]


def _build_lambda(comp, scope):
    lam = grammar.lambda_of(comp)
    param = lam.parameter_name
    inner = scope.bind(param) if param else scope
    body = _build(lam.result, inner)

    def make(env):
        if not param:
            return lambda *_: body(env)

        def fn(arg=None):
            local_env = dict(env)
            local_env[param] = arg
            return body(local_env)

        return fn

    return make


def _build_block(comp, scope):
    locals_ = []
    for local in comp.block.local:
        locals_.append((local.name, _build(local.value, scope)))
        scope = scope.bind(local.name)
    result = _build(comp.block.result, scope)

    def run(env):
        env = dict(env)
        for name, node in locals_:
            env[name] = node(env)
        return result(env)

    return run


def _build_call(comp, scope):
    if scope.at_server:
        meaning = _build_server_call(comp, scope)
        if meaning is not None:
            return meaning
    fn = _build(comp.call.function, scope)
    if comp.call.HasField("argument"):
        arg = _build(comp.call.argument, scope)
        return lambda env: _apply(fn(env), arg(env))
    return lambda env: _apply(fn(env))


def _counted(fn: LocalFn) -> LocalFn:
    """`fn`, counting the calls it makes against `max_eval_steps` (outermost call resets)."""

    def run(*arg):
        depth = getattr(_steps, "depth", 0)
        if depth == 0:
            _steps.count = 0
        _steps.depth = depth + 1
        try:
            return fn(*arg)
        finally:
            _steps.depth = depth

    return run


def _apply(fn, *arg):
    if not callable(fn):
        raise ComputationError(f"a Call's function evaluated to a non-function value {fn!r}")
    count = getattr(_steps, "count", 0) + 1
    _steps.count = count
    if count > limits.LIMITS.max_eval_steps:
        raise limits.too_many_steps("a local computation")
    return fn(*arg)


def _build_struct(comp, scope):
    elements = [(e.name or None, _build(e.value, scope)) for e in comp.struct.element]
    return lambda env: structure.Struct([(n, node(env)) for n, node in elements])


def _build_selection(comp, scope):
    source = _build(comp.selection.source, scope)
    index = comp.selection.index

    return lambda env: select_element(source(env), index)


def _build_literal(comp, scope):
    value = read_literal(comp.literal)
    return lambda env: value


def _build_intrinsic(comp, scope):
    uri = comp.intrinsic.uri
    type_ = parse_type(comp.type)
    if uri == GENERIC_ZERO:
        zero = zeros_of_type(type_)
        return lambda env: zero
    if scope.at_server and type_ is not None and type_analysis.contains_federated_types(type_):
        raise ComputationError(
            f"`{uri}` on placed values has no local meaning at the server (type {type_})")
    if uri in GENERIC_BINARY:
        op = GENERIC_BINARY[uri]
        result_type = type_.result if isinstance(type_, federated_language.FunctionType) else None
        fn = make_generic_binary(op, result_type, uri)
        return lambda env: fn
    raise ComputationError(
        f"intrinsic `{uri}` cannot run in a local computation; local parts may use only "
        f"{', '.join(GENERIC_URIS)}"
    )


_APPLY = intrinsic_defs.FEDERATED_APPLY.uri
_EVAL_AT_SERVER = intrinsic_defs.FEDERATED_EVAL_AT_SERVER.uri
# The SERVER intrinsics a round's server steps use, which have local meanings where a
# SERVER value is its member (`compile_local(at_server=True)`), each in call position.
SERVER_LOCAL_URIS = frozenset({_APPLY, _EVAL_AT_SERVER,
                               intrinsic_defs.FEDERATED_ZIP_AT_SERVER.uri,
                               intrinsic_defs.FEDERATED_VALUE_AT_SERVER.uri})


def _build_server_call(comp, scope) -> Optional[_Node]:
    """A call of one of `SERVER_LOCAL_URIS` built by its meaning: `federated_apply(<f, x>)`
    as `f(x)`, `federated_eval_at_server(f)` as `f()`, the zips and values as their
    argument; None for any other call."""
    call = grammar.intrinsic_call(comp)
    if call is None or call[0] not in SERVER_LOCAL_URIS:
        return None
    uri, arg = call
    if arg is None:
        raise ComputationError(f"`{uri}` was called without an argument")
    if uri == _APPLY:
        pair = grammar.struct_elements(arg, 2)
        if pair is None:
            raise ComputationError(f"`{uri}` takes a struct <function, value> at the server")
        fn, value = _build(pair[0], scope), _build(pair[1], scope)
        return lambda env: _apply(fn(env), value(env))
    inner = _build(arg, scope)
    if uri == _EVAL_AT_SERVER:
        return lambda env: _apply(inner(env))
    return inner


def _build_xla(comp, scope):
    fn = xla_function(comp)
    return lambda env: fn


_BUILDERS = grammar.handlers({
    "reference": _build_reference,
    "lambda": _build_lambda,
    "block": _build_block,
    "call": _build_call,
    "struct": _build_struct,
    "selection": _build_selection,
    "literal": _build_literal,
    "intrinsic": _build_intrinsic,
    "xla": _build_xla,
})


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


# ---------------------------------------------------------------------------------------
# Xla computations.


def _executable(hlo_bytes: bytes) -> hlo.HloExecutable:
    key = hashlib.sha256(hlo_bytes).hexdigest()
    with _lock:
        exe = _executables.get(key)
    if exe is None:
        exe = hlo.compile_hlo(hlo_bytes)
        with _lock:
            exe = _executables.setdefault(key, exe)
    return exe


def _count_tensors(binding: computation_pb2.Xla.Binding, where: str) -> list[int]:
    kind = binding.WhichOneof("binding")
    if kind == "tensor":
        return [binding.tensor.index]
    if kind == "struct":
        out = []
        for b in binding.struct.element:
            out.extend(_count_tensors(b, where))
        return out
    raise ComputationError(f"the Xla {where} binding has an element with nothing set")


def _flatten_arg(value, binding, type_, path, out: dict) -> None:
    kind = binding.WhichOneof("binding")
    if kind == "tensor":
        if isinstance(value, structure.Struct):
            raise ComputationError(
                f"Xla parameter {path or '<arg>'}: expected a tensor "
                f"{type_ if type_ is not None else ''}, got a struct"
            )
        arr = value if hlo.is_traced(value) else np.asarray(value)
        if isinstance(type_, federated_language.TensorType):
            arr = _check_tensor(arr, type_, path)
        out[binding.tensor.index] = arr
        return
    elements = binding.struct.element
    if not isinstance(value, structure.Struct) or len(value) != len(elements):
        got = f"a struct of {len(value)} elements" if isinstance(
            value, structure.Struct) else f"a {type(value).__name__}"
        raise ComputationError(
            f"Xla parameter {path or '<arg>'}: expected a struct of {len(elements)} "
            f"elements, got {got}"
        )
    types = [t for _, t in type_.items()] if isinstance(
        type_, federated_language.StructType) else [None] * len(elements)
    for i, (b, v, t) in enumerate(zip(elements, value, types)):
        _flatten_arg(v, b, t, f"{path}[{i}]", out)


def _check_tensor(arr: np.ndarray, type_: federated_language.TensorType, path: str):
    shape = type_.shape or ()
    if len(arr.shape) != len(shape) or any(
            d is not None and d != a for d, a in zip(shape, arr.shape)):
        raise ComputationError(
            f"Xla parameter {path or '<arg>'}: expected {type_}, got shape "
            f"{list(arr.shape)} ({arr.dtype})"
        )
    if arr.dtype != type_.dtype:
        if not np.can_cast(arr.dtype, type_.dtype, casting="same_kind"):
            raise ComputationError(
                f"Xla parameter {path or '<arg>'}: expected dtype {type_.dtype}, got "
                f"{arr.dtype}"
            )
        arr = arr.astype(type_.dtype)
    return arr


def _pack_result(outputs, binding, type_):
    kind = binding.WhichOneof("binding")
    if kind == "tensor":
        return outputs[binding.tensor.index]
    names = [n for n, _ in type_.items()] if isinstance(
        type_, federated_language.StructType) else [None] * len(binding.struct.element)
    types = [t for _, t in type_.items()] if isinstance(
        type_, federated_language.StructType) else [None] * len(binding.struct.element)
    if len(names) != len(binding.struct.element):
        raise ComputationError(
            f"the Xla result binding has {len(binding.struct.element)} elements but the "
            f"result type {type_} has {len(names)}"
        )
    return structure.Struct([
        (n, _pack_result(outputs, b, t))
        for n, b, t in zip(names, binding.struct.element, types)
    ])


def xla_function(comp: computation_pb2.Computation) -> LocalFn:
    """A python callable running one `Xla` computation with TFF's binding convention."""
    xla = comp.xla
    if xla.hlo_module.type_url != hlo.HLO_MODULE_TYPE_URL:
        raise ComputationError(
            f"an Xla computation's hlo_module must be an Any of `{hlo.HLO_MODULE_TYPE_URL}`, got "
            f"`{xla.hlo_module.type_url}`"
        )
    fn_type = parse_type(comp.type)
    if not isinstance(fn_type, federated_language.FunctionType):
        raise ComputationError(f"an Xla computation must have a function type, got {fn_type}")
    exe = _executable(xla.hlo_module.value)
    has_param = xla.HasField("parameter")
    if has_param != (fn_type.parameter is not None):
        raise ComputationError(
            f"the Xla computation of type {fn_type} "
            f"{'has' if has_param else 'lacks'} a parameter binding"
        )
    param_indices = _count_tensors(xla.parameter, "parameter") if has_param else []
    if sorted(param_indices) != list(range(len(exe.parameters))):
        raise ComputationError(
            f"the Xla parameter binding names HLO parameters {sorted(param_indices)}, but "
            f"the HLO module has {len(exe.parameters)} parameters"
        )
    if not xla.HasField("result"):
        raise ComputationError("the Xla computation has no result binding")
    result_indices = _count_tensors(xla.result, "result")
    if any(not 0 <= i < len(exe.results) for i in result_indices):
        raise ComputationError(
            f"the Xla result binding names outputs {result_indices}, but the HLO module "
            f"has {len(exe.results)} outputs"
        )
    n_params = len(exe.parameters)

    def run(arg=None):
        flat: dict[int, np.ndarray] = {}
        if has_param:
            _flatten_arg(arg, xla.parameter, fn_type.parameter, "", flat)
        args = [flat[i] for i in range(n_params)]
        if any(hlo.is_traced(a) for a in args):  # inside `client_map`'s batched function
            outputs = exe.call_traced(args)
        else:
            outputs = exe(args)
        return _pack_result(outputs, xla.result, fn_type.result)

    return run
