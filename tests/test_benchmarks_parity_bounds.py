"""Smoke runs of benchmarks/parity_bounds.py at its smallest (one family, 2 clients, XLA
clients in process): it finishes with its figures, the honest differences within what
the check allows and every bound within its limit (no timing), under the family's own
algorithm and under another `--algorithm`; an algorithm it does not know is refused, and a
combination that cannot run is a row with its error."""

import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _benchmark():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import parity_bounds
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    return parity_bounds


def test_an_unknown_algorithm_is_refused_naming_the_known_ones(capsys):
    parity_bounds = _benchmark()
    with pytest.raises(SystemExit):
        parity_bounds.main(["--models", "mlp", "--algorithm", "fed_sgd,fed_foo"])
    err = capsys.readouterr().err
    assert "--algorithm ['fed_foo']" in err and "streaming_diloco" in err
    with pytest.raises(ValueError, match="no algorithm 'fed_foo' for round 'mlp'"):
        parity_bounds.phone_models.make_round("mlp", 2, "fed_foo")


def test_a_combination_that_cannot_run_is_a_row_with_its_error(monkeypatch, capsys):
    parity_bounds = _benchmark()

    def refuse(name, clients, rounds, runtime, first_order, algorithm):
        raise ValueError(f"{algorithm} needs more\nthan this")

    monkeypatch.setattr(parity_bounds, "measure", refuse)
    rows = parity_bounds.main(["--models", "gru", "--algorithm", "fed_sgd,dp_fed_avg"])
    assert [(r["model"], r["algorithm"], r["error"]) for r in rows] == [
        ("gru", "fed_sgd", "ValueError: fed_sgd needs more"),
        ("gru", "dp_fed_avg", "ValueError: dp_fed_avg needs more")]
    assert "| gru | dp_fed_avg | 3 | 1 | cannot run: ValueError: dp_fed_avg needs more |" \
        in capsys.readouterr().out


# Runs a family's rounds beside their float64 shadow: 15-25 s, kept out of the
# suite's ten minutes (make test-peers runs it, as CI does).
@pytest.mark.peers
def test_the_benchmark_measures_a_family_within_its_bounds(tmp_path, capsys):
    parity_bounds = _benchmark()
    out = tmp_path / "rows.json"
    (row,) = parity_bounds.main(["--models", "lstm", "--clients", "2", "--runtime", "xla",
                                 "--json", str(out)])
    assert row["model"] == "lstm" and row["runtime"] == "xla" and out.stat().st_size > 0
    assert row["algorithm"] == "fed_avg"  # the family's own
    assert 0 < row["max_allowed"] and row["diff/allowed"] <= 1.0
    assert 0 < row["bound/limit"] <= 1.0
    assert row["methods"] == ["float64 shadow"]  # the round loops: the shadow's bound
    assert "| lstm | fed_avg | 2 | 1 |" in capsys.readouterr().out


# The MLP under Streaming DiLoCo's first round (E3M0 codes up and down), within its
# limit: ~10-20 s.
@pytest.mark.peers
def test_the_benchmark_measures_a_family_under_another_algorithm(capsys):
    parity_bounds = _benchmark()
    (row,) = parity_bounds.main(["--models", "mlp", "--algorithm", "streaming_diloco",
                                 "--clients", "2", "--runtime", "xla"])
    assert "error" not in row, row
    assert row["model"] == "mlp" and row["algorithm"] == "streaming_diloco"
    assert math.isfinite(row["max_diff"]) and 0 < row["max_allowed"] < math.inf, row
    assert row["diff/allowed"] <= 1.0
    # E3M0's codes are exact conversions: no drawn rounding moves every top code
    assert 0 < row["bound/limit"] <= 1.0, row
    assert row["worst_bound"].startswith("round 1 ")  # names the leaf nearest its limit
    assert "| mlp | streaming_diloco | 2 | 1 |" in capsys.readouterr().out
