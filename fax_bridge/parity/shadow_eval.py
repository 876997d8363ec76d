"""The float64 shadow's evaluator (`parity.shadow`): a jaxpr walked equation by equation
with each float value a (float32, float64) pair, every decision taken by the float32 path.

Both halves are evaluated in step: the float32 half as the program is (every value in
its own dtype), the float64 half with every float widened and, where noisy, moved by a
rounding of the size float32 allows at each equation (`rounded`). A value that is not a
float (a bool, an integer, a key) is one value, made from the float32 half: so a
comparison, an argmax, a float made an integer, and `floor`, `ceil`, `round` and `sign`
(`DECIDES`: a float result that is a decision) are the float32 path's in both halves,
and the `cond` branch, the `select_n` case, the `while` trip count, a gathered index
and a sort's or top_k's order that follow from them are float32's in the float64 half
too, inside scans, loops and client maps alike. XLA drops float32 work that feeds no
decision and no output.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core

from fax_bridge.language import jax_compat
from fax_bridge.language import primitive_facts

ULPS_OF_FUNCTIONS = 4.0
# Ops that move or pick values (no rounding of their own).
MOVES = {"reshape", "transpose", "broadcast_in_dim", "slice", "squeeze", "concatenate",
         "select_n", "gather", "dynamic_slice", "dynamic_update_slice", "pad", "copy",
         "copy_p", "expand_dims", "rev", "max", "min", "reduce_max", "reduce_min", "neg",
         "abs", "iota", "sign", "stop_gradient", "argmax", "argmin", "clamp",
         "federated_broadcast", "sort", "reduce_window_max", "reduce_window_min",
         "split", "top_k", "floor", "ceil", "round", "optimization_barrier",
         "bitcast_convert_type"}
# Float results that are decisions (a step function of their operand): the float32
# path's in both halves.
DECIDES = {"floor", "ceil", "round", "sign"}
# Orders decided by comparing floats: the float64 half is permuted as float32's is.
ORDERS = {"sort", "top_k"}
# Elementwise functions an interpreter's kernels compute within a few ulp, not 0.5.
TRANSCENDENTAL = {"exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos",
                  "tan", "pow", "erf", "erfc", "erf_inv", "rsqrt", "sqrt", "cbrt", "atan2",
                  "lgamma", "digamma", "asin", "acos", "atan", "sinh", "cosh", "asinh",
                  "acosh", "atanh"}
# IEEE operations every float32 implementation rounds alike from the same operands: what
# tells two evaluations apart is their operands (carried here by the program itself)
# and where a compiler fuses a multiply into an add (one rounding fewer: covered by the
# float32 path's own error, `parity.shadow.bound`). Not drawn, which keeps the shadow
# small to compile.
ALIKE = {"add", "sub", "mul", "add_any", "square"}
CALLS = ("pjit", "jit", "closed_call", "core_call")  # sub-jaxprs evaluated in place
_SUB_JAXPRS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
_DTYPE_PARAMS = ("new_dtype", "dtype", "preferred_element_type", "out_dtype")
# Scatters by name: their reduction region is typed with the operand, so one is made anew.
_SCATTERS = {"scatter-add": lax.scatter_add, "scatter_add": lax.scatter_add,
             "scatter-mul": lax.scatter_mul, "scatter-min": lax.scatter_min,
             "scatter-max": lax.scatter_max, "scatter": lax.scatter}


def is_float(dtype) -> bool:
    """Whether `dtype` (a name too) is a float type, bfloat16 and float8s included."""
    return bool(jnp.issubdtype(jnp.dtype(dtype), jnp.floating))


def is_key(value) -> bool:
    """Whether `value` is an array of PRNG keys."""
    dtype = getattr(value, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def floating(value) -> bool:
    """Whether `value` (an array, a scalar) holds floats."""
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        dtype = np.asarray(value).dtype
    return not is_key(value) and is_float(dtype)


class Pair(NamedTuple):
    """A float value as the float32 path has it and as the float64 shadow has it."""

    narrow: Any
    wide: Any


def pair(value):
    """`value` as the evaluator holds it: a `Pair` of it and it in float64 for floats,
    itself otherwise."""
    if floating(value):
        return Pair(value, jnp.asarray(value, jnp.float64))
    return value


def narrow(value):
    """The float32 path's half of a held value."""
    return value.narrow if isinstance(value, Pair) else value


def wide(value):
    """The float64 half of a held value."""
    return value.wide if isinstance(value, Pair) else value


