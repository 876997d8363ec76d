"""The one evaluator of the federated_language `Computation` grammar.

`compile_node(comp, table)` turns a computation into a node: a python function of an
environment (a dict of the names bound around it) returning the computation's value.
A node is built once and run as often as needed, so a repeated call costs only the calls
its parts make. Every case of the grammar is handled here, once: Reference, Lambda (its
value a `Closure`), Block, Call, Struct, Selection, Literal and Xla (a `LocalFunction`).
What an intrinsic does depends on where the computation runs, so intrinsics come from an
`IntrinsicTable` (keyed by URI), as do the meanings of `Data` and `Placement`
computations where a table has them:

- `local_eval.LOCAL`: local computations (the generic intrinsics), and
  `local_eval.AT_SERVER`: a round's server steps on the coordinator, where a SERVER value
  is its member (the SERVER intrinsics with a local meaning too); both behind
  `local_eval.compile_local`;
- `intrinsics.PLACED`: placed computations over a clients backend, behind
  `interpreter.evaluate`; its nodes find the running evaluation in the environment under
  `RUN`.

An evaluation counts its calls and the Structs it builds against `max_eval_steps`
(`runtime/limits.py`), each evaluation on its own (`counted`). The values of the
grammar's leaves that every reader of a proto shares are read here too: types
(`parse_type`), literals (`read_literal`), selections (`select_element`).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import threading
from typing import Any, Callable, Mapping, Optional

import federated_language
import numpy as np
from federated_language.common_libs import structure
from federated_language.compiler import array as fl_array
from federated_language.proto import computation_pb2
from google.protobuf.message import DecodeError

from fax_bridge.errors import ComputationError
from fax_bridge.runtime import grammar, limits
from fax_bridge.runtime.xla_function import xla_function

Computation = computation_pb2.Computation
Env = dict
Node = Callable[[Env], Any]
# (the Intrinsic computation, its parsed type or None) -> the node of its value
IntrinsicBuilder = Callable[[Computation, Optional[federated_language.Type]], Node]


class _RunKey:
    """The environment key of a running placed evaluation: not a str, so no name a
    proto binds can equal it."""

    def __repr__(self) -> str:
        return "RUN"


RUN = _RunKey()


# ---------------------------------------------------------------------------------------
# Function values.


class Closure:
    """A Lambda's value: the Lambda, the environment it was evaluated in, its body."""

    __slots__ = ("comp", "env", "_param", "_body")

    def __init__(self, comp: Computation, env: Env, param: str, body: Node):
        self.comp, self.env, self._param, self._body = comp, env, param, body

    def __call__(self, *arg):
        if not self._param:
            return self._body(self.env)
        if not arg:
            raise ComputationError(
                f"the Lambda of parameter `{self._param}` was called without an argument")
        env = dict(self.env)
        env[self._param] = arg[0]
        return self._body(env)


class LocalFunction:
    """An Xla computation's value: its proto, run by `xla_function` (compiled on the
    first call where the table defers it: a placed computation's per-client parts run on
    the clients, not here). `guard`, when set, checks each argument first."""

    __slots__ = ("comp", "_type", "_fn", "_guard")

    def __init__(self, comp: Computation, fn_type, guard: Optional[Callable] = None):
        self.comp, self._type, self._fn, self._guard = comp, fn_type, None, guard

    def function(self) -> Callable:
        """The compiled callable (compiled now if not yet)."""
        if self._fn is None:
            self._fn = xla_function(self.comp, self._type)
        return self._fn

    def __call__(self, *arg):
        if self._guard is not None and arg:
            self._guard(arg[0])
        fn = self._fn
        return (fn if fn is not None else self.function())(*arg)


class IntrinsicFunction:
    """An intrinsic's value: its URI and type signature, and what a table makes it do."""

    __slots__ = ("uri", "type_signature", "_call")

    def __init__(self, uri: str, type_signature, call: Callable):
        self.uri, self.type_signature, self._call = uri, type_signature, call

    def __call__(self, *arg):
        return self._call(*arg)


FUNCTION_VALUES = (Closure, LocalFunction, IntrinsicFunction)


def has_leaf(value: Any, kinds: tuple) -> bool:
    """Whether a leaf of `value` is one of `kinds`; each shared part is visited once."""
    seen: set[int] = set()
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, structure.Struct):
            if id(v) not in seen:
                seen.add(id(v))
                stack.extend(v)
        elif isinstance(v, kinds):
            return True
    return False


