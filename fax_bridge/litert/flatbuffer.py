"""Reading and fixing LiteRT flatbuffers: the operators a model uses, and scatter regions.

`operators(model)` names every operator of every subgraph (builtin names as LiteRT's
schema spells them, `CUSTOM:<code>` for custom and Flex ops). `non_builtin` picks the
ones a stock LiteRT runtime does not have.

`fix_scatter_regions(model)`: the converter writes a `stablehlo.scatter` whose update
computation adds (the gradient of an index gather, `x[idx]` / `take_along_axis`) as a
STABLEHLO_SCATTER whose region subgraph holds a plain ADD (or MUL, MAXIMUM, MINIMUM);
the interpreter's scatter kernel recognizes only the STABLEHLO_ forms of those four ops
there and refuses the model. The fix rewrites the region's operator to its STABLEHLO_
form (same operands, no options): what the kernel reads the region for is which of the
four combiners it is, so the model computes what it did.
"""

from __future__ import annotations

import flatbuffers
from ai_edge_litert import schema_py_generated as schema

_NAMES = {v: k for k, v in vars(schema.BuiltinOperator).items() if not k.startswith("_")}
_REGION_FORMS = {schema.BuiltinOperator.ADD: schema.BuiltinOperator.STABLEHLO_ADD,
                 schema.BuiltinOperator.MUL: schema.BuiltinOperator.STABLEHLO_MULTIPLY,
                 schema.BuiltinOperator.MAXIMUM: schema.BuiltinOperator.STABLEHLO_MAXIMUM,
                 schema.BuiltinOperator.MINIMUM: schema.BuiltinOperator.STABLEHLO_MINIMUM}
_GREATER = schema.BuiltinOperator.PLACEHOLDER_FOR_GREATER_OP_CODES


def read(model: bytes) -> schema.ModelT:
    """The model's object tree (LiteRT's schema)."""
    return schema.ModelT.InitFromPackedBuf(bytearray(model), 0)


def write(tree: schema.ModelT) -> bytes:
    """The model's flatbuffer."""
    builder = flatbuffers.Builder(1024)
    builder.Finish(tree.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


def _code(op_code: schema.OperatorCodeT) -> int:
    return max(op_code.builtinCode, op_code.deprecatedBuiltinCode)


def operator_name(op_code: schema.OperatorCodeT) -> str:
    """LiteRT's name of an operator code (`CUSTOM:<code>` for a custom or Flex op)."""
    code = _code(op_code)
    if code == schema.BuiltinOperator.CUSTOM:
        custom = op_code.customCode
        return "CUSTOM:" + (custom.decode() if isinstance(custom, bytes) else str(custom))
    return _NAMES.get(code, f"BUILTIN_{code}")


def operators(model: bytes) -> list[str]:
    """The distinct operator names the model's subgraphs use, sorted."""
    tree = read(model)
    codes = tree.operatorCodes or []
    used = {op.opcodeIndex for sub in tree.subgraphs or [] for op in sub.operators or []}
    return sorted({operator_name(codes[i]) for i in used})


def non_builtin(names: list[str]) -> list[str]:
    """The custom and Flex (TensorFlow) operators among `names`."""
    return [n for n in names if n.startswith("CUSTOM:")]


def _opcode_index(tree: schema.ModelT, code: int) -> int:
    for i, op_code in enumerate(tree.operatorCodes):
        if _code(op_code) == code and op_code.customCode in (None, b"", ""):
            return i
    new = schema.OperatorCodeT()
    new.builtinCode = code
    new.deprecatedBuiltinCode = min(code, _GREATER)
    new.version = 1
    tree.operatorCodes.append(new)
    return len(tree.operatorCodes) - 1


def fix_scatter_regions(model: bytes) -> tuple[bytes, int]:
    """(the model with its scatter regions' combiners in STABLEHLO_ form, how many
    operators were rewritten); the model unchanged when none needed it."""
    tree = read(model)
    codes = tree.operatorCodes or []
    regions = set()
    for sub in tree.subgraphs or []:
        for op in sub.operators or []:
            if _code(codes[op.opcodeIndex]) == schema.BuiltinOperator.STABLEHLO_SCATTER and \
                    isinstance(op.builtinOptions2, schema.StablehloScatterOptionsT):
                regions.add(op.builtinOptions2.updateComputationSubgraphIndex)
    fixed = 0
    for index in sorted(regions):
        for op in tree.subgraphs[index].operators or []:
            form = _REGION_FORMS.get(_code(codes[op.opcodeIndex]))
            if form is None:
                continue
            op.opcodeIndex = _opcode_index(tree, form)
            op.builtinOptionsType, op.builtinOptions = 0, None
            fixed += 1
    return (write(tree), fixed) if fixed else (model, 0)
