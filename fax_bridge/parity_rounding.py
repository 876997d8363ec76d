"""Why jit and the fleet differ: float rounding in aggregations over clients.

jit sums a CLIENTS value in its float dtype, rounding after every addition; the fleet
(and the in-process runtime) computes the exact sum and rounds it once. With
cancellation (`[1e8, 1, -1e8, 1]`: jit's float32 gives 0 or 1, the exact sum is 2) the
two differ by far more than the usual tolerances, and both are right for what they
compute. For n addends any summation order errs by at most n * eps * sum|x| (eps of
the dtype), a bound that can exceed |sum x| by many orders of magnitude.

`aggregation_roundings(comp, args)` evaluates a traced program operation by operation,
and at each `federated_sum`, `federated_mean` and `federated_weighted_mean` measures
that bound (scaled for means), jit's own result and the exact one; it also says which
aggregations each output depends on. `explain(leaf, ...)` turns that into the words a
parity report prints under a mismatched output.
"""

from __future__ import annotations

import contextvars
import dataclasses
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core

from fax_bridge import primitive_facts, tracing
from fax_bridge.runtime import aggregation

# The aggregation kinds (a primitive's record, `primitive_facts`) jit rounds in floats.
_FLOAT_KINDS = ("sum", "mean", "weighted_mean")
_CALLS = ("pjit", "jit", "closed_call", "core_call")  # sub-jaxprs evaluated in place


@dataclasses.dataclass
class Rounding:
    """jit's float rounding at one aggregation over clients, against the exact value.

    Figures are the largest over the aggregate's elements: `abs_sum` is sum|x| (for a
    mean, divided as the mean divides), `bound` n * eps * abs_sum plus eps * |exact|
    (the final rounding), `error` |jit - exact| for this operation on its own.
    """

    op: str
    where: str
    clients: int
    dtype: str
    abs_sum: float
    bound: float
    error: float
    exact_at: float  # the exact value and jit's (op by op) where they differ most
    jit_at: float

    def describe(self) -> str:
        return (f"{self.op} of {self.clients} {self.dtype} values per element (at "
                f"{self.where}), where jit rounds after each addition and the fleet sums "
                f"exactly: exact {self.exact_at:.8g}, jit {self.jit_at:.8g}; with sum|x| = "
                f"{self.abs_sum:.3g}, rounding may reach n*eps*sum|x| = {self.bound:.3g}")


def is_float(dtype) -> bool:
    """Whether `dtype` (a name too) is a float type, bfloat16 and float8s included."""
    return bool(jnp.issubdtype(jnp.dtype(dtype), jnp.floating))


def _float_kind(prim) -> Optional[str]:
    """The aggregation kind of `prim` when jit may round it in floats, else None."""
    facts = primitive_facts.facts_of(prim)
    return facts.kind if facts is not None and facts.kind in _FLOAT_KINDS else None


def _exact(kind: str, x: np.ndarray, weights: Optional[np.ndarray]) -> np.ndarray:
    members = list(x)
    ws = None if weights is None else list(weights)
    return np.asarray(aggregation.reduce(kind, members, ws), np.float64)


def _measure(eqn, invals, out) -> Optional[Rounding]:
    x = np.asarray(invals[0])
    if not is_float(x.dtype) or x.shape[0] == 0:
        return None  # integer sums are exact on both paths
    kind = _float_kind(eqn.primitive)
    n, eps = x.shape[0], float(jnp.finfo(x.dtype).eps)
    weights = np.asarray(invals[1]) if kind == "weighted_mean" else None
    x64 = x.astype(np.float64)
    if weights is None:
        abs_sum = np.abs(x64).sum(axis=0) / (n if kind == "mean" else 1)
    else:
        w = weights.astype(np.float64).reshape(weights.shape + (1,) * (x.ndim - weights.ndim))
        with np.errstate(divide="ignore", invalid="ignore"):
            abs_sum = np.abs(w * x64).sum(axis=0) / np.abs(w.sum(axis=0))
    try:
        exact = _exact(kind, x, weights)
    except Exception:  # noqa: BLE001 - e.g. weights summing to 0: nothing to explain
        return None
    with np.errstate(invalid="ignore"):
        bound = n * eps * abs_sum + eps * np.abs(exact)
        error = np.abs(np.asarray(out, np.float64) - exact)
    finite = np.isfinite(bound) & np.isfinite(error)
    if not finite.any():
        return None
    worst = np.unravel_index(np.argmax(np.where(finite, error, -1.0)), error.shape)
    return Rounding(eqn.primitive.name, tracing.eqn_location(eqn), n, x.dtype.name,
                    float(np.max(abs_sum[finite], initial=0.0)),
                    float(np.max(bound[finite], initial=0.0)),
                    float(np.max(error[finite], initial=0.0)),
                    float(exact[worst]), float(np.asarray(out, np.float64)[worst]))


