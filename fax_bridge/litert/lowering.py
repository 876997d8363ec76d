"""A round's client part as one jax function of named tensors, lowered to StableHLO.

The client part of a round split (`rounds.round_split`) is a local computation
`<broadcast values, one client's inputs> -> <aggregand_0, weight_0?, aggregand_1, ...>`.
`client_signature` names its leaves after the tree paths of the round's values:

  inputs   `broadcast/<i>/<path>` for the i-th broadcast value, `client/<j>/<path>` for
           the client's j-th input (a struct's element names where it has them, else
           the element's index);
  outputs  `aggregate/<k>/value/<path>` and `aggregate/<k>/weight/<path>` for the k-th
           aggregation's aggregand and (a weighted mean's) weight.

`lower` traces the client part (`local_eval.compile_local`, the callable every transport
runs, its `Xla` parts inlined) over those leaves, in that order, and gives the StableHLO
text of the jitted function: what the LiteRT converter takes (`convert`). `flatten` and
`build` move between local values and leaves in that order. `source_lines` finds where in
the user's code the ops of a refused client part were written (the exported HLO keeps
each op's stack).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterator, Optional

import federated_language
import jax
import numpy as np
from federated_language.common_libs import structure
from federated_language.proto import computation_pb2

from fax_bridge.errors import ComputationError
from fax_bridge.language import jax_compat
from fax_bridge.litert import locations, refusals
from fax_bridge.litert.side_rewrites import walk
from fax_bridge.runtime import local_eval


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One named leaf of the client part's signature."""

    name: str
    shape: tuple
    dtype: str

    def describe(self) -> str:
        return f"{self.name}: {self.dtype}[{','.join(map(str, self.shape))}]"


@dataclasses.dataclass(frozen=True)
class ClientSignature:
    """The client part's parameter and result types, and their leaves' names."""

    parameter: federated_language.Type
    result: federated_language.Type
    inputs: tuple
    outputs: tuple


def _segment(name: Optional[str], index: int) -> str:
    return name if name else str(index)


def _leaves(type_, path: str, out: list, where: str) -> list:
    """The TensorTypes of `type_`, depth first, as `Tensor`s named by their path."""
    if isinstance(type_, federated_language.StructType):
        for i, (name, element) in enumerate(type_.items()):
            _leaves(element, f"{path}/{_segment(name, i)}", out, where)
        return out
    if not isinstance(type_, federated_language.TensorType):
        raise ComputationError(f"the client part's {where} {path} has type {type_}; a LiteRT "
                               "model takes and gives tensors (and structs of them) only")
    shape = tuple(type_.shape) if type_.shape is not None else None
    if shape is None or any(d is None for d in shape):
        raise ComputationError(
            f"the client part's {where} {path} has shape {type_.shape}: a LiteRT model has "
            "fixed shapes; export the round with every client input's shape fixed (pad "
            "the clients' data to one batch size: fax_bridge.data.padding)")
    out.append(Tensor(path, shape, np.dtype(type_.dtype).name))
    return out


def split_types(split) -> tuple:
    """(parameter type, result type) of a round split's client part: <broadcast member
    types, client input member types> -> <aggregands and weights, in result order>."""
    server = dict(split.server_locals)
    sent = []
    for name in split.broadcasts:
        type_ = local_eval.parse_type(server[name].type)
        sent.append(getattr(type_, "member", type_))
    param = federated_language.StructType([
        federated_language.StructType([(None, t) for t in sent]),
        federated_language.StructType([(None, t) for t in split.input_types])])
    results: dict = {}
    for agg in split.aggregations:
        results[agg.value_index] = agg.member_type
        if agg.weight_index is not None:
            results[agg.weight_index] = agg.weight_type
    return param, federated_language.StructType(
        [(None, results[i]) for i in range(len(results))])


