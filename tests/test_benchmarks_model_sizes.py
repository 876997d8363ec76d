"""Smoke test of benchmarks/model_sizes.py: the smallest linear model, both weighted means
(sums and means are checked in tests/test_primitives_sums.py), one sample each; fax_bridge,
the hand-written round and DrJAX agree (no timing checked)."""

import importlib.util
import json
import pathlib

import pytest

_SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "model_sizes.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("model_sizes", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smallest_configuration_agrees_across_implementations(bench, tmp_path, monkeypatch):
    out, png = tmp_path / "sizes.json", tmp_path / "sizes.png"
    monkeypatch.setattr(bench, "RECHECK_SAMPLES", 3)
    monkeypatch.setattr(bench, "RECHECK_SAMPLE_S", 0.01)
    result = bench.main(["--quick", "--models", "linear", "--kinds", "weighted", "elementwise",
                         "--repeats", "1", "--clients", "4", "--json", str(out), "--plot",
                         str(png), "--recheck-above", "1e-9"])  # every row timed again
    assert json.loads(out.read_text())["rows"] == result["rows"]
    assert png.stat().st_size > 0
    rows = result["rows"]
    assert [r["kind"] for r in rows] == ["weighted", "elementwise"]
    for r in rows:
        assert r["params"] == 100 * 100
        assert set(r["median_s"]) == set(bench.IMPLS)
        assert r["runs"] and all(n == 1 for n in r["runs"].values())
        assert set(r["max_rel_diff"]) == {"fax_bridge", "drjax"}
        assert max(r["max_rel_diff"].values()) < 1e-5, r
        assert r["fax_over_hand_recheck"] > 0
        assert f"(again: {r['fax_over_hand_recheck']:.2f})" in bench.format_row(r, ())
