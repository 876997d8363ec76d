"""StableHLO rewrites into ops TensorFlow Lite has builtins for: scatter-adds, unsigned
integers and 32-bit bitwise ops, each computing exactly what the op it replaces does.

Written, like `side_rewrites`, with generic MLIR operations only (jax's bindings or the
converter's); `fax_bridge.tff.fcp_client` runs them on a round's client parts before they
are embedded in the Federated Compute forms, whose client graph TF's TFLite converter
turns into TFLite builtins (checked by `tools/tff087/tflite_client.py`).

`scatter_adds(module, ir)`: a `stablehlo.scatter` whose update region adds (the gradient
of an index gather: `jnp.take_along_axis`, `x[i]`, an embedding lookup) and whose windows
are whole along every unindexed dimension becomes a one-hot of the updates' positions
(a compare of their linearized indices with an iota; out-of-range indices, which a
scatter drops, match nothing) and a sum over the updates: `select` and a reduction where
the one-hot times the window stays under `SELECT_ELEMENTS`, otherwise a `dot_general`
with the one-hot (where an update that is NaN or infinite also spreads NaN to the other
positions of its batch: 0 * inf). Batching dimensions (`input_batching_dims`) stay batch
dimensions. Each position receiving one update gets XLA's bits; positions receiving
several sum them in another order.

`unsigned_integers(module, ir)`: every unsigned integer type becomes the signless
(two's complement) type of its width, which keeps the bits of add, subtract, multiply,
the bitwise ops, shifts left and logical, and every op that moves data. The ops whose
meaning depends on the sign are rewritten: compare, maximum and minimum flip the sign bit
of both operands and compare as signed; a convert widening an unsigned value adds 2^width
where the signed one is negative; one to a float converts the high and low 16 bits apart
(one rounding, as the unsigned convert). A right shift of a 64-bit iota by at least as
many bits as its values have is zero (jax's threefry counters, an iota times a stride per
dimension added up: `jax.random` in a client).
Others (divide, remainder, a convert from a float to an unsigned type or from a 64-bit
unsigned to a float, ...) are not rewritten: `unsigned_integers` returns them, and leaves
the module untouched.

`bitwise_ops(module, ir)`: TFLite has builtins for xor and the arithmetic right shift of
32-bit integers but not for and, or, not, the left shift and the logical right shift,
which its converter makes Flex (TensorFlow) ops. On 32-bit integers they become
arithmetic that wraps as two's complement (ADD, SUB, MUL, RIGHT_SHIFT, BITWISE_XOR):
`a & b = lshr((a + b) - (a ^ b), 1)` with the sign bit set where both are negative,
`a | b = (a ^ b) + (a & b)`, `~a = a ^ -1`, `a << k = a * 2^k`, `lshr(a, k) = ashr(a, k) ^
(ashr(a, 31) * 2^(32 - k))`, and shifts by k outside [0, 32) as StableHLO defines them
(0, or the sign for an arithmetic one). 2^k of a computed k is a product of five selects
of its bits.
"""

from __future__ import annotations

import math
import re

from fax_bridge.litert.side_rewrites import Builder, region_op, walk

# The largest one-hot times window (elements) summed by select and reduce; past it a dot.
SELECT_ELEMENTS = 1 << 22

# Ops whose unsigned operands and results keep their meaning as signless bits.
SAME_BITS = frozenset({
    "stablehlo.add", "stablehlo.subtract", "stablehlo.multiply", "stablehlo.negate",
    "stablehlo.xor", "stablehlo.or", "stablehlo.and", "stablehlo.not",
    "stablehlo.shift_left", "stablehlo.shift_right_logical", "stablehlo.iota",
    "stablehlo.broadcast_in_dim", "stablehlo.broadcast", "stablehlo.reshape",
    "stablehlo.slice", "stablehlo.dynamic_slice", "stablehlo.dynamic_update_slice",
    "stablehlo.concatenate", "stablehlo.transpose", "stablehlo.select", "stablehlo.pad",
    "stablehlo.reverse", "stablehlo.gather", "stablehlo.scatter", "stablehlo.while",
    "stablehlo.if", "stablehlo.case", "stablehlo.return", "stablehlo.reduce",
    "stablehlo.optimization_barrier", "stablehlo.bitcast_convert", "stablehlo.popcnt",
    "stablehlo.count_leading_zeros", "func.return", "func.call", "func.func",
    "stablehlo.constant", "stablehlo.compare", "stablehlo.maximum", "stablehlo.minimum",
    "stablehlo.convert", "builtin.module"})

