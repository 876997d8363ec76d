"""What a client part that LiteRT cannot run is refused with: the op, its jax primitive,
the user's source lines and the rewrite that avoids it.

`ConversionRefused` is raised at build time (`convert`) when the converter leaves a
StableHLO op it cannot legalize, when the model needs custom or Flex (TensorFlow) ops, or
when the interpreter refuses to prepare an op; its message names each op with the user's
source lines that compute it (`located`, from `lowering.source_lines`, which looks a
LiteRT op up by the StableHLO op it comes from: `stablehlo_source`), the jax primitive
that lowers to it (`JAX_SOURCES`, `KERNELS`) and how to write the client work without
it. A LiteRT builtin is never called one LiteRT lacks: an interpreter refusal names the
op whose kernel failed to prepare (`failed_node`), not the loops around it.
"""

from __future__ import annotations

import re

from fax_bridge.errors import ComputationError

# StableHLO op -> (the jax primitive(s) that lower to it, the rewrite that avoids it)
JAX_SOURCES = {
    "stablehlo.sort": ("sort (jnp.sort, jnp.argsort, jnp.median; lax.top_k when only its "
                       "values are used)",
                       "use max/min reductions, or sort on the server; for lax.top_k's "
                       "values, use its indices, which LiteRT's TOPK_V2 gives: "
                       "jnp.take_along_axis(x, lax.top_k(x, k)[1], axis=-1)"),
    "stablehlo.rng_bit_generator": ("random_bits (jax.random inside the client work)",
                                    "draw the noise on the server or pass it in the "
                                    "client's data"),
    "stablehlo.custom_call": ("a custom call (jnp.linalg decompositions, callbacks)",
                              "write the linear algebra with matmuls and elementwise ops"),
    "stablehlo.reduce_precision": ("reduce_precision (float8/e3m0 rounding)",
                                   "round with elementwise ops (floor of a scaled value, "
                                   "clip) instead of a narrow float type"),
    "stablehlo.bitcast_convert": ("bitcast_convert_type (float bits as integers)",
                                  "compute the code from the value (floor, log2) instead "
                                  "of its bits"),
    "stablehlo.popcnt": ("population_count", "count with a sum of comparisons"),
    "stablehlo.fft": ("fft (jnp.fft)", "use a matmul with the DFT matrix"),
    "stablehlo.cholesky": ("cholesky (jnp.linalg.cholesky)", "solve on the server"),
    "stablehlo.triangular_solve": ("triangular_solve (jax.scipy.linalg)",
                                   "solve on the server"),
    "stablehlo.scatter": ("scatter (x.at[i].set/add, the gradient of an index gather)",
                          "use a one-hot product (jax.nn.one_hot(i, n) * values)"),
    "stablehlo.select_and_scatter": ("the gradient of a max pool (reduce_window max) whose "
                                     "scatter does not add",
                                     "use a max pool of jax's own gradient, an average pool "
                                     "or a strided convolution"),
    "stablehlo.reduce_window": ("reduce_window (pooling, cumulative sums)",
                                "use a strided convolution or jnp.cumsum"),
    "stablehlo.complex": ("complex numbers", "keep real and imaginary parts apart"),
    "stablehlo.convert": ("convert_element_type to a type LiteRT lacks (float64, int64 "
                          "without x64, float8)", "keep the client work in float32/int32"),
}

_CONV_SOURCE = ("conv_general_dilated or its gradient (jax.grad of a convolution, "
                "lax.conv_transpose) in a form litert-converter 0.5.0 does not write as a "
                "builtin, even after side_rewrites (which handle the strides, paddings, "
                "dilations and depthwise groups of 2-d CNNs)")
_CONV_FIX = ("compute it at stride 1 with the strided convolution's own padding and keep "
             "every s-th output: lax.conv_general_dilated(x, k, (1, 1), "
             "lax.padtype_to_pads(x.shape[1:3], dilated kernel shape, (s, s), padding), "
             "rhs_dilation=d)[:, ::s, ::s] (NHWC)")
JAX_SOURCES["stablehlo.convolution"] = (_CONV_SOURCE, _CONV_FIX)

# LiteRT builtin -> (the StableHLO op it is made from, whose source lines are the user's;
# the jax primitive behind it; the rewrite that avoids it), for builtins whose kernel can
# refuse what the converter wrote (`tfl.<name>` is the same op inside the converter)
KERNELS = {
    "TRANSPOSE_CONV": ("stablehlo.convolution",
                       "the gradient of a strided convolution with respect to its input "
                       "(jax.grad of lax.conv_general_dilated), or lax.conv_transpose", _CONV_FIX),
    "CONV_2D": ("stablehlo.convolution", "jax's conv_general_dilated or its gradient",
                _CONV_FIX),
    "DEPTHWISE_CONV_2D": ("stablehlo.convolution", "jax's conv_general_dilated with "
                          "feature_group_count > 1, or its gradient", _CONV_FIX),
}


_TERMINATORS = {"stablehlo.return", "mhlo.return"}  # a region's end, named beside its op


def _builtin_names() -> frozenset:
    """LiteRT's builtin operator names (its schema's)."""
    try:
        from ai_edge_litert import schema_py_generated as schema
    except ImportError:  # the interpreter not installed: names in LiteRT's own spelling
        return frozenset()
    return frozenset(k for k in vars(schema.BuiltinOperator) if not k.startswith("_"))


