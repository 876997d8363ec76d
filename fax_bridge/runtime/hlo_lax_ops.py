"""The op table of `hlo_lax`: for each StableHLO op it reads, a builder that takes the
MLIR op (and the reader, for regions and callees) once and returns `run(inputs, env)`,
which emits the `lax` call jax lowers back to that op.

Builders read every attribute that changes what the op computes and raise
`hlo_lax.Unreadable` (through `_refuse`) for any value they do not implement, so an op
is read exactly or not at all. Where lax's own semantics differ from StableHLO's (jax
wraps negative dynamic-slice starts, `lax.switch` clamps a negative index to the first
branch), the builder adds the operations that give StableHLO's.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir as _ir
from jax._src.lib.mlir.dialects import hlo as _hlo


ELEMENT_TYPES = {
    "f16": np.float16, "f32": np.float32, "f64": np.float64, "bf16": None,
    "i1": np.bool_, "i8": np.int8, "i16": np.int16, "i32": np.int32, "i64": np.int64,
    "ui8": np.uint8, "ui16": np.uint16, "ui32": np.uint32, "ui64": np.uint64,
    "complex<f32>": np.complex64, "complex<f64>": np.complex128,
}


class Unreadable(Exception):
    """The module holds something `read` cannot turn into lax operations (the message
    names the op and where it comes from)."""


def element_dtype(element_type) -> Optional[np.dtype]:
    """The numpy dtype of an MLIR element type; None for one numpy lacks."""
    name = str(element_type)
    if name == "bf16":
        import ml_dtypes  # imported lazily: only bfloat16 programs need it

        return np.dtype(ml_dtypes.bfloat16)
    dtype = ELEMENT_TYPES.get(name)
    return None if dtype is None else np.dtype(dtype)


def tensor_type(mlir_type) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) of a ranked tensor type; `Unreadable` for anything else."""
    if mlir_type.typeid != _ir.RankedTensorType.static_typeid:
        raise Unreadable(f"a value of type {mlir_type}, not a ranked tensor")
    tensor = _ir.RankedTensorType(mlir_type)
    if not tensor.has_static_shape:
        raise Unreadable(f"a tensor of dynamic shape {mlir_type}")
    dtype = element_dtype(tensor.element_type)
    if dtype is None:
        raise Unreadable(f"a tensor of element type {tensor.element_type}")
    if (dtype.itemsize == 8 and dtype.kind != "c" or dtype.itemsize == 16) and not \
            jax.config.jax_enable_x64:
        raise Unreadable(f"a 64-bit tensor ({mlir_type}) while jax_enable_x64 is off")
    return tuple(int(d) for d in tensor.shape), dtype


def _refuse(what: str):
    raise Unreadable(what)


def _type(value):
    return tensor_type(value.type)


def _ints(op, name: str, default=None) -> list:
    if name not in op.attributes:
        if default is None:
            _refuse(f"no `{name}` attribute")
        return list(default)
    attr = op.attributes[name]
    if isinstance(attr, _ir.DenseI64ArrayAttr):
        return [int(v) for v in attr]
    if isinstance(attr, _ir.DenseBoolArrayAttr):
        return [bool(v) for v in attr]
    if isinstance(attr, _ir.DenseIntElementsAttr):
        return np.array(attr).tolist()
    return _refuse(f"attribute `{name}` = {attr}")


def _int(op, name: str, default=None) -> int:
    if name not in op.attributes:
        if default is None:
            _refuse(f"no `{name}` attribute")
        return default
    return int(_ir.IntegerAttr(op.attributes[name]).value)


def _only(op, allowed: set) -> None:
    """Refuses an attribute this builder does not read (and that may change the op)."""
    known = allowed | {"result_layout", "xla_shape", "mhlo.sharding", "mhlo.frontend_attributes"}
    for name in op.attributes:
        name = getattr(name, "name", name)
        if name not in known:
            _refuse(f"attribute `{name}` = {op.attributes[name]}")


def _precision(op):
    if "precision_config" not in op.attributes:
        return None
    names = [_hlo.PrecisionAttr(a).value for a in _ir.ArrayAttr(op.attributes["precision_config"])]
    if not names:
        return None
    return tuple(lax.Precision[n] if n != "DEFAULT" else lax.Precision.DEFAULT for n in names)


def _elementwise(fn: Callable, *allowed: str) -> Callable:
    def build(op, reader):
        _only(op, set(allowed))
        return lambda xs, env: [fn(*xs)]
    return build


def _round_afz(x):
    return lax.round(x, lax.RoundingMethod.AWAY_FROM_ZERO)


