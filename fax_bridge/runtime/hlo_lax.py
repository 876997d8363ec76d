"""Reads a StableHLO module into jax `lax` operations, so that jax can transform it.

An exported computation's local parts are HLO modules. Called as a module
(`HloExecutable.call_traced`, a `jax.export.Exported`) a part has no batching rule:
`jax.vmap` over clients is impossible and `client_map` loops over them. `read` walks the
module's `func.func @main` once, with jaxlib's MLIR bindings, into a `Program`: a python
function of jax values that emits, op by op, the `lax` call XLA lowers back to the same
StableHLO op (the op table is `hlo_lax_ops`). Regions (a reduction's body, a loop's
condition and body, a case's branches) and `func.call`ed functions become python
callables read the same way. Being plain jax, the program vmaps, differentiates and
fuses with its caller like any jax function; the module may come from fax_bridge's
export, TFF or any tool that writes HLO.

Where a module holds an op the table does not know (or an attribute it does not read,
such as a sort's custom comparator), `read` raises `Unreadable` naming the op and its
source location: its caller runs the module as a module instead. The program holds no
MLIR object: it may be called from any thread, after the context it was read in is gone.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Optional, Sequence

from jax._src.interpreters import mlir as _mlir
from jax._src.lib.mlir import ir as _ir

from fax_bridge.runtime import hlo_lax_ops

_FILE_LINE = re.compile(r'"([^"]+)":(\d+):\d+')
_NAME = re.compile(r'loc\("([^"]+)"')
Unreadable = hlo_lax_ops.Unreadable
element_dtype = hlo_lax_ops.element_dtype
tensor_type = hlo_lax_ops.tensor_type


def where(location) -> str:
    """The op's name in its source and its file:line, from an MLIR location."""
    text = str(location)
    names = _NAME.findall(text)
    line = _FILE_LINE.search(text)
    parts = [names[0]] if names else []
    if line:
        parts.append(f"{line.group(1)}:{line.group(2)}")
    return " at ".join(parts) or "an unknown location"


@dataclasses.dataclass(frozen=True)
class _Step:
    run: Callable          # (input values, env) -> output values
    inputs: tuple          # value ids
    outputs: tuple         # value ids


@dataclasses.dataclass(frozen=True)
class Function:
    """A function body or a region: parameters, steps and results, by value id."""

    params: tuple
    steps: tuple
    results: tuple

    def __call__(self, *args, env: Optional[dict] = None) -> list:
        """The results for `args`; `env`: the enclosing values a region may use."""
        values = dict(env or {})
        if len(args) != len(self.params):
            raise ValueError(f"the function takes {len(self.params)} values, got {len(args)}")
        values.update(zip(self.params, args))
        for step in self.steps:
            outs = step.run([values[i] for i in step.inputs], values)
            values.update(zip(step.outputs, outs))
        return [values[i] for i in self.results]


class _Reader:
    """Turns one module's functions into `Function`s (the context the op table reads
    regions and callees through)."""

    def __init__(self, module):
        self.ids: dict = {}
        self.symbols = {_ir.StringAttr(op.attributes["sym_name"]).value: op
                        for op in module.body.operations if op.operation.name == "func.func"}
        self.functions: dict[str, Function] = {}

    def id(self, value) -> int:
        return self.ids.setdefault(value, len(self.ids))

    def function(self, name: str) -> Function:
        """The `func.func @name` of the module, read once."""
        if name not in self.functions:
            op = self.symbols.get(name)
            if op is None:
                raise Unreadable(f"a call of `@{name}`, which the module does not define")
            self.functions[name] = None  # a call cycle reads as unknown, not forever
            self.functions[name] = self.region(op.regions[0])
        found = self.functions[name]
        if found is None:
            raise Unreadable(f"`@{name}` calls itself")
        return found

    def region(self, region) -> Function:
        """One region (one block) as a `Function` of its block arguments."""
        blocks = list(region.blocks)
        if len(blocks) != 1:
            raise Unreadable(f"a region of {len(blocks)} blocks")
        block = blocks[0]
        for arg in block.arguments:
            tensor_type(arg.type)
        params = tuple(self.id(a) for a in block.arguments)
        steps, results = [], None
        for op in block.operations:
            if op.operation.name in ("func.return", "stablehlo.return"):
                results = tuple(self.id(v) for v in op.operands)
                break
            steps.append(self.step(op))
        if results is None:
            raise Unreadable("a region without a return")
        return Function(params, tuple(steps), results)

    def step(self, op) -> _Step:
        name = op.operation.name
        build = hlo_lax_ops.TABLE.get(name)
        if build is None:
            raise Unreadable(f"op `{name}` ({where(op.location)}) has no lax reading")
        try:
            for result in op.results:
                if result.type.typeid != _ir.TupleType.static_typeid:
                    tensor_type(result.type)
            run = build(op, self)
        except Unreadable as e:
            raise Unreadable(f"op `{name}` ({where(op.location)}): {e}") from None
        return _Step(run, tuple(self.id(v) for v in op.operands),
                     tuple(self.id(v) for v in op.results))


@dataclasses.dataclass(frozen=True)
class Program:
    """A module's `main` as a function of jax values (`__call__`), with its signature."""

    main: Function
    parameters: tuple      # (shape, dtype) per parameter
    results: tuple         # (shape, dtype) per result (a tuple result flattened)

    def __call__(self, *args) -> list:
        if len(args) != len(self.parameters):
            raise ValueError(f"the module takes {len(self.parameters)} parameters, got "
                             f"{len(args)}")
        return _flat(self.main(*args))


def _flat(values: Sequence) -> list:
    out: list = []
    for v in values:
        out.extend(_flat(v) if isinstance(v, tuple) else [v])
    return out


def flat_types(types) -> list:
    """MLIR types with each tuple type replaced by its elements, in order (the results
    of a `main` that XLA's HLO import gives a tuple)."""
    out: list = []
    for t in types:
        if t.typeid == _ir.TupleType.static_typeid:
            tup = _ir.TupleType(t)
            out.extend(tup.get_type(i) for i in range(tup.num_types))
        else:
            out.append(t)
    return out


def read(stablehlo: bytes) -> Program:
    """The module (StableHLO text or bytecode) as a `Program`; raises `Unreadable`
    naming the first op, type or attribute it cannot read as lax operations."""
    with _mlir.make_ir_context():
        module = _ir.Module.parse(stablehlo)
        reader = _Reader(module)
        main = reader.symbols.get("main")
        if main is None:
            raise Unreadable("the module has no entry function `main`")
        fn_type = _ir.FunctionType(_ir.TypeAttr(main.attributes["function_type"]).value)
        params = tuple(tensor_type(t) for t in fn_type.inputs)
        results = tuple(tensor_type(t) for t in flat_types(fn_type.results))
        return Program(reader.function("main"), params, results)
