"""A parity comparison's result: one `LeafParity` per output leaf in a `ParityReport`.

`compare_leaves` compares two results leaf by leaf; `parity.check_parity` (jit against a
fleet, the interpreter or a Flower deployment) and `parity/flower.py` report with it.

`ParityReport.table(top=N)` prints a summary first (the verdict, the leaves, what ran
them, how jit ran the clients where in chunks, and the worst leaf: the one that used
the largest share of what it may differ by, `LeafParity.used`), the round's type
signature abbreviated, the timings and the rule, then the N worst leaves' rows, worst
first (every row without `top`); `to_json()` is the whole report, every leaf with it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax
import numpy as np

from fax_bridge.system import cli_args


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
    bound_method: str = ""  # what gave the bound (`parity.rounding.evaluation_bounds`)
    # max over elements of |difference| / (atol + rtol |jit's value|) (`compare_leaves`)
    tolerance_used: Optional[float] = None

    @property
    def used(self) -> float:
        """The share of what this leaf may differ by that it does differ by: its largest
        difference over its largest bound (a bounded leaf), or the largest of each
        element's difference over its tolerance; 0 where the values are equal, inf
        where they differ and nothing is allowed (or the leaf could not be compared)."""
        if self.bound is not None:
            if self.max_abs == 0:
                return 0.0
            return self.max_abs / self.bound if self.bound > 0 else math.inf
        if self.tolerance_used is not None:
            return self.tolerance_used
        return 0.0 if self.max_abs == 0 else math.inf


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
    chunking: str = ""  # how jit ran the clients where in chunks (`chunking_of`)

    @property
    def ok(self) -> bool:
        return all(leaf.ok for leaf in self.leaves) and self.fleet_bits is not False

    def worst(self) -> list:
        """The leaves, worst first: mismatches, then by the share of their allowance
        used (`LeafParity.used`), each kind in output order."""
        order = sorted(range(len(self.leaves)), key=lambda i: (
            self.leaves[i].ok, -_finite(self.leaves[i].used), i))
        return [self.leaves[i] for i in order]

    def where(self) -> str:
        """What ran the exported round: a fleet or a Flower deployment, and its runtime."""
        where = (f"Flower deployment of {self.devices} SuperNode(s)" if self.target == "flower"
                 else f"fleet of {self.devices} device(s)")
        if self.client_runtime != "xla":
            where += f" running client parts in {self.client_runtime}"
        return where

    def summary(self) -> list:
        """The summary's lines (module docstring)."""
        verdict = "PARITY OK" if self.ok else "PARITY MISMATCH"
        failed = sum(not leaf.ok for leaf in self.leaves)
        first = (f"{verdict}: {len(self.leaves)} output leaves"
                 + (f", {failed} mismatched" if failed else "")
                 + f"; jit against a {self.where()}")
        if self.chunking:
            first += f"; jit ran the clients {self.chunking}"
        lines = [first]
        if self.leaves:
            leaf = self.worst()[0]
            allowed = (f"bound {leaf.bound:.3e}" if leaf.bound is not None
                       else f"rtol={self.rtol:g} atol={self.atol:g}")
            how = f", {leaf.bound_method}" if getattr(leaf, "bound_method", "") else ""
            share = leaf.used
            lines.append(
                f"worst leaf: {leaf.path} {leaf.dtype}{list(leaf.shape)}: max abs err "
                f"{leaf.max_abs:.3e}, {allowed}{how}: "
                + (f"{share:.1%} of what it may differ by" if math.isfinite(share)
                   else "it may not differ")
                + ("" if leaf.ok else f" ({leaf.note or 'MISMATCH'})"))
        return lines

    def table(self, top: Optional[int] = None, signature_chars: Optional[int] = 200
              ) -> str:
        """The report as text (module docstring): the summary, then one row per output
        leaf, the `top` worst first (every leaf, in output order, without `top`); the
        type signature cut at `signature_chars` characters (None: whole)."""
        bounded = any(leaf.bound is not None for leaf in self.leaves)
        shown = self.leaves if top is None else self.worst()[:max(top, 0)]
        methods = any(getattr(leaf, "bound_method", "") for leaf in self.leaves)
        rows = [("output", "shape", "dtype", "max abs err",
                 "bound" if bounded else "max rel err", "status")
                + (("bound from",) if methods else ())]
        for leaf in shown:
            rows.append((leaf.path, str(leaf.shape), leaf.dtype, f"{leaf.max_abs:.3e}",
                         (f"{leaf.bound:.3e}" if leaf.bound is not None else "exact")
                         if bounded else f"{leaf.max_rel:.3e}",
                         ("ok" if leaf.ok else "MISMATCH") + (f" ({leaf.note})" if leaf.note
                                                              else ""))
                        + ((getattr(leaf, "bound_method", ""),) if methods else ()))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        tolerance = ("bound: 2 x each leaf's float32 rounding bound (its 'bound from' "
                     "column: a float64 shadow's measure or the first-order worst case)"
                     if bounded else f"tolerance: rtol={self.rtol:g} atol={self.atol:g}")
        fleet = (f"{self.fleet_s * 1e3:.2f} ms" if self.fleet_s is not None
                 else "not timed warm (warm_round=True times a second round)")
        signature = cli_args.shortened(self.signature, signature_chars,
                                       "in the report's JSON")
        lines = self.summary() + [
            f"parity: {signature}",
            f"per round: local jit {self.local_s * 1e3:.2f} ms, {self.where()} {fleet}"]
        if self.startup_s:
            lines.append("once, not per round: " + ", ".join(
                f"{what} {s * 1e3:,.0f} ms" for what, s in self.startup_s.items()))
        lines.append(tolerance)
        if len(shown) < len(self.leaves):
            lines.append(f"the {len(shown)} worst of {len(self.leaves)} leaves, worst first:")
        for i, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        if len(shown) < len(self.leaves):
            rest = self.leaves[len(shown):] if top is None else self.worst()[len(shown):]
            bad = sum(not leaf.ok for leaf in rest)
            lines.append(f"... {len(rest)} more leaves, "
                         + (f"{bad} of them mismatched" if bad else "all ok")
                         + " (every row: the report's JSON)")
        lines.extend(f"{leaf.path}: {leaf.explanation}" for leaf in self.leaves
                     if leaf.explanation and not leaf.ok)
        if self.fleet_bits is not None:
            lines.append("the same bits as the fleet's round plan: "
                         + ("yes" if self.fleet_bits else "NO"))
        lines.append("PARITY OK" if self.ok else "PARITY MISMATCH")
        return "\n".join(lines)

    def to_json(self) -> dict:
        """The whole report as JSON-ready data: the verdict, what ran, the timings, the
        whole type signature and every leaf (its fields, and `used`), in output order;
        a non-finite number as its text ("inf", "nan")."""
        def number(x):
            return x if not isinstance(x, float) or math.isfinite(x) else str(x)

        leaves = []
        for leaf in self.leaves:
            row = {k: number(v) for k, v in dataclasses.asdict(leaf).items()}
            row["shape"] = list(leaf.shape)
            row["used"] = number(leaf.used)
            leaves.append(row)
        return {"ok": self.ok, "target": self.target, "devices": self.devices,
                "client_runtime": self.client_runtime, "chunking": self.chunking,
                "rtol": self.rtol, "atol": self.atol, "signature": self.signature,
                "local_s": self.local_s, "fleet_s": self.fleet_s,
                "startup_s": dict(self.startup_s), "fleet_bits": self.fleet_bits,
                "leaves": leaves}


