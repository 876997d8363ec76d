"""StableHLO rewrites into ops LiteRT has builtins for, run in the converter's side venv.

Imported by `side_convert.py` (by path, in `.venv-litert`), so it uses only the standard
library and litert-converter's MLIR bindings. Each rewrite computes exactly what the op
it replaces computes.

`batch_grouped_convolutions(module, ir)`: the kernel gradient of a grouped (depthwise)
convolution is a `stablehlo.convolution` with `batch_group_count` G > 1, which the
converter writes as a plain CONV_2D of the wrong shape. Each one is rewritten as
StableHLO defines it: G convolutions of the G contiguous slices of the input's batch
dimension and of the kernel's output features, concatenated along the output features.

`lhs_dilated_convolutions(module, ir)`: the gradient of a strided convolution with
respect to its input (and `lax.conv_transpose`) is a `stablehlo.convolution` whose input
is dilated (`lhs_dilation` = the stride) and padded by (k-1-lo, k-1-hi+r) for the
forward padding (lo, hi) and remainder r. litert-converter 0.5.0 makes such a
convolution a TRANSPOSE_CONV correctly only when it is padded by k-1 on both sides (the
"full" transposed convolution, size (n-1)s+k); other paddings (a stride-2 "SAME"
convolution's, any stride-2 convolution of an even input) it either leaves unconverted
(`mhlo.convolution`) or writes as a TRANSPOSE_CONV with the wrong padding, which the
interpreter refuses ("computed_input_height != SizeOfDimension(input, 1)"). Each one is
rewritten as the full transposed convolution followed by a slice of the rows and columns
the original keeps and, where its padding reaches past the full one, zero padding (an
output position whose window holds only padding is 0): the same sums of the same
products, element by element. One whose kernel is dilated too (the input gradient of a
dilated strided convolution), which no TRANSPOSE_CONV takes, becomes a `stablehlo.pad`
that dilates and pads its input, as XLA defines lhs dilation, and a convolution of
neither.

`select_and_scatter(module, ir)`: the gradient of a max (or min) pool is a
`stablehlo.select_and_scatter`, for which the converter has no builtin. Each one whose
select region is one `stablehlo.compare` of its two arguments and whose scatter region
adds is replaced by strided slices, compares, selects and pads, following XLA's
definition step by step: in every window the candidates are visited in row-major order,
padding skipped; a candidate replaces the one held unless `select(held, candidate)` (so
`GE` keeps the first maximum among ties, NaN handling included); each source value is
added to the output at its window's choice, which starts at the init value. With
non-overlapping windows (a 2x2 pool of stride 2) every output element receives one
value or none, so the result is XLA's bit for bit; with overlapping windows the values
landing on one element are summed in another order.

The rewrite works on the module, whatever wrote the pool (`lax.reduce_window`, flax's
`nn.max_pool`, an exported HLO from elsewhere): the client part reaches the converter as
an exported module, not as the user's jax code.
"""

from __future__ import annotations

import itertools
import re


def walk(op, out: list) -> list:
    """Every operation nested in MLIR operation `op` appended to `out`, children before
    their parent (any MLIR bindings: jax's, or the converter's in the side venv)."""
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                walk(child.operation, out)
    out.append(op)
    return out


def region_op(region, n_args: int):
    """The one op of a region `(a, b) -> op(a, b)` and the order it takes its arguments
    in ((0, 1) or (1, 0)); None otherwise."""
    block = region.blocks[0]
    ops = list(block.operations)
    if len(ops) != 2 or len(block.arguments) != n_args:
        return None
    op, ret = ops[0].operation, ops[1].operation
    if len(ret.operands) != 1 or ret.operands[0] != op.results[0] or len(op.operands) != 2:
        return None
    args = list(block.arguments)
    try:
        order = tuple(next(i for i, a in enumerate(args) if a == v) for v in op.operands)
    except StopIteration:
        return None
    return (op, order) if sorted(order) == [0, 1] else None