def _round_even(x):
    return lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN)


_UNARY = {
    "abs": lax.abs, "cbrt": lax.cbrt, "ceil": lax.ceil, "cosine": lax.cos,
    "count_leading_zeros": lax.clz, "exponential": lax.exp,
    "exponential_minus_one": lax.expm1, "floor": lax.floor, "imag": lax.imag,
    "is_finite": lax.is_finite, "log": lax.log, "log_plus_one": lax.log1p,
    "logistic": lax.logistic, "negate": lax.neg, "not": lax.bitwise_not,
    "popcnt": lax.population_count, "real": lax.real, "round_nearest_afz": _round_afz,
    "round_nearest_even": _round_even, "rsqrt": lax.rsqrt, "sign": lax.sign,
    "sine": lax.sin, "sqrt": lax.sqrt, "tan": lax.tan, "tanh": lax.tanh,
}
_BINARY = {
    "add": lax.add, "and": lax.bitwise_and, "atan2": lax.atan2, "complex": lax.complex,
    "divide": lax.div, "maximum": lax.max, "minimum": lax.min, "multiply": lax.mul,
    "or": lax.bitwise_or, "power": lax.pow, "remainder": lax.rem,
    "shift_left": lax.shift_left, "shift_right_arithmetic": lax.shift_right_arithmetic,
    "shift_right_logical": lax.shift_right_logical, "subtract": lax.sub,
    "xor": lax.bitwise_xor,
}
_COMPARE = {"EQ": lax.eq, "NE": lax.ne, "LT": lax.lt, "LE": lax.le, "GT": lax.gt, "GE": lax.ge}

TABLE: dict[str, Callable] = {}
for _name, _fn in {**_UNARY, **_BINARY}.items():
    TABLE[f"stablehlo.{_name}"] = _elementwise(_fn)
TABLE["stablehlo.tan"] = _elementwise(lax.tan, "result_accuracy")
TABLE["stablehlo.select"] = _elementwise(
    lambda p, a, b: lax.select(lax.broadcast_in_dim(p, a.shape, ()) if p.ndim < a.ndim
                               else p, a, b))
TABLE["stablehlo.clamp"] = _elementwise(lax.clamp)
TABLE["stablehlo.optimization_barrier"] = lambda op, reader: (
    lambda xs, env: list(lax.optimization_barrier(list(xs))))
TABLE["stablehlo.tuple"] = lambda op, reader: lambda xs, env: [tuple(xs)]


def _op(name: str):
    def register(build):
        TABLE[f"stablehlo.{name}"] = build
        return build
    return register


for _accurate in ("exponential", "exponential_minus_one", "log", "log_plus_one",
                  "logistic", "rsqrt", "sqrt", "cbrt", "cosine", "sine", "tanh"):
    TABLE[f"stablehlo.{_accurate}"] = _elementwise(_UNARY[_accurate], "result_accuracy")


@_op("constant")
def _constant(op, reader):
    shape, dtype = _type(op.result)
    attr = op.attributes["value"]
    if attr.is_splat:
        splat = attr.get_splat_value()
        scalar = (splat.value if isinstance(splat, (_ir.BoolAttr, _ir.FloatAttr,
                                                    _ir.IntegerAttr)) else None)
        if scalar is None:
            _refuse(f"a constant splat of {splat}")
        value = np.full(shape, scalar, dtype=dtype)
    else:
        try:
            value = np.array(attr).astype(dtype).reshape(shape)
        except Exception as e:  # noqa: BLE001 - bf16 and complex constants
            _refuse(f"a constant of type {op.result.type} ({e})")
    return lambda xs, env: [value]


@_op("iota")
def _iota(op, reader):
    shape, dtype = _type(op.result)
    dim = _int(op, "iota_dimension")
    return lambda xs, env: [lax.broadcasted_iota(dtype, shape, dim)]


@_op("convert")
def _convert(op, reader):
    _only(op, set())
    _, dtype = _type(op.result)
    return lambda xs, env: [lax.convert_element_type(xs[0], dtype)]


@_op("bitcast_convert")
def _bitcast(op, reader):
    _only(op, set())
    _, dtype = _type(op.result)
    return lambda xs, env: [lax.bitcast_convert_type(xs[0], dtype)]


@_op("reduce_precision")
def _reduce_precision(op, reader):
    e, m = _int(op, "exponent_bits"), _int(op, "mantissa_bits")
    return lambda xs, env: [lax.reduce_precision(xs[0], e, m)]


