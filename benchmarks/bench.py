"""fax_bridge side by side with google-fax, TFF and Flower on the shared FedAvg workload,
and side by side with Flower on the large one (a cohort of 1,000 from 10,000 clients).

Five runners, each a subprocess in its own process group under a timeout, run
alternately (round-robin, the starting runner rotating each repeat) ``--repeats``
times so that they share the machine's load:

=================  ===========  =================================================
runner             venv         script
=================  ===========  =================================================
fax_bridge_local   ``.venv``    ``peers/fax_bridge_peer.py --mode local``
fax_bridge_fleet   ``.venv``    ``peers/fax_bridge_peer.py --mode fleet --devices K``
fax                ``.venv-fax``     ``peers/fax_peer.py`` (google-fax 0.0.2)
tff                ``.venv-tff``     ``peers/tff_peer.py`` (TFF 0.87 C++ runtime)
flower             ``.venv-flower``  ``peers/flower_peer.py`` (Ray simulation)
=================  ===========  =================================================

Then once each: ``--grad-check`` of fax_bridge and of google-fax. It prints the medians
over repeats (setup, median round, first round, peak RSS of the process tree, bytes
moved), the ratios the goals are stated in (fax_bridge local against google-fax and
TFF, fax_bridge fleet against Flower's simulation), and the numerical agreement: loss
and gradient of fax_bridge against google-fax, and every runner's loss curve against
the numpy reference (``peers/numpy_mlp.fedavg``). A peer whose venv is missing is
reported as skipped with the command that builds it.

``--workload large`` (or ``both``, the default) then runs the large workload
(``peers/large_workload.py``, report in ``bench_large.py``) with the fleet and Flower
only, alternating, ``--large-repeats`` times: ``fax_bridge_peer.py --mode fleet
--workload large`` on a fleet whose devices host the population (written once to
``--population-dir``) and ``flower_peer.py --workload large --supernodes S``; each run
is ``--large-rounds`` rounds, the first a warm-up left out of the round median.

    .venv/bin/python benchmarks/bench.py [--repeats 3] [--rounds 20] [--devices 2]
        [--only fax_bridge_local,fax] [--json OUT] [--log-dir DIR]
        [--workload shared|large|both] [--large-rounds 3] [--large-repeats 1]
        [--supernodes S] [--population-dir DIR]
    .venv/bin/python benchmarks/bench.py --from-json OUT     # the tables of a saved run

Exit status 0 when every runner that ran succeeded (goals missed are reported, not
failures), 1 when a runner failed or numbers disagree beyond float32 tolerance.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PEERS_DIR = os.path.join(HERE, "peers")
sys.path.insert(0, PEERS_DIR)
sys.path.insert(0, HERE)

import bench_large  # noqa: E402  (benchmarks/)
from bench_summary import (COMPARISON_HEADER, comparison_row, count, fmt,  # noqa: E402
                           max_abs_diff, max_abs_diff_leaves, ratio, ratio_row, runner_rows,
                           summarize_runs)
from run_peer import PeerFailed, kill_group, run_script  # noqa: E402  (benchmarks/peers)

RUNNERS = ("fax_bridge_local", "fax_bridge_fleet", "fax", "tff", "flower")
VENVS = {"fax_bridge_local": ".venv", "fax_bridge_fleet": ".venv", "fax": ".venv-fax",
         "tff": ".venv-tff", "flower": ".venv-flower"}
SCRIPTS = {"fax_bridge_local": "fax_bridge_peer.py", "fax_bridge_fleet": "fax_bridge_peer.py",
           "fax": "fax_peer.py", "tff": "tff_peer.py", "flower": "flower_peer.py"}
TIMEOUT_S = {"fax_bridge_local": 300.0, "fax_bridge_fleet": 600.0, "fax": 300.0,
             "tff": 600.0, "flower": 900.0}
WORKLOADS = ("shared", "large")
LARGE_TIMEOUT_S = {"fax_bridge_fleet": 600.0, "flower": 2700.0}
# Exit status of a peer whose runtime never started (TFF's worker): retried once.
STARTUP_EXIT = 3
# float32 agreement: losses are printed to 6 decimals and drift over 20 rounds.
LOSS_ATOL = 1e-5
GRAD_ATOL = 1e-6
GOALS = (
    ("local_vs_fax_round", "fax_bridge local round time / google-fax <= 1.0"),
    ("local_vs_tff_round", "TFF round time / fax_bridge local >= 10"),
    ("fleet_vs_flower_round", "Flower round time / fax_bridge fleet >= 20, in every repeat"),
    ("fleet_vs_local_round", "fax_bridge fleet round time / fax_bridge local <= 5"),
    ("fleet_wire_bytes", "fax_bridge fleet wire bytes / payload bytes <= 1.1"),
    ("fleet_vs_flower_memory", "fax_bridge fleet peak RSS < Flower's"),
)

# The child running now, so a signal to this process can take its group down too.
_CURRENT: Dict[str, Any] = {}


def venv_python(runner: str, repo: str = REPO) -> str:
    """The interpreter that runs ``runner``."""
    return os.path.join(repo, VENVS[runner], "bin", "python")


def available(runner: str, repo: str = REPO) -> bool:
    """Whether the venv of ``runner`` exists."""
    return os.access(venv_python(runner, repo), os.X_OK)


def setup_command(runner: str) -> str:
    """The command that builds the venv ``runner`` needs."""
    if VENVS[runner] == ".venv":
        return "make venv"
    return f"benchmarks/peers/setup_venvs.sh {runner}"


def runner_args(runner: str, rounds: int, seed: int, devices: int) -> List[str]:
    """Script arguments of one benchmark run."""
    args = ["--rounds", str(rounds), "--seed", str(seed)]
    if runner == "fax_bridge_local":
        args += ["--mode", "local"]
    elif runner == "fax_bridge_fleet":
        args += ["--mode", "fleet", "--devices", str(devices)]
    return args


def _track_group(pgid: Optional[int]) -> None:
    """Remembers the running child's process group so a signal can end it."""
    if pgid is None:
        _CURRENT.pop("pgid", None)
    else:
        _CURRENT["pgid"] = pgid


