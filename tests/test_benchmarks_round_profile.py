"""Smoke test of benchmarks/round_profile.py: a few rounds, every timer reports (no timing)."""

import json
import math
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_profile_times_the_coordinator_and_each_device(tmp_path):
    out = tmp_path / "profile.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "round_profile.py"),
                           "--rounds", "3", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert rows["devices"] == 2 and rows["rounds"] == 2
    # The devices users get: forked by the fork server, whose start the shim must not
    # break (a fleet then falls back to fresh interpreters and says so).
    from fax_bridge.system import forks

    assert rows["devices_forked"] == forks.available(), done.stderr[-2000:]
    assert "without a fork server" not in done.stderr
    assert "without the fork server" not in done.stderr
    # The device timers ran inside the device processes (through the shim), and the
    # clocks of both sides line up into the three RPC gaps.
    for section, labels in (("coordinator_ms", ("RPCs (call_each)", "finish the aggregates",
                                                "whole round (fleet.run)")),
                            ("device_ms", ("whole handler", "client part and partials",
                                           "of which the XLA call (all clients)",
                                           "of which the partial sums (float64)",
                                           "read the cohort's rows")),
                            ("rpc_gaps_ms", ("call start to first handler entry",))):
        for label in labels:
            assert math.isfinite(rows[section][label]), (section, label)
    device = rows["device_ms"]
    assert device["whole handler"] >= device["client part and partials"] >= max(
        device["of which the XLA call (all clients)"],
        device["of which the partial sums (float64)"])
    assert rows["coordinator_ms"]["whole round (fleet.run)"] >= \
        rows["coordinator_ms"]["RPCs (call_each)"]
    assert "| RPCs (call_each) |" in done.stdout


def test_arguments_are_checked():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "round_profile.py"),
                           "--rounds", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--rounds at least 2" in done.stderr