@_op("broadcast_in_dim")
def _broadcast(op, reader):
    shape, _ = _type(op.result)
    dims = tuple(_ints(op, "broadcast_dimensions"))
    return lambda xs, env: [lax.broadcast_in_dim(xs[0], shape, dims)]


@_op("reshape")
def _reshape(op, reader):
    shape, _ = _type(op.result)
    return lambda xs, env: [lax.reshape(xs[0], shape)]


@_op("transpose")
def _transpose(op, reader):
    perm = tuple(_ints(op, "permutation"))
    return lambda xs, env: [lax.transpose(xs[0], perm)]


@_op("slice")
def _slice(op, reader):
    start, limit = _ints(op, "start_indices"), _ints(op, "limit_indices")
    strides = _ints(op, "strides", [1] * len(start))
    return lambda xs, env: [lax.slice(xs[0], start, limit, strides)]


def _clamped(starts, shape, sizes) -> list:
    """Start indices clamped into [0, dim - size], as StableHLO clamps them (jax would
    wrap a negative one around first)."""
    return [lax.clamp(np.zeros((), s.dtype), s, np.asarray(d - z, s.dtype))
            for s, d, z in zip(starts, shape, sizes)]


@_op("dynamic_slice")
def _dynamic_slice(op, reader):
    sizes = _ints(op, "slice_sizes")
    return lambda xs, env: [lax.dynamic_slice(
        xs[0], _clamped(xs[1:], xs[0].shape, sizes), sizes)]


@_op("dynamic_update_slice")
def _dynamic_update_slice(op, reader):
    return lambda xs, env: [lax.dynamic_update_slice(
        xs[0], xs[1], _clamped(xs[2:], xs[0].shape, xs[1].shape))]


@_op("concatenate")
def _concatenate(op, reader):
    dim = _int(op, "dimension")
    return lambda xs, env: [lax.concatenate(list(xs), dim)]


@_op("pad")
def _pad(op, reader):
    config = list(zip(_ints(op, "edge_padding_low"), _ints(op, "edge_padding_high"),
                      _ints(op, "interior_padding")))
    return lambda xs, env: [lax.pad(xs[0], xs[1], config)]


@_op("reverse")
def _reverse(op, reader):
    dims = tuple(_ints(op, "dimensions"))
    return lambda xs, env: [lax.rev(xs[0], dims)]


@_op("compare")
def _compare(op, reader):
    direction = _hlo.ComparisonDirectionAttr(op.attributes["comparison_direction"]).value
    if "compare_type" in op.attributes:
        kind = _hlo.ComparisonTypeAttr(op.attributes["compare_type"]).value
        if kind == "TOTALORDER":
            _refuse("a TOTALORDER comparison")
    fn = _COMPARE[direction]
    return lambda xs, env: [fn(xs[0], xs[1])]


def _dot(lhs, rhs, dims, precision, dtype):
    return lax.dot_general(lhs, rhs, dims, precision=precision, preferred_element_type=dtype)


@_op("dot_general")
def _dot_general(op, reader):
    _only(op, {"dot_dimension_numbers", "precision_config"})
    d = _hlo.DotDimensionNumbers(op.attributes["dot_dimension_numbers"])
    dims = ((tuple(d.lhs_contracting_dimensions), tuple(d.rhs_contracting_dimensions)),
            (tuple(d.lhs_batching_dimensions), tuple(d.rhs_batching_dimensions)))
    precision, (_, dtype) = _precision(op), _type(op.result)
    return lambda xs, env: [_dot(xs[0], xs[1], dims, precision, dtype)]


@_op("dot")
def _dot_legacy(op, reader):
    _only(op, {"precision_config"})
    precision, (_, dtype) = _precision(op), _type(op.result)
    lhs_rank = len(_type(op.operands[0])[0])
    dims = (((lhs_rank - 1,), (0,)), ((), ()))
    return lambda xs, env: [_dot(xs[0], xs[1], dims, precision, dtype)]


