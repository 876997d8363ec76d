"""The large workload's part of ``bench.py``: its runners, report and tables.

The large workload (``peers/large_workload.py``) is a cohort of 1,000 clients per round
sampled from a population of 10,000, run side by side by two runners: the fax_bridge
fleet with the population on its devices (``fax_bridge_peer.py --mode fleet --workload
large``) and Flower's simulation (``flower_peer.py --workload large --supernodes S``).
``bench.py`` runs them (``--workload large`` or ``both``); this module turns their result
lines into the report's ``large`` object and its tables: setup, round time after the
warm-up round (median and each repeat), peak RSS of the process tree, bytes moved, and
agreement: each loss curve against the numpy reference (``large_workload.fedavg``), the
final models of the two runners and of the reference, and whether every fleet round
after the warm-up went as one request per device (a round plan).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from bench_summary import (COMPARISON_HEADER, comparison_row, count, fmt, max_abs_diff,
                           max_abs_diff_leaves, ratio_row, runner_rows, summarize_runs)

RUNNERS = ("fax_bridge_fleet", "flower")
# float32 agreement of the final server models. Flower adds the 1,000 scaled client
# models in float32 (its model drifts about 2e-6 per round from the exact mean here);
# the fleet's sums are exact.
PARAM_ATOL = 5e-5


def runner_args(runner: str, rounds: int, seed: int, devices: int, supernodes: int,
                population_dir: str) -> List[str]:
    """Script arguments of one large-workload run."""
    args = ["--workload", "large", "--rounds", str(rounds), "--seed", str(seed)]
    if runner == "fax_bridge_fleet":
        return args + ["--mode", "fleet", "--devices", str(devices),
                       "--population-dir", population_dir]
    return args + ["--supernodes", str(supernodes)]


def numpy_reference(rounds: int, seed: int) -> Optional[Dict[str, Any]]:
    """Loss per round and final model of the numpy reference (None without sklearn)."""
    try:
        import large_workload
    except ImportError:
        return None
    losses, history = large_workload.fedavg(rounds, seed)
    return {"loss_per_round": [float(x) for x in losses],
            "final_params": {k: v.tolist() for k, v in history[-1].items()}}


def agreement(runs: Dict[str, List[Dict[str, Any]]], reference: Optional[Dict[str, Any]],
              loss_atol: float) -> Dict[str, Any]:
    """Loss curves and final models of the last run of each runner against the numpy
    reference and each other, and the fleet's round path; ``ok`` when all agree."""
    last = {r: results[-1] for r, results in runs.items() if results}
    ref_curve = (reference or {}).get("loss_per_round")
    ref_params = (reference or {}).get("final_params")
    out: Dict[str, Any] = {"loss_vs_numpy": {}, "params_vs_numpy": {}}
    for runner, res in last.items():
        out["loss_vs_numpy"][runner] = max_abs_diff(res.get("loss_per_round"), ref_curve)
        out["params_vs_numpy"][runner] = max_abs_diff_leaves(res.get("final_params"), ref_params)
    fleet, flower = last.get("fax_bridge_fleet"), last.get("flower")
    out["loss_fleet_vs_flower"] = (max_abs_diff(fleet.get("loss_per_round"),
                                               flower.get("loss_per_round"))
                                   if fleet and flower else None)
    out["params_fleet_vs_flower"] = (max_abs_diff_leaves(fleet.get("final_params"),
                                                  flower.get("final_params"))
                                     if fleet and flower else None)
    fleet_runs = runs.get("fax_bridge_fleet") or []
    out["fleet_one_request_per_device"] = (
        all(r.get("one_request_per_device") and r.get("round_path") == "plan"
            for r in fleet_runs) if fleet_runs else None)
    losses = [v for v in (*out["loss_vs_numpy"].values(), out["loss_fleet_vs_flower"])
              if v is not None]
    params = [v for v in (*out["params_vs_numpy"].values(), out["params_fleet_vs_flower"])
              if v is not None]
    out["ok"] = (all(v <= loss_atol for v in losses) and all(v <= PARAM_ATOL for v in params)
                 and out["fleet_one_request_per_device"] is not False)
    return out


def make_report(runs: Dict[str, List[Dict[str, Any]]], config: Dict[str, Any],
                skipped: Dict[str, str], failed: Dict[str, str],
                reference: Optional[Dict[str, Any]], loss_atol: float) -> Dict[str, Any]:
    """The report's ``large`` object: the runners' summaries and ratios as the shared
    workload's (``bench_summary``), and their agreement."""
    summary = summarize_runs(runs)
    for runner, results in runs.items():
        if results and runner in summary:
            summary[runner]["supernodes"] = results[-1].get("supernodes")
            summary[runner]["round_s_all_each"] = [r.get("round_s_all") for r in results]
    ours, theirs = summary.get("fax_bridge_fleet", {}), summary.get("flower", {})
    return {"config": config, "skipped": skipped, "failed": failed, "summary": summary,
            "ratios": ratio_row(ours, theirs), "numpy_reference": reference,
            "agreement": agreement(runs, reference, loss_atol), "runs": runs}


def format_tables(large: Dict[str, Any]) -> str:
    """Markdown tables of the report's ``large`` object."""
    cfg = large["config"]
    lines = [
        f"Large workload: a cohort of {cfg['cohort']:,} of {cfg['population']:,} clients per "
        f"round, {cfg['rounds']} rounds (the first a warm-up, left out of the round median), "
        f"seed {cfg['seed']}, medians over {cfg['repeats']} alternating repeats; fleet of "
        f"{cfg['devices']} devices hosting the population, Flower on {cfg['supernodes']:,} "
        "SuperNodes.",
        "",
        "| runner | setup s | round s (median) | round s, repeat by repeat | warm-up round s "
        "| peak RSS MiB | bytes moved | final test acc |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += runner_rows(large, RUNNERS, 8, lambda s: [
        fmt(s["setup_s"], ".2f"), fmt(s["round_s_median"], ".3f"),
        ", ".join(fmt(x, ".3f") for x in s.get("round_s_median_each") or []) or "-",
        fmt(s["first_round_s"], ".3f"), fmt(s["peak_rss_mb"], ".0f"), count(s["bytes_moved"]),
        fmt(s["final_test_accuracy"], ".4f")])
    lines += ["", *COMPARISON_HEADER,
              comparison_row("fax_bridge fleet vs Flower, large", large["ratios"])]
    a = large["agreement"]
    lines += ["", "| large workload | loss curve, max abs diff | final model, max abs diff |",
              "|---|---|---|"]
    for runner in RUNNERS:
        if runner in a["loss_vs_numpy"]:
            lines.append(f"| {runner} vs numpy reference | "
                         f"{fmt(a['loss_vs_numpy'][runner], '.1e')} | "
                         f"{fmt(a['params_vs_numpy'].get(runner), '.1e')} |")
    lines.append(f"| fax_bridge fleet vs Flower | {fmt(a['loss_fleet_vs_flower'], '.1e')} | "
                 f"{fmt(a['params_fleet_vs_flower'], '.1e')} |")
    plan = a["fleet_one_request_per_device"]
    lines += ["", "Fleet rounds after the warm-up as one request per device (round plan): "
                  f"{'not measured' if plan is None else ('yes' if plan else 'NO')}. "
                  f"Agreement {'within' if a['ok'] else 'OUTSIDE'} float32 tolerance."]
    return "\n".join(lines)
