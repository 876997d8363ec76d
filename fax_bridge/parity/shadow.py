"""How far two float evaluations of one program may differ, measured: a float64 shadow.

jit's XLA and the LiteRT interpreter evaluate the same program in float32 with other
kernels, sum orders and `exp`/`tanh` approximations; neither has the exact result's
bits. `measure(comp, args)` evaluates the traced program three ways, equation by
equation (the jaxpr is walked here, so a float32 fixed in user code, such as a scan's
`jnp.zeros(..., jnp.float32)` carry, is widened like every other value):

  float32   the program as it is (every value in its own dtype): one float32 path
  truth     every float equation in float64 (x64 on this host's CPU): the reference
  samples   `SAMPLES` runs of the float64 shadow where each float equation's result is
            moved by a random rounding error of the size float32 allows there (below):
            the spread of these around the truth is how far float32 rounding, carried
            through the rest of the program by the program itself, moves each element

A rounding is modelled by the equation's kind: ops that only move, pick or reinterpret
values add none (a bitcast; a bool or integer made a float the type holds exactly,
such as a comparison's result or a quantization code), nor do `add`, `sub` and `mul` (`ALIKE`: IEEE operations every implementation
rounds alike from the same operands); another elementwise op (a division, a narrowing
cast) moves its result by up to eps * |y|; `exp`, `log`, `tanh`, ... by
`ULPS_OF_FUNCTIONS` ulps; a sum of n terms (a dot, a convolution, a reduction, a window
sum, a scatter-add, an aggregation over clients) by up to
eps * sqrt(n) * (sqrt(sum terms^2) + |sum|), the size n random roundings of its partial
sums reach (a partial sum of k terms is about sqrt(k * mean square) plus k/n of the
sum). Each sample draws these errors uniformly, independently per element.

`Shadow.bounds()` turns it into a bound per element: `SAFETY` times the larger of the
samples' spread (scaled up by how much more the float32 path itself is off the truth at
most elements of that output, the `CALIBRATION` quantile, should the model understate
it) and the float32 path's own error there, plus one ulp of the value, and at least
`FLOOR_ULPS` ulps of the output's largest value (an element small by cancellation errs
as the terms it was computed from). A second float evaluation (LiteRT's, the fleet's
exact sums) is taken to err as the float32 path does, so the two may differ by twice
it. It is a measurement, not a guarantee: it follows the program's own cancellations
(LayerNorm's division, softmax, a recurrence that contracts, a max pool that picks one
of its inputs) where a worst-case analysis compounds every operation's derivative
without its sign; where float32 and float64 take another branch or code (a comparison
at a tie, a value rounded to a quantization step) the element's bound is that step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core

from fax_bridge.language import jax_compat
from fax_bridge.language import primitive_facts
from fax_bridge.parity import shadow_compile

SAMPLES = 4  # noisy shadow runs
SAFETY = 4.0  # the bound's factor over the measured error
FLOOR_ULPS = 2.0  # the least bound: ulps of the output's largest |value|
CALIBRATION = 0.9  # the quantile of |float32 - truth| / spread the spread is scaled by
ULPS_OF_FUNCTIONS = 4.0
# Ops that move or pick values (no rounding of their own).
MOVES = {"reshape", "transpose", "broadcast_in_dim", "slice", "squeeze", "concatenate",
         "select_n", "gather", "dynamic_slice", "dynamic_update_slice", "pad", "copy",
         "copy_p", "expand_dims", "rev", "max", "min", "reduce_max", "reduce_min", "neg",
         "abs", "iota", "sign", "stop_gradient", "argmax", "argmin", "clamp",
         "federated_broadcast", "sort", "reduce_window_max", "reduce_window_min",
         "split", "top_k", "floor", "ceil", "round", "optimization_barrier",
         "bitcast_convert_type"}
# Elementwise functions an interpreter's kernels compute within a few ulp, not 0.5.
TRANSCENDENTAL = {"exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos",
                  "tan", "pow", "erf", "erfc", "erf_inv", "rsqrt", "sqrt", "cbrt", "atan2",
                  "lgamma", "digamma", "asin", "acos", "atan", "sinh", "cosh", "asinh",
                  "acosh", "atanh"}
# IEEE operations every float32 implementation rounds alike from the same operands: what
# tells two evaluations apart is their operands (carried here by the program itself)
# and where a compiler fuses a multiply into an add (one rounding fewer: covered by the
# float32 path's own error, below). Not drawn, which keeps the shadow small to compile.
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


def _is_key(value) -> bool:
    dtype = getattr(value, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _floating(value) -> bool:
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        dtype = np.asarray(value).dtype
    return not _is_key(value) and is_float(dtype)


@dataclasses.dataclass(frozen=True)
class _Mode:
    wide: bool  # float values in float64
    key: Any  # the noise's key (None: no noise)
    scale: Any  # the noise's size (a traced 0.0 gives the truth from the same program)
    record: Optional[list]  # aggregations' operands, at the top level only

    def inner(self, key) -> "_Mode":
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


def _widen(value, mode: _Mode):
    if mode.wide and _floating(value):
        return jnp.asarray(value, jnp.float64)
    return value


def _eps(dtype) -> float:
    return float(jnp.finfo(dtype).eps)


def _mix(salt, i):
    """Another draw's salt from `salt` and `i` (an equation, a step, a client)."""
    i = lax.convert_element_type(i, jnp.float64)
    return salt * 1.6180339887 + (i + 1.0) * 0.7548776662


