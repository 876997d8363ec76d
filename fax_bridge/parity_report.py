"""A parity comparison's result: one `LeafParity` per output leaf in a `ParityReport`.

`compare_leaves` compares two results leaf by leaf; `parity.check_parity` (jit against a
fleet, the interpreter or a Flower deployment) and `parity_flower.py` report with it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import numpy as np


@dataclasses.dataclass
class LeafParity:
    """How one output leaf of the fleet path compares with the local path."""

    path: str
    shape: tuple
    dtype: str
    max_abs: float
    max_rel: float
    ok: bool
    note: str = ""
    explanation: str = ""  # why jit and the fleet may differ (float rounding), if known
    bound: Optional[float] = None  # the largest difference the rounding bound allows


@dataclasses.dataclass
class ParityReport:
    """Result of `check_parity`: `.ok` and one `LeafParity` per output leaf."""

    leaves: list[LeafParity]
    rtol: float
    atol: float
    devices: int
    local_s: float  # one round under jit, compiled
    fleet_s: Optional[float]  # one round on the exported path, warm (None: not timed)
    signature: str
    target: str = "fleet"  # what ran the proto: "fleet" (devices) or "flower" (SuperNodes)
    fleet_bits: Optional[bool] = None  # Flower: whether the result has the fleet plan's bits
    client_runtime: str = "xla"  # what ran the client parts: "xla" or "litert" (LiteRT)
    # seconds spent once, not per round, by what: compiling, starting processes
    startup_s: dict = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(leaf.ok for leaf in self.leaves) and self.fleet_bits is not False

    def table(self) -> str:
        """A plain-text table, one row per output leaf."""
        bounded = any(leaf.bound is not None for leaf in self.leaves)
        rows = [("output", "shape", "dtype", "max abs err",
                 "bound" if bounded else "max rel err", "status")]
        for leaf in self.leaves:
            rows.append((leaf.path, str(leaf.shape), leaf.dtype, f"{leaf.max_abs:.3e}",
                         (f"{leaf.bound:.3e}" if leaf.bound is not None else "exact")
                         if bounded else f"{leaf.max_rel:.3e}",
                         ("ok" if leaf.ok else "MISMATCH") + (f" ({leaf.note})" if leaf.note
                                                              else "")))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        where = (f"Flower deployment of {self.devices} SuperNode(s)" if self.target == "flower"
                 else f"fleet of {self.devices} device(s)")
        if self.client_runtime != "xla":
            where += f" running client parts in {self.client_runtime}"
        tolerance = ("bound: 2 x n*eps*sum|x| through the client steps and aggregations"
                     if bounded else f"tolerance: rtol={self.rtol:g} atol={self.atol:g}")
        fleet = (f"{self.fleet_s * 1e3:.2f} ms" if self.fleet_s is not None
                 else "not timed warm (warm_round=True times a second round)")
        lines = [f"parity: {self.signature}",
                 f"per round: local jit {self.local_s * 1e3:.2f} ms, {where} {fleet}"]
        if self.startup_s:
            lines.append("once, not per round: " + ", ".join(
                f"{what} {s * 1e3:,.0f} ms" for what, s in self.startup_s.items()))
        lines.append(tolerance)
        for i, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines.extend(f"{leaf.path}: {leaf.explanation}" for leaf in self.leaves
                     if leaf.explanation and not leaf.ok)
        if self.fleet_bits is not None:
            lines.append("the same bits as the fleet's round plan: "
                         + ("yes" if self.fleet_bits else "NO"))
        lines.append("PARITY OK" if self.ok else "PARITY MISMATCH")
        return "\n".join(lines)


def compare_leaves(local: Any, remote: Any, rtol: float, atol: float,
                   paths: Optional[list[str]] = None) -> list[LeafParity]:
    """Leaf-by-leaf comparison of two results with the same flattened order."""
    want = jax.tree_util.tree_leaves(local)
    got = jax.tree_util.tree_leaves(remote)
    if paths is None:
        paths = [jax.tree_util.keystr(p) or "result"
                 for p, _ in jax.tree_util.tree_flatten_with_path(local)[0]]
    out = []
    if len(want) != len(got):
        return [LeafParity("result", (), "", float("inf"), float("inf"), False,
                           f"{len(got)} leaves from the fleet, {len(want)} locally")]
    for path, w, g in zip(paths, want, got):
        w, g = np.asarray(w), np.asarray(g)
        if w.shape != g.shape:
            out.append(LeafParity(path, w.shape, str(w.dtype), float("inf"), float("inf"),
                                  False, f"fleet shape {g.shape}"))
            continue
        wf, gf = w.astype(np.float64), g.astype(np.float64)
        diff = np.abs(wf - gf)
        max_abs = float(diff.max()) if diff.size else 0.0
        with np.errstate(over="ignore"):  # a difference next to a zero: inf
            rel = diff / np.maximum(np.abs(wf), np.finfo(np.float64).tiny)
        max_rel = float(rel.max()) if rel.size else 0.0
        ok = bool(np.allclose(gf, wf, rtol=rtol, atol=atol, equal_nan=True))
        note = "" if w.dtype == g.dtype else f"fleet dtype {g.dtype}"
        out.append(LeafParity(path, tuple(w.shape), str(w.dtype), max_abs, max_rel,
                              ok and not note, note))
    return out
