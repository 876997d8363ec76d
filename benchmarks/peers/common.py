"""Helpers the peer scripts share: arguments, the gradient check, peak-memory sampling
and the result line.

Imports only the standard library at module level (psutil when it is installed, and
numpy through ``workload``), so it works in every peer venv; ``grad_check`` imports jax
when called (only the jax peers call it).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

# Taken at import, which each peer script does before any heavy import.
PROCESS_T0 = time.perf_counter()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import workload  # noqa: E402  (the path above makes it importable)


def base_parser(description: str, grad_check: bool = False,
                workloads: bool = False) -> argparse.ArgumentParser:
    """The arguments every peer takes. ``grad_check``: also ``--grad-check`` (the peers
    whose check program is differentiated, see ``grad_check``); ``workloads``: also
    ``--workload shared|large`` with the large workload's ``--population-size`` and
    ``--cohort-size``, and ``--rounds`` then defaults to the workload's (``rounds_of``)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--rounds", type=int, default=workload.ROUNDS, help="rounds to run (default 20)")
    p.add_argument("--seed", type=int, default=0, help="seed of the cohort schedule (default 0)")
    p.add_argument("--json", metavar="OUT", default=None, help="also write the result line to OUT")
    if grad_check:
        p.add_argument("--grad-check", action="store_true",
                       help="print loss and gradient of the check program")
    if workloads:
        p.add_argument("--workload", choices=("shared", "large"), default="shared",
                       help="large: a cohort of 1,000 from 10,000 clients")
        p.add_argument("--population-size", type=int, default=None,
                       help="large: clients in the population (default 10000)")
        p.add_argument("--cohort-size", type=int, default=None,
                       help="large: clients per round (default 1000)")
        p.set_defaults(rounds=None)
    return p


def rounds_of(args: argparse.Namespace) -> int:
    """``--rounds``, or the default of the chosen ``--workload`` when it is not given
    (the shared workload's 20, the large one's 3)."""
    if args.rounds:
        return args.rounds
    if getattr(args, "workload", "shared") == "large":
        import large_workload

        return large_workload.ROUNDS
    return workload.ROUNDS


def grad_check(peer: str, program: Any) -> Dict[str, Any]:
    """What ``--grad-check`` prints: the loss and gradient of ``program``, a peer's
    mean-client-loss check program, at ``workload.check_program_inputs`` (round 0's
    clients' first batches and the initial weights), by ``jax.value_and_grad``."""
    import jax
    import numpy as np

    params, x, y = workload.check_program_inputs()
    loss, grads = jax.jit(jax.value_and_grad(program))(params, x, y)
    grads = {k: np.asarray(v) for k, v in grads.items()}
    return {
        "peer": peer,
        "mode": "grad_check",
        "jax_version": jax.__version__,
        "loss": float(loss),
        "grad_norm": {k: float(np.linalg.norm(v)) for k, v in grads.items()},
        "grad": {k: v.tolist() for k, v in grads.items()},
    }


class PeakRss:
    """Samples the resident memory of this process plus all its descendants.

    The peak of the sum over the process tree is what matters for peers that start
    helper processes (TFF's worker, Ray's daemons and workers). Without psutil it
    falls back to ``getrusage`` (this process, plus the largest waited-for child).
    """

    def __init__(self, interval_s: float = 0.1) -> None:
        self._interval = interval_s
        self._peak = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        try:
            import psutil

            self._proc = psutil.Process()
        except ImportError:
            self._proc = None

    def _sample(self) -> None:
        if self._proc is None:
            return
        total = 0
        procs = [self._proc]
        try:
            procs += self._proc.children(recursive=True)
        except Exception:
            pass
        for p in procs:
            try:
                total += p.memory_info().rss
            except Exception:
                pass
        self._peak = max(self._peak, total)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self._interval)

    def start(self) -> "PeakRss":
        """Starts sampling in a daemon thread."""
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="peak-rss", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> float:
        """Stops sampling; returns the peak in MiB."""
        self._sample()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        return self.peak_mb()

    def peak_mb(self) -> float:
        """The largest of the sampled tree total and getrusage's figures, in MiB."""
        self_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        child_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        return round(max(self._peak / 2**20, (self_kb + child_kb) / 1024), 1)