def _noise(y, size, mode: _Mode, salt):
    """`y` moved by up to `size` (elementwise), drawn uniformly: a hash of the element's
    index and `salt`, in a few lax ops (a PRNG per equation compiles far slower)."""
    if mode.key is None or not mode.wide:
        return y
    shape = jnp.shape(y)
    index = lax.broadcasted_iota(jnp.float64, shape, 0) if shape else jnp.float64(0.0)
    for d in range(1, len(shape)):
        index = index * float(shape[d]) + lax.broadcasted_iota(jnp.float64, shape, d)
    v = lax.sin(index * 12.9898 + lax.rem(salt, 997.0) * 78.233) * 43758.5453
    return y + (mode.scale * size) * ((v - lax.floor(v)) * 2.0 - 1.0)


def loops(jaxpr) -> bool:
    """Whether `jaxpr` (a Jaxpr or ClosedJaxpr) runs a loop (scan, while), anywhere."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("scan", "while"):
            return True
        for value in eqn.params.values():
            inner = value if isinstance(value, (tuple, list)) else (value,)
            if any(isinstance(v, (core.Jaxpr, core.ClosedJaxpr)) and loops(v) for v in inner):
                return True
    return False


def _eval(jaxpr, consts: Sequence, args: Sequence, mode: _Mode) -> list:
    env: dict = {}

    def read(v):
        if isinstance(v, core.Literal):
            return _widen(v.val, mode)
        return env[v]

    env.update(zip(jaxpr.constvars, [_widen(c, mode) for c in consts]))
    env.update(zip(jaxpr.invars, args))
    for j, eqn in enumerate(jaxpr.eqns):
        key = None if mode.key is None else _mix(mode.key, j)
        outs = _equation(eqn, [read(v) for v in eqn.invars], mode, key)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _equation(eqn, invals: list, mode: _Mode, key) -> list:
    name, params = eqn.primitive.name, eqn.params
    facts = primitive_facts.facts_of(eqn.primitive)
    sub = inner_jaxpr(params)
    if name == "scan":
        return _scan(params, invals, mode, key)
    if name == "while":
        return _while(params, invals, mode, key)
    if name == "cond":
        branches = [lambda *ops, b=b: _eval(b.jaxpr, b.consts, ops, mode.inner(key))
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
        x = invals[0]
        return [jnp.broadcast_to(x[None], (params["clients"],) + jnp.shape(x))]
    if facts is not None and facts.aggregates and mode.record is not None:
        mode.record.append((facts.kind, list(invals)))
    if facts is not None and facts.kind in ("sum", "mean", "weighted_mean") \
            and _floating(invals[0]):
        return [_aggregate(facts.kind, invals[0], invals[1] if len(invals) > 1 else None,
                           mode, key)]
    if sub is not None and (name in CALLS or name.startswith(("custom_", "checkpoint",
                                                              "remat"))):
        return _eval(sub[0], sub[1], invals, dataclasses.replace(mode, key=key))
    outs = _bind(eqn, invals, mode)
    if not mode.wide or mode.key is None:
        return outs
    return [_rounded(eqn, invals, o, v.aval.dtype, mode, _mix(key, i))
            if _floating(o) and is_float(v.aval.dtype) else o
            for i, (o, v) in enumerate(zip(outs, eqn.outvars))]


def _bind(eqn, invals: list, mode: _Mode) -> list:
    """The equation on `invals`: in float64 where wide (its dtype parameters widened),
    else, or where the primitive refuses float64, in its own dtypes, widened after."""
    params = eqn.primitive.get_bind_params(eqn.params)
    narrow = invals
    if mode.wide and eqn.primitive.name in _SCATTERS:
        operand, indices, updates = invals[:3]
        return [_SCATTERS[eqn.primitive.name](
            operand, indices, updates, params["dimension_numbers"],
            indices_are_sorted=params["indices_are_sorted"],
            unique_indices=params["unique_indices"], mode=params["mode"])]
    regions = any(isinstance(v, (core.Jaxpr, core.ClosedJaxpr)) for v in params.values())
    if mode.wide and not regions:  # a region typed in float32 would not lower in float64
        wide = {k: (jnp.float64 if k in _DTYPE_PARAMS and v is not None and is_float(v)
                    else v) for k, v in params.items()}
        try:
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*invals, **wide)
            return list(outs) if eqn.primitive.multiple_results else [outs]
        except Exception:  # noqa: BLE001 - e.g. a bitcast of float32's bits: float32
            pass
    if mode.wide:
        narrow = [jnp.asarray(x).astype(v.aval.dtype if isinstance(v, core.Var)
                                        else np.asarray(v.val).dtype)
                  if _floating(x) else x for x, v in zip(invals, eqn.invars)]
    with eqn.ctx.manager:
        outs = eqn.primitive.bind(*narrow, **params)
    outs = list(outs) if eqn.primitive.multiple_results else [outs]
    return [_widen(o, mode) for o in outs]


def _rounded(eqn, invals: list, y, dtype, mode: _Mode, key):
    """`y`, the equation's float64 result, moved by a float rounding of its kind."""
    name = eqn.primitive.name
    eps = _eps(dtype)
    if name in MOVES or name in ALIKE:
        return y
    if name == "convert_element_type":
        before = invals[0]
        if _floating(before) and _eps(eqn.invars[0].aval.dtype) >= eps:
            return y  # widening, or the same type: exact
        if not _floating(before):  # a bool or an integer: exact while the type holds it
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
    squared = [jnp.square(x) if _floating(x) else x for x in invals]
    mode = _Mode(True, None, 0.0, None)
    (total,) = _bind(eqn, squared, mode)
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