def client_signature(param: federated_language.Type, result: federated_language.Type,
                     aggregations: Optional[list] = None,
                     names: Optional[tuple] = None) -> ClientSignature:
    """The named leaves of a client part of type `param -> result` (module docstring).
    `aggregations` (the split's `Aggregation`s) name the outputs by the aggregation they
    feed; without them the outputs are `result/<i>/<path>`. `names`: (input names,
    output names) that replace those, one per leaf in order (`litert.manifest.
    signature_names`: by the program's pytree paths)."""
    if not isinstance(param, federated_language.StructType) or len(param) != 2:
        raise ComputationError(f"a client part takes <broadcasts, client inputs>; got {param}")
    inputs: list = []
    for prefix, element in zip(("broadcast", "client"), param):
        for i, (name, member) in enumerate(element.items()):
            _leaves(member, f"{prefix}/{_segment(name, i)}", inputs, "input")
    if not isinstance(result, federated_language.StructType):
        raise ComputationError(f"a client part gives a struct of aggregands; got {result}")
    roles = {}
    for k, agg in enumerate(aggregations or []):
        roles[agg.value_index] = f"aggregate/{k}/value"
        if agg.weight_index is not None:
            roles[agg.weight_index] = f"aggregate/{k}/weight"
    outputs: list = []
    for i, element in enumerate(result):
        _leaves(element, roles.get(i, f"result/{i}"), outputs, "output")
    if names is not None:
        ins, outs = names
        if len(ins) != len(inputs) or len(outs) != len(outputs) or \
                len(set(ins)) != len(ins) or len(set(outs)) != len(outs):
            raise ComputationError(
                f"{len(ins)} input and {len(outs)} output names for a client part of "
                f"{len(inputs)} input and {len(outputs)} output tensors (each name once)")
        inputs = [dataclasses.replace(t, name=n) for t, n in zip(inputs, ins)]
        outputs = [dataclasses.replace(t, name=n) for t, n in zip(outputs, outs)]
    return ClientSignature(param, result, tuple(inputs), tuple(outputs))


def flatten(value: Any, type_: federated_language.Type, out: list) -> list:
    """The leaves of a local value of `type_`, depth first (numpy arrays or tracers)."""
    if isinstance(type_, federated_language.StructType):
        elements = (list(structure.iter_elements(value)) if isinstance(value, structure.Struct)
                    else list(enumerate(value)) if isinstance(value, (list, tuple)) else None)
        if elements is None or len(elements) != len(type_):
            raise ComputationError(f"a value {type(value).__name__} does not have the "
                                   f"structure of {type_}")
        for (_, element), (_, element_type) in zip(elements, type_.items()):
            flatten(element, element_type, out)
        return out
    out.append(value)
    return out


def build(type_: federated_language.Type, leaves: Iterator) -> Any:
    """The local value of `type_` around `leaves` (an iterator)."""
    if isinstance(type_, federated_language.StructType):
        return structure.Struct([(name, build(element, leaves))
                                 for name, element in type_.items()])
    return next(leaves)


def flat_function(fn: computation_pb2.Computation, signature: ClientSignature):
    """The client part as a function of the signature's input leaves (in order) giving
    its output leaves (in order); jax traces it (what `lower` lowers, and what a
    benchmark jits to time the client part under XLA)."""
    compiled = local_eval.compile_local(fn)

    def flat(*leaves):
        arg = build(signature.parameter, iter(leaves))
        return tuple(flatten(compiled(arg), signature.result, []))

    return flat


def _lowered(fn: computation_pb2.Computation, signature: ClientSignature):
    """jax's lowering of `flat_function(fn, signature)`, every input kept."""
    flat = flat_function(fn, signature)
    avals = [jax.ShapeDtypeStruct(t.shape, np.dtype(t.dtype)) for t in signature.inputs]
    try:
        lowered = jax_compat.lower_embedded(jax.jit(flat, keep_unused=True), *avals)
    except ComputationError:
        raise
    except Exception as e:  # noqa: BLE001 - jax's own errors, named
        raise ComputationError(f"the client part cannot be traced for LiteRT: "
                               f"{type(e).__name__}: {e}") from e
    return lowered


