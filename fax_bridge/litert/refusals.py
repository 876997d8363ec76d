"""What a client part that LiteRT cannot run is refused with: the op, its jax primitive,
and the rewrite that avoids it.

`ConversionRefused` is raised at build time (`convert`) when the converter leaves a
StableHLO op it has no builtin for, when the model needs custom or Flex (TensorFlow)
ops, or when the interpreter refuses to prepare an op; its message names each op with
the user's source lines that compute it (`located`, from `lowering.source_lines`), the
jax primitive that lowers to it (`JAX_SOURCES`) and how to write the client work
without it.
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


_TERMINATORS = {"stablehlo.return", "mhlo.return"}  # a region's end, named beside its op


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
    if source is None and op.startswith("tfl."):
        return (f"{named}, a LiteRT builtin with no kernel for these operand types (unsigned "
                "or narrow integers): cast to int32 or float32 before it; jax.random "
                "(threefry on uint32 words) is such a source: draw a dropout mask with "
                "fax_bridge.litert.layers.dropout(key, rate, x) from an int32 key, or pass "
                "the noise in the client's data")
    if source is None:
        return f"{named} (no LiteRT builtin)"
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
    ops = sorted(set(ops) - _TERMINATORS)
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


def ops_in_message(text: str) -> list:
    """The StableHLO / LiteRT op names an error message mentions."""
    found = re.findall(r"'?((?:stablehlo|chlo|mhlo|vhlo)\.[a-z_0-9]+)'?", text)
    found += re.findall(r"legalize operation '(tfl\.[a-z_0-9]+)'", text)
    for name in re.findall(r"builtin opcode '([A-Z_0-9]+)'", text):
        found.append("stablehlo." + name[len("STABLEHLO_"):].lower()
                      if name.startswith("STABLEHLO_") else name)
    found += [f"CUSTOM:{m}" for m in re.findall(r"custom op '?([A-Za-z_0-9]+)", text)]
    return sorted(set(found) - _TERMINATORS)