def _aggregate(kind: str, x, w, mode: _Mode, key):
    """A float aggregation over clients (axis 0), as jit computes it, with the rounding
    of a float sum of that many terms where noisy."""
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
    if mode.key is None or not mode.wide:
        return y
    eps = _eps(jnp.float32)  # the program's floats are float32 where jit sums them
    size = np.sqrt(max(n, 1)) * (jnp.sqrt(squares) + jnp.abs(y)) + jnp.abs(y)
    return _noise(y, eps * size, mode, key)


def _client_map(params: dict, invals: list, mode: _Mode, key) -> list:
    closed = params["jaxpr"]
    if not str(params.get("placement", "clients")).lower().endswith("clients"):
        return _eval(closed.jaxpr, closed.consts, invals, mode.inner(key))
    clients = int(params["clients"])

    def one(c, *member):
        inner = mode.inner(None if key is None else _mix(key, c))
        return tuple(_eval(closed.jaxpr, closed.consts, member, inner))

    return list(jax.vmap(one, axis_size=clients)(jnp.arange(clients), *invals))


def _scan(params: dict, invals: list, mode: _Mode, key) -> list:
    body = params["jaxpr"]
    nc, ncarry = jax_compat.scan_counts(params)
    consts, init, xs = invals[:nc], invals[nc:nc + ncarry], invals[nc + ncarry:]

    def step(carry, x):
        i, vals = carry
        inner = mode.inner(None if key is None else _mix(key, i))
        outs = _eval(body.jaxpr, body.consts, [*consts, *vals, *x], inner)
        return (i + 1, outs[:ncarry]), outs[ncarry:]

    (_, carry), ys = lax.scan(step, (jnp.int32(0), list(init)), list(xs),
                              length=params["length"], reverse=params["reverse"])
    return list(carry) + list(ys)