def descendants() -> List[Any]:
    """psutil handles of every live descendant of this process (empty without psutil)."""
    try:
        import psutil

        return psutil.Process().children(recursive=True)
    except Exception:
        return []


def end_processes(procs: Optional[List[Any]] = None, grace_s: float = 5.0) -> None:
    """Terminates ``procs`` (default: this process's descendants), then kills the ones
    still alive after ``grace_s``. Processes already reparented (e.g. workers whose
    daemon has exited) are still reached when they were listed beforehand."""
    try:
        import psutil
    except ImportError:
        return
    procs = descendants() if procs is None else procs
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace_s)


def jitted_rounds(round_fn: Any, params: Any, data: workload.ClientData, rounds: int,
                  seed: int) -> Tuple[List[float], List[float], List[workload.Params]]:
    """``rounds`` timed rounds of a compiled round function ``round_fn(params, xb, yb,
    counts) -> (params, loss)`` on the shared workload's cohorts; returns (seconds, loss
    and host model per round). A round's time includes the cohort's gather and the copy
    of its model to the host, which waits for the round to finish."""
    import numpy as np

    round_s: List[float] = []
    losses: List[float] = []
    history: List[workload.Params] = []
    for r in range(rounds):
        t0 = time.perf_counter()
        ids = workload.cohort(seed, r)
        params, loss = round_fn(params, data.x[ids], data.y[ids], data.counts[ids])
        host = {k: np.asarray(v) for k, v in params.items()}  # waits for the round
        loss = float(loss)
        round_s.append(time.perf_counter() - t0)
        losses.append(loss)
        history.append(host)
    return round_s, losses, history


def result_line(
    peer: str,
    setup_s: float,
    round_s: Sequence[float],
    loss_per_round: Sequence[float],
    params_per_round: Sequence[workload.Params],
    peak_rss_mb: float,
    bytes_moved: Optional[int],
    extra: Optional[Dict[str, Any]] = None,
    warmup: int = 0,
) -> Dict[str, Any]:
    """The result object; test metrics are computed here, outside every timing.
    ``round_s_median`` leaves out the first ``warmup`` rounds (when there are more)."""
    timed = list(round_s[warmup:] if len(round_s) > warmup else round_s)
    split = workload.load_split()
    accs: List[float] = []
    test_losses: List[float] = []
    for params in params_per_round:
        loss, acc = workload.evaluate(params, split.x_test, split.y_test)
        test_losses.append(round(loss, 6))
        accs.append(round(acc, 6))
    out: Dict[str, Any] = {
        "peer": peer,
        "setup_s": round(setup_s, 3),
        "round_s_median": (round(statistics.median(timed), 6) if timed else None),
        "round_s_all": [round(t, 6) for t in round_s],
        "peak_rss_mb": peak_rss_mb,
        "final_test_accuracy": accs[-1] if accs else None,
        "loss_per_round": [round(float(x), 6) for x in loss_per_round],
        "bytes_moved": bytes_moved,
        "test_accuracy_per_round": accs,
        "test_loss_per_round": test_losses,
    }
    if warmup:
        out["warmup_rounds"] = warmup
    if extra:
        out.update(extra)
    return out


def emit(result: Dict[str, Any], json_path: Optional[str]) -> None:
    """Prints the result as one JSON line (last line of stdout) and writes it to a file."""
    line = json.dumps(result, sort_keys=False)
    if json_path:
        with open(json_path, "w") as f:
            f.write(line + "\n")
    sys.stdout.flush()
    print(line, flush=True)
