"""Parity between the two paths: jit on this machine vs the exported proto on a fleet.

`check_parity(fn, *args, placements=...)` runs the program locally (jit), exports it to
a TFF proto, runs the proto on a `LocalFleet` of device processes (or a fleet you pass),
and compares the two results leaf by leaf. A mismatched float output that an
aggregation's float rounding may explain says so, with the rounding bound and the
tolerance that covers it (`parity_rounding`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional

import federated_language
import jax
import numpy as np

from fax_bridge import parity_rounding, tracing
from fax_bridge.fleet.launcher import LocalFleet
from fax_bridge.runtime import interpreter
from fax_bridge.tff import export as tff_export
from fax_bridge.tff import types as tff_types


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


@dataclasses.dataclass
class ParityReport:
    """Result of `check_parity`: `.ok` and one `LeafParity` per output leaf."""

    leaves: list[LeafParity]
    rtol: float
    atol: float
    devices: int
    local_s: float
    fleet_s: float
    signature: str

    @property
    def ok(self) -> bool:
        return all(leaf.ok for leaf in self.leaves)

    def table(self) -> str:
        """A plain-text table, one row per output leaf."""
        rows = [("output", "shape", "dtype", "max abs err", "max rel err", "status")]
        for leaf in self.leaves:
            rows.append((leaf.path, str(leaf.shape), leaf.dtype, f"{leaf.max_abs:.3e}",
                         f"{leaf.max_rel:.3e}",
                         ("ok" if leaf.ok else "MISMATCH") + (f" ({leaf.note})" if leaf.note
                                                              else "")))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [f"parity: {self.signature}",
                 f"local jit {self.local_s * 1e3:.2f} ms, fleet of {self.devices} device(s) "
                 f"{self.fleet_s * 1e3:.1f} ms, rtol={self.rtol:g} atol={self.atol:g}"]
        for i, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines.extend(f"{leaf.path}: {leaf.explanation}" for leaf in self.leaves
                     if leaf.explanation and not leaf.ok)
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


def explain_mismatches(leaves: list[LeafParity], comp: Any, args: tuple) -> None:
    """Sets the `explanation` of each mismatched float leaf that float rounding in an
    aggregation over clients may explain (`parity_rounding`)."""
    wrong = [i for i, leaf in enumerate(leaves) if not leaf.ok and not leaf.note
             and parity_rounding.is_float(leaf.dtype)]
    if not wrong or len(leaves) != len(comp.out_avals):
        return
    try:
        roundings, depends, direct = parity_rounding.aggregation_roundings(comp, args)
    except Exception as e:  # noqa: BLE001 - the comparison stands without the analysis
        for i in wrong:
            leaves[i].explanation = f"(no rounding analysis: {type(e).__name__}: {e})"
        return
    for i in wrong:
        leaves[i].explanation = parity_rounding.explain(
            leaves[i].max_abs, roundings, depends[i], direct[i])


def leaves_in_type_order(tree: Any, type_: federated_language.Type) -> list:
    """Leaves of a runtime result in the depth-first order of its TFF type.

    The runtime returns named structs as dicts, which jax would flatten in sorted-key
    order; the exported type keeps the program's own order (e.g. NamedTuple fields),
    which is the order of the program's flattened outputs.
    """
    if isinstance(type_, federated_language.FederatedType):
        return leaves_in_type_order(tree, type_.member)
    if isinstance(type_, federated_language.StructType):
        out = []
        for i, (name, element) in enumerate(type_.items()):
            child = tree[name] if isinstance(tree, dict) and name else tree[i]
            out.extend(leaves_in_type_order(child, element))
        return out
    return [tree]


def fleet_arguments(args: tuple, parameter: Optional[federated_language.Type]) -> tuple:
    """The program's positional arguments as the runtime's per-element arguments.

    The exporter makes the elements of a program's only argument the parameter's
    elements; NamedTuple fields are matched by name (`values.bind_arguments`).
    """
    if parameter is None:
        return ()
    if len(args) == 1 and isinstance(parameter, federated_language.StructType):
        args = tuple(child for _, child in tff_types.named_children(args[0]))
    return tuple(args)


def check_parity(fn: Callable, *args, placements: Any = None, fleet: Any = None,
                 devices: int = 2, rtol: float = 1e-5, atol: float = 1e-6,
                 clients: Optional[int] = None) -> ParityReport:
    """Runs `fn(*args)` with jit and as an exported TFF proto on a fleet; compares them.

    `fleet` is a running `fax_bridge.LocalFleet` (or any object with the same `run`);
    without one, a `LocalFleet(devices=devices)` is started and stopped here.
    """
    comp = tracing.trace(fn, *args, placements=placements, clients=clients)
    jitted = jax.jit(fn)
    jax.block_until_ready(jitted(*args))  # compile
    start = time.perf_counter()
    local = jax.block_until_ready(jitted(*args))
    local_s = time.perf_counter() - start
    proto = tff_export.export_computation(comp, tff_export.argument_names(fn, len(args)))
    fn_type = interpreter.computation_type(proto)
    param = fn_type.parameter if isinstance(fn_type, federated_language.FunctionType) else None
    run_args = fleet_arguments(args, param)

    def run_on(f):
        t0 = time.perf_counter()
        result = f.run(proto, *run_args, num_clients=comp.clients)
        return result, time.perf_counter() - t0

    if fleet is None:
        with LocalFleet(devices=devices) as own:
            remote, fleet_s = run_on(own)
        used = devices
    else:
        remote, fleet_s = run_on(fleet)
        used = getattr(fleet, "num_devices", devices)
    result_type = fn_type.result if isinstance(fn_type, federated_language.FunctionType) \
        else fn_type
    if jax.tree_util.tree_structure(remote) != jax.tree_util.tree_structure(local):
        remote = leaves_in_type_order(remote, result_type)  # the generic structure
    leaves = compare_leaves(local, remote, rtol, atol,
                            paths=[p.replace("out", "result", 1) for p in comp.out_paths])
    explain_mismatches(leaves, comp, args)
    return ParityReport(leaves=leaves, rtol=rtol, atol=atol, devices=used,
                        local_s=local_s, fleet_s=fleet_s, signature=str(
                            federated_language.framework.ComputationBuildingBlock.from_proto(
                                proto).type_signature)
                        if hasattr(federated_language, "framework") else comp.signature())
