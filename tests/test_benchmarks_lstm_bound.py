"""Smoke test of benchmarks/lstm_bound.py on a small LSTM: the figures it prints keep
the relations docs/litert.md draws from them (no timing)."""

import json
import pathlib
import subprocess
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_chain_of_step_jacobians_bounds_what_compounding_their_absolutes_does(tmp_path):
    out = tmp_path / "lstm.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lstm_bound.py"),
                           "--hidden", "8", "--steps", "4", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(out.read_text())
    assert row["hidden"] == 8 and row["steps"] == 4
    # |J_T ... J_1| is at most |J_T| ... |J_1| entry by entry, so its row sums too, and
    # the worst case through the chain at most what the analysis carries through |J|.
    assert 0 < row["chain_abs"] <= row["abs_chain"] * (1 + 1e-9)
    assert 0 < row["chain_bound"] <= row["analysis_bound"] * (1 + 1e-6)
    assert row["float32_error"] <= row["chain_bound"]  # a bound of what float32 does
    # the shadow's bound holds float32 too, within 1e-4 of the carry's values
    top = np.float32(row["carry_max"])
    assert row["float32_error"] <= row["shadow_bound"] <= 1e-4 * top + np.spacing(top)
