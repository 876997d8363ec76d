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
