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

`evaluation_bounds(comp, args)` bounds, output element by output element, how far one
float evaluation of the whole program (jit's XLA; a LiteRT client's interpreter) may be
from the exact result: the smaller of the first-order worst case
(`parity.first_order`) and the float64 shadow's measure (`parity.shadow`), saying per
output which gave it; `aggregand_bounds` does the same for what each client hands each
aggregation. A LiteRT parity check holds each float output to twice it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core

from fax_bridge.parity import first_order as parity_first_order, shadow as parity_shadow
from fax_bridge.parity import shadow_eval
from fax_bridge.language import primitive_facts, tracing
from fax_bridge.runtime import aggregation

# The aggregation kinds (a primitive's record, `primitive_facts`) jit rounds in floats.
_FLOAT_KINDS = ("sum", "mean", "weighted_mean")
_CALLS = shadow_eval.CALLS  # sub-jaxprs evaluated in place
is_float = shadow_eval.is_float


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

FIRST_ORDER, SHADOW = "first-order analysis", "float64 shadow"
first_order_bounds = parity_first_order.first_order_bounds


def _least(first: np.ndarray, shadow: Optional[np.ndarray], why: str) -> tuple:
    """(elementwise the smaller of the two bounds, which method gave it)."""
    first = np.asarray(first, np.float64)
    if shadow is None or np.shape(shadow) != first.shape:
        return first, f"{FIRST_ORDER} (no {SHADOW}: {why})" if why else FIRST_ORDER
    shadow = np.asarray(shadow, np.float64)
    out = np.fmin(first, shadow)
    tighter = int(np.count_nonzero(first < shadow))
    if tighter == 0:
        return out, SHADOW
    if tighter == first.size:
        return out, FIRST_ORDER
    return out, f"{SHADOW}; {FIRST_ORDER} at {tighter} of {first.size} elements"


def _shadow(comp: Any, args: tuple, float32: Optional[Sequence] = None,
            rounds: int = 1, carry: int = 0) -> tuple:
    try:
        return parity_shadow.measure(comp, args, float32=float32, rounds=rounds,
                                     carry=carry), ""
    except Exception as e:  # noqa: BLE001 - the first-order bound stands alone
        return None, f"{type(e).__name__}: {str(e)[:200]}"


def _first_order(comp: Any, args: tuple, shadow: Any, run) -> Optional[list]:
    """The first-order analysis's result (`run`), unless the shadow measured the program
    and it loops: through a loop's steps the worst case compounds every step's |J|
    (vacuous bounds: docs/litert.md), and costs a Jacobian per step."""
    if shadow is not None and parity_shadow.loops(comp.jaxpr):
        return None
    return run(comp, args)


def evaluation_bounds(comp: Any, args: tuple, methods: Optional[list] = None,
                      float32: Optional[Sequence] = None, rounds: int = 1,
                      carry: int = 0) -> list[np.ndarray]:
    """Per output leaf of the traced program `comp` at `args`, elementwise, how far one
    float evaluation may be from the exact result: the float64 shadow's measure
    (`parity.shadow`: the program run in float64, with and without float32's rounding
    drawn at every op), or the first-order analysis's worst case
    (`parity.first_order`) where that is smaller, on programs without loops (through
    loops it compounds far above the shadow, and costs a Jacobian per step). Two
    evaluations (jit, and a fleet whose clients run LiteRT and whose sums are exact)
    may differ by twice it.

    Args:
      comp: the traced program (`tracing.trace`); args: its arguments.
      methods: a list that gets each leaf's method appended (`SHADOW`, `FIRST_ORDER`,
        or both, saying at how many elements the first-order bound is the tighter).
      float32: the output leaves jit gave for `args`, where the caller has them (the
        shadow then compiles only the float64 program).
      rounds, carry: bound the last of `rounds` chained rounds, each fed the first
        `carry` output leaves of the one before as its first argument leaves (a round's
        state); the shadow alone measures a chain (`parity.shadow.measure`).

    Raises ValueError where neither method can bound the program (the reason of each)."""
    shadow, why = _shadow(comp, args, float32, rounds, carry)
    if rounds > 1:
        if shadow is None:
            raise ValueError(f"no {SHADOW} of {rounds} chained rounds: {why}")
        first, loop_why = None, f"{rounds} chained rounds"
    else:
        loop_why = "the program loops"
        try:
            first = _first_order(comp, args, shadow, parity_first_order.first_order_bounds)
        except Exception as e:  # noqa: BLE001 - the shadow's bound stands alone
            if shadow is None:
                raise ValueError(f"no rounding bound: no {SHADOW} ({why}) and no "
                                 f"{FIRST_ORDER} ({type(e).__name__}: {e})") from e
            first, loop_why = None, f"{type(e).__name__} in it"
    measured = shadow.bounds() if shadow is not None else [None] * len(first)
    out = []
    for i, m in enumerate(measured):
        if first is None:
            bound, method = np.asarray(m, np.float64), (
                f"{SHADOW} ({loop_why}: no {FIRST_ORDER})")
        else:
            bound, method = _least(first[i], m, why)
        out.append(bound)
        if methods is not None:
            methods.append(method)
    return out


def aggregand_bounds(comp: Any, args: tuple) -> list[tuple]:
    """(kind, [per-client bounds of the aggregand, of the weights]) for each aggregation
    over clients of `comp` at `args`, in evaluation order (clients on axis 0): the bound
    of `evaluation_bounds` on what each client hands to the aggregation (the float64
    shadow's, the smaller of it and the first-order one's where both apply)."""
    shadow, _ = _shadow(comp, args)
    first = _first_order(comp, args, shadow, parity_first_order.first_order_aggregands)
    measured = shadow.aggregand_bounds() if shadow is not None else None
    if first is None:
        return measured
    same = measured is not None and len(measured) == len(first) and all(
        k1 == k2 and len(a) == len(b) for (k1, a), (k2, b) in zip(first, measured))
    if not same:
        return first
    return [(kind, [_least(f, m, "")[0] for f, m in zip(errs, shadows)])
            for (kind, errs), (_, shadows) in zip(first, measured)]