_SCATTER_FIELDS = ("update_window_dims", "inserted_window_dims", "input_batching_dims",
                   "scatter_indices_batching_dims", "scatter_dims_to_operand_dims")


def _direction(ir, name: str):
    return ir.Attribute.parse(f"#stablehlo<comparison_direction {name}>")


class _Ops(Builder):
    """`Builder` with the few ops the rewrites compose, on tensors of one shape."""

    def like(self, value, element=None):
        kind = self.ir.RankedTensorType(value.type)
        return self.tensor(list(kind.shape), element or kind.element_type)

    def binary(self, name: str, a, b):
        return self.op(f"stablehlo.{name}", a.type, [a, b])

    def compare(self, direction: str, a, b, signed: bool = False):
        attributes = {"comparison_direction": _direction(self.ir, direction)}
        if signed:
            attributes["compare_type"] = self.ir.Attribute.parse(
                "#stablehlo<comparison_type SIGNED>")
        return self.op("stablehlo.compare", self.like(a, self.i1), [a, b], **attributes)

    def select(self, p, a, b):
        return self.op("stablehlo.select", a.type, [p, a, b])

    def full(self, value, text: str):
        """A constant like `value` (shape and element type) of every element `text`."""
        kind = self.ir.RankedTensorType(value.type)
        return self.splat(text, list(kind.shape), kind.element_type)

    def convert(self, value, element):
        return self.op("stablehlo.convert", self.like(value, element), [value])

    def transpose(self, value, permutation: list):
        kind = self.ir.RankedTensorType(value.type)
        if permutation == sorted(permutation):
            return value
        shape = [kind.shape[p] for p in permutation]
        return self.op("stablehlo.transpose", self.tensor(shape, kind.element_type), [value],
                       permutation=self.array(permutation))

    def reshape(self, value, shape: list):
        kind = self.ir.RankedTensorType(value.type)
        if list(kind.shape) == list(shape):
            return value
        return self.op("stablehlo.reshape", self.tensor(shape, kind.element_type), [value])

    def broadcast(self, value, shape: list, dims: list):
        kind = self.ir.RankedTensorType(value.type)
        return self.op("stablehlo.broadcast_in_dim", self.tensor(shape, kind.element_type),
                       [value], broadcast_dimensions=self.array(dims))


def _is(kind, thing) -> bool:
    """Whether the MLIR type or attribute `thing` is a `kind` (bindings old and new)."""
    try:
        kind(thing)
    except (ValueError, TypeError):
        return False
    return True


def _int_type(ir, value):
    """(width, unsigned) of an integer tensor's elements, None for other types."""
    if not _is(ir.RankedTensorType, value.type):
        return None
    element = ir.RankedTensorType(value.type).element_type
    if not _is(ir.IntegerType, element):
        return None
    kind = ir.IntegerType(element)
    return kind.width, kind.is_unsigned


def _defining_op(value):
    """The operation that gives `value`, or None for a block argument."""
    owner = value.owner
    op = getattr(owner, "operation", owner)
    return op if hasattr(op, "name") else None


def _constant_int(ir, value):
    """The one integer every element of `value` holds (a splat constant, maybe broadcast),
    else None."""
    op = _defining_op(value)
    if op is None:
        return None
    if op.name == "stablehlo.broadcast_in_dim":
        return _constant_int(ir, op.operands[0])
    if op.name != "stablehlo.constant":
        return None
    attr = ir.DenseIntElementsAttr(op.attributes["value"]) \
        if _is(ir.DenseIntElementsAttr, op.attributes["value"]) else None
    if attr is None:
        return None
    values = {int(v) for v in attr} if not attr.is_splat else {int(attr.get_splat_value().value)}
    return values.pop() if len(values) == 1 else None