class Builder:
    """Creates StableHLO ops before one op (generic form: no dialect bindings needed)."""

    def __init__(self, ir):
        self.ir = ir
        self.i1 = ir.IntegerType.get_signless(1)
        self.i32 = ir.IntegerType.get_signless(32)

    def tensor(self, shape, element):
        return self.ir.RankedTensorType.get(list(shape), element)

    def op(self, name: str, result, operands: list, **attributes):
        return self.ir.Operation.create(name, results=[result], operands=operands,
                                        attributes=attributes).results[0]

    def array(self, values):
        return self.ir.DenseI64ArrayAttr.get([int(v) for v in values])

    def splat(self, text: str, shape, element):
        kind = self.tensor(shape, element)
        return self.op("stablehlo.constant", kind, [],
                       value=self.ir.Attribute.parse(f"dense<{text}> : {kind}"))

    def mask(self, shape, dim: int, bits: list):
        """A boolean of `shape` that is bits[i] along dimension `dim`."""
        row = self.tensor([len(bits)], self.i1)
        text = ", ".join("true" if b else "false" for b in bits)
        const = self.op("stablehlo.constant", row, [],
                        value=self.ir.Attribute.parse(f"dense<[{text}]> : {row}"))
        return self.op("stablehlo.broadcast_in_dim", self.tensor(shape, self.i1), [const],
                       broadcast_dimensions=self.array([dim]))


def _rewrite_one(op, ir) -> bool:
    """Replaces one `stablehlo.select_and_scatter` (module docstring); False when its
    regions are not a compare and an add."""
    select = region_op(op.regions[0], 2)
    scatter = region_op(op.regions[1], 2)
    if select is None or scatter is None or select[0].name != "stablehlo.compare" \
            or scatter[0].name != "stablehlo.add":
        return False
    operand, source, init = op.operands
    out_type = ir.RankedTensorType(op.results[0].type)
    src_type = ir.RankedTensorType(source.type)
    shape, tshape, element = list(out_type.shape), list(src_type.shape), out_type.element_type
    rank = len(shape)
    attr = {name: op.attributes[name] for name in op.attributes}
    window = list(ir.DenseI64ArrayAttr(attr["window_dimensions"])) \
        if "window_dimensions" in attr else [1] * rank
    strides = list(ir.DenseI64ArrayAttr(attr["window_strides"])) \
        if "window_strides" in attr else [1] * rank
    pads = [(0, 0)] * rank
    if "padding" in attr:
        flat = [int(v) for v in ir.DenseIntElementsAttr(attr["padding"])]
        pads = [(flat[2 * d], flat[2 * d + 1]) for d in range(rank)]
    padded = [s + lo + hi for s, (lo, hi) in zip(shape, pads)]
    compare, order = select
    b = Builder(ir)
    with op.location, ir.InsertionPoint(op):
        x = operand
        if any(lo or hi for lo, hi in pads):  # padded places are masked out below
            zero = b.splat("0.0" if str(element).startswith(("f", "bf")) else "0", [], element)
            x = b.op("stablehlo.pad", b.tensor(padded, element), [x, zero],
                     edge_padding_low=b.array(p[0] for p in pads),
                     edge_padding_high=b.array(p[1] for p in pads),
                     interior_padding=b.array([0] * rank))
        offsets = list(itertools.product(*(range(w) for w in window)))
        held = index = has = None
        for k, offset in enumerate(offsets):
            limit = [o + (t - 1) * s + 1 for o, t, s in zip(offset, tshape, strides)]
            candidate = b.op("stablehlo.slice", b.tensor(tshape, element), [x],
                             start_indices=b.array(offset), limit_indices=b.array(limit),
                             strides=b.array(strides))
            valid = None
            for d, ((lo, hi), o, s) in enumerate(zip(pads, offset, strides)):
                bits = [lo <= o + t * s < lo + shape[d] for t in range(tshape[d])]
                if all(bits):
                    continue
                m = b.mask(tshape, d, bits)
                valid = m if valid is None else b.op("stablehlo.and", m.type, [valid, m])
            if k == 0:
                held, has = candidate, valid
                index = b.splat("0", tshape, b.i32)
                continue
            pair = [held, candidate]
            keep = b.op("stablehlo.compare", b.tensor(tshape, b.i1),
                        [pair[order[0]], pair[order[1]]],
                        **{name: compare.attributes[name] for name in compare.attributes})
            take = b.op("stablehlo.not", keep.type, [keep])
            if has is not None:  # an earlier window place was padding: take the first real
                fresh = b.op("stablehlo.not", keep.type, [has])
                take = b.op("stablehlo.or", keep.type, [take, fresh])
            if valid is not None:
                take = b.op("stablehlo.and", keep.type, [take, valid])
                if has is not None:
                    has = b.op("stablehlo.or", keep.type, [has, valid])
            else:
                has = None  # every window holds this real place from here on
            held = b.op("stablehlo.select", held.type, [take, candidate, held])
            index = b.op("stablehlo.select", index.type,
                         [take, b.splat(str(k), tshape, b.i32), index])
        total = b.op("stablehlo.broadcast_in_dim", b.tensor(padded, element), [init],
                     broadcast_dimensions=b.array([]))
        zero = b.splat("0.0" if str(element).startswith(("f", "bf")) else "0", [], element)
        zeros = b.op("stablehlo.broadcast_in_dim", b.tensor(tshape, element), [zero],
                     broadcast_dimensions=b.array([]))
        eq = ir.Attribute.parse("#stablehlo<comparison_direction EQ>")
        for k, offset in enumerate(offsets):
            chosen = b.op("stablehlo.compare", b.tensor(tshape, b.i1),
                          [index, b.splat(str(k), tshape, b.i32)], comparison_direction=eq)
            if has is not None:
                chosen = b.op("stablehlo.and", chosen.type, [chosen, has])
            part = b.op("stablehlo.select", zeros.type, [chosen, source, zeros])
            high = [p - o - (t - 1) * s - 1 for p, o, t, s in
                    zip(padded, offset, tshape, strides)]
            part = b.op("stablehlo.pad", total.type, [part, zero],
                        edge_padding_low=b.array(offset), edge_padding_high=b.array(high),
                        interior_padding=b.array([s - 1 for s in strides]))
            total = b.op("stablehlo.add", total.type, [total, part])
        if padded != shape:
            total = b.op("stablehlo.slice", out_type, [total],
                         start_indices=b.array(p[0] for p in pads),
                         limit_indices=b.array(p[0] + s for p, s in zip(pads, shape)),
                         strides=b.array([1] * rank))
    op.results[0].replace_all_uses_with(total)
    op.erase()
    return True


