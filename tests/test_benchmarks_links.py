"""benchmarks/links.py's fax_bridge path without network namespaces: the benchmark's
own app, populations and initial state (a model of its own, `start_model`), one short
round on a loopback deployment, its outcome checked as the benchmark checks it
(`flower_runs.outcome`). `make bench-links` runs the same path on shaped links (root,
`ip netns`, `tc`), which CI does not have. The run (a SuperLink, two SuperNodes and
their workers: about a minute on two shared cores) is marked `peers`: `make test-peers`
runs it in CI after `make test`, whose ten minutes it does not fit."""

from __future__ import annotations

import os
import pathlib
import sys
import types

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

pytest.importorskip("flwr")

import flower_runs  # noqa: E402
import links  # noqa: E402


class _Loopback:
    """`links.run_once`'s network without namespaces: no link counters to read."""

    nodes = 2

    @staticmethod
    def counters(k: int) -> tuple:
        return (0, 0)


@pytest.mark.peers
def test_the_fax_bridge_run_of_the_links_benchmark_finishes_from_its_own_model(tmp_path):
    from fax_bridge.flower.deployment import LocalDeployment
    from fax_bridge.flower.security import local_credentials

    size = 1000
    creds = local_credentials(str(tmp_path / "creds"), hosts=["127.0.0.1"])
    configs, apps = links.write_apps(str(tmp_path / "apps"), size, 2, 1, creds)
    out = str(tmp_path / "out")
    with LocalDeployment(configs, str(tmp_path / "flwr"), credentials=creds) as deployment:
        got = links.run_once(deployment, _Loopback(), "fax_bridge", apps, 1, out, size)
    assert len(got["wall_s"]) == 1 and got["wall_s"][0] > 0
    # The round started from the benchmark's model, not the app's: the result is its
    # weighted mean of each client's p * 0.5 + x (clients 1 and 2 of weights 1 and 2).
    from fax_bridge.system.npz_files import read_npz

    start = links.start_model(size, links._RUNS[0] / 1024)
    x, w = np.float32([0.001, 0.002]), np.float32([1, 2])
    want = ((start[None] * np.float32(0.5) + x[:, None]) * w[:, None]).sum(0) / w.sum()
    result = read_npz(os.path.join(out, "result.npz"), what="result")
    held = [np.asarray(v) for k, v in sorted(result.items()) if np.asarray(v).shape == (size,)]
    assert held and np.allclose(held[0], want, rtol=1e-6)


def test_a_run_that_wrote_no_reports_is_a_failure_naming_it(tmp_path):
    run = types.SimpleNamespace(returncode=0, stdout="ServerApp: initial-state refused")
    with pytest.raises(SystemExit, match="(?s)wrote no .*reports.jsonl.*initial-state refused"):
        flower_runs.outcome(run, str(tmp_path), "fax_bridge", 1)
    (tmp_path / "reports.jsonl").write_text('{"wall_s": 1.0, "error": null}\n')
    assert len(flower_runs.outcome(run, str(tmp_path), "fax_bridge", 1)) == 1
    with pytest.raises(SystemExit, match="holds 1 round reports, not 2"):
        flower_runs.outcome(run, str(tmp_path), "fax_bridge", 2)
    (tmp_path / "reports.jsonl").write_text('{"wall_s": 1.0, "error": "no node answered"}\n')
    with pytest.raises(SystemExit, match="a round failed: no node answered"):
        flower_runs.outcome(run, str(tmp_path), "fax_bridge", 1)
    with pytest.raises(SystemExit, match="wrote no .*rounds.json"):
        flower_runs.outcome(run, str(tmp_path), "flower", 1)
    with pytest.raises(SystemExit, match="exited with status 1"):
        flower_runs.outcome(types.SimpleNamespace(returncode=1, stdout=""), str(tmp_path),
                            "flower", 1)