@_op("convolution")
def _convolution(op, reader):
    _only(op, {"window_strides", "padding", "lhs_dilation", "rhs_dilation",
               "window_reversal", "dimension_numbers", "feature_group_count",
               "batch_group_count", "precision_config"})
    d = _hlo.ConvDimensionNumbers(op.attributes["dimension_numbers"])
    n = len(d.input_spatial_dimensions)
    if any(_ints(op, "window_reversal", [False] * n)):
        _refuse("a convolution with window reversal")
    pads = _ints(op, "padding", [[0, 0]] * n)
    numbers = lax.ConvDimensionNumbers(
        (d.input_batch_dimension, d.input_feature_dimension, *d.input_spatial_dimensions),
        (d.kernel_output_feature_dimension, d.kernel_input_feature_dimension,
         *d.kernel_spatial_dimensions),
        (d.output_batch_dimension, d.output_feature_dimension, *d.output_spatial_dimensions))
    kwargs = dict(
        window_strides=_ints(op, "window_strides", [1] * n), padding=[tuple(p) for p in pads],
        lhs_dilation=_ints(op, "lhs_dilation", [1] * n),
        rhs_dilation=_ints(op, "rhs_dilation", [1] * n), dimension_numbers=numbers,
        feature_group_count=_int(op, "feature_group_count", 1),
        batch_group_count=_int(op, "batch_group_count", 1), precision=_precision(op),
        preferred_element_type=_type(op.result)[1])
    return lambda xs, env: [lax.conv_general_dilated(xs[0], xs[1], **kwargs)]


def _body(fn, env, count: int) -> Callable:
    """A reduction body (`count` accumulators, then as many values) as lax's callable:
    one operand takes and gives values, several take and give tuples."""
    if count == 1:
        return lambda a, b: fn(a, b, env=env)[0]
    return lambda a, b: tuple(fn(*a, *b, env=env))


@_op("reduce")
def _reduce(op, reader):
    dims = tuple(_ints(op, "dimensions"))
    count = len(op.operands) // 2
    fn = reader.region(op.regions[0])

    def run(xs, env):
        body = _body(fn, env, count)
        if count == 1:
            return [lax.reduce(xs[0], xs[1], body, dims)]
        return list(lax.reduce(tuple(xs[:count]), tuple(xs[count:]), body, dims))
    return run


@_op("reduce_window")
def _reduce_window(op, reader):
    count = len(op.operands) // 2
    dims = _ints(op, "window_dimensions")
    n = len(dims)
    strides = _ints(op, "window_strides", [1] * n)
    base = _ints(op, "base_dilations", [1] * n)
    window = _ints(op, "window_dilations", [1] * n)
    pads = [tuple(p) for p in _ints(op, "padding", [[0, 0]] * n)]
    fn = reader.region(op.regions[0])

    def run(xs, env):
        body = _body(fn, env, count)
        if count == 1:
            return [lax.reduce_window(xs[0], xs[1], body, dims, strides, pads, base, window)]
        return list(lax.reduce_window(tuple(xs[:count]), tuple(xs[count:]), body, dims,
                                      strides, pads, base, window))
    return run


@_op("while")
def _while(op, reader):
    cond, body = reader.region(op.regions[0]), reader.region(op.regions[1])

    def run(xs, env):
        out = lax.while_loop(lambda c: cond(*c, env=env)[0],
                             lambda c: tuple(body(*c, env=env)), tuple(xs))
        return list(out)
    return run


@_op("case")
def _case(op, reader):
    branches = [reader.region(r) for r in op.regions]
    last = len(branches) - 1

    def run(xs, env):
        index = xs[0]
        # StableHLO runs the last branch for any index out of range, lax clamps.
        index = lax.select((index < 0) | (index > last), np.asarray(last, index.dtype), index)
        fns = [lambda b=b: tuple(b(env=env)) for b in branches]
        return list(lax.switch(index, fns))
    return run


@_op("if")
def _if(op, reader):
    yes, no = reader.region(op.regions[0]), reader.region(op.regions[1])
    return lambda xs, env: list(lax.cond(xs[0], lambda: tuple(yes(env=env)),
                                         lambda: tuple(no(env=env))))


@_op("get_tuple_element")
def _get_tuple_element(op, reader):
    index = _int(op, "index")
    return lambda xs, env: [xs[0][index]]


@_op("rng_bit_generator")
def _rng_bit_generator(op, reader):
    algorithm = str(op.attributes["rng_algorithm"])
    names = {"DEFAULT": lax.RandomAlgorithm.RNG_DEFAULT,
             "THREE_FRY": lax.RandomAlgorithm.RNG_THREE_FRY,
             "PHILOX": lax.RandomAlgorithm.RNG_PHILOX}
    chosen = [v for k, v in names.items() if k in algorithm]
    if not chosen:
        _refuse(f"rng algorithm {algorithm}")
    shape, dtype = _type(op.results[1])
    return lambda xs, env: list(lax.rng_bit_generator(xs[0], shape, dtype, chosen[0]))


def _call(op, reader):
    callee = str(op.attributes["callee"]).lstrip("@")
    fn = reader.function(callee)
    return lambda xs, env: fn(*xs)


TABLE["func.call"] = _call


