"""What one `flwr run` of a benchmark's app produced, checked rather than assumed.

`flwr run` exits 0 once the run is submitted and streamed, also when the ServerApp
fails (a refused run config, a round that could not finish), so each benchmark run's
outcome is read from the files the app writes: fax_bridge's `reports.jsonl` (a report
a round) and Flower's own app's `rounds.json` (a wall time a round).
"""

from __future__ import annotations

import json
import os
from typing import Any


def outcome(run: Any, out: str, system: str, rounds: int) -> Any:
    """The run's records: fax_bridge's reports (a list, one a round, none failed) or
    Flower's `rounds.json` (a dict, `wall_s` one a round); a SystemExit naming the
    system, what is missing and the end of the run's output otherwise."""
    def failed(why: str) -> SystemExit:
        return SystemExit(f"{system}: {why}; the end of `flwr run`'s output:\n"
                          f"{(run.stdout or '')[-3000:]}")

    if run.returncode != 0:
        raise failed(f"flwr run exited with status {run.returncode}")
    if system == "flower":
        path = os.path.join(out, "rounds.json")
        if not os.path.exists(path):
            raise failed(f"the run wrote no {path}")
        with open(path) as f:
            got = json.load(f)
        if len(got.get("wall_s", [])) != rounds:
            raise failed(f"{path} holds {len(got.get('wall_s', []))} rounds, not {rounds}")
        return got
    path = os.path.join(out, "reports.jsonl")
    if not os.path.exists(path):
        raise failed(f"the ServerApp wrote no {path} (it failed before its first round)")
    with open(path) as f:
        reports = [json.loads(line) for line in f if line.strip()]
    if len(reports) != rounds:
        raise failed(f"{path} holds {len(reports)} round reports, not {rounds}")
    errors = [r.get("error") for r in reports if r.get("error")]
    if errors:
        raise failed(f"a round failed: {errors[0]}")
    return reports