def select_and_scatter(module, ir) -> int:
    """Rewrites every `stablehlo.select_and_scatter` it can (module docstring); how many."""
    ops = [op for op in walk(module.operation, []) if op.name == "stablehlo.select_and_scatter"]
    return sum(_rewrite_one(op, ir) for op in ops)


_CONV_DIMS = re.compile(r"#stablehlo\.conv<\[([^\]]*)\]x\[([^\]]*)\]->\[([^\]]*)\]>")


def _spatial(spec: str) -> list:
    """The positions of the spatial dimensions 0, 1, ... in a dimension spec `b, 0, 1, f`."""
    parts = [p.strip() for p in spec.split(",")]
    return [i for _, i in sorted((int(p), i) for i, p in enumerate(parts) if p.isdigit())]


def _ints(ir, attr, default: list) -> list:
    return list(ir.DenseI64ArrayAttr(attr)) if attr is not None else default


def _dilate_by_padding(op, ir, attr: dict, lhs_dims: list, dilation: list,
                       pads: list) -> bool:
    """Replaces one lhs-dilated convolution by a `stablehlo.pad` that dilates and pads
    its input (negative padding cut by a slice) and a convolution of neither."""
    lhs = op.operands[0]
    kind = ir.RankedTensorType(lhs.type)
    rank, element = len(kind.shape), kind.element_type
    b = Builder(ir)
    low, high, interior = [0] * rank, [0] * rank, [0] * rank
    for d, axis in enumerate(lhs_dims):
        low[axis], high[axis] = max(pads[d][0], 0), max(pads[d][1], 0)
        interior[axis] = dilation[d] - 1
    shape = [(s - 1) * (i + 1) + 1 + lo + hi if s else lo + hi
             for s, i, lo, hi in zip(kind.shape, interior, low, high)]
    with op.location, ir.InsertionPoint(op):
        zero = b.splat("0.0" if str(element).startswith(("f", "bf")) else "0", [], element)
        value = b.op("stablehlo.pad", b.tensor(shape, element), [lhs, zero],
                     edge_padding_low=b.array(low), edge_padding_high=b.array(high),
                     interior_padding=b.array(interior))
        if any(lo < 0 or hi < 0 for lo, hi in pads):
            start, limit = [0] * rank, list(shape)
            for d, axis in enumerate(lhs_dims):
                start[axis] = max(-pads[d][0], 0)
                limit[axis] = shape[axis] - max(-pads[d][1], 0)
            shape = [hi - lo for lo, hi in zip(start, limit)]
            value = b.op("stablehlo.slice", b.tensor(shape, element), [value],
                         start_indices=b.array(start), limit_indices=b.array(limit),
                         strides=b.array([1] * rank))
        attr = dict(attr)
        attr["lhs_dilation"] = b.array([1] * len(lhs_dims))
        attr["padding"] = ir.Attribute.parse(
            f"dense<0> : tensor<{len(lhs_dims)}x2xi64>")
        new = ir.Operation.create("stablehlo.convolution", results=[op.results[0].type],
                                  operands=[value, op.operands[1]],
                                  attributes=attr).results[0]
    op.results[0].replace_all_uses_with(new)
    op.erase()
    return True


