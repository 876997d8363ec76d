"""Structural checks of an HloModuleProto before XLA reads it.

XLA trusts the modules it is given: some inconsistencies it reports as errors, others
stop the process on an internal CHECK (a tuple shape whose length differs from its
tuple's operands) or crash it. `check_module` parses the bytes with the schema in
protos/fax_bridge/v1/hlo_module.proto (XLA's field numbers) and refuses, naming the
fault, every module whose

- shapes are malformed: an element type XLA does not define, a negative dimension, an
  array with tuple elements or a tuple with dimensions, dynamic-dimension flags that do
  not match the dimensions, a layout's `minor_to_major` that is not a permutation of the
  dimensions, a layout with tiles, element sizes or memory spaces (jax exports none);
- references dangle: an operand or control predecessor that is not an earlier (resp.
  any) instruction of the same computation, a called computation that is not an earlier
  one, a root id or an entry computation id that names nothing, duplicate ids;
- signatures disagree: parameter numbers that are not 0..n-1, parameter or root shapes
  that differ from the computation's program shape, a host program shape that differs
  from the entry computation's;
- instructions are malformed: an unknown opcode, a wrong operand count for operations
  of fixed arity, a `tuple` whose shape does not list its operands' shapes, a
  `get-tuple-element` whose index or shape does not fit its operand.

What these checks cannot prove safe (every operation's own attributes) is left to the
XLA import, which `hlo.py` runs in a separate process.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

from google.protobuf.message import DecodeError

from fax_bridge.errors import HloModuleError
from fax_bridge.v1 import hlo_module_pb2

TUPLE, OPAQUE, TOKEN = 13, 14, 17
# xla.PrimitiveType numbers of this XLA version (`xla_client.PrimitiveType`), 0 excepted.
ELEMENT_TYPES = {
    1: "pred", 2: "s8", 3: "s16", 4: "s32", 5: "s64", 6: "u8", 7: "u16", 8: "u32",
    9: "u64", 10: "f16", 11: "f32", 12: "f64", 13: "tuple", 14: "opaque", 15: "c64",
    16: "bf16", 17: "token", 18: "c128", 19: "f8e5m2", 20: "f8e4m3fn", 21: "s4", 22: "u4",
    23: "f8e4m3b11fnuz", 24: "f8e5m2fnuz", 25: "f8e4m3fnuz", 28: "f8e4m3", 29: "f8e3m4",
    32: "f4e2m1fn", 33: "f8e8m0fnu",
}
# The opcodes are those of the XLA versions of jaxlib 0.10.2 to 0.12.x together (jax
# 0.12 writes cosh, sinh, exp2, log2 and fma where older ones wrote expansions): an XLA
# that lacks one refuses it itself, as an unknown opcode, an error and no crash.
_UNARY = ("abs", "acos", "acosh", "asin", "asinh", "atanh", "bitcast", "bitcast-convert",
          "broadcast", "cbrt", "ceil", "convert", "copy", "cosh", "cosine",
          "count-leading-zeros", "erf", "exp2", "exponential", "exponential-minus-one",
          "floor", "get-dimension-size", "imag", "is-finite", "log", "log2", "log-plus-one",
          "logistic", "negate", "not", "popcnt", "real", "reduce-precision", "reshape",
          "reverse", "round-nearest-afz", "round-nearest-even", "rsqrt", "sign", "sine",
          "sinh", "slice", "sqrt", "tan", "tanh", "transpose", "get-tuple-element")
_BINARY = ("add", "and", "atan2", "compare", "complex", "divide", "maximum",
           "minimum", "multiply", "or", "pad", "power", "remainder", "shift-left",
           "shift-right-arithmetic", "shift-right-logical", "subtract", "xor",
           "stochastic-convert", "set-dimension-size", "add-dependency")
_TERNARY = ("clamp", "fma", "select")
_NULLARY = ("constant", "iota", "parameter", "partition-id", "replica-id",
            "rng-get-and-update-state")
# Operand counts of the operations of fixed arity.
ARITY = {**{op: 1 for op in _UNARY}, **{op: 2 for op in _BINARY},
         **{op: 3 for op in _TERNARY}, **{op: 0 for op in _NULLARY}}
# Every other operation of these XLA versions (any operand count here; `dot` too, as a
# sparse dot has more than two).
_VARIADIC = (
    "after-all", "all-gather", "all-gather-done", "all-gather-start", "all-reduce",
    "all-reduce-done", "all-reduce-start", "all-to-all", "async-done", "async-start",
    "async-update", "batch-norm-grad", "batch-norm-inference", "batch-norm-training",
    "call", "cholesky", "collective-broadcast", "collective-permute",
    "collective-permute-done", "collective-permute-start", "concatenate", "conditional",
    "convolution", "copy-done", "copy-start", "custom-call", "domain", "dot",
    "dynamic-reshape", "dynamic-slice", "dynamic-update-slice", "fft", "fusion", "gather",
    "infeed", "map", "opt-barrier", "outfeed", "ragged-all-to-all", "ragged-dot", "recv",
    "recv-done", "reduce", "reduce-scatter", "reduce-window", "rng", "rng-bit-generator",
    "scaled-dot", "scatter", "select-and-scatter", "send", "send-done", "sort", "topk",
    "triangular-solve", "tuple", "while")
OPCODES = frozenset(ARITY) | frozenset(_VARIADIC)
MAX_ELEMENTS = 1 << 62
_SUB_BYTE_BITS = {21: 4, 22: 4, 32: 4}


class _Refused(Exception):
    """A fault found in the module; `check_module` names the module around it."""


def module_label(module: bytes) -> str:
    """How errors name a module: its `name` field (when readable) and its sha256."""
    digest = hashlib.sha256(module).hexdigest()[:12]
    try:
        name = hlo_module_pb2.Module.FromString(module).name
    except (DecodeError, RuntimeError, ValueError):
        name = ""
    return f"HloModuleProto `{name[:80]}` (sha256 {digest})" if name else \
        f"HloModuleProto (sha256 {digest})"


def check_module(module: bytes) -> hlo_module_pb2.Module:
    """Parses serialized HloModuleProto bytes and checks their structure (see the module
    docstring). Returns the parsed module; raises `HloModuleError` naming the fault."""
    try:
        parsed = hlo_module_pb2.Module.FromString(module)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise HloModuleError(
            f"the Xla computation's hlo_module bytes are not a serialized "
            f"xla.HloModuleProto ({e}); export Xla computations with fax_bridge or jax "
            "(`as_serialized_hlo_module_proto()`)") from None
    try:
        _check(parsed)
    except _Refused as e:
        raise HloModuleError(
            f"the Xla computation's {module_label(module)} is malformed: {e}. It was "
            "refused before XLA read it; re-export the computation (the bytes may be "
            "damaged)") from None
    return parsed


def _check(module: hlo_module_pb2.Module) -> None:
    if not module.computations:
        raise _Refused("it has no computations")
    seen: dict[int, hlo_module_pb2.Computation] = {}
    for comp in module.computations:
        where = f"computation `{comp.name[:80]}` (id {comp.id})"
        if comp.id in seen:
            raise _Refused(f"{where} reuses the id of an earlier computation")
        _check_computation(comp, where, seen)
        seen[comp.id] = comp
    entry = seen.get(module.entry_computation_id)
    if entry is None:
        raise _Refused(f"its entry computation id {module.entry_computation_id} names no "
                       "computation")
    if module.entry_computation_name and module.entry_computation_name != entry.name:
        raise _Refused(f"its entry computation is named `{module.entry_computation_name[:80]}`"
                       f" but computation {entry.id} is `{entry.name[:80]}`")
    if not module.HasField("host_program_shape"):
        raise _Refused("it has no host program shape")
    _check_program(module.host_program_shape, "the host program shape")
    _same_program(module.host_program_shape, _program_of(entry), "the host program shape",
                  "the entry computation's")


def _program_of(comp: hlo_module_pb2.Computation) -> hlo_module_pb2.ProgramShape:
    """The computation's signature as its instructions define it."""
    program = hlo_module_pb2.ProgramShape()
    params = sorted((i.parameter_number, i) for i in comp.instructions
                    if i.opcode == "parameter")
    for _, ins in params:
        program.parameters.add().CopyFrom(ins.shape)
    root = next(i for i in comp.instructions if i.id == comp.root_id)
    program.result.CopyFrom(root.shape)
    return program