def _finite(x: float) -> float:
    """`x` with inf as the largest float and nan as -1 (for sorting)."""
    return -1.0 if math.isnan(x) else min(x, 1.7976931348623157e308)


def chunked_program(fn: Any) -> Any:
    """The program object behind `fn`: `fn` itself, or the one a `jax.jit` (or other
    `functools.wraps` wrapper) wraps; None when there is none (a plain function)."""
    for _ in range(8):
        if hasattr(fn, "clients_per_step") and hasattr(fn, "chunk_size"):
            return fn
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            return None
    return None


def chunking_of(fn: Any, clients: int, args: Optional[tuple] = None) -> str:
    """How jit runs `fn`'s clients where it runs them in chunks (`fax_bridge.local.chunking`:
    a program, or a jit of one, with `clients_per_step` below its clients): "in chunks
    of 4 (of 64 clients)"; with `args`, "auto" resolved as jit resolves it for them: "in
    chunks of 8 (of 64 clients, clients_per_step='auto')"; "" otherwise."""
    program = chunked_program(fn)
    k = getattr(program, "clients_per_step", None)
    if k is None or (k != "auto" and k >= clients):
        return ""
    if k != "auto":
        return f"in chunks of {k} (of {clients} clients)"
    if args is None:
        return "in chunks (clients_per_step='auto')"
    k = program.chunk_size(*args)
    return "" if k is None else f"in chunks of {k} (of {clients} clients, clients_per_step='auto')"