# ------------------------------------------------------------------------ scatter-adds


def _scatter_dims(text: str) -> dict:
    dims = {name: [int(v) for v in re.findall(r"-?\d+", m.group(1))] if m else []
            for name in _SCATTER_FIELDS
            for m in [re.search(rf"\b{name} = \[([^\]]*)\]", text)]}
    found = re.search(r"index_vector_dim = (\d+)", text)
    dims["index_vector_dim"] = int(found.group(1)) if found else 0
    return dims


def _rewrite_scatter(op, ir) -> bool:
    """One scatter-add as a one-hot sum (module docstring); False when not of that form."""
    if len(op.operands) != 3 or len(op.results) != 1:
        return False
    combiner = region_op(op.regions[0], 2)
    if combiner is None or combiner[0].name != "stablehlo.add":
        return False
    dims = _scatter_dims(str(op.attributes["scatter_dimension_numbers"]))
    operand, indices, updates = op.operands
    oshape, ishape, ushape = (list(ir.RankedTensorType(v.type).shape) for v in op.operands)
    element = ir.RankedTensorType(operand.type).element_type
    windows, inserted = dims["update_window_dims"], dims["inserted_window_dims"]
    batch_o, batch_i = dims["input_batching_dims"], dims["scatter_indices_batching_dims"]
    to_operand, vector = dims["scatter_dims_to_operand_dims"], dims["index_vector_dim"]
    if any(d not in inserted for d in to_operand):
        return False  # a window along an indexed dimension: not a one-hot
    window_o = [d for d in range(len(oshape)) if d not in inserted and d not in batch_o]
    if len(window_o) != len(windows) or any(ushape[w] != oshape[d]
                                              for w, d in zip(windows, window_o)):
        return False  # a window shorter than its dimension
    b = _Ops(ir)
    with op.location, ir.InsertionPoint(op):
        if vector == len(ishape):
            ishape = ishape + [1]
            indices = b.reshape(indices, ishape)
        index_dims = [d for d in range(len(ishape)) if d != vector]
        update_scatter = [d for d in range(len(ushape)) if d not in windows]
        others = [d for d in index_dims if d not in batch_i]
        bsz = [ishape[d] for d in batch_i]
        nb, n = len(bsz), math.prod(ishape[d] for d in others)
        sizes = [oshape[d] for d in to_operand]
        q, wf = math.prod(sizes), math.prod(oshape[d] for d in window_o)
        indices = b.reshape(b.transpose(indices, batch_i + others + [vector]),
                            bsz + [n, len(sizes)])
        if _int_type(ir, indices) != (32, False):
            indices = b.convert(indices, b.i32)
        upd = b.reshape(b.transpose(
            updates, [update_scatter[index_dims.index(d)] for d in batch_i + others]
            + windows), bsz + [n, wf])
        position = valid = None
        for j, size in enumerate(sizes):
            column = b.reshape(b.op(
                "stablehlo.slice", b.tensor(bsz + [n, 1], b.i32), [indices],
                start_indices=b.array([0] * (nb + 1) + [j]),
                limit_indices=b.array(bsz + [n, j + 1]), strides=b.array([1] * (nb + 2))),
                bsz + [n])
            inside = b.binary("and", b.compare("GE", column, b.full(column, "0")),
                              b.compare("LT", column, b.full(column, str(size))))
            valid = inside if valid is None else b.binary("and", valid, inside)
            position = column if position is None else b.binary(
                "add", b.binary("multiply", position, b.full(position, str(size))), column)
        position = b.select(valid, position, b.full(position, "-1"))
        hot_shape = bsz + [n, q]
        iota = b.op("stablehlo.iota", b.tensor(hot_shape, b.i32), [],
                    iota_dimension=ir.IntegerAttr.get(ir.IntegerType.get_signless(64), nb + 1))
        hot = b.compare("EQ", b.broadcast(position, hot_shape, list(range(nb + 1))), iota)
        zero_text = "0.0" if str(element).startswith(("f", "bf")) else "0"
        if n * q * wf * math.prod(bsz) <= SELECT_ELEMENTS:
            shape = hot_shape + [wf]
            spread = b.select(b.broadcast(hot, shape, list(range(nb + 2))),
                              b.broadcast(upd, shape, list(range(nb + 1)) + [nb + 2]),
                              b.splat(zero_text, shape, element))
            zero = b.splat(zero_text, [], element)
            reduce = ir.Operation.create(
                "stablehlo.reduce", results=[b.tensor(bsz + [q, wf], element)],
                operands=[spread, zero], attributes={"dimensions": b.array([nb])}, regions=1)
            scalar = b.tensor([], element)
            block = reduce.regions[0].blocks.append(scalar, scalar)
            with ir.InsertionPoint(block):
                total = b.op("stablehlo.add", scalar, list(block.arguments))
                ir.Operation.create("stablehlo.return", operands=[total])
            contribution = reduce.results[0]
        else:
            batch = ", ".join(map(str, range(nb)))
            numbers = ir.Attribute.parse(
                f"#stablehlo.dot<lhs_batching_dimensions = [{batch}], rhs_batching_dimensions"
                f" = [{batch}], lhs_contracting_dimensions = [{nb}], "
                f"rhs_contracting_dimensions = [{nb}]>")
            contribution = b.op("stablehlo.dot_general", b.tensor(bsz + [q, wf], element),
                                [b.convert(hot, element), upd], dot_dimension_numbers=numbers)
        order = batch_o + to_operand + window_o
        base = b.reshape(b.transpose(operand, order), bsz + [q, wf])
        total = b.binary("add", base, contribution)
        inverse = [order.index(d) for d in range(len(oshape))]
        result = b.transpose(b.reshape(total, [oshape[d] for d in order]), inverse)
    op.results[0].replace_all_uses_with(result)
    op.erase()
    return True