@dataclasses.dataclass(frozen=True)
class Mode:
    """How the float64 half is evaluated."""

    key: Any  # the noise's key (None: no noise)
    scale: Any  # the noise's size (a traced 0.0 gives the truth from the same program)
    record: Optional[list]  # aggregations' operands, at the top level only

    def inner(self, key) -> "Mode":
        return dataclasses.replace(self, key=key, record=None)


def inner_jaxpr(params: dict):
    """(jaxpr, consts) of the program an equation calls (a jit, a custom rule's body),
    from its params; None for an equation that calls none."""
    for name in _SUB_JAXPRS:
        sub = params.get(name)
        if isinstance(sub, core.ClosedJaxpr):
            return sub.jaxpr, sub.consts
        if isinstance(sub, core.Jaxpr):
            return sub, []
    return None


def _eps(dtype) -> float:
    return float(jnp.finfo(dtype).eps)


def mix(salt, i):
    """Another draw's salt from `salt` and `i` (an equation, a step, a client)."""
    i = lax.convert_element_type(i, jnp.float64)
    return salt * 1.6180339887 + (i + 1.0) * 0.7548776662


def _noise(y, size, mode: Mode, salt):
    """`y` moved by up to `size` (elementwise), drawn uniformly: a hash of the element's
    index and `salt`, in a few lax ops (a PRNG per equation compiles far slower)."""
    if mode.key is None:
        return y
    shape = jnp.shape(y)
    index = lax.broadcasted_iota(jnp.float64, shape, 0) if shape else jnp.float64(0.0)
    for d in range(1, len(shape)):
        index = index * float(shape[d]) + lax.broadcasted_iota(jnp.float64, shape, d)
    v = lax.sin(index * 12.9898 + lax.rem(salt, 997.0) * 78.233) * 43758.5453
    return y + (mode.scale * size) * ((v - lax.floor(v)) * 2.0 - 1.0)


def evaluate(jaxpr, consts: Sequence, args: Sequence, mode: Mode) -> list:
    """`jaxpr`'s outputs as held values (`Pair`s for floats) from held `args`."""
    env: dict = {}

    def read(v):
        return pair(v.val) if isinstance(v, core.Literal) else env[v]

    env.update(zip(jaxpr.constvars, [pair(c) for c in consts]))
    env.update(zip(jaxpr.invars, args))
    for j, eqn in enumerate(jaxpr.eqns):
        key = None if mode.key is None else mix(mode.key, j)
        outs = _equation(eqn, [read(v) for v in eqn.invars], mode, key)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _equation(eqn, invals: list, mode: Mode, key) -> list:
    name, params = eqn.primitive.name, eqn.params
    facts = primitive_facts.facts_of(eqn.primitive)
    sub = inner_jaxpr(params)
    if name == "scan":
        return _scan(params, invals, mode, key)
    if name == "while":
        return _while(params, invals, mode, key)
    if name == "cond":  # the index is not a float: the float32 path's
        branches = [lambda *ops, b=b: evaluate(b.jaxpr, b.consts, ops, mode.inner(key))
                    for b in params["branches"]]
        return list(lax.switch(invals[0], branches, *invals[1:]))
    if name == "federated_map":
        return _client_map(params, invals, mode, key)
    if name == "federated_decode_sum":
        if mode.record is not None:
            mode.record.append((facts.kind, list(invals)))
        params = dict(params, placement="clients")
        decoded = _client_map(params, invals, mode, key)
        return [_aggregate("sum", d, None, mode, key) for d in decoded]
    if name == "federated_broadcast":
        return [jax.tree.map(lambda x: jnp.broadcast_to(x[None], (params["clients"],)
                                                        + jnp.shape(x)), invals[0])]
    if facts is not None and facts.aggregates and mode.record is not None:
        mode.record.append((facts.kind, list(invals)))
    if facts is not None and facts.kind in ("sum", "mean", "weighted_mean") \
            and isinstance(invals[0], Pair):
        return [_aggregate(facts.kind, invals[0], invals[1] if len(invals) > 1 else None,
                           mode, key)]
    if sub is not None and (name in CALLS or name.startswith(("custom_", "checkpoint",
                                                              "remat"))):
        return evaluate(sub[0], sub[1], invals, dataclasses.replace(mode, key=key))
    return _paired(eqn, invals, mode, key)