def _check_program(program: hlo_module_pb2.ProgramShape, where: str) -> None:
    for i, shape in enumerate(program.parameters):
        _check_shape(shape, f"{where}'s parameter {i}")
    _check_shape(program.result, f"{where}'s result")
    if program.parameter_names and len(program.parameter_names) != len(program.parameters):
        raise _Refused(f"{where} names {len(program.parameter_names)} parameters but has "
                       f"{len(program.parameters)}")


def _same_program(a, b, a_name: str, b_name: str) -> None:
    if len(a.parameters) != len(b.parameters):
        raise _Refused(f"{a_name} has {len(a.parameters)} parameters, {b_name} "
                       f"{len(b.parameters)}")
    for i, (x, y) in enumerate(zip(a.parameters, b.parameters)):
        _same_shape(x, y, f"{a_name}'s parameter {i}", f"{b_name}")
    _same_shape(a.result, b.result, f"{a_name}'s result", f"{b_name}")


def _text(shape: hlo_module_pb2.Shape) -> str:
    if shape.element_type == TUPLE:
        return "(" + ", ".join(_text(t) for t in shape.tuple_shapes) + ")"
    name = ELEMENT_TYPES.get(shape.element_type, f"type{shape.element_type}")
    return f"{name}{list(shape.dimensions)}"