def _while(params: dict, invals: list, mode: _Mode, key) -> list:
    cond, body = params["cond_jaxpr"], params["body_jaxpr"]
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    cconsts, bconsts, init = invals[:nc], invals[nc:nc + nb], invals[nc + nb:]
    quiet = mode.inner(None)

    def test(carry):
        return _eval(cond.jaxpr, cond.consts, [*cconsts, *carry[1]], quiet)[0]

    def step(carry):
        i, vals = carry
        inner = mode.inner(None if key is None else _mix(key, i))
        return i + 1, _eval(body.jaxpr, body.consts, [*bconsts, *vals], inner)

    return list(lax.while_loop(test, step, (jnp.int32(0), list(init)))[1])


@dataclasses.dataclass
class Shadow:
    """A program's outputs and the operands of its aggregations over clients, each as
    the float32 path gives it, its float64 truth and the samples' spread around it."""

    float32: list
    truth: list
    spread: list
    aggregands: list  # (kind, [float32, truth, spread] per operand) per aggregation

    def bounds(self) -> list[np.ndarray]:
        """Per output, elementwise, how far one float evaluation may be from the exact
        result (module docstring); zeros for integer and key outputs."""
        return [bound(*v) for v in zip(self.float32, self.truth, self.spread)]

    def aggregand_bounds(self) -> list[tuple]:
        """(kind, per-client bounds of each operand) per aggregation at the top level."""
        return [(kind, [bound(*v) for v in operands]) for kind, operands in self.aggregands]


def _spacing(x: np.ndarray, dtype) -> np.ndarray:
    """The ulp at |x| (float64 values) in `dtype`, as float64."""
    info = jnp.finfo(dtype)
    exponent = np.floor(np.log2(np.maximum(x, float(info.tiny))))
    return np.exp2(exponent) * float(info.eps)