def scatter_adds(module, ir) -> int:
    """Rewrites every scatter-add it can (module docstring); how many."""
    ops = [op for op in walk(module.operation, []) if op.name == "stablehlo.scatter"]
    return sum(_rewrite_scatter(op, ir) for op in ops)


# ------------------------------------------------------------------------ unsigned


def _signless(ir, kind):
    """The type `kind` with unsigned integer elements made signless; None if it has none."""
    if _is(ir.RankedTensorType, kind):
        tensor = ir.RankedTensorType(kind)
        element = tensor.element_type
        if _is(ir.IntegerType, element) and ir.IntegerType(element).is_unsigned:
            return ir.RankedTensorType.get(
                list(tensor.shape), ir.IntegerType.get_signless(ir.IntegerType(element).width))
    if _is(ir.FunctionType, kind):
        fn = ir.FunctionType(kind)
        ins = [_signless(ir, t) or t for t in fn.inputs]
        outs = [_signless(ir, t) or t for t in fn.results]
        return ir.FunctionType.get(ins, outs)
    return None


def _make_signless(ir, value):
    """`value` retyped signless where its type has unsigned integers; `value`."""
    kind = _signless(ir, value.type)
    if kind is not None:
        value.set_type(kind)
    return value


def _touches_unsigned(op, ir) -> bool:
    values = list(op.operands) + list(op.results)
    values += [a for region in op.regions for block in region.blocks for a in block.arguments]
    return any((_int_type(ir, v) or (0, False))[1] for v in values)


def float_to_unsigned(op, ir) -> bool:
    """Whether the convert `op` makes a float an unsigned integer."""
    source, target = _int_type(ir, op.operands[0]), _int_type(ir, op.results[0])
    return target is not None and target[1] and source is None


def _unsupported(op, ir) -> bool:
    """Whether the unsigned rewrite cannot keep the meaning of `op`."""
    if op.name not in SAME_BITS:
        return True
    if op.name == "stablehlo.convert":
        source, target = _int_type(ir, op.operands[0]), _int_type(ir, op.results[0])
        if float_to_unsigned(op, ir):
            return True
        if source is not None and source[1] and target is None and source[0] > 32:
            return True  # a 64-bit unsigned to a float
    return False