def builtin(op: str) -> str | None:
    """The LiteRT builtin `op` names (`TRANSPOSE_CONV`, or `tfl.transpose_conv` as the
    converter spells it), None for any other op."""
    name = op[len("tfl."):].upper() if op.startswith("tfl.") else op
    names = _builtin_names()
    if name in names or (not names and re.fullmatch(r"[A-Z][A-Z0-9_]*", name)):
        return name
    return None


def stablehlo_source(op: str) -> str | None:
    """The StableHLO op whose source lines are `op`'s: itself for a StableHLO op (an
    `mhlo.` op is the converter's copy of one), the op a LiteRT builtin is made from
    where `KERNELS` knows it; None where none is known."""
    if op.startswith(("stablehlo.", "mhlo.")):
        return "stablehlo." + op.split(".", 1)[1]
    kernel = KERNELS.get(builtin(op) or "")
    return kernel[0] if kernel else None


class ConversionRefused(ComputationError):
    """A client part that no stock LiteRT runtime can run (builtin ops only)."""

    def __init__(self, message: str, ops: list, what: str = "", detail: str = ""):
        super().__init__(message)
        self.ops = list(ops)
        self.what, self.detail = what, detail


def describe(op: str, at: list | None = None) -> str:
    """`op`, the user's source lines `at` that compute it, the jax primitive behind it
    and the rewrite, where known."""
    named = op + (f" (at {', '.join(at)})" if at else "")
    source = JAX_SOURCES.get(op)
    if source is None and op.startswith("CUSTOM:"):
        name = op.split(":", 1)[1]
        source = ((f"a TensorFlow op ({name[4:]})" if name.startswith("Flex")
                   else f"the custom op {name}"),
                  "express it with the StableHLO ops jax lowers jnp arithmetic to")
    kernel = KERNELS.get(builtin(op) or "")
    if source is None and kernel is not None:
        return (f"{named}, a LiteRT builtin that refused the operands litert-converter "
                f"gave it, made from {kernel[1]}: {kernel[2]}")
    if source is None and op.startswith("tfl."):
        return (f"{named}, a LiteRT builtin with no kernel for these operand types (unsigned "
                "or narrow integers): cast to int32 or float32 before it; jax.random "
                "(threefry on uint32 words) is such a source: draw a dropout mask with "
                "fax_bridge.litert.layers.dropout(key, rate, x) from an int32 key, or pass "
                "the noise in the client's data")
    if source is None and builtin(op) is not None:
        return (f"{named}, a LiteRT builtin that refused what litert-converter gave it (the "
                "check that failed is below): compute this step with other jnp operations")
    if source is None:
        return (f"{named}, which litert-converter 0.5.0 does not write as a LiteRT builtin: "
                "compute this step with other jnp operations")
    return f"{named}, from jax's {source[0]}: {source[1]}"


def _informative(detail: str) -> str:
    """`detail` without the lines that only announce a message (`Failed to export
    flatbuffer:` with nothing after it)."""
    kept = [line for line in detail.strip().splitlines()
            if line.strip() and not re.fullmatch(r"[^:]+:\s*", line)]
    return "\n".join(kept)[-1500:]


def refuse(what: str, ops: list, detail: str = "", where: dict | None = None
           ) -> ConversionRefused:
    """The refusal naming each of `ops` (`describe`), with the source lines `where`
    gives for it (op -> ["file:line (function)", ...])."""
    ops = {"stablehlo." + op[len("mhlo."):] if op.startswith("mhlo.") else op
           for op in ops} - _TERMINATORS
    # a converter op (tfl.conv_2d) named beside the StableHLO op it is made from: one failure
    ops = sorted(op for op in ops if not (op.startswith("tfl.") and stablehlo_source(op) in ops))
    where = where or {}
    named = "; ".join(describe(op, where.get(op)) for op in ops) if ops else \
        "(the converter named no op)"
    text = f"the client part cannot run in LiteRT: {what}: {named}"
    detail = _informative(detail)
    if detail:
        text += f"\n{detail}"
    return ConversionRefused(text, ops, what, detail)


def located(refusal: ConversionRefused, where: dict) -> ConversionRefused:
    """`refusal` naming the user's source lines of its ops."""
    return refuse(refusal.what, refusal.ops, refusal.detail, where)


def failed_node(text: str) -> list:
    """The op whose kernel failed to prepare, from the interpreter's message ("Node number
    79 (TRANSPOSE_CONV) failed to prepare.", then one such line for each loop around it,
    innermost first): [that op], or [] where the message names none."""
    found = re.search(r"Node number \d+ \(([A-Z][A-Z0-9_]*)\) failed to prepare", text)
    return [found.group(1)] if found else []


def ops_in_message(text: str) -> list:
    """The StableHLO / LiteRT op names an error message mentions."""
    found = re.findall(r"'?((?:stablehlo|chlo|mhlo|vhlo)\.[a-z_0-9]+)'?", text)
    found += re.findall(r"legalize operation '(tfl\.[a-z_0-9]+)'", text)
    for name in re.findall(r"builtin opcode '([A-Z_0-9]+)'", text):
        found.append("stablehlo." + name[len("STABLEHLO_"):].lower()
                      if name.startswith("STABLEHLO_") else name)
    found += [f"CUSTOM:{m}" for m in re.findall(r"custom op '?([A-Za-z_0-9]+)", text)]
    return sorted(set(found) - _TERMINATORS)