def bound(float32, truth, spread) -> np.ndarray:
    """`SAFETY` x the larger of the spread (scaled up where the float32 path's own error
    exceeds it) and that error, plus one ulp of the value (at least `FLOOR_ULPS` ulps of
    the largest value); inf where not finite."""
    if _is_key(float32) or not is_float(np.asarray(float32).dtype):
        return np.zeros(np.shape(float32), np.float64)
    value = np.asarray(float32)
    f, t = value.astype(np.float64), np.asarray(truth, np.float64)
    s = np.asarray(spread, np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(f - t)
        finite = np.isfinite(err) & np.isfinite(s)
        drawn = finite & (s > 0)
        # how much more the float32 path is off than the samples, at most elements (a
        # quantile: an element where float32 and float64 took another branch or code is
        # bounded by its own error, not every element by it)
        ratio = float(np.quantile(err[drawn] / s[drawn], CALIBRATION)) if drawn.any() \
            else 1.0
        measured = np.maximum(s * max(ratio, 1.0), err)
        # an element small by cancellation errs as the terms it came from: at least
        # the ulps of the output's largest value
        top = np.max(np.abs(f), where=np.isfinite(f), initial=0.0)
        ulp = np.maximum(_spacing(np.abs(f), value.dtype),
                         FLOOR_ULPS * _spacing(np.asarray(top), value.dtype))
        out = SAFETY * measured + ulp
    return np.where(finite, out, np.inf)


_COMPILED: dict = {}  # the program's text and constants -> its jitted evaluations
def _host():
    """The CPU, where float64 runs on every machine (a TPU has none); the default
    device where jax was started without its CPU backend."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return None


def _constants(closed):
    """Every constant of `closed` and of the closed jaxprs in its equations' params."""
    yield from getattr(closed, "consts", ())
    for eqn in getattr(closed, "jaxpr", closed).eqns:
        for value in eqn.params.values():
            for v in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(v, (core.Jaxpr, core.ClosedJaxpr)):
                    yield from _constants(v)


def _compiled(closed) -> tuple:
    """((jit of the float32 path, jit of the float64 one), the aggregations' kinds) of
    the closed jaxpr `closed`, the same for a program traced again alike."""
    digest = hashlib.sha256(str(closed.jaxpr).encode())
    for c in _constants(closed):
        digest.update(repr(c).encode() if _is_key(c) else
                      np.asarray(c).tobytes() + str(np.shape(c)).encode())
    hit = _COMPILED.get(digest.hexdigest())
    if hit is not None:
        return hit
    kinds: list = []

    def run(flat_args, key, scale, wide):
        record: list = []
        mode = _Mode(wide, key, scale, record)
        outs = _eval(closed.jaxpr, closed.consts, [_widen(a, mode) for a in flat_args],
                     mode)
        kinds[:] = [k for k, _ in record]
        return outs, [vals for _, vals in record]

    made = ((shadow_compile.Compiled(lambda a: run(a, None, 0.0, False), closed),
             shadow_compile.Compiled(lambda a, k, s: run(a, k, s, True), closed)), kinds)
    if len(_COMPILED) >= 16:
        _COMPILED.clear()
    _COMPILED[digest.hexdigest()] = made
    return made


def measure(comp: Any, args: tuple, samples: int = SAMPLES, seed: int = 0,
            float32: Optional[Sequence] = None, rounds: int = 1,
            carry: int = 0) -> Shadow:
    """The traced program `comp` at `args` evaluated in float32, in float64 and in
    `samples` noisy float64 runs (module docstring). `float32`: the program's output
    leaves as a float32 path gave them (jit's; after `rounds` rounds), which saves
    compiling it again here; the aggregations' operands are then not measured
    (`Shadow.aggregands` empty).

    `rounds` > 1 measures a chain of rounds: each evaluation feeds its own first `carry`
    output leaves (a round's new state) back as the first `carry` argument leaves of
    the next round, so the rounding of every round is carried through the rest, and the
    last round is measured (its aggregations' operands are those of the last round)."""
    flat = list(jax.tree_util.tree_leaves(args))
    if rounds < 1 or not 0 <= carry <= len(flat) or (rounds > 1 and carry == 0):
        raise ValueError(f"measure: rounds={rounds} with carry={carry} of {len(flat)} "
                         "argument leaves; chained rounds carry at least one leaf")
    run, kinds = _compiled(comp.jaxpr)
    host = _host()
    if host is not None:  # arrays an accelerator holds, copied to the CPU
        flat = jax.device_put(flat, host)

    def chained(step, key=None, scale=None):
        """The last round's (outputs, aggregands); each round draws its own errors."""
        state = flat
        for r in range(rounds):
            extra = () if key is None else (key if r == 0 else _mix(key, -r), scale)
            got = step(state, *extra)
            state = list(got[0][:carry]) + flat[carry:]
        return got

    start = time.perf_counter()
    log = shadow_compile.LOG
    log.info("float64 shadow: measuring float rounding (%d float64 run(s) of %d round(s))",
             samples + 1, rounds)
    with jax.enable_x64(True), jax.default_device(host):
        narrow = chained(run[0]) if float32 is None else (list(float32), None)
        wide = run[1]
        key = jnp.float64(seed)
        truth = jax.block_until_ready(chained(wide, key, 0.0))
        runs = []
        for i in range(samples):
            runs.append(jax.block_until_ready(chained(wide, _mix(key, i + 1), 1.0)))
            log.info("float64 shadow: sample %d of %d (%.1f s)", i + 1, samples,
                     time.perf_counter() - start)
        got = jax.device_get((narrow, truth, runs))
    narrow, truth, runs = got

    def spread(path: tuple, reference) -> np.ndarray:
        if _is_key(reference) or not is_float(np.asarray(reference).dtype):
            return np.zeros(np.shape(reference), np.float64)
        out = np.zeros(np.shape(reference), np.float64)
        for r in runs:
            sample = r
            for p in path:
                sample = sample[p]
            with np.errstate(invalid="ignore"):
                out = np.maximum(out, np.abs(np.asarray(sample, np.float64)
                                             - np.asarray(reference, np.float64)))
        return out

    outs = [(narrow[0][i], truth[0][i], spread((0, i), truth[0][i]))
            for i in range(len(narrow[0]))]
    aggregands = [] if narrow[1] is None else [
        (kind, [(narrow[1][a][o], truth[1][a][o], spread((1, a, o), truth[1][a][o]))
                for o in range(len(narrow[1][a]))])
        for a, kind in enumerate(kinds)]
    return Shadow([o[0] for o in outs], [o[1] for o in outs], [o[2] for o in outs],
                  aggregands)