def _rewrite_sign_dependent(op, ir) -> None:
    """Replaces a compare, maximum, minimum or convert of unsigned operands by signed ops
    (module docstring); the replacement's types are already signless."""
    b = _Ops(ir)
    source = _int_type(ir, op.operands[0])
    if source is None or not source[1]:
        return
    width = source[0]
    signless = ir.IntegerType.get_signless(width)
    with op.location, ir.InsertionPoint(op):
        lhs = op.operands[0]
        if op.name in ("stablehlo.compare", "stablehlo.maximum", "stablehlo.minimum"):
            rhs = op.operands[1]
            low = b.splat(str(-(1 << (width - 1))), list(ir.RankedTensorType(lhs.type).shape),
                          signless)
            a, c = b.binary("xor", lhs, low), b.binary("xor", rhs, low)
            for value in (a, c):
                _make_signless(ir, value)
            if op.name == "stablehlo.compare":
                direction = str(op.attributes["comparison_direction"]).split()[-1].rstrip(">")
                new = b.compare(direction, a, c, signed=True)
            else:
                keep = b.compare("GT" if op.name == "stablehlo.maximum" else "LT", a, c,
                                 signed=True)
                new = _make_signless(ir, b.select(keep, lhs, rhs))
        elif op.name == "stablehlo.convert":
            target = ir.RankedTensorType(op.results[0].type).element_type
            if _is(ir.IntegerType, target):
                if ir.IntegerType(target).width <= width:
                    return  # truncation: the same bits
                wide = ir.IntegerType.get_signless(ir.IntegerType(target).width)
                new = b.convert(lhs, wide)
                negative = b.compare("LT", lhs, b.splat("0", list(
                    ir.RankedTensorType(lhs.type).shape), signless), signed=True)
                new = b.binary("add", new, b.select(
                    negative, b.full(new, str(1 << width)), b.full(new, "0")))
            elif width <= 16:
                wide = b.convert(lhs, b.i32)
                negative = b.compare("LT", lhs, b.splat("0", list(
                    ir.RankedTensorType(lhs.type).shape), signless), signed=True)
                wide = b.binary("add", wide, b.select(negative, b.full(wide, str(1 << width)),
                                                      b.full(wide, "0")))
                new = b.convert(wide, target)
            else:  # 32 bits: the high and low halves, each exact, summed once
                high = b.op("stablehlo.shift_right_logical", b.like(lhs, signless),
                            [lhs, b.full(lhs, "16")])
                low = b.binary("subtract", lhs, b.binary("multiply", high, b.full(lhs, "65536")))
                _make_signless(ir, low)
                hf, lf = b.convert(high, target), b.convert(low, target)
                new = b.binary("add", b.binary("multiply", hf, b.full(hf, "65536.0")), lf)
        else:
            return
    op.results[0].replace_all_uses_with(new)
    op.erase()


def _largest(ir, value):
    """The largest value a non-negative integer counter `value` can hold: an iota, a
    splat constant, broadcasts and reshapes of them, and their sums and products, as
    jax builds its threefry counters (an iota times a stride per dimension, added up);
    else None."""
    op = _defining_op(value)
    if op is None:
        return None
    if op.name == "stablehlo.iota":
        shape = ir.RankedTensorType(op.results[0].type).shape
        dim = ir.IntegerAttr(op.attributes["iota_dimension"]).value
        return max(shape[dim] - 1, 0) if shape else 0
    if op.name in ("stablehlo.broadcast_in_dim", "stablehlo.reshape"):
        return _largest(ir, op.operands[0])
    if op.name in ("stablehlo.add", "stablehlo.multiply"):
        a, b = (_largest(ir, x) for x in op.operands)
        if a is None or b is None:
            return None
        return a + b if op.name == "stablehlo.add" else a * b
    found = _constant_int(ir, value)
    return found if found is not None and found >= 0 else None


