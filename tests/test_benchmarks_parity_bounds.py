"""Smoke run of benchmarks/parity_bounds.py at its smallest (one family, 2 clients, XLA
clients in process): it finishes with its figures, the honest differences within what
the check allows and every bound within its limit (no timing)."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Runs a family's rounds beside their float64 shadow: 15-25 s, kept out of the
# suite's ten minutes (make test-peers runs it, as CI does).
@pytest.mark.peers
def test_the_benchmark_measures_a_family_within_its_bounds(tmp_path, capsys):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import parity_bounds
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    out = tmp_path / "rows.json"
    (row,) = parity_bounds.main(["--models", "lstm", "--clients", "2", "--runtime", "xla",
                                 "--json", str(out)])
    assert row["model"] == "lstm" and row["runtime"] == "xla" and out.stat().st_size > 0
    assert 0 < row["max_allowed"] and row["diff/allowed"] <= 1.0
    assert 0 < row["bound/limit"] <= 1.0
    assert row["methods"] == ["float64 shadow"]  # the round loops: the shadow's bound
    assert "| lstm | 2 | 1 |" in capsys.readouterr().out