# ---------------------------------------------------------------------------------------
# Steps: calls counted per evaluation.

class _Steps(threading.local):
    """The running evaluation's count of steps, per thread."""

    count = 0
    what = "the computation"


_steps = _Steps()


def count_steps(count: int = 1) -> None:
    """Counts `count` steps of the running evaluation against `max_eval_steps`."""
    _steps.count += count
    if _steps.count > limits.LIMITS.max_eval_steps:
        raise limits.too_many_steps(_steps.what)


def counted(fn: Callable, what: str) -> Callable:
    """`fn`, each call of it one evaluation (`what` in the message past the cap) with
    its own count of steps; the count of an evaluation it runs inside is kept."""

    def run(*arg):
        steps = _steps
        saved_count, saved_what = steps.count, steps.what
        steps.count, steps.what = 0, what
        try:
            return fn(*arg)
        finally:
            steps.count, steps.what = saved_count, saved_what

    return run


def apply(fn: Any, *arg: Any) -> Any:
    """A Call: `fn(*arg)`, counted, once `fn` is checked to be a function value."""
    if not callable(fn):
        raise ComputationError(
            f"a Call's function evaluated to a non-function value ({type(fn).__name__})")
    count_steps()
    return fn(*arg)


# ---------------------------------------------------------------------------------------
# Intrinsic tables.


@dataclasses.dataclass(frozen=True)
class IntrinsicTable:
    """What intrinsics (and Data, Placement computations) mean where a computation runs.

    `name`: what runs, in messages ("a local computation"). `intrinsics`: a node builder
    by URI. `refusal(uri)`: the message for an intrinsic not in the table. `typed`:
    whether every intrinsic must carry its type signature. `data`, `placement`: node
    builders of those cases (None: refused). `defer_xla`: whether Xla parts compile on
    their first call rather than when built. `local_guard`: a check of every argument an
    Xla part is called on. `direct_calls`: by URI, the node of a call of that intrinsic
    on a Struct computation, built from the nodes of the Struct's elements (so a
    `federated_apply(<f, x>)` at the server calls `f(x)` without building the pair: a
    `Struct` costs more to build than a call).
    """

    name: str
    intrinsics: Mapping[str, IntrinsicBuilder]
    refusal: Callable[[str], str]
    typed: bool = False
    data: Optional[Callable[[Computation], Node]] = None
    placement: Optional[Callable[[Computation], Node]] = None
    defer_xla: bool = False
    local_guard: Optional[Callable[[Any], None]] = None
    direct_calls: Mapping[str, Callable[[list], Node]] = dataclasses.field(
        default_factory=dict)


@dataclasses.dataclass(frozen=True)
class _Scope:
    """What a node is built in: the names bound around it, and the table."""

    names: frozenset
    table: IntrinsicTable

    def bind(self, name: str) -> "_Scope":
        return _Scope(self.names | {name}, self.table)


def compile_node(comp: Computation, table: IntrinsicTable, names=()) -> Node:
    """The node of `comp` under `table`, in an environment binding `names`.

    Raises ComputationError for a case, intrinsic or name the table cannot give a
    meaning to, wherever it sits in `comp`."""
    return _build(comp, _Scope(frozenset(names), table))


def _build(comp: Computation, scope: _Scope) -> Node:
    return _BUILDERS[grammar.case(comp)](comp, scope)


def _build_reference(comp, scope):
    name = comp.reference.name
    if name not in scope.names:
        raise ComputationError(
            f"reference to unbound name `{name}` in {scope.table.name} (names bound here: "
            f"{', '.join(sorted(scope.names)) or 'none'}); bind it in an enclosing Lambda "
            "or Block")
    return operator.itemgetter(name)


def _build_lambda(comp, scope):
    lam = grammar.lambda_of(comp)
    param = lam.parameter_name
    body = _build(lam.result, scope.bind(param) if param else scope)
    return lambda env: Closure(comp, env, param, body)