def run_runner(runner: str, args: Sequence[str], timeout_s: float,
               log_path: Optional[str] = None) -> Dict[str, Any]:
    """One run of ``runner``; a run whose runtime did not start is retried once."""
    script = os.path.join(PEERS_DIR, SCRIPTS[runner])
    for attempt in range(2):
        try:
            return run_script(venv_python(runner), script, args, timeout_s,
                              log_path=log_path, on_start=_track_group)
        except PeerFailed as e:
            if e.returncode != STARTUP_EXIT or attempt == 1:
                raise
            print(f"bench: {runner} did not start, retrying", file=sys.stderr)
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------------
# Summary


def compare(summary: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """The ratios of the goals (``bench_summary.ratio_row`` of each pair of runners).
    ``x_over_y`` is x's figure divided by y's."""
    pairs = {"local_vs_fax": ("fax_bridge_local", "fax"),
             "local_vs_tff": ("fax_bridge_local", "tff"),
             "fleet_vs_flower": ("fax_bridge_fleet", "flower"),
             "fleet_vs_local": ("fax_bridge_fleet", "fax_bridge_local")}
    out = {name: ratio_row(summary.get(ours, {}), summary.get(theirs, {}))
           for name, (ours, theirs) in pairs.items()}
    fleet = summary.get("fax_bridge_fleet", {})
    out["fleet_wire"] = {"wire_over_payload": ratio(fleet.get("bytes_moved"),
                                                    fleet.get("payload_moved"))}
    return out


def verdicts(ratios: Dict[str, Dict[str, Optional[float]]]) -> Dict[str, Optional[bool]]:
    """Each goal: True met, False missed, None not measured (a peer was skipped)."""
    def check(value: Optional[float], ok: Any) -> Optional[bool]:
        return None if value is None else bool(ok(value))

    return {
        "local_vs_fax_round": check(ratios["local_vs_fax"]["round_s_median_ours_over_theirs"],
                                    lambda r: r <= 1.0),
        "local_vs_tff_round": check(ratios["local_vs_tff"]["round_speedup"],
                                    lambda r: r >= 10.0),
        "fleet_vs_flower_round": check(
            _slowest(ratios["fleet_vs_flower"]), lambda r: r >= 20.0),
        "fleet_vs_local_round": check(
            ratios["fleet_vs_local"]["round_s_median_ours_over_theirs"], lambda r: r <= 5.0),
        "fleet_wire_bytes": check(ratios["fleet_wire"]["wire_over_payload"],
                                  lambda r: r <= 1.1),
        "fleet_vs_flower_memory": check(ratios["fleet_vs_flower"]["peak_rss_mb_ours_over_theirs"],
                                        lambda r: r < 1.0),
    }


def _slowest(row: Dict[str, Any]) -> Optional[float]:
    """The smallest speed-up of the repeats (the median's when there are none)."""
    each = [r for r in row.get("round_speedup_each") or [] if r is not None]
    return min(each) if each else row.get("round_speedup")


def loss_agreement(summary: Dict[str, Dict[str, Any]],
                   reference: Optional[Sequence[float]]) -> Dict[str, Dict[str, Optional[float]]]:
    """Max abs difference of each loss curve from the numpy reference and from google-fax."""
    fax_curve = summary.get("fax", {}).get("loss_per_round")
    out = {}
    for runner, s in summary.items():
        curve = s.get("loss_per_round")
        out[runner] = {
            "vs_numpy": max_abs_diff(curve, reference) if reference else None,
            "vs_fax": max_abs_diff(curve, fax_curve) if fax_curve and runner != "fax" else None,
        }
    return out


def grad_agreement(ours: Optional[Dict[str, Any]],
                   theirs: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """Max abs differences of the check program's loss and gradient leaves."""
    if not ours or not theirs:
        return None
    theirs_grad = theirs.get("grad") or {}
    names = sorted(set(ours["grad"]) | set(theirs_grad))
    # A leaf one side lacks, of another shape or holding a NaN differs by inf.
    grads = {k: max_abs_diff_leaves({k: ours["grad"].get(k, [])}, {k: theirs_grad[k]})
             if k in theirs_grad and k in ours["grad"] else math.inf for k in names}
    loss_diff = abs(float(ours["loss"]) - float(theirs["loss"]))
    loss_diff = math.inf if math.isnan(loss_diff) else loss_diff
    return {"loss": float(ours["loss"]), "loss_abs_diff": loss_diff, "grad_max_abs_diff": grads,
            "ok": bool(grads) and loss_diff <= LOSS_ATOL and max(grads.values()) <= GRAD_ATOL}


# ---------------------------------------------------------------------------------------
# Table


def _verdict(v: Optional[bool]) -> str:
    return "not measured" if v is None else ("met" if v else "MISSED")


def format_table(report: Dict[str, Any]) -> str:
    """Markdown tables of a bench report (the object written by ``--json``): the shared
    workload's, then the large workload's when it ran."""
    parts = []
    if "summary" in report:
        parts.append(format_shared_table(report))
    if report.get("large"):
        parts.append(bench_large.format_tables(report["large"]))
    return "\n\n".join(parts)


def format_shared_table(report: Dict[str, Any]) -> str:
    """Markdown tables of the shared workload's part of a bench report."""
    ratios = report["ratios"]
    lines = [
        f"Medians over {report['config']['repeats']} alternating repeats, "
        f"{report['config']['rounds']} rounds each, seed {report['config']['seed']}, "
        f"fleet of {report['config']['devices']} devices.",
        "",
        "| runner | setup s | round s (median) | first round s | peak RSS MiB | bytes moved "
        "| final test acc |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += runner_rows(report, RUNNERS, 7, lambda s: [
        fmt(s["setup_s"], ".2f"), fmt(s["round_s_median"], ".5f"), fmt(s["first_round_s"], ".3f"),
        fmt(s["peak_rss_mb"], ".0f"), count(s["bytes_moved"]),
        fmt(s["final_test_accuracy"], ".4f")])
    lines += ["", *COMPARISON_HEADER]
    names = {"local_vs_fax": "fax_bridge local vs google-fax",
             "local_vs_tff": "fax_bridge local vs TFF",
             "fleet_vs_flower": "fax_bridge fleet vs Flower",
             "fleet_vs_local": "fax_bridge fleet vs local"}
    for key, label in names.items():
        lines.append(comparison_row(label, ratios[key]))
    lines += ["", "| goal | verdict |", "|---|---|"]
    for key, text in GOALS:
        lines.append(f"| {text} | {_verdict(report['verdicts'].get(key))} |")
    lines += ["", "| loss curve | max abs diff vs numpy reference | vs google-fax |",
              "|---|---|---|"]
    for runner in RUNNERS:
        a = report["loss_agreement"].get(runner)
        if a is not None:
            lines.append(f"| {runner} | {fmt(a['vs_numpy'], '.1e')} | {fmt(a['vs_fax'], '.1e')} |")
    g = report.get("grad_agreement")
    if g:
        grads = ", ".join(f"{k} {v:.1e}" for k, v in g["grad_max_abs_diff"].items())
        lines += ["", f"Gradient check (fax_bridge vs google-fax, loss {g['loss']:.6f}): loss abs "
                      f"diff {g['loss_abs_diff']:.1e}; gradient max abs diff {grads}; "
                      f"{'within' if g['ok'] else 'OUTSIDE'} float32 tolerance "
                      f"(loss {LOSS_ATOL:g}, gradient {GRAD_ATOL:g})."]
    else:
        lines += ["", "Gradient check: not run (google-fax's venv is missing)."]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# Main


def _machine() -> Dict[str, Any]:
    info: Dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform(),
                            "python": platform.python_version()}
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
        info["mem_gib"] = round(kb / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    try:
        info["loadavg_start"] = os.getloadavg()
    except OSError:
        pass
    return info


def _numpy_reference(rounds: int, seed: int) -> Optional[List[float]]:
    try:
        import numpy_mlp
    except ImportError:
        return None
    losses, _ = numpy_mlp.fedavg(rounds, seed)
    return [float(x) for x in losses]


def _on_signal(signum: int, _frame: Any) -> None:
    pgid = _CURRENT.get("pgid")
    if pgid is not None:
        kill_group(pgid, grace_s=1.0)
    raise SystemExit(128 + signum)


def _round_robin(todo: Sequence[str], repeats: int, args_of: Any, timeout_of: Any,
                 log_dir: Optional[str], tag: str = ""
                 ) -> Tuple[Dict[str, List[Dict[str, Any]]], Dict[str, str]]:
    """Runs each runner of ``todo`` ``repeats`` times, alternating, the first runner
    rotating each repeat; returns (result lines per runner, failures)."""
    runs: Dict[str, List[Dict[str, Any]]] = {r: [] for r in todo}
    failed: Dict[str, str] = {}
    for rep in range(repeats):
        order = list(todo[rep % len(todo):]) + list(todo[:rep % len(todo)]) if todo else []
        for runner in order:
            if runner in failed:
                continue
            log = os.path.join(log_dir, f"{runner}{tag}-{rep}.log") if log_dir else None
            t0 = time.perf_counter()
            try:
                result = run_runner(runner, args_of(runner), timeout_of(runner), log)
            except PeerFailed as e:
                failed[runner] = f"failed: {str(e).splitlines()[0]}"
                print(f"bench: {runner}{tag} repeat {rep}: {e}", file=sys.stderr)
                continue
            runs[runner].append(result)
            print(f"bench: repeat {rep} {runner}{tag}: setup {result.get('setup_s')} s, round "
                  f"{result.get('round_s_median')} s, peak {result.get('peak_rss_mb')} MiB "
                  f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return runs, failed


def _skipped(runners: Sequence[str]) -> Dict[str, str]:
    return {r: f"skipped: no {VENVS[r]} (build it with `{setup_command(r)}`)"
            for r in runners if not available(r)}


def run_large(runners: Sequence[str], repeats: int, rounds: int, seed: int, devices: int,
              supernodes: int, population_dir: str, log_dir: Optional[str] = None,
              timeout_scale: float = 1.0) -> Dict[str, Any]:
    """The large workload's runners (those of ``runners`` it has), round-robin; returns
    the report's ``large`` object."""
    import large_workload

    mine = [r for r in bench_large.RUNNERS if r in runners]
    skipped = _skipped(mine)
    todo = [r for r in mine if r not in skipped]
    runs, failed = _round_robin(
        todo, repeats,
        lambda r: bench_large.runner_args(r, rounds, seed, devices, supernodes,
                                          population_dir),
        lambda r: LARGE_TIMEOUT_S[r] * timeout_scale, log_dir, tag="-large")
    config = {"repeats": repeats, "rounds": rounds, "seed": seed, "devices": devices,
              "supernodes": supernodes, "population": large_workload.POPULATION,
              "cohort": large_workload.COHORT, "population_dir": population_dir,
              "runners": mine}
    return bench_large.make_report(runs, config, skipped, failed,
                                   bench_large.numpy_reference(rounds, seed), LOSS_ATOL)


def run_bench(runners: Sequence[str], repeats: int, rounds: int, seed: int, devices: int,
              log_dir: Optional[str] = None, grad_check: bool = True,
              timeout_scale: float = 1.0) -> Dict[str, Any]:
    """Runs the runners round-robin and returns the report object."""
    machine = _machine()
    skipped = _skipped(runners)
    todo = [r for r in runners if r not in skipped]
    runs, failed = _round_robin(
        todo, repeats, lambda r: runner_args(r, rounds, seed, devices),
        lambda r: TIMEOUT_S[r] * timeout_scale, log_dir)
    grads: Dict[str, Dict[str, Any]] = {}
    if grad_check:
        for runner, name in (("fax_bridge_local", "fax_bridge"), ("fax", "fax")):
            if runner not in runners or runner in skipped:
                continue
            log = os.path.join(log_dir, f"{name}-grad-check.log") if log_dir else None
            try:
                grads[name] = run_runner(runner, ["--grad-check"], TIMEOUT_S[runner], log)
            except PeerFailed as e:
                failed[f"{name}_grad_check"] = f"failed: {str(e).splitlines()[0]}"
    summary = summarize_runs(runs)
    ratios = compare(summary)
    reference = _numpy_reference(rounds, seed)
    losses = loss_agreement(summary, reference)
    grad = grad_agreement(grads.get("fax_bridge"), grads.get("fax"))
    agree = all(v is None or v <= LOSS_ATOL for a in losses.values() for v in a.values())
    return {
        "config": {"repeats": repeats, "rounds": rounds, "seed": seed, "devices": devices,
                   "runners": list(runners)},
        "machine": machine,
        "skipped": skipped,
        "failed": failed,
        "summary": summary,
        "ratios": ratios,
        "verdicts": verdicts(ratios),
        "numpy_reference_loss": reference,
        "loss_agreement": losses,
        "losses_agree": agree,
        "grad_agreement": grad,
        "grad_checks": grads,
        "runs": runs,
    }


def rerender(report: Dict[str, Any]) -> Dict[str, Any]:
    """Recomputes the summary, ratios and agreement of a saved report from its runs."""
    large = report.get("large")
    if large:
        large = bench_large.make_report(
            large["runs"], large["config"], large.get("skipped", {}), large.get("failed", {}),
            large.get("numpy_reference"), LOSS_ATOL)
        report = dict(report, large=large)
    if "runs" not in report:
        return report
    cfg = report["config"]
    summary = summarize_runs(report["runs"])
    ratios = compare(summary)
    reference = report.get("numpy_reference_loss") or _numpy_reference(cfg["rounds"], cfg["seed"])
    grads = report.get("grad_checks") or {}
    grad = (grad_agreement(grads.get("fax_bridge"), grads.get("fax")) if grads
            else report.get("grad_agreement"))
    losses = loss_agreement(summary, reference)
    return dict(report, summary=summary, ratios=ratios, verdicts=verdicts(ratios),
                loss_agreement=losses, grad_agreement=grad,
                losses_agree=all(v is None or v <= LOSS_ATOL
                                 for a in losses.values() for v in a.values()))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--devices", type=int, default=2, help="fleet devices (default 2)")
    parser.add_argument("--only", default=None,
                        help=f"comma-separated subset of {','.join(RUNNERS)}")
    parser.add_argument("--no-grad-check", action="store_true")
    parser.add_argument("--timeout-scale", type=float, default=1.0,
                        help="multiplies every runner's timeout")
    parser.add_argument("--json", metavar="OUT", default=None, help="write the report to OUT")
    parser.add_argument("--log-dir", default=None, help="keep each run's stdout/stderr here")
    parser.add_argument("--from-json", metavar="IN", default=None,
                        help="print the tables of a saved report instead of running")
    parser.add_argument("--workload", choices=("shared", "large", "both"), default="both",
                        help="shared: the five runners on 100 clients; large: the fleet and "
                             "Flower on a cohort of 1,000 from 10,000 clients; both (default)")
    parser.add_argument("--large-rounds", type=int, default=3,
                        help="large: rounds per run, the first a warm-up (default 3)")
    parser.add_argument("--large-repeats", type=int, default=1,
                        help="large: repeats (default 1: a Flower round of 1,000 clients "
                             "takes minutes)")
    parser.add_argument("--supernodes", type=int, default=10_000,
                        help="large: Flower SuperNodes (default 10000, one per client)")
    parser.add_argument("--population-dir", default=os.path.join(REPO, "out", "bench",
                                                                 "population-large"),
                        help="large: where the fleet's population is written once and kept")
    args = parser.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            print(format_table(rerender(json.load(f))))
        return 0
    runners = list(RUNNERS) if not args.only else [r.strip() for r in args.only.split(",")]
    unknown = [r for r in runners if r not in RUNNERS]
    if unknown:
        parser.error(f"unknown runners {unknown}; choose from {', '.join(RUNNERS)}")
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    if args.workload in ("shared", "both"):
        report = run_bench(runners, args.repeats, args.rounds, args.seed, args.devices,
                           args.log_dir, grad_check=not args.no_grad_check,
                           timeout_scale=args.timeout_scale)
    else:
        report = {"config": {}, "machine": _machine(), "skipped": {}, "failed": {}}
    report["config"]["workload"] = args.workload
    if args.workload in ("large", "both"):
        report["large"] = run_large(
            runners, args.large_repeats, args.large_rounds, args.seed,
            args.devices, args.supernodes, args.population_dir, args.log_dir,
            timeout_scale=args.timeout_scale)
    try:
        report["machine"]["loadavg_end"] = os.getloadavg()
    except OSError:
        pass
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(format_table(report))
    for runner, why in report["skipped"].items():
        print(f"{runner}: {why}")
    return 0 if succeeded(report) else 1


def succeeded(report: Dict[str, Any]) -> bool:
    """Every runner that ran succeeded and every number agrees within tolerance."""
    ok = not report.get("failed")
    if "summary" in report:
        grad = report.get("grad_agreement")
        ok = ok and report["losses_agree"] and (grad is None or grad["ok"])
    large = report.get("large")
    if large:
        ok = ok and not large["failed"] and large["agreement"]["ok"]
    return bool(ok)


if __name__ == "__main__":
    sys.exit(main())