def _rewrite_convolution(op, ir) -> bool:
    """Replaces one lhs-dilated convolution by its full form, sliced and padded (module
    docstring); False when it needs no rewrite or is not of that form."""
    attr = {name: op.attributes[name] for name in op.attributes}
    dims = _CONV_DIMS.fullmatch(str(attr.get("dimension_numbers", "")))
    if dims is None:
        return False
    lhs_dims, rhs_dims, out_dims = (_spatial(g) for g in dims.groups())
    n = len(out_dims)
    dilation = _ints(ir, attr.get("lhs_dilation"), [1] * n)
    if all(d == 1 for d in dilation) or any(
            s != 1 for s in _ints(ir, attr.get("window_strides"), [1] * n)):
        return False
    rhs_dilation = _ints(ir, attr.get("rhs_dilation"), [1] * n)
    pads = [(0, 0)] * n
    if "padding" in attr:
        flat = [int(v) for v in ir.DenseIntElementsAttr(attr["padding"])]
        pads = [(flat[2 * d], flat[2 * d + 1]) for d in range(n)]
    if any(d != 1 for d in rhs_dilation):  # no TRANSPOSE_CONV takes a dilated kernel
        return _dilate_by_padding(op, ir, attr, lhs_dims, dilation, pads)
    lhs = list(ir.RankedTensorType(op.operands[0].type).shape)
    rhs = list(ir.RankedTensorType(op.operands[1].type).shape)
    out_type = ir.RankedTensorType(op.results[0].type)
    out = list(out_type.shape)
    full_shape, starts, limits, lows, highs = list(out), [0] * len(out), list(out), \
        [0] * len(out), [0] * len(out)
    full_pads = []
    for d in range(n):
        edge = (rhs[rhs_dims[d]] - 1) * rhs_dilation[d]  # k_eff - 1
        full = (lhs[lhs_dims[d]] - 1) * dilation[d] + 1 + edge
        offset = edge - pads[d][0]  # out[j] = full[j + offset]
        axis, size = out_dims[d], out[out_dims[d]]
        start, limit = max(offset, 0), min(offset + size, full)
        if limit <= start:
            return False  # every output is padding alone: left to the converter
        full_pads.append((edge, edge))
        full_shape[axis], starts[axis], limits[axis] = full, start, limit
        lows[axis] = max(-offset, 0)
        highs[axis] = size - lows[axis] - (limit - start)
    if full_pads == pads:
        return False  # already the full form, which the converter writes correctly
    b = Builder(ir)
    element = out_type.element_type
    text = ", ".join(f"[{lo}, {hi}]" for lo, hi in full_pads)
    attr["padding"] = ir.Attribute.parse(f"dense<[{text}]> : tensor<{n}x2xi64>")
    with op.location, ir.InsertionPoint(op):
        value = ir.Operation.create("stablehlo.convolution",
                                    results=[b.tensor(full_shape, element)],
                                    operands=list(op.operands), attributes=attr).results[0]
        if (starts, limits) != ([0] * len(out), full_shape):
            value = b.op("stablehlo.slice",
                         b.tensor([hi - lo for lo, hi in zip(starts, limits)], element),
                         [value], start_indices=b.array(starts),
                         limit_indices=b.array(limits), strides=b.array([1] * len(out)))
        if any(lows) or any(highs):
            zero = b.splat("0.0" if str(element).startswith(("f", "bf")) else "0", [],
                           element)
            value = b.op("stablehlo.pad", out_type, [value, zero],
                         edge_padding_low=b.array(lows), edge_padding_high=b.array(highs),
                         interior_padding=b.array([0] * len(out)))
    op.results[0].replace_all_uses_with(value)
    op.erase()
    return True