def _evaluate(jaxpr, consts: Sequence, args: Sequence, found: list):
    """Runs `jaxpr` op by op; returns its outputs, each output's aggregation indices
    (into `found`) and, per output, the index of the aggregation it is (or None)."""
    env: dict = {}
    deps: dict = {}
    direct: dict = {}

    def read(v):
        return v.val if isinstance(v, core.Literal) else env[v]

    def dep(v):
        return frozenset() if isinstance(v, core.Literal) else deps.get(v, frozenset())

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        before = frozenset().union(*(dep(v) for v in eqn.invars))
        sub = eqn.params.get("jaxpr")
        if eqn.primitive.name in _CALLS and isinstance(sub, core.ClosedJaxpr):
            outs, sub_deps, _ = _evaluate(sub.jaxpr, sub.consts, invals, found)
            out_deps = [before | d for d in sub_deps]
        else:
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
            outs = list(outs) if eqn.primitive.multiple_results else [outs]
            out_deps = [before] * len(outs)
            if _float_kind(eqn.primitive) is not None:
                measured = _measure(eqn, invals, outs[0])
                if measured is not None:
                    found.append(measured)
                    out_deps = [before | {len(found) - 1}]
                    direct[eqn.outvars[0]] = len(found) - 1
        for v, o, d in zip(eqn.outvars, outs, out_deps):
            env[v], deps[v] = o, d
    outvars = jaxpr.outvars
    return ([read(v) for v in outvars], [dep(v) for v in outvars],
            [None if isinstance(v, core.Literal) else direct.get(v) for v in outvars])


def aggregation_roundings(comp: Any, args: tuple):
    """(roundings, per output leaf its aggregation indices, per output leaf the index
    of the aggregation it is or None) for the traced program `comp` at `args`."""
    found: list[Rounding] = []
    flat = jax.tree_util.tree_leaves(args)
    _, deps, direct = _evaluate(comp.jaxpr.jaxpr, comp.jaxpr.consts, flat, found)
    return found, deps, direct


def explain(max_abs: float, roundings: Sequence[Rounding],
            depends_on: frozenset, direct: Optional[int]) -> str:
    """Why an output may differ between jit and the fleet, or "" when no float
    aggregation feeds it. `max_abs` is the output's largest |jit - fleet|."""
    if direct is not None:
        r = roundings[direct]
        if max_abs <= r.bound:
            return (f"float rounding explains it: {r.describe()}. atol={_ceil(max_abs)} "
                    f"covers this difference; atol={_ceil(r.bound)} covers any rounding "
                    "of these addends")
        return (f"not float rounding alone: {r.describe()}, but the outputs differ by "
                f"{max_abs:.3g}")
    feeding = sorted((roundings[i] for i in depends_on), key=lambda r: -r.bound)
    if not feeding:
        return ""
    more = f" (and {len(feeding) - 1} more aggregations)" if len(feeding) > 1 else ""
    return (f"float rounding may explain it: it depends on {feeding[0].describe()}"
            f"{more}, and later operations carry such differences on. "
            f"atol={_ceil(max_abs)} accepts this difference")


