"""Rounding through the client steps, bounded in the worst case: how far a float
evaluation of a program (jit's XLA, the LiteRT interpreter) may be from the exact result.

`first_order_bounds(comp, args)` runs the traced program op by op carrying, beside each
value, a bound on its distance from the exact result: every float op adds half an ulp
of its result (`ULPS_OF_FUNCTIONS` for exp, log, tanh, ...), every sum of n terms (a
dot, a convolution, a reduction, an aggregation over clients) n*eps*sum|x|, and other
ops carry their inputs' bounds through their derivative; a loop carries its carry's
bound through each whole step's Jacobian. `first_order_aggregands` records what each
client hands each aggregation. `parity.rounding.evaluation_bounds` takes the smaller of
this and the float64 shadow's measure (`parity.shadow`).
"""

from __future__ import annotations

import contextvars
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core

from fax_bridge.parity import shadow_eval
from fax_bridge.language import jax_compat
from fax_bridge.language import primitive_facts

_FLOAT_KINDS = ("sum", "mean", "weighted_mean")
_CALLS = shadow_eval.CALLS  # sub-jaxprs evaluated in place
is_float = shadow_eval.is_float


_MOVES, _TRANSCENDENTAL = shadow_eval.MOVES, shadow_eval.TRANSCENDENTAL
ULPS_OF_FUNCTIONS = shadow_eval.ULPS_OF_FUNCTIONS
# While `first_order_aggregands` runs: (kind, per-client bounds of each operand) per aggregation.
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


class _ByIdentity:
    """Jitted maps kept per (object, float positions): keyed by the object's id and
    checked by identity (an id is reused once its object is gone), all dropped past
    `cap` entries. Loops run an equation, or a body, many times."""

    def __init__(self, cap: int):
        self.cap = cap
        self.entries: dict = {}

    def get(self, obj, floats: tuple, make):
        """The map kept for (`obj`, `floats`), else `make()`'s, kept."""
        hit = self.entries.get((id(obj), floats))
        if hit is not None and hit[0] is obj:
            return hit[1]
        fn = make()
        if len(self.entries) > self.cap:
            self.entries.clear()
        self.entries[(id(obj), floats)] = (obj, fn)
        return fn


def _with_floats(vals: Sequence, floats: tuple, new: Sequence) -> list:
    """`vals` with `new` at the positions `floats`."""
    args = list(vals)
    for i, v in zip(floats, new):
        args[i] = v
    return args


_JVPS = _ByIdentity(4096)  # an equation's jitted tangent map


def _jvp_of(eqn, floats: tuple):
    """jit((values, tangents of the float ones) -> the outputs' tangents) for `eqn`."""
    def tangents(vals, tans):
        def f(*fl):
            return tuple(_bind(eqn, _with_floats(vals, floats, fl)))
        return jax.jvp(f, tuple(vals[i] for i in floats), tuple(tans))[1]

    return _JVPS.get(eqn, floats, lambda: jax.jit(tangents))


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
    sub = shadow_eval.inner_jaxpr(params)
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
    sub, consts = shadow_eval.inner_jaxpr(eqn.params)
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
_JACOBIANS = _ByIdentity(256)  # a loop body's jitted Jacobian in its float carries


def _jacobian_of(body, floats: tuple):
    """jit(values -> d(outputs)/d(the float carries at `floats`)) of the loop body."""
    fn = core.jaxpr_as_fun(body)

    def jacobian(vals):
        def f(*carried):
            return tuple(fn(*_with_floats(vals, floats, carried)))
        return jax.jacfwd(f, argnums=tuple(range(len(floats))))(
            *(vals[i] for i in floats))

    return _JACOBIANS.get(body, floats, lambda: jax.jit(jacobian))


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
    (nc, ncarry), length = jax_compat.scan_counts(params), params["length"]
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


def first_order_bounds(comp: Any, args: tuple) -> list[np.ndarray]:
    """Per output leaf of the traced program `comp` at `args`, elementwise, a first-order
    bound on how far a float evaluation is from the exact result: every float op rounds
    its result (0.5 ulp; `ULPS_OF_FUNCTIONS` for exp, log, tanh, ...), a sum of n terms
    (a dot, a reduction, an aggregation over clients) by n*eps*sum|x|, and the bounds of
    its inputs are carried through it (|f'(x)| * bound). Two evaluations that each stay
    within it (jit, and the fleet whose clients run LiteRT and whose sums are exact)
    differ by at most twice it. A worst case: every rounding is taken to go the way
    every later derivative amplifies it, which compounds through divisions, softmax,
    max pools and recurrences to bounds far above any error seen."""
    flat = [a if _is_key(a) else np.asarray(a) for a in jax.tree_util.tree_leaves(args)]
    _, errs = _run_bounds(comp.jaxpr.jaxpr, comp.jaxpr.consts, flat,
                          [_zeros(a) for a in flat])
    return [np.asarray(e, np.float64) for e in errs]


def first_order_aggregands(comp: Any, args: tuple) -> list[tuple]:
    """`aggregand_bounds` of the first-order analysis alone."""
    record: list = []
    token = _AGGREGANDS.set(record)
    try:
        first_order_bounds(comp, args)
    finally:
        _AGGREGANDS.reset(token)
    return record