def _gather_numbers(d, index_vector_dim: int, rank: int):
    if index_vector_dim != rank - 1:
        _refuse("a gather whose index vector is not the indices' last dimension")
    return lax.GatherDimensionNumbers(
        offset_dims=tuple(d.offset_dims), collapsed_slice_dims=tuple(d.collapsed_slice_dims),
        start_index_map=tuple(d.start_index_map),
        operand_batching_dims=tuple(d.operand_batching_dims),
        start_indices_batching_dims=tuple(d.start_indices_batching_dims))


@_op("gather")
def _gather(op, reader):
    _only(op, {"dimension_numbers", "slice_sizes", "indices_are_sorted"})
    d = _hlo.GatherDimensionNumbers(op.attributes["dimension_numbers"])
    rank = len(_type(op.operands[1])[0])
    expand = d.index_vector_dim == rank
    numbers = _gather_numbers(d, d.index_vector_dim + expand, rank + expand)
    sizes = tuple(_ints(op, "slice_sizes"))

    def run(xs, env):
        indices = lax.expand_dims(xs[1], (rank,)) if expand else xs[1]
        # StableHLO clamps out-of-range starts, as XLA's gather does natively.
        return [lax.gather(xs[0], indices, numbers, sizes,
                           mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)]
    return run


_SCATTERS = {"stablehlo.add": lax.scatter_add, "stablehlo.multiply": lax.scatter_mul,
             "stablehlo.maximum": lax.scatter_max, "stablehlo.minimum": lax.scatter_min}


@_op("scatter")
def _scatter(op, reader):
    _only(op, {"scatter_dimension_numbers", "indices_are_sorted", "unique_indices"})
    if len(op.operands) != 3:
        _refuse("a scatter of several operands")
    block = list(op.regions[0].blocks)[0]
    ops = list(block.operations)
    args = list(block.arguments)
    if len(ops) == 1 and ops[0].operands[0] == args[1]:
        scatter = lax.scatter  # the update replaces the operand's element
    elif len(ops) == 2 and ops[0].name in _SCATTERS and \
            {ops[0].operands[0], ops[0].operands[1]} == {args[0], args[1]} and \
            ops[1].operands[0] == ops[0].result:
        scatter = _SCATTERS[ops[0].name]
    else:
        _refuse("a scatter whose combiner is not a replacement, add, multiply, max or min")
    d = _hlo.ScatterDimensionNumbers(op.attributes["scatter_dimension_numbers"])
    rank = len(_type(op.operands[1])[0])
    if d.index_vector_dim != rank - 1 and d.index_vector_dim != rank:
        _refuse("a scatter whose index vector is not the indices' last dimension")
    expand = d.index_vector_dim == rank
    numbers = lax.ScatterDimensionNumbers(
        update_window_dims=tuple(d.update_window_dims),
        inserted_window_dims=tuple(d.inserted_window_dims),
        scatter_dims_to_operand_dims=tuple(d.scattered_dims_to_operand_dims),
        operand_batching_dims=tuple(d.input_batching_dims),
        scatter_indices_batching_dims=tuple(d.scatter_indices_batching_dims))

    def run(xs, env):
        indices = lax.expand_dims(xs[1], (rank,)) if expand else xs[1]
        # Out-of-range updates are dropped, as XLA's scatter does natively.
        return [scatter(xs[0], indices, xs[2], numbers,
                        mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)]
    return run


@_op("select_and_scatter")
def _select_and_scatter(op, reader):
    # Max (min) pooling's gradient: jax's own transpose of a max (min) reduce_window,
    # which lowers to this op with a GE (LE) select and an add scatter.
    select = list(list(op.regions[0].blocks)[0].operations)
    scatter = list(list(op.regions[1].blocks)[0].operations)
    direction = (_hlo.ComparisonDirectionAttr(select[0].attributes["comparison_direction"]).value
                 if select[0].name == "stablehlo.compare" else None)
    if len(select) != 2 or direction not in ("GE", "LE") or len(scatter) != 2 or \
            scatter[0].name != "stablehlo.add":
        _refuse("a select_and_scatter other than a max or min pooling's gradient")
    dims = _ints(op, "window_dimensions")
    strides = _ints(op, "window_strides", [1] * len(dims))
    pads = [tuple(p) for p in _ints(op, "padding", [[0, 0]] * len(dims))]
    pool = lax.max if direction == "GE" else lax.min

    def run(xs, env):
        operand, source, init = xs
        low = np.array(-np.inf if direction == "GE" else np.inf, operand.dtype)
        _, vjp = jax.vjp(lambda x: lax.reduce_window(x, low, pool, dims, strides, pads),
                         operand)
        return [vjp(source)[0] + init]
    return run