def difference(want: np.ndarray, got: np.ndarray) -> tuple:
    """(|want - got| as float64, where the two are the same) elementwise. Integers of
    every width (int64 and uint64 among them) are subtracted exactly, so two that differ
    never show a difference of 0 (float64 holds no int64 above 2**53 exactly); floats
    are the same where equal or both NaN, and differ by inf where either is not finite
    and they are not the same (+inf against -inf, or against a number)."""
    if want.dtype.kind in "biu" and got.dtype.kind in "biu":
        if want.dtype.kind == got.dtype.kind == "u" or np.uint64 not in (want.dtype, got.dtype):
            wide = np.uint64 if want.dtype.kind == got.dtype.kind == "u" else np.int64
            a, b = want.astype(wide), got.astype(wide)
            # the larger minus the smaller, taken modulo 2**64: exact in uint64
            ua, ub = a.astype(np.uint64), b.astype(np.uint64)
            diff = np.where(a >= b, ua - ub, ub - ua).astype(np.float64)
        else:  # uint64 against a signed integer: python integers
            diff = np.abs(want.astype(object) - got.astype(object)).astype(np.float64)
        return diff, diff == 0
    w, g = want.astype(np.float64), got.astype(np.float64)
    same = (w == g) | (np.isnan(w) & np.isnan(g))
    with np.errstate(invalid="ignore"):
        diff = np.where(same, 0.0, np.abs(w - g))
    return np.where(same | (np.isfinite(w) & np.isfinite(g)), diff, np.inf), same


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
        diff, same = difference(w, g)
        max_abs = float(diff.max()) if diff.size else 0.0
        with np.errstate(over="ignore", invalid="ignore"):  # next to a zero: inf
            rel = diff / np.maximum(np.abs(wf), np.finfo(np.float64).tiny)
        max_rel = float(np.nan_to_num(rel, nan=np.inf).max()) if rel.size else 0.0
        with np.errstate(invalid="ignore"):
            close = diff <= atol + rtol * np.abs(wf)
        # a NaN or infinity only against the same (numpy.isclose's rule), whatever rtol
        ok = bool(np.all(same | (close & np.isfinite(wf) & np.isfinite(gf))))
        note = "" if w.dtype == g.dtype else f"fleet dtype {g.dtype}"
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(diff == 0, 0.0, diff / (atol + rtol * np.abs(wf)))
        share = np.where(same, 0.0, np.nan_to_num(share, nan=np.inf))
        out.append(LeafParity(path, tuple(w.shape), str(w.dtype), max_abs, max_rel,
                              ok and not note, note,
                              tolerance_used=float(share.max()) if share.size else 0.0))
    return out
