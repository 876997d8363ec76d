"""Summary figures and Markdown table pieces of ``bench.py``'s report, for both workloads.

``bench.py`` (the shared workload) and ``bench_large.py`` (the large one) summarize
their runners' result lines, compare them and print them with the helpers here: the
medians over repeats, the ours-over-theirs ratios, the comparison table and its cells.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Callable, Dict, List, Optional, Sequence

# The comparison table both workloads print, one row per pair of runners.
COMPARISON_HEADER = [
    "| comparison | round time (ours / theirs) | speed-up per round | same, repeat by repeat "
    "| setup (ours / theirs) | peak RSS (ours / theirs) | bytes (ours / theirs) |",
    "|---|---|---|---|---|---|---|",
]


def median(xs: Sequence[Optional[float]]) -> Optional[float]:
    """Median of the figures that are there (None when none is)."""
    xs = [x for x in xs if x is not None]
    return float(statistics.median(xs)) if xs else None


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """``a / b``, None when either is missing or ``b`` is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def max_abs_diff(a: Optional[Sequence[float]], b: Optional[Sequence[float]]) -> Optional[float]:
    """Largest absolute difference of two curves: None when either is missing (nothing
    to compare), inf when they cannot agree (different lengths, a NaN on either side)."""
    if not a or not b:
        return None
    if len(a) != len(b):
        return math.inf
    diffs = [abs(float(x) - float(y)) for x, y in zip(a, b)]
    return math.inf if any(math.isnan(d) for d in diffs) else float(max(diffs))


def max_abs_diff_leaves(a: Optional[Dict[str, Any]],
                        b: Optional[Dict[str, Any]]) -> Optional[float]:
    """Largest absolute difference over named arrays (a model's parameters, gradients):
    None when either is missing, inf when their names or shapes differ or a NaN is on
    either side (never broadcast one onto the other)."""
    import numpy as np

    if not a or not b:
        return None
    if sorted(a) != sorted(b):
        return math.inf
    worst = 0.0
    for k in a:
        x, y = np.asarray(a[k], np.float64), np.asarray(b[k], np.float64)
        if x.shape != y.shape:
            return math.inf
        if x.size:
            d = float(np.max(np.abs(x - y)))
            if math.isnan(d):
                return math.inf
            worst = max(worst, d)
    return worst


def summarize_runs(runs: Dict[str, List[Dict[str, Any]]]) -> Dict[str, Dict[str, Any]]:
    """Medians over the repeats of each runner's figures."""
    out: Dict[str, Dict[str, Any]] = {}
    for runner, results in runs.items():
        if not results:
            continue
        out[runner] = {
            "repeats": len(results),
            "setup_s": median([r.get("setup_s") for r in results]),
            "round_s_median": median([r.get("round_s_median") for r in results]),
            "first_round_s": median([(r.get("round_s_all") or [None])[0] for r in results]),
            "peak_rss_mb": median([r.get("peak_rss_mb") for r in results]),
            "bytes_moved": median([r.get("bytes_moved") for r in results]),
            "payload_moved": median([r.get("payload_moved") for r in results]),
            "final_test_accuracy": results[-1].get("final_test_accuracy"),
            "round_s_median_each": [r.get("round_s_median") for r in results],
            "setup_s_each": [r.get("setup_s") for r in results],
            "loss_per_round": results[-1].get("loss_per_round"),
        }
    return out


def ratio_row(ours: Dict[str, Any], theirs: Dict[str, Any]) -> Dict[str, Any]:
    """Two runners' summaries compared: ``<figure>_ours_over_theirs`` for round time,
    setup, peak RSS and bytes moved, and the round speed-up (theirs over ours), overall
    and repeat by repeat."""
    row: Dict[str, Any] = {f"{key}_ours_over_theirs": ratio(ours.get(key), theirs.get(key))
                           for key in ("round_s_median", "setup_s", "peak_rss_mb",
                                       "bytes_moved")}
    row["round_speedup"] = ratio(theirs.get("round_s_median"), ours.get("round_s_median"))
    row["round_speedup_each"] = [
        ratio(b, a) for a, b in zip(ours.get("round_s_median_each") or [],
                                    theirs.get("round_s_median_each") or [])]
    return row


def fmt(x: Optional[float], spec: str) -> str:
    """``x`` formatted by ``spec``, or "-" when it is missing."""
    return "-" if x is None else format(x, spec)


def times(x: Optional[float]) -> str:
    """A factor such as "8.00x", or "-"."""
    return "-" if x is None else f"{x:.2f}x"


def count(x: Optional[float]) -> str:
    """A whole number with thousands separators, or "-"."""
    return "-" if x is None else f"{int(x):,}"


def comparison_row(label: str, r: Dict[str, Any]) -> str:
    """One row of the comparison table from a ``ratio_row``."""
    return (f"| {label} | {fmt(r['round_s_median_ours_over_theirs'], '.3f')} | "
            f"{times(r['round_speedup'])} | "
            f"{', '.join(times(x) for x in r.get('round_speedup_each') or []) or '-'} | "
            f"{fmt(r['setup_s_ours_over_theirs'], '.2f')} | "
            f"{fmt(r['peak_rss_mb_ours_over_theirs'], '.2f')} | "
            f"{fmt(r['bytes_moved_ours_over_theirs'], '.2f')} |")


def runner_rows(report: Dict[str, Any], runners: Sequence[str], columns: int,
                cells: Callable[[Dict[str, Any]], Sequence[str]]) -> List[str]:
    """The runner table's rows: each runner's name and ``cells`` of its entry in
    ``report["summary"]``, or, for a runner without one, why (skipped or failed, from
    ``report``) and empty cells up to ``columns``."""
    rows = []
    for runner in runners:
        s = report["summary"].get(runner)
        if s is not None:
            rows.append("| " + " | ".join([runner, *cells(s)]) + " |")
            continue
        why = report.get("skipped", {}).get(runner) or report.get("failed", {}).get(runner)
        rows.append(f"| {runner} | {why or 'not run'} |" + " |" * (columns - 2))
    return rows