def _ceil(value: float) -> str:
    """`value` rounded up to 2 significant digits, as a flag value."""
    if not np.isfinite(value) or value <= 0:
        return f"{value:g}"
    digits = 1 - int(np.floor(np.log10(value)))
    rounded = np.ceil(value * 10.0 ** digits) / 10.0 ** digits
    return f"{rounded:.2g}"


# ---------------------------------------------------------------------------------------
# Rounding through the client steps: how far two float evaluations of one program (jit's
# XLA and the LiteRT interpreter) may each be from the exact result.

# Ops that move or pick values (no rounding of their own); the rest add eps*|result|.
_MOVES = {"reshape", "transpose", "broadcast_in_dim", "slice", "squeeze", "concatenate",
          "select_n", "gather", "dynamic_slice", "dynamic_update_slice", "pad", "copy",
          "copy_p", "expand_dims", "rev", "max", "min", "reduce_max", "reduce_min", "neg",
          "abs", "iota", "sign", "stop_gradient", "argmax", "argmin", "clamp",
          "federated_broadcast", "sort"}
# Elementwise functions an interpreter's kernels compute within a few ulp, not 0.5.
_TRANSCENDENTAL = {"exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos",
                   "tan", "pow", "erf", "erf_inv", "rsqrt", "sqrt", "cbrt", "atan2", "lgamma",
                   "digamma"}
ULPS_OF_FUNCTIONS = 4.0
# While `aggregand_bounds` runs: (kind, per-client bounds of each operand) per aggregation.
_AGGREGANDS: contextvars.ContextVar = contextvars.ContextVar("aggregands", default=None)


def _eps(value) -> float:
    value = np.asarray(value)
    return float(jnp.finfo(value.dtype).eps) if is_float(value.dtype) else 0.0