def lower(fn: computation_pb2.Computation, signature: ClientSignature) -> str:
    """The StableHLO text of `flat_function(fn, signature)`, jitted with every input
    kept (an input the client part does not read is still one of the signature's, which
    names one StableHLO argument per input)."""
    module = _lowered(fn, signature).compiler_ir("stablehlo")
    older_ops(module)
    return module.operation.get_asm(large_elements_limit=None, enable_debug_info=False)


# Ops newer jax writes that the LiteRT converter's StableHLO cannot parse, as the ops it
# has: log2(x) = log(x) / ln 2, exp2(x) = exp(x ln 2), fma(a, b, c) = a b + c (each
# within float rounding of the fused op, which the parity bound covers).
_LN2 = "0.693147180559945309417232121458176568"


def older_ops(module) -> int:
    """Rewrites `log2`, `exp2` and `fma` in `module` (above); how many."""
    from jax._src.lib.mlir import ir

    from fax_bridge.litert.side_rewrites import Builder

    ops = [op for op in walk(module.operation, [])
           if op.name in ("stablehlo.log2", "stablehlo.exp2", "stablehlo.fma")]
    with module.context:
        b = Builder(ir)
        for op in ops:
            kind = op.results[0].type
            shaped = ir.RankedTensorType(kind)
            with op.location, ir.InsertionPoint(op):
                if op.name == "stablehlo.fma":
                    a, m, c = op.operands
                    value = b.op("stablehlo.add", kind,
                                 [b.op("stablehlo.multiply", kind, [a, m]), c])
                else:
                    ln2 = b.splat(_LN2, shaped.shape, shaped.element_type)
                    (x,) = op.operands
                    value = (b.op("stablehlo.divide", kind,
                                  [b.op("stablehlo.log", kind, [x]), ln2])
                             if op.name == "stablehlo.log2" else
                             b.op("stablehlo.exponential", kind,
                                  [b.op("stablehlo.multiply", kind, [x, ln2])]))
            op.results[0].replace_all_uses_with(value)
            op.erase()
    return len(ops)


def source_lines(fn: computation_pb2.Computation, signature: ClientSignature,
                 ops: list) -> dict:
    """op name -> the user's source lines (`file:line (function)`) where the client part
    computes it, for the StableHLO ops among `ops` and the LiteRT builtins whose StableHLO
    source `refusals.stablehlo_source` knows (a TRANSPOSE_CONV: the convolutions of a
    dilated input, a strided convolution's input gradient); another LiteRT op (`tfl.*`, a
    builtin with no kernel for unsigned integers) is looked for as the StableHLO ops on
    unsigned integers, a sort also as a `lax.top_k` (whose values alone the converter
    makes a sort). An op inside a called function takes the lines of its calls."""
    module = _lowered(fn, signature).compiler_ir("stablehlo")
    every = walk(module.operation, [])
    where = locations.Lines(module)

    def unsigned(op) -> bool:
        return any(re.search(r"xui\d+>|<ui\d+>", str(r.type)) for r in op.results)

    def top_k(op) -> bool:  # lax.top_k, which becomes a sort where its indices go unused
        return op.name == "stablehlo.custom_call" and "topk" in str(
            op.attributes["call_target_name"]).lower() if "call_target_name" in \
            op.attributes else False

    def dilated_input(op) -> bool:  # a transposed convolution's (TRANSPOSE_CONV's) form
        return "lhs_dilation" in op.attributes and any(
            int(d) != 1 for d in re.findall(r"\d+", str(op.attributes["lhs_dilation"]))[1:])

    out: dict = {}
    for wanted in ops:
        source = refusals.stablehlo_source(wanted)
        hits = [op for op in every if op.name == source] if source is not None \
            else [op for op in every if op.name.startswith("stablehlo.") and unsigned(op)] \
            if wanted.startswith("tfl.") else []
        if refusals.builtin(wanted) == "TRANSPOSE_CONV":
            hits = [op for op in hits if dilated_input(op)] or hits
        if wanted == "stablehlo.sort":
            hits += [op for op in every if top_k(op)]
        seen: list = []
        for op in hits:
            for line in where.of(op):
                if line not in seen:
                    seen.append(line)
        if seen:
            out[wanted] = seen[:3]
    return out
