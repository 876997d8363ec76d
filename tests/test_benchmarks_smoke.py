"""Smoke runs of the benchmark scripts no other test runs, each at its smallest size in
this one process (they share its jax): each finishes with figures, on the path users
get (the devices forked by the fork server, never its fallback). Scripts with tests of
their own have them in tests/test_benchmarks_<script>.py; those needing a Flower
deployment or LiteRT conversions (a minute or more each) run in `make test-peers`
(marker `peers`)."""

from __future__ import annotations

import json
import logging
import math
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

FALLBACK = ("without a fork server", "without the fork server")


def _no_fallback(caplog, stderr: str = "") -> None:
    _no_fallback_text(stderr + "\n".join(r.getMessage() for r in caplog.records))


def test_exported_round_runs_both_paths_with_the_same_bits(tmp_path):
    import exported_round

    out = tmp_path / "er.json"
    got = exported_round.main(["--params", "1000", "--clients", "2", "--layers", "1",
                               "--repeats", "1", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["clients"] == 2 and saved["same_bits"] is True
    for key in ("jit_s", "host_s", "device_s", "host_over_jit"):
        assert math.isfinite(saved[key]) and saved[key] > 0, key
    assert got["same_bits"] is True


def test_stream_round_times_both_ways_with_the_same_bits(tmp_path):
    import stream_round

    out = tmp_path / "sr.json"
    got = stream_round.main(["--clients", "4", "--chunk", "2", "--width", "8", "--steps",
                             "1", "--batch", "2", "--repeats", "1", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["same_bits"] is True and got["same_bits"] is True
    for key in ("in_memory_s", "streamed_s", "streamed_over_in_memory", "fastest_ratio"):
        assert math.isfinite(saved[key]) and saved[key] > 0, key


def test_partial_bytes_measures_every_count(capsys):
    import partial_bytes

    assert partial_bytes.main(["--size", "100", "--clients", "1", "2"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(r[0], r[1]) for r in rows] == [("1", "False"), ("2", "False"), ("1", "True"),
                                            ("2", "True")]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)


def test_fleet_overhead_runs_a_round_on_forked_devices(tmp_path, caplog):
    import fleet_overhead

    out = tmp_path / "fo.json"
    with caplog.at_level(logging.WARNING):
        assert fleet_overhead.main(["--clients", "4", "--devices", "1", "--rounds", "1",
                                    "--json", str(out)]) == 0
    _no_fallback(caplog)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["clients"] == 4 and row["devices"] == 1
    assert row["fleet_s"] > 0 and row["local_s"] > 0 and row["bytes_down"] > 0


@pytest.mark.peers
def test_scaling_runs_a_round_and_measures_memory(tmp_path, caplog):
    # A coordinator and a device in processes of their own: 10-20 s, kept out of the
    # suite's ten minutes.
    out = tmp_path / "scaling.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "scaling.py"), "--clients", "10",
                           "--devices", "1", "--rounds", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    _no_fallback(caplog, done.stderr)
    (result,) = json.loads(out.read_text())["results"]
    assert result["clients"] == 10 and result["devices"] == 1 and result["rounds"] == 1
    assert result["round_s"] > 0 and result["coordinator_rss_mib"] > 0


@pytest.mark.peers
def test_readme_round_split_times_each_stage_of_a_flower_round():
    # A warm worker a node, fresh interpreters importing each app: about 90 s.
    done = subprocess.run([sys.executable, str(BENCHMARKS / "readme_round_split.py"),
                           "--size", "1000", "--rounds", "1", "--imports", "2"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fax_bridge round (after the first):" in done.stdout
    assert "node: worker's client part (compute_s)" in done.stdout
    assert "flower round (after the first):" in done.stdout


def _script(tmp_path, name: str, *args: str, timeout: int = 900) -> dict:
    """Runs benchmarks/`name` with `args` and `--json`; its JSON report."""
    out = tmp_path / f"{name}.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / name), *args, "--json", str(out)],
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    _no_fallback_text(done.stderr)
    return json.loads(out.read_text())


def _no_fallback_text(text: str) -> None:
    assert not any(f in text for f in FALLBACK), text[-2000:]


@pytest.mark.peers
def test_readme_round_runs_both_apps_as_the_readme_starts_them(tmp_path):
    # The README's deployment, both apps, one repeat: about 3 minutes here.
    report = _script(tmp_path, "readme_round.py", "--size", "1000", "--repeats", "1")
    assert {r["system"] for r in report["runs"]} == {"fax_bridge", "flower"}
    for system in ("fax_bridge", "flower"):
        assert report["summary"][system]["round_s"] > 0, report["summary"]
    assert all(len(r["wall_s"]) >= 2 for r in report["runs"])


@pytest.mark.peers
def test_flower_rounds_runs_both_apps_on_warm_forked_nodes(tmp_path):
    # A deployment, both apps, two rounds each: about 2.5 minutes here.
    report = _script(tmp_path, "flower_rounds.py", "--rounds", "2", "--repeats", "1",
                     "--systems", "fax_bridge", "flower")
    assert "warm fax_bridge workers" in report["deployment"]
    assert "app processes forked" in report["deployment"]
    for system in ("fax_bridge", "flower"):
        (run,) = report["runs"][system]
        assert len(run["wall_s"]) == 2 and all(w > 0 for w in run["wall_s"])
    assert report["runs"]["fax_bridge"][0]["participants"] == [10, 10]


@pytest.mark.peers
def test_litert_sizes_converts_and_runs_the_smallest_models(tmp_path):
    # Two conversions and their runs against jit: about a minute here.
    report = _script(tmp_path, "litert_sizes.py", "--sizes", "--quick", "--repeats", "1")
    assert [s["status"] for s in report["sizes"]] == ["runs", "runs"]
    for s in report["sizes"]:
        assert s["bytes"] > 0 and s["litert_ms"] > 0 and s["jit_ms"] > 0
        assert math.isfinite(s["max_err"]), s


@pytest.mark.peers
def test_parity_cost_times_the_default_bound_against_the_jit_round(tmp_path, capsys):
    import parity_cost

    out = tmp_path / "cost.json"
    assert parity_cost.main(["--clients", "2", "--devices", "1", "--json", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row["verdict"] == "OK" and row["fixed_verdict"] == "OK"
    for key in ("jit_compile_s", "jit_round_s", "parity_s", "shadow_s", "fixed_s"):
        assert math.isfinite(row[key]) and row[key] > 0, key
    assert row["shadow_s"] < row["parity_s"]  # the shadow is a part of the verdict
    assert capsys.readouterr().out.splitlines()[1].split()[:2] == ["2", "1"]