def _paired(eqn, invals: list, mode: Mode, key) -> list:
    """A primitive on held values: the float32 half from the float32 operands; the
    float64 half of each float result from the float64 operands, rounded, except where
    it is a decision (`DECIDES`, `ORDERS`); other results the float32 path's."""
    name = eqn.primitive.name
    outs = _bind(eqn, [narrow(x) for x in invals], False)
    floats = [floating(o) for o in outs]
    if not any(floats):
        return outs
    if name in DECIDES:
        return [Pair(o, jnp.asarray(o, jnp.float64)) for o in outs]
    wides = [wide(x) for x in invals]
    wouts = _ordered(eqn, invals, outs) if name in ORDERS else _bind(eqn, wides, True)
    return [Pair(o, _rounded(eqn, wides, w, v.aval.dtype, mode, mix(key, i))
                 if mode.key is not None else w) if f else o
            for i, (o, w, v, f) in enumerate(zip(outs, wouts, eqn.outvars, floats))]


def _ordered(eqn, invals: list, outs: list) -> list:
    """A sort's or top_k's float64 results in the float32 path's order: each operand's
    float64 half sorted by the float32 keys along with it."""
    params = eqn.params
    if eqn.primitive.name == "top_k":
        operand = invals[0]
        values, indices = outs
        picked = jnp.take_along_axis(jnp.asarray(wide(operand)), indices, axis=-1)
        return [picked, indices]
    dim, nkeys = params["dimension"], params["num_keys"]
    keys = [narrow(x) for x in invals[:nkeys]]
    order = lax.broadcasted_iota(jnp.int32, jnp.shape(keys[0]), dim)
    *_, perm = lax.sort([*keys, order], dimension=dim, is_stable=params["is_stable"],
                        num_keys=nkeys)
    return [jnp.take_along_axis(jnp.asarray(wide(x)), perm, axis=dim) for x in invals]


def _bind(eqn, invals: list, widen: bool) -> list:
    """The equation on `invals`: in float64 where `widen` (its dtype parameters widened),
    else, or where the primitive refuses float64, in its own dtypes (widened after)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    if widen and eqn.primitive.name in _SCATTERS:
        operand, indices, updates = invals[:3]
        return [_SCATTERS[eqn.primitive.name](
            operand, indices, updates, params["dimension_numbers"],
            indices_are_sorted=params["indices_are_sorted"],
            unique_indices=params["unique_indices"], mode=params["mode"])]
    regions = any(isinstance(v, (core.Jaxpr, core.ClosedJaxpr)) for v in params.values())
    if widen and not regions:  # a region typed in float32 would not lower in float64
        wide_params = {k: (jnp.float64 if k in _DTYPE_PARAMS and v is not None
                           and is_float(v) else v) for k, v in params.items()}
        try:
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*invals, **wide_params)
            return list(outs) if eqn.primitive.multiple_results else [outs]
        except Exception:  # noqa: BLE001 - e.g. a bitcast of float32's bits: float32
            pass
    if widen:
        invals = [jnp.asarray(x).astype(v.aval.dtype if isinstance(v, core.Var)
                                        else np.asarray(v.val).dtype)
                  if floating(x) else x for x, v in zip(invals, eqn.invars)]
    with eqn.ctx.manager:
        outs = eqn.primitive.bind(*invals, **params)
    outs = list(outs) if eqn.primitive.multiple_results else [outs]
    return [jnp.asarray(o, jnp.float64) if widen and floating(o) else o for o in outs]


def _rounded(eqn, invals: list, y, dtype, mode: Mode, key):
    """`y`, the equation's float64 result, moved by a float rounding of its kind."""
    name = eqn.primitive.name
    eps = _eps(dtype)
    if name in MOVES or name in ALIKE:
        return y
    if name == "convert_element_type":
        before = invals[0]
        if floating(before) and _eps(eqn.invars[0].aval.dtype) >= eps:
            return y  # widening, or the same type: exact
        if not floating(before):  # a bool or an integer: exact while the type holds it
            exact = jnp.abs(y) <= 2.0 ** (jnp.finfo(dtype).nmant + 1)
            return _noise(y, jnp.where(exact, 0.0, eps * jnp.abs(y)), mode, key)
        return _noise(y, eps * jnp.abs(y), mode, key)
    if name in TRANSCENDENTAL:
        return _noise(y, ULPS_OF_FUNCTIONS * eps * jnp.abs(y), mode, key)
    summed = _square_sum(eqn, invals)
    if summed is not None:
        terms, squares = summed
        size = np.sqrt(terms) * (jnp.sqrt(squares) + jnp.abs(y)) + jnp.abs(y)
        return _noise(y, eps * size, mode, key)
    return _noise(y, eps * jnp.abs(y), mode, key)


