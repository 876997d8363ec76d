"""`stablehlo.fma` in older StableHLO: jax 0.12 writes a fused multiply-add (`erf_inv`
behind `jax.random.normal`, ...) that StableHLO 0.9.0 (TF 2.14's `XlaCallModule`) has
no op for. `fma_as_float64(module, ir)` rewrites each float32 one into float64 ops
giving the fused result's bits: the product is exact
in float64, the sum rounded to odd there (the nearest float64, moved to its odd
neighbour towards the exact sum when the sum is inexact, the error found exactly by
Knuth's two-sum), then rounded once to the narrow type, which gives the correctly rounded
result because float64 holds at least two bits more than twice float32's mantissa.
Others are left as they are (no wider type here holds a float64 product; XLA's CPU has
no float16 or bfloat16 fma to check one against).
"""

from __future__ import annotations

_NARROW = ("f32",)


def _ops(module) -> list:
    out = []

    def visit(op) -> None:
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    visit(child.operation)
        out.append(op)

    visit(module.operation)
    return out


def fma_as_float64(module, ir) -> int:
    """Rewrites every float32 `stablehlo.fma` of `module` (module docstring); how
    many."""
    count = 0
    for op in _ops(module):
        if op.name != "stablehlo.fma":
            continue
        kind = ir.RankedTensorType(op.results[0].type)
        if str(kind.element_type) not in _NARROW:
            continue
        _rewrite(op, ir, kind)
        count += 1
    return count


def _rewrite(op, ir, kind) -> None:
    shape = list(kind.shape)
    f64, i64, i1 = ir.F64Type.get(), ir.IntegerType.get_signless(64), \
        ir.IntegerType.get_signless(1)
    wide, bits, flags = (ir.RankedTensorType.get(shape, t) for t in (f64, i64, i1))

    def make(name, result, *operands, **attributes):
        return ir.Operation.create(name, results=[result], operands=list(operands),
                                   attributes=attributes).results[0]

    def const(text, tensor):
        return make("stablehlo.constant", tensor,
                    value=ir.DenseElementsAttr.get_splat(tensor, ir.Attribute.parse(
                        f"{text} : {tensor.element_type}")))

    def compare(direction, a, b):
        return make("stablehlo.compare", flags, a, b, comparison_direction=ir.Attribute.parse(
            f"#stablehlo<comparison_direction {direction}>"))

    with op.location, ir.InsertionPoint(op):
        a, b, c = (make("stablehlo.convert", wide, x) for x in op.operands)
        product = make("stablehlo.multiply", wide, a, b)  # exact: 2 x 24 bits < 53
        total = make("stablehlo.add", wide, product, c)
        # two-sum: total + error == product + c exactly
        back = make("stablehlo.subtract", wide, total, product)
        error = make("stablehlo.add", wide,
                     make("stablehlo.subtract", wide, product,
                          make("stablehlo.subtract", wide, total, back)),
                     make("stablehlo.subtract", wide, c, back))
        word = make("stablehlo.bitcast_convert", bits, total)
        two = const("2", bits)
        even = compare("EQ", make("stablehlo.remainder", bits, word, two), const("0", bits))
        zero = const("0.0", wide)
        inexact = make("stablehlo.and", flags, compare("NE", error, zero),
                       make("stablehlo.is_finite", flags, total))
        # away from zero when the error has the sum's sign, else towards it
        same = compare("EQ", compare("LT", error, zero), compare("LT", total, zero))
        step = make("stablehlo.select", bits, same, const("1", bits), const("-1", bits))
        odd = make("stablehlo.select", bits,
                   make("stablehlo.and", flags, inexact, even), step, const("0", bits))
        rounded = make("stablehlo.bitcast_convert", wide,
                       make("stablehlo.add", bits, word, odd))
        result = make("stablehlo.convert", op.results[0].type, rounded)
    op.results[0].replace_all_uses_with(result)
    op.erase()