def _fold_counter_shift(op, ir) -> bool:
    """A logical right shift by c bits of a counter (`_largest`) under 2^c: zeros."""
    if op.name != "stablehlo.shift_right_logical":
        return False
    shift = _constant_int(ir, op.operands[1])
    if shift is None or not 0 <= shift < 64:
        return False
    top = _largest(ir, op.operands[0])
    if top is None or top >= (1 << shift):
        return False
    b = _Ops(ir)
    with op.location, ir.InsertionPoint(op):
        zeros = b.full(op.results[0], "0")
    op.results[0].replace_all_uses_with(zeros)
    op.erase()
    return True


def unsigned_integers(module, ir) -> list:
    """Makes every unsigned integer signless (module docstring). Returns the ops it could
    not keep the meaning of (MLIR operations; the module unchanged then), else []."""
    ops = [op for op in walk(module.operation, []) if _touches_unsigned(op, ir)]
    refused = [op for op in ops if _unsupported(op, ir)]
    if refused:
        return refused
    mains = [op for op in walk(module.operation, []) if op.name == "func.func"
             and ir.StringAttr(op.attributes["sym_name"]).value == "main"]
    signature = [ir.TypeAttr(op.attributes["function_type"]).value for op in mains]
    for op in ops:
        if op.name in ("stablehlo.compare", "stablehlo.maximum", "stablehlo.minimum",
                       "stablehlo.convert"):
            _rewrite_sign_dependent(op, ir)
    for op in walk(module.operation, []):
        for value in list(op.results) + [a for region in op.regions
                                         for block in region.blocks for a in block.arguments]:
            _make_signless(ir, value)
        if op.name == "func.func":
            kind = _signless(ir, ir.TypeAttr(op.attributes["function_type"]).value)
            op.attributes["function_type"] = ir.TypeAttr.get(kind)
        if op.name == "stablehlo.constant":
            _retype_constant(op, ir)
    for op in walk(module.operation, []):
        _fold_counter_shift(op, ir)
    for op, kind in zip(mains, signature):
        _keep_signature(op, ir, ir.FunctionType(kind))
    return []


def _keep_signature(main, ir, kind) -> None:
    """`main` taking and giving its unsigned values as before (the caller's types), each
    bitcast to or from its signless twin at its entry or return."""
    block = main.regions[0].blocks[0]
    first = list(block.operations)[0]
    for arg, wanted in zip(block.arguments, kind.inputs):
        if arg.type != wanted:
            with first.location, ir.InsertionPoint(first):
                cast = ir.Operation.create("stablehlo.bitcast_convert", results=[arg.type],
                                           operands=[arg])
            arg.replace_all_uses_with(cast.results[0])
            cast.operands[0] = arg
            arg.set_type(wanted)
    ret = list(block.operations)[-1]
    for i, (value, wanted) in enumerate(zip(list(ret.operands), kind.results)):
        if value.type != wanted:
            with ret.location, ir.InsertionPoint(ret):
                cast = ir.Operation.create("stablehlo.bitcast_convert", results=[wanted],
                                           operands=[value])
            ret.operands[i] = cast.results[0]
    main.attributes["function_type"] = ir.TypeAttr.get(kind)


def _retype_constant(op, ir) -> None:
    import numpy as np  # in the side venv too; only here, where an attribute is rebuilt

    attr = op.attributes["value"]
    kind = ir.RankedTensorType(attr.type)
    element = kind.element_type
    if not (_is(ir.IntegerType, element) and ir.IntegerType(element).is_unsigned):
        return
    width = ir.IntegerType(element).width
    values = np.asarray(ir.DenseIntElementsAttr(attr)).astype(f"uint{width}")
    target = _signless(ir, attr.type)
    op.attributes["value"] = ir.DenseElementsAttr.get(
        np.ascontiguousarray(values.view(f"int{width}").reshape(list(kind.shape))),
        type=target)


# ------------------------------------------------------------------------ bitwise