def _square_sum(eqn, invals: list) -> Optional[tuple]:
    """(n, the same sum over the terms squared) for an equation that sums n terms per
    element: a dot's terms a_k b_k squared are a_k^2 b_k^2, so the op on the squares."""
    name, params = eqn.primitive.name, eqn.params
    if name not in ("dot_general", "conv_general_dilated", "reduce_sum", "cumsum",
                    "reduce_window_sum", "scatter-add", "scatter_add"):
        return None
    squared = [jnp.square(x) if floating(x) else x for x in invals]
    (total,) = _bind(eqn, squared, True)
    if name == "dot_general":
        (contract, _), _ = params["dimension_numbers"]
        n = int(np.prod([np.shape(invals[0])[d] for d in contract], dtype=np.int64))
    elif name == "conv_general_dilated":
        rhs = np.shape(invals[1])
        n = int(np.prod(rhs)) // max(1, rhs[params["dimension_numbers"].rhs_spec[0]])
    elif name == "reduce_sum":
        n = int(np.prod([np.shape(invals[0])[d] for d in params["axes"]], dtype=np.int64))
    elif name == "cumsum":
        n = int(np.shape(invals[0])[params["axis"]])
    elif name.startswith("scatter"):  # at most every index onto one element
        n = int(np.prod(np.shape(invals[1])[:-1], dtype=np.int64)) + 1
    else:
        n = int(np.prod(params["window_dimensions"], dtype=np.int64))
    return max(n, 1), total


def _aggregate(kind: str, x: Pair, w, mode: Mode, key) -> Pair:
    """A float aggregation over clients (axis 0), as jit computes it, in both halves;
    the float64 half with the rounding of a float sum of that many terms where noisy."""
    return Pair(_aggregated(kind, x.narrow, narrow(w), None),
                _aggregated(kind, x.wide, wide(w), mode, key))


def _aggregated(kind: str, x, w, mode: Optional[Mode], key=None):
    n = jnp.shape(x)[0]
    if kind == "weighted_mean":
        w = jnp.asarray(w, x.dtype).reshape((n,) + (1,) * (jnp.ndim(x) - 1))
        total = jnp.sum(w, 0)
        y = jnp.sum(w * x, 0) / total
        squares = jnp.sum(jnp.square(w * x), 0) / jnp.square(total)
    else:
        div = n if kind == "mean" else 1
        y, squares = jnp.sum(x, 0) / div, jnp.sum(jnp.square(x), 0) / div ** 2
        y = y.astype(x.dtype)
    if mode is None or mode.key is None:
        return y
    eps = _eps(jnp.float32)  # the program's floats are float32 where jit sums them
    size = np.sqrt(max(n, 1)) * (jnp.sqrt(squares) + jnp.abs(y)) + jnp.abs(y)
    return _noise(y, eps * size, mode, key)


def _client_map(params: dict, invals: list, mode: Mode, key) -> list:
    closed = params["jaxpr"]
    if not str(params.get("placement", "clients")).lower().endswith("clients"):
        return evaluate(closed.jaxpr, closed.consts, invals, mode.inner(key))
    clients = int(params["clients"])

    def one(c, *member):
        inner = mode.inner(None if key is None else mix(key, c))
        return tuple(evaluate(closed.jaxpr, closed.consts, member, inner))

    return list(jax.vmap(one, axis_size=clients)(jnp.arange(clients), *invals))


def _scan(params: dict, invals: list, mode: Mode, key) -> list:
    body = params["jaxpr"]
    nc, ncarry = jax_compat.scan_counts(params)
    consts, init, xs = invals[:nc], invals[nc:nc + ncarry], invals[nc + ncarry:]

    def step(carry, x):
        i, vals = carry
        inner = mode.inner(None if key is None else mix(key, i))
        outs = evaluate(body.jaxpr, body.consts, [*consts, *vals, *x], inner)
        return (i + 1, outs[:ncarry]), outs[ncarry:]

    (_, carry), ys = lax.scan(step, (jnp.int32(0), list(init)), list(xs),
                              length=params["length"], reverse=params["reverse"])
    return list(carry) + list(ys)


def _while(params: dict, invals: list, mode: Mode, key) -> list:
    """A while loop on held values: its predicate is a bool, so the float32 path's, and
    both halves run float32's trip count."""
    cond, body = params["cond_jaxpr"], params["body_jaxpr"]
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    cconsts, bconsts, init = invals[:nc], invals[nc:nc + nb], invals[nc + nb:]
    quiet = mode.inner(None)

    def test(carry):
        return evaluate(cond.jaxpr, cond.consts, [*cconsts, *carry[1]], quiet)[0]

    def step(carry):
        i, vals = carry
        inner = mode.inner(None if key is None else mix(key, i))
        return i + 1, evaluate(body.jaxpr, body.consts, [*bconsts, *vals], inner)

    return list(lax.while_loop(test, step, (jnp.int32(0), list(init)))[1])
