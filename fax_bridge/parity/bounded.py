"""How jit's result and an exported path's are compared, output leaf by output leaf.

Without `rtol`/`atol` (`tolerances` gives None), `bounded_comparison` holds each float
leaf to twice the program's rounding bound (`parity.rounding.evaluation_bounds`: each
path within the bound of the exact result, so the two within twice it), integer and
bool leaves to equality, and says per leaf which method gave its bound; with them,
`parity.report.compare_leaves` compares as `numpy.allclose` does. `check_parity` (a
fleet) and `parity.flower` (a Flower run) both compare so.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import numpy as np

from fax_bridge.parity import rounding as parity_rounding
from fax_bridge.parity.report import LeafParity, compare_leaves, difference


# The tolerances of a comparison that asks for them (`rtol=` or `atol=`); without
# either, float leaves are held to the rounding bound (`bounded_comparison`).
DEFAULT_RTOL, DEFAULT_ATOL = 1e-5, 1e-6


def tolerances(rtol: Optional[float], atol: Optional[float]) -> Optional[tuple]:
    """(rtol, atol) where a caller gave either (the other at its default); None where it
    gave neither: the comparison then holds each float leaf to the rounding bound."""
    if rtol is None and atol is None:
        return None
    return (DEFAULT_RTOL if rtol is None else rtol, DEFAULT_ATOL if atol is None else atol)


def bounded_comparison(comp: Any, args: tuple, local: list, remote: list, paths: list,
                       who: str, rounds: int = 1, carry: int = 0) -> tuple:
    """(leaves, rtol, atol): `local` (jit's output leaves for `args`, after `rounds`
    chained rounds that carry their first `carry` leaves) against `remote` (what `who`
    computed), each float leaf within twice the program's rounding bound
    (`parity.rounding.evaluation_bounds`), integer and bool leaves equal. Where no bound
    can be had (`comp` None: no traced program), the default tolerances, said on every
    float leaf."""
    methods: list = []
    try:
        if comp is None:
            raise ValueError("the round was not traced here (read from its app)")
        bounds = parity_rounding.evaluation_bounds(comp, args, methods, float32=local,
                                                   rounds=rounds, carry=carry)
    except ValueError as e:
        leaves = compare_leaves(local, remote, DEFAULT_RTOL, DEFAULT_ATOL, paths=paths)
        for leaf in leaves:
            if parity_rounding.is_float(leaf.dtype):
                leaf.explanation = (f"(no rounding bound: {e}; compared with rtol="
                                    f"{DEFAULT_RTOL:g} atol={DEFAULT_ATOL:g})")
        return leaves, DEFAULT_RTOL, DEFAULT_ATOL
    return bounded_leaves(local, remote, bounds, paths, methods, who), 0.0, 0.0


def bounded_leaves(local: Any, remote: Any, bounds: list, paths: list,
                   methods: Optional[list] = None, who: str = "LiteRT") -> list[LeafParity]:
    """Leaf-by-leaf comparison where leaf i may differ by 2 * bounds[i] elementwise
    (`parity.rounding.evaluation_bounds`: each path within the bound of the exact
    result; `methods[i]` says what gave it; `who` names the other path); integer and
    bool leaves must be equal (exactly, at every width), and a NaN or infinity must be
    the same on both paths (class and sign), whatever the bound."""
    leaves = compare_leaves(local, remote, 0.0, 0.0, paths=paths)
    want, got = jax.tree_util.tree_leaves(local), jax.tree_util.tree_leaves(remote)
    if len(want) != len(got) or len(bounds) != len(want):
        return leaves
    methods = list(methods or []) + [""] * (len(want) - len(methods or []))
    for leaf, w, g, b, method in zip(leaves, want, got, bounds, methods):
        if leaf.note or not parity_rounding.is_float(leaf.dtype):
            continue
        diff, same = difference(np.asarray(w), np.asarray(g))
        allowed = 2.0 * np.asarray(b, np.float64)
        with np.errstate(invalid="ignore"):  # a non-finite value only against the same
            leaf.ok = bool(np.all(same | (np.isfinite(diff) & (diff <= allowed))))
        leaf.bound = float(np.max(allowed, initial=0.0))
        leaf.bound_method = method
        how = f" ({method})" if method else ""
        leaf.explanation = (
            f"{who} and jit each stay within the rounding bound{how} of the exact "
            f"result: they may differ by up to {leaf.bound:.3g} here (elementwise), and "
            f"differ by at most {leaf.max_abs:.3g}")
    return leaves