def _pow2(b: _Ops, k):
    """2^k (wrapping at 2^31) where 0 <= k < 32, else 0, of an int32 tensor `k`."""
    inside = b.binary("and", b.compare("GE", k, b.full(k, "0")),
                      b.compare("LT", k, b.full(k, "32")))
    k = b.select(inside, k, b.full(k, "0"))
    power = b.full(k, "1")
    for j in range(5):
        bit = b.binary("subtract", b.binary("shift_right_arithmetic", k, b.full(k, str(j))),
                       b.binary("multiply", b.binary("shift_right_arithmetic", k,
                                                     b.full(k, str(j + 1))), b.full(k, "2")))
        factor = b.select(b.compare("EQ", bit, b.full(k, "1")), b.full(k, str(1 << (1 << j))),
                          b.full(k, "1"))
        power = b.binary("multiply", power, factor)
    return b.select(inside, power, b.full(k, "0"))


def _power(b: _Ops, k, constant):
    """2^k as `_pow2` gives it, a constant where k is one."""
    if constant is not None:
        value = (1 << constant) if 0 <= constant < 32 else 0
        return b.full(k, str(value - (1 << 32) if value >= 1 << 31 else value))
    return _pow2(b, k)


def _lshr(b: _Ops, a, k, constant):
    """The logical right shift of int32 `a` by `k` with the arithmetic one."""
    if constant is not None and not 0 <= constant < 32:
        return b.full(a, "0")
    if constant == 0:
        return a
    sign = b.binary("shift_right_arithmetic", a, b.full(a, "31"))
    if constant is not None:
        return b.binary("xor", b.binary("shift_right_arithmetic", a, k),
                        b.binary("multiply", sign, _power(b, k, 32 - constant)))
    inside = b.binary("and", b.compare("GE", k, b.full(k, "0")),
                      b.compare("LT", k, b.full(k, "32")))
    kept = b.select(inside, k, b.full(k, "0"))
    shifted = b.binary("xor", b.binary("shift_right_arithmetic", a, kept),
                       b.binary("multiply", sign, _pow2(b, b.binary(
                           "subtract", b.full(k, "32"), kept))))
    return b.select(inside, shifted, b.full(a, "0"))


def _and(b: _Ops, a, c):
    twice = b.binary("subtract", b.binary("add", a, c), b.binary("xor", a, c))
    low = _lshr(b, twice, b.full(twice, "1"), 1)
    both = b.binary("and", b.compare("LT", a, b.full(a, "0")),
                    b.compare("LT", c, b.full(c, "0")))
    return b.binary("xor", low, b.select(both, b.full(a, str(-(1 << 31))), b.full(a, "0")))


def _rewrite_bitwise(op, ir) -> bool:
    if op.name not in ("stablehlo.and", "stablehlo.or", "stablehlo.not",
                       "stablehlo.shift_left", "stablehlo.shift_right_logical",
                       "stablehlo.shift_right_arithmetic") \
            or _int_type(ir, op.results[0]) != (32, False):
        return False
    b = _Ops(ir)
    a = op.operands[0]
    with op.location, ir.InsertionPoint(op):
        if op.name == "stablehlo.not":
            new = b.binary("xor", a, b.full(a, "-1"))
        elif op.name in ("stablehlo.and", "stablehlo.or"):
            new = _and(b, a, op.operands[1])
            if op.name == "stablehlo.or":
                new = b.binary("add", b.binary("xor", a, op.operands[1]), new)
        else:
            k = op.operands[1]
            constant = _constant_int(ir, k)
            if op.name == "stablehlo.shift_left":
                new = b.binary("multiply", a, _power(b, k, constant))
            elif op.name == "stablehlo.shift_right_logical":
                new = _lshr(b, a, k, constant)
            elif constant is not None and 0 <= constant < 32:
                return False  # an arithmetic shift TFLite's RIGHT_SHIFT takes as it is
            else:
                inside = b.binary("and", b.compare("GE", k, b.full(k, "0")),
                                  b.compare("LT", k, b.full(k, "32")))
                new = b.binary("shift_right_arithmetic", a,
                               b.select(inside, k, b.full(k, "31")))
    op.results[0].replace_all_uses_with(new)
    op.erase()
    return True


def bitwise_ops(module, ir) -> int:
    """Rewrites every 32-bit and, or, not and shift TFLite has no builtin for (module
    docstring); how many. Run after `unsigned_integers`."""
    return sum(_rewrite_bitwise(op, ir) for op in walk(module.operation, []))