def _dimension(spec: str, letter: str) -> int:
    """The position of `letter` (b, f, i or o) in a dimension spec `b, 0, 1, f`."""
    return [p.strip() for p in spec.split(",")].index(letter)


def _split_batch_groups(op, ir) -> bool:
    """Replaces one convolution of batch_group_count > 1 by its groups, concatenated
    (module docstring); False when it has one group or is not of that form."""
    attr = {name: op.attributes[name] for name in op.attributes}
    groups = int(ir.IntegerAttr(attr["batch_group_count"]).value) \
        if "batch_group_count" in attr else 1
    dims = _CONV_DIMS.fullmatch(str(attr.get("dimension_numbers", "")))
    if groups == 1 or dims is None:
        return False
    batch, kernel_out, out_feature = (_dimension(dims.group(1), "b"),
                                      _dimension(dims.group(2), "o"),
                                      _dimension(dims.group(3), "f"))
    lhs_type, rhs_type = (ir.RankedTensorType(v.type) for v in op.operands)
    out_type = ir.RankedTensorType(op.results[0].type)
    if lhs_type.shape[batch] % groups or rhs_type.shape[kernel_out] % groups:
        return False
    b = Builder(ir)
    attr["batch_group_count"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), 1)

    def part(value, kind, axis: int, g: int):
        shape = list(kind.shape)
        size = shape[axis] // groups
        start, limit = [0] * len(shape), list(shape)
        start[axis], limit[axis] = g * size, (g + 1) * size
        shape[axis] = size
        return b.op("stablehlo.slice", b.tensor(shape, kind.element_type), [value],
                    start_indices=b.array(start), limit_indices=b.array(limit),
                    strides=b.array([1] * len(shape)))

    shape = list(out_type.shape)
    shape[out_feature] //= groups
    with op.location, ir.InsertionPoint(op):
        parts = [ir.Operation.create(
            "stablehlo.convolution", results=[b.tensor(shape, out_type.element_type)],
            operands=[part(op.operands[0], lhs_type, batch, g),
                      part(op.operands[1], rhs_type, kernel_out, g)],
            attributes=attr).results[0] for g in range(groups)]
        whole = ir.Operation.create(
            "stablehlo.concatenate", results=[out_type], operands=parts,
            attributes={"dimension": ir.IntegerAttr.get(ir.IntegerType.get_signless(64),
                                                         out_feature)}).results[0]
    op.results[0].replace_all_uses_with(whole)
    op.erase()
    return True


def batch_grouped_convolutions(module, ir) -> int:
    """Splits every convolution of batch_group_count > 1 into its groups (module
    docstring); how many."""
    ops = [op for op in walk(module.operation, []) if op.name == "stablehlo.convolution"]
    return sum(_split_batch_groups(op, ir) for op in ops)


def lhs_dilated_convolutions(module, ir) -> int:
    """Rewrites every lhs-dilated convolution not in its full form (module docstring);
    how many."""
    ops = [op for op in walk(module.operation, []) if op.name == "stablehlo.convolution"]
    return sum(_rewrite_convolution(op, ir) for op in ops)