def _compatible(a: hlo_module_pb2.Shape, b: hlo_module_pb2.Shape) -> bool:
    """Same element type, dimensions and tuple structure (layouts aside)."""
    if a.element_type != b.element_type or list(a.dimensions) != list(b.dimensions):
        return False
    if len(a.tuple_shapes) != len(b.tuple_shapes):
        return False
    return all(_compatible(x, y) for x, y in zip(a.tuple_shapes, b.tuple_shapes))


def _same_shape(a, b, a_name: str, b_name: str) -> None:
    if not _compatible(a, b):
        raise _Refused(f"{a_name} is {_text(a)} but {b_name} says {_text(b)}")


def _check_shape(shape: hlo_module_pb2.Shape, where: str) -> None:
    kind = shape.element_type
    if kind not in ELEMENT_TYPES:
        raise _Refused(f"{where} has element type {kind}, which XLA does not define")
    dims = list(shape.dimensions)
    if kind in (TUPLE, OPAQUE, TOKEN):
        if dims or shape.is_dynamic_dimension or shape.HasField("layout") and (
                shape.layout.minor_to_major or shape.layout.tiles):
            raise _Refused(f"{where} is a {ELEMENT_TYPES[kind]} with dimensions or a layout")
        if kind != TUPLE and shape.tuple_shapes:
            raise _Refused(f"{where} is a {ELEMENT_TYPES[kind]} with tuple elements")
        for i, element in enumerate(shape.tuple_shapes):
            _check_shape(element, f"{where}'s element {i}")
        return
    if shape.tuple_shapes:
        raise _Refused(f"{where} is an array ({_text(shape)}) with tuple elements")
    if any(d < 0 for d in dims):
        raise _Refused(f"{where} has a negative dimension ({dims})")
    count = 1
    for d in dims:
        count *= d
    if count > MAX_ELEMENTS:
        raise _Refused(f"{where} has {count} elements, more than XLA can address")
    if shape.is_dynamic_dimension and len(shape.is_dynamic_dimension) != len(dims):
        raise _Refused(f"{where} has {len(shape.is_dynamic_dimension)} dynamic-dimension "
                       f"flags for {len(dims)} dimensions")
    if shape.HasField("layout"):
        _check_layout(shape.layout, len(dims), kind, where)


def _check_layout(layout: hlo_module_pb2.Layout, rank: int, kind: int, where: str) -> None:
    """A dimension order and nothing else (no tiles, element sizes, memory spaces):
    modules exported from jax carry no more."""
    order = list(layout.minor_to_major)
    if order and sorted(order) != list(range(rank)):
        raise _Refused(f"{where}'s layout minor_to_major {order[:16]} is not a permutation "
                       f"of its {rank} dimensions")
    if layout.tiles or layout.HasField("physical_shape") or layout.memory_space:
        raise _Refused(f"{where}'s layout has tiles, a physical shape or a memory space")
    if layout.element_size_in_bits not in (0, _SUB_BYTE_BITS.get(kind, 0)):
        raise _Refused(f"{where}'s layout sets {layout.element_size_in_bits} bits an element "
                       f"for {ELEMENT_TYPES[kind]}")