def _build_block(comp, scope):
    locals_ = []
    for local in comp.block.local:
        if not local.name:
            raise ComputationError("a Block local has an empty name; name each local")
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
    direct = _direct_call(comp, scope)
    if direct is not None:
        return direct
    fn = _build(comp.call.function, scope)
    if comp.call.HasField("argument"):
        arg = _build(comp.call.argument, scope)
        return lambda env: apply(fn(env), arg(env))
    return lambda env: apply(fn(env))


def _direct_call(comp, scope) -> Optional[Node]:
    """The table's direct node of an intrinsic called on a Struct computation, or None."""
    call = grammar.intrinsic_call(comp)
    if call is None or call[0] not in scope.table.direct_calls or call[1] is None or \
            grammar.case(call[1]) != "struct":
        return None
    _build(comp.call.function, scope)  # the intrinsic refused or typed as the table says
    elements = [_build(e.value, scope) for e in call[1].struct.element]
    return scope.table.direct_calls[call[0]](elements)


def _build_struct(comp, scope):
    elements = [(e.name or None, _build(e.value, scope)) for e in comp.struct.element]

    def run(env):
        count_steps()  # a Struct costs more to build than a call: counted as one
        return structure.Struct([(n, node(env)) for n, node in elements])

    return run


def _build_selection(comp, scope):
    source = _build(comp.selection.source, scope)
    index = comp.selection.index
    return lambda env: select_element(source(env), index)


def _build_literal(comp, scope):
    value = read_literal(comp.literal)
    return lambda env: value


def _build_xla(comp, scope):
    table = scope.table
    value = LocalFunction(comp, parse_type(comp.type), table.local_guard)
    if not table.defer_xla:
        value.function()
    return lambda env: value


def _build_intrinsic(comp, scope):
    uri = comp.intrinsic.uri
    table = scope.table
    type_ = parse_type(comp.type)
    if table.typed and type_ is None:
        raise ComputationError(f"intrinsic `{uri}` has no type signature")
    builder = table.intrinsics.get(uri)
    if builder is None:
        raise ComputationError(table.refusal(uri))
    return builder(comp, type_)


def _by_table(kind: str):
    def build(comp, scope):
        meaning = getattr(scope.table, kind)
        if meaning is None:
            raise ComputationError(
                f"{scope.table.name} cannot hold a `{kind}` computation; only Xla, Lambda, "
                "Block, Call, Struct, Selection, Reference, Literal and the intrinsics "
                "with a meaning there run in it")
        return meaning(comp)
    return build


_BUILDERS = grammar.handlers({
    "reference": _build_reference,
    "lambda": _build_lambda,
    "block": _build_block,
    "call": _build_call,
    "struct": _build_struct,
    "selection": _build_selection,
    "literal": _build_literal,
    "xla": _build_xla,
    "intrinsic": _build_intrinsic,
    "data": _by_table("data"),
    "placement": _by_table("placement"),
})


# ---------------------------------------------------------------------------------------
# The grammar's leaves.


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


_LIST_NAMES = {"DT_FLOAT": "float32", "DT_DOUBLE": "float64", "DT_HALF": "float16"}


def _list_of(dtype: int):
    """The name of the Array proto's list that holds values of DataType `dtype`
    (`int32_list` for DT_INT32); None for a number that names no DataType."""
    from federated_language.proto import data_type_pb2

    try:
        name = data_type_pb2.DataType.Name(dtype)
    except ValueError:
        return None
    if name == "DT_INVALID":
        return None
    return f"{_LIST_NAMES.get(name, name[3:].lower())}_list"


def read_literal(literal) -> np.ndarray:
    """The array of a `Literal` proto, its declared shape checked against the caps first.
    Read-only: a node returns the same array on every run."""
    shape = literal.value.shape
    dims = list(shape.dim) if shape is not None else []
    limits.tensor_bytes(dims, 1, "a Literal")
    # The array is read from the list its dtype names: values held in another kind's
    # list would be ignored (an int32 literal of float32 values read as no values).
    held, wanted = literal.value.WhichOneof("kind"), _list_of(literal.value.dtype)
    if held is not None and wanted is not None and held != wanted:
        raise ComputationError(
            f"a Literal of dtype {wanted[:-5]} holds its values in {held}; put them in "
            f"{wanted}, or declare the dtype of the values it holds")
    try:
        value = np.array(fl_array.from_proto(literal.value))
    except Exception as e:
        raise ComputationError(f"cannot read a Literal's array: {e}") from e
    value.setflags(write=False)
    return value


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