def _is_key(value) -> bool:
    dtype = getattr(value, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _zeros(value) -> np.ndarray:
    if _is_key(value):  # a PRNG key: no float to round
        return np.zeros(value.shape, np.float32)
    value = np.asarray(value)
    return np.zeros(value.shape, value.dtype if is_float(value.dtype) else np.float32)


def _jaxpr_of(params: dict):
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = params.get(name)
        if isinstance(sub, core.ClosedJaxpr):
            return sub.jaxpr, sub.consts
        if isinstance(sub, core.Jaxpr):
            return sub, []
    return None


def _bind(eqn, invals):
    with eqn.ctx.manager:
        outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _abs64(x) -> np.ndarray:
    return np.abs(np.asarray(x, np.float64))


def _rule(eqn, vals: list, errs: list, outs: list) -> list:
    """Each output's error bound from its inputs' values and bounds (first order)."""
    name = eqn.primitive.name
    out = np.asarray(outs[0]) if len(outs) == 1 else None
    if name in ("add", "sub", "add_any"):
        return [np.asarray(errs[0]) + np.asarray(errs[1])]
    if name == "mul":
        return [_abs64(vals[1]) * errs[0] + _abs64(vals[0]) * errs[1]]
    if name == "div":
        return [(np.asarray(errs[0]) + _abs64(out) * errs[1]) / _abs64(vals[1])]
    if name in ("dot_general", "conv_general_dilated"):
        a, b = _abs64(vals[0]), _abs64(vals[1])
        ea, eb = (np.asarray(e, np.float64) for e in errs[:2])
        params = eqn.primitive.get_bind_params(eqn.params)

        def f(x, y):
            with eqn.ctx.manager:
                return np.asarray(eqn.primitive.bind(x.astype(np.float32),
                                                     y.astype(np.float32), **params),
                                  np.float64)
        if name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            n = int(np.prod([np.shape(vals[0])[d] for d in contract], dtype=np.int64))
        else:
            rhs = np.shape(vals[1])
            n = int(np.prod(rhs)) // max(1, rhs[eqn.params["dimension_numbers"].rhs_spec[0]])
        return [f(a, eb) + f(ea, b) + n * _eps(out) * f(a, b)]
    if name in ("reduce_sum", "cumsum"):
        x, e = _abs64(vals[0]), np.asarray(errs[0], np.float64)
        n = int(np.prod([np.shape(vals[0])[d] for d in eqn.params.get(
            "axes", (eqn.params.get("axis", 0),))], dtype=np.int64))
        return [np.asarray(_bind(eqn, [e.astype(vals[0].dtype)])[0], np.float64)
                + n * _eps(out) * np.asarray(_bind(eqn, [x.astype(vals[0].dtype)])[0],
                                             np.float64)]
    if name == "stop_gradient":
        return [errs[0]]
    floats = tuple(i for i, v in enumerate(vals) if is_float(np.asarray(v).dtype))
    try:
        tangents = _jvp_of(eqn, floats)(
            list(vals), [np.asarray(errs[i], np.asarray(vals[i]).dtype) for i in floats])
        return [_no_nan(np.abs(np.asarray(t, np.float64)), errs)
                if is_float(np.asarray(o).dtype) else _zeros(o)
                for t, o in zip(tangents, outs)]
    except Exception:  # noqa: BLE001 - no jvp rule: the largest input bound, as moved
        worst = max((float(np.max(e, initial=0.0)) for e in errs), default=0.0)
        return [np.full(np.shape(o), worst) for o in outs]


def _no_nan(tangent: np.ndarray, errs: list) -> np.ndarray:
    """A tangent's NaNs (0 * inf: an infinite derivative, sqrt at 0, times no error) as
    0 where every same-shaped input is known exactly there, else inf."""
    bad = np.isnan(tangent)
    if not bad.any():
        return tangent
    exact = np.ones(tangent.shape, bool)
    for e in errs:
        e = np.asarray(e)
        if e.shape == tangent.shape:
            exact &= e == 0
        elif np.any(e != 0):
            exact[:] = False
    return np.where(bad, np.where(exact, 0.0, np.inf), tangent)


_JVPS: dict = {}  # id(eqn) -> (eqn, its jitted tangent map): loops run an eqn many times


def _jvp_of(eqn, floats: tuple):
    """jit((values, tangents of the float ones) -> the outputs' tangents) for `eqn`."""
    hit = _JVPS.get((id(eqn), floats))
    if hit is not None and hit[0] is eqn:
        return hit[1]

    def tangents(vals, tans):
        def f(*fl):
            args = list(vals)
            for i, v in zip(floats, fl):
                args[i] = v
            return tuple(_bind(eqn, args))
        return jax.jvp(f, tuple(vals[i] for i in floats), tuple(tans))[1]

    fn = jax.jit(tangents)
    if len(_JVPS) > 4096:
        _JVPS.clear()
    _JVPS[(id(eqn), floats)] = (eqn, fn)
    return fn


def _run_bounds(jaxpr, consts: Sequence, vals: Sequence, errs: Sequence) -> tuple:
    """Runs `jaxpr` on values and their error bounds; (outputs, their bounds)."""
    env: dict = {}

    def read(v):
        if isinstance(v, core.Literal):
            return v.val, _zeros(v.val)
        return env[v]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = (c, _zeros(c))
    for v, x, e in zip(jaxpr.invars, vals, errs):
        env[v] = (x, e)
    for eqn in jaxpr.eqns:
        pairs = [read(v) for v in eqn.invars]
        invals, inerrs = [p[0] for p in pairs], [p[1] for p in pairs]
        outs, outerrs = _eqn_bounds(eqn, invals, inerrs)
        for v, o, e in zip(eqn.outvars, outs, outerrs):
            env[v] = (o, e)
    pairs = [read(v) for v in jaxpr.outvars]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _eqn_bounds(eqn, invals: list, inerrs: list) -> tuple:
    name, params = eqn.primitive.name, eqn.params
    facts = primitive_facts.facts_of(eqn.primitive)
    if name == "scan":
        return _scan_bounds(params, invals, inerrs)
    if name == "while":
        return _while_bounds(params, invals, inerrs)
    if name == "cond":
        branch = params["branches"][int(np.asarray(invals[0]))]
        return _run_bounds(branch.jaxpr, branch.consts, invals[1:], inerrs[1:])
    if facts is not None and name.startswith("federated_map") and \
            str(params.get("placement", "clients")).lower().endswith("clients"):
        return _client_map_bounds(eqn, invals, inerrs)
    if name == "federated_decode_sum":
        return _decode_sum_bounds(eqn, invals, inerrs)
    sub = _jaxpr_of(params)
    if sub is not None and (name in _CALLS or name.startswith(("custom_", "checkpoint",
                                                                 "remat", "federated_"))):
        return _run_bounds(sub[0], sub[1], invals, inerrs)
    outs = _bind(eqn, invals)
    if any(_is_key(v) for v in [*invals, *outs]):  # random bits: drawn alike on both paths
        return outs, [_zeros(o) for o in outs]
    kind = facts.kind if facts is not None else None
    record = _AGGREGANDS.get()
    if record is not None and facts is not None and facts.aggregates:
        record.append((kind, [np.asarray(e, np.float64) for e in inerrs]))
    if kind in _FLOAT_KINDS and is_float(np.asarray(invals[0]).dtype):
        x, e = _abs64(invals[0]), np.asarray(inerrs[0], np.float64)
        n = x.shape[0]
        if kind == "weighted_mean":
            w = _abs64(invals[1]).reshape((n,) + (1,) * (x.ndim - 1))
            total = max(float(w.sum()), np.finfo(np.float64).tiny)
            err, abs_sum = (w * e).sum(0) / total, (w * x).sum(0) / total
        else:
            scale = n if kind == "mean" else 1
            err, abs_sum = e.sum(0) / scale, x.sum(0) / scale
        return outs, [err + n * _eps(outs[0]) * abs_sum] + [_zeros(o) for o in outs[1:]]
    if facts is not None and facts.aggregates:
        return outs, [np.max(np.asarray(e, np.float64), axis=0) if np.ndim(e) else
                      np.asarray(e, np.float64) for e in inerrs[:len(outs)]]
    errs = _rule(eqn, invals, inerrs, outs)
    scale = (ULPS_OF_FUNCTIONS if name in _TRANSCENDENTAL else 0.0 if name in _MOVES
             else 1.0)
    return outs, [np.asarray(e, np.float64) + scale * _eps(o) * _abs64(o)
                  if is_float(np.asarray(o).dtype) else _zeros(o) for e, o in zip(errs, outs)]


def _client_map_bounds(eqn, invals: list, inerrs: list) -> tuple:
    """A map at CLIENTS, client by client: its clients are the equation's (a map of no
    operands has clients all the same), its outputs stacked on a leading clients axis
    (empty ones, of the equation's shapes, for no clients)."""
    sub, consts = _jaxpr_of(eqn.params)
    clients = int(eqn.params.get("clients", np.shape(invals[0])[0] if invals else 0))
    per = [_run_bounds(sub, consts, [x[c] if _is_key(x) else np.asarray(x)[c]
                                     for x in invals],
                       [np.asarray(e)[c] for e in inerrs])
           for c in range(clients)]
    if not per:
        outs = _bind(eqn, invals)
        return outs, [_zeros(o) for o in outs]
    count = len(eqn.outvars)
    return ([jnp.stack([p[0][k] for p in per]) if _is_key(per[0][0][k])
             else np.stack([np.asarray(p[0][k]) for p in per]) for k in range(count)],
            [np.stack([np.asarray(p[1][k]) for p in per]) for k in range(count)])


def _decode_sum_bounds(eqn, invals: list, inerrs: list) -> tuple:
    """A decode-sum (`federated_decode_sum`): each client's member decoded with its
    bounds (the decoder's jaxpr run client by client, as the server runs it), then
    summed as `federated_sum` sums: the decoded bounds added, plus n*eps*sum|decoded|
    for the float sum (jit rounds after each addition, the fleet once). The members'
    bounds are recorded as an aggregation's (`aggregand_bounds`). Integer members (the
    codes) carry no bound: a code is taken as the same on both paths (module docs)."""
    closed = eqn.params["jaxpr"]
    clients = int(eqn.params["clients"])
    record = _AGGREGANDS.get()
    if record is not None:
        facts = primitive_facts.facts_of(eqn.primitive)
        record.append((facts.kind if facts is not None else None,
                       [np.asarray(e, np.float64) for e in inerrs]))
    outs = _bind(eqn, invals)
    per = [_run_bounds(closed.jaxpr, closed.consts, [np.asarray(x)[c] for x in invals],
                       [np.asarray(e)[c] for e in inerrs]) for c in range(clients)]
    errs = []
    for k, out in enumerate(outs):
        if not is_float(np.asarray(out).dtype):
            errs.append(_zeros(out))
            continue
        decoded = np.stack([_abs64(p[0][k]) for p in per]) if per else None
        carried = np.stack([np.asarray(p[1][k], np.float64) for p in per]) if per else None
        errs.append(np.zeros(np.shape(out)) if not per else
                    carried.sum(0) + clients * _eps(out) * decoded.sum(0))
    return outs, errs


# A loop carries its bounds through a whole step at once (`_step`): the carry's bound
# goes through the step's Jacobian (|J| @ bound), and only what the step rounds itself
# goes op by op. Carried op by op instead, every step would widen the bound by the row
# sums of |J| of each op (|W| |x| in a gradient's backward pass, never the cancellation
# of `p - lr * grad(p)`), which grows it geometrically with the local steps: bounds of
# 500 on a loss of 0.2 after five SGD steps of a small CNN, 0.4 this way.
MAX_JACOBIAN_ENTRIES = 1 << 24  # above: carried op by op (the Jacobian's memory)
_JACOBIANS: dict = {}  # (id(body), float carry positions) -> (body, jitted jacobian)


def _jacobian_of(body, floats: tuple):
    """jit(values -> d(outputs)/d(the float carries at `floats`)) of the loop body."""
    hit = _JACOBIANS.get((id(body), floats))
    if hit is not None and hit[0] is body:
        return hit[1]
    fn = core.jaxpr_as_fun(body)

    def jacobian(vals):
        def f(*carried):
            args = list(vals)
            for i, v in zip(floats, carried):
                args[i] = v
            return tuple(fn(*args))
        return jax.jacfwd(f, argnums=tuple(range(len(floats))))(
            *(vals[i] for i in floats))

    jitted = jax.jit(jacobian)
    if len(_JACOBIANS) > 256:
        _JACOBIANS.clear()
    _JACOBIANS[(id(body), floats)] = (body, jitted)
    return jitted


def _step(body, vals: list, errs: list, carry_at: range) -> tuple:
    """One loop step: `body` (a ClosedJaxpr) at `vals`, whose bounds are `errs` and whose
    loop carries sit at `carry_at`; (outputs, their bounds). The carries' bounds go
    through the step's Jacobian where it is small enough (`MAX_JACOBIAN_ENTRIES`), the
    step's own rounding (and its other inputs' bounds) op by op."""
    floats = tuple(i for i in carry_at if is_float(np.asarray(vals[i]).dtype)
                   and np.any(errs[i]))
    size = sum(int(np.size(vals[i])) for i in floats)
    outs_size = sum(int(np.prod(v.aval.shape, dtype=np.int64)) for v in body.jaxpr.outvars)
    if not floats or size * outs_size > MAX_JACOBIAN_ENTRIES:
        return _run_bounds(body.jaxpr, body.consts, vals, errs)
    local = [_zeros(v) if i in floats else e for i, (v, e) in enumerate(zip(vals, errs))]
    outs, out_errs = _run_bounds(body.jaxpr, body.consts, vals, local)
    jac = _jacobian_of(body, floats)(list(vals))
    carried = []
    for o, e, per_input in zip(outs, out_errs, jac):
        if not is_float(np.asarray(o).dtype):
            carried.append(e)
            continue
        add = np.zeros(np.size(o), np.float64)
        for i, d in zip(floats, per_input):
            d = np.abs(np.asarray(d, np.float64)).reshape(np.size(o), -1)
            bound = np.asarray(errs[i], np.float64).reshape(1, -1)
            # an infinite or undefined derivative times a known value adds nothing,
            # times an uncertain one anything
            add += np.where(bound == 0, 0.0, np.where(np.isnan(d), np.inf, d) * bound).sum(1)
        carried.append(np.asarray(e, np.float64) + add.reshape(np.shape(o)))
    return outs, carried


def _scan_bounds(params: dict, invals: list, inerrs: list) -> tuple:
    body = params["jaxpr"]
    nc, ncarry, length = params["num_consts"], params["num_carry"], params["length"]
    consts, cerrs = invals[:nc], inerrs[:nc]
    carry, carry_err = list(invals[nc:nc + ncarry]), list(inerrs[nc:nc + ncarry])
    xs, xerrs = invals[nc + ncarry:], inerrs[nc + ncarry:]
    ys: list = []
    order = range(length - 1, -1, -1) if params.get("reverse") else range(length)
    for i in order:
        outs, errs = _step(body, consts + carry + [np.asarray(x)[i] for x in xs],
                           cerrs + carry_err + [np.asarray(e)[i] for e in xerrs],
                           range(nc, nc + ncarry))
        carry, carry_err = outs[:ncarry], errs[:ncarry]
        ys.append((outs[ncarry:], errs[ncarry:]))
    if params.get("reverse"):
        ys.reverse()
    count = len(body.jaxpr.outvars) - ncarry
    stacked = [np.stack([np.asarray(y[0][k]) for y in ys]) for k in range(count)] if ys else []
    stacked_err = [np.stack([np.asarray(y[1][k]) for y in ys]) for k in range(count)] \
        if ys else []
    return carry + stacked, carry_err + stacked_err


def _while_bounds(params: dict, invals: list, inerrs: list) -> tuple:
    cond, body = params["cond_jaxpr"], params["body_jaxpr"]
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    cconsts, bconsts, berrs = invals[:nc], invals[nc:nc + nb], inerrs[nc:nc + nb]
    carry, carry_err = list(invals[nc + nb:]), list(inerrs[nc + nb:])
    while bool(np.asarray(core.jaxpr_as_fun(cond)(*cconsts, *carry)[0])):
        carry, carry_err = _step(body, bconsts + carry, berrs + carry_err,
                                 range(nb, nb + len(carry)))
    return carry, carry_err


def evaluation_bounds(comp: Any, args: tuple) -> list[np.ndarray]:
    """Per output leaf of the traced program `comp` at `args`, elementwise, a first-order
    bound on how far a float evaluation is from the exact result: every float op rounds
    its result (0.5 ulp; `ULPS_OF_FUNCTIONS` for exp, log, tanh, ...), a sum of n terms
    (a dot, a reduction, an aggregation over clients) by n*eps*sum|x|, and the bounds of
    its inputs are carried through it (|f'(x)| * bound). Two evaluations that each stay
    within it (jit, and the fleet whose clients run LiteRT and whose sums are exact)
    differ by at most twice it."""
    flat = [a if _is_key(a) else np.asarray(a) for a in jax.tree_util.tree_leaves(args)]
    _, errs = _run_bounds(comp.jaxpr.jaxpr, comp.jaxpr.consts, flat,
                          [_zeros(a) for a in flat])
    return [np.asarray(e, np.float64) for e in errs]


def aggregand_bounds(comp: Any, args: tuple) -> list[tuple]:
    """(kind, [per-client bounds of the aggregand, of the weights]) for each aggregation
    over clients of `comp` at `args`, in evaluation order (clients on axis 0): the bound
    of `evaluation_bounds` on what each client hands to the aggregation."""
    record: list = []
    token = _AGGREGANDS.set(record)
    try:
        evaluation_bounds(comp, args)
    finally:
        _AGGREGANDS.reset(token)
    return record