def _check_computation(comp: hlo_module_pb2.Computation, where: str,
                       earlier: dict[int, hlo_module_pb2.Computation]) -> None:
    if not comp.instructions:
        raise _Refused(f"{where} has no instructions")
    shapes: dict[int, hlo_module_pb2.Shape] = {}
    params: dict[int, hlo_module_pb2.Instruction] = {}
    for ins in comp.instructions:
        at = f"instruction `{ins.name[:80]}` (id {ins.id}) of {where}"
        if ins.id in shapes:
            raise _Refused(f"{at} reuses the id of an earlier instruction")
        _check_instruction(ins, at, shapes, earlier, comp.id)
        if ins.opcode == "parameter":
            if ins.parameter_number in params:
                raise _Refused(f"{at} is parameter {ins.parameter_number} a second time")
            params[ins.parameter_number] = ins
        shapes[ins.id] = ins.shape
    ids = set(shapes)
    for ins in comp.instructions:
        missing = [i for i in ins.control_predecessor_ids if i not in ids or i == ins.id]
        if missing:
            raise _Refused(f"instruction `{ins.name[:80]}` of {where} has control "
                           f"predecessors {missing[:8]} that are no other instruction of it")
    if sorted(params) != list(range(len(params))):
        raise _Refused(f"{where} numbers its parameters {sorted(params)[:16]}, not "
                       f"0..{len(params) - 1}")
    if comp.root_id not in ids:
        raise _Refused(f"{where} names root id {comp.root_id}, which is none of its "
                       "instructions")
    if comp.HasField("program_shape"):
        _check_program(comp.program_shape, f"{where}'s program shape")
        _same_program(comp.program_shape, _program_of(comp), f"{where}'s program shape",
                      "its instructions")


def _check_instruction(ins: hlo_module_pb2.Instruction, at: str,
                       shapes: dict[int, hlo_module_pb2.Shape],
                       earlier: dict[int, hlo_module_pb2.Computation], own_id: int) -> None:
    if ins.opcode not in OPCODES:
        raise _Refused(f"{at} has opcode `{ins.opcode[:40]}`, which XLA does not define")
    if not ins.HasField("shape"):
        raise _Refused(f"{at} has no shape")
    _check_shape(ins.shape, f"the shape of {at}")
    for i, shape in enumerate(ins.operand_shapes_with_layout):
        _check_shape(shape, f"operand shape {i} of {at}")
    if ins.HasField("outfeed_shape"):
        _check_shape(ins.outfeed_shape, f"the outfeed shape of {at}")
    missing = [i for i in ins.operand_ids if i not in shapes]
    if missing:
        raise _Refused(f"{at} has operands {missing[:8]} that are no earlier instruction of "
                       "its computation")
    arity = ARITY.get(ins.opcode)
    if arity is not None and len(ins.operand_ids) != arity:
        raise _Refused(f"{at} is a `{ins.opcode}` with {len(ins.operand_ids)} operands, "
                       f"not {arity}")
    called = [c for c in ins.called_computation_ids if c not in earlier]
    if called:
        what = "itself" if own_id in called else "no earlier computation of the module"
        raise _Refused(f"{at} calls computations {called[:8]}: {what}")
    if ins.opcode == "parameter" and ins.parameter_number < 0:
        raise _Refused(f"{at} has parameter number {ins.parameter_number}")
    if ins.opcode == "tuple":
        _check_tuple(ins, at, [shapes[i] for i in ins.operand_ids])
    elif ins.opcode == "get-tuple-element":
        source = shapes[ins.operand_ids[0]]
        if source.element_type != TUPLE:
            raise _Refused(f"{at} takes an element of {_text(source)}, which is no tuple")
        if not 0 <= ins.tuple_index < len(source.tuple_shapes):
            raise _Refused(f"{at} takes element {ins.tuple_index} of a tuple of "
                           f"{len(source.tuple_shapes)}")
        _same_shape(ins.shape, source.tuple_shapes[ins.tuple_index], f"the shape of {at}",
                    f"element {ins.tuple_index} of its operand")


def _check_tuple(ins, at: str, operands: Iterable[hlo_module_pb2.Shape]) -> None:
    operands = list(operands)
    if ins.shape.element_type != TUPLE:
        raise _Refused(f"{at} is a `tuple` of shape {_text(ins.shape)}")
    if len(ins.shape.tuple_shapes) != len(operands):
        raise _Refused(f"{at} is a tuple of {len(operands)} operands whose shape lists "
                       f"{len(ins.shape.tuple_shapes)} elements")
    for i, (element, operand) in enumerate(zip(ins.shape.tuple_shapes, operands)):
        _same_shape(element, operand, f"element {i} of the shape of {at}",
                    f"operand {i}")
