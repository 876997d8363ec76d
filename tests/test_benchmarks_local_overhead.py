"""Smoke test of benchmarks/local_overhead.py: tiny sizes, both versions agree (no timing)."""

import importlib.util
import json
import pathlib

import numpy as np
import pytest

_SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "local_overhead.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("local_overhead", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_main_runs_and_versions_agree(bench, tmp_path, capsys):
    aggregate = "weighted"
    out = tmp_path / "result.json"
    result = bench.main(["--repeats", "2", "--clients", "3", "--steps", "2", "--batch", "4",
                         "--layers", "8,16,4", "--warmup", "0", "--aggregate", aggregate,
                         "--json", str(out)])
    assert result["config"]["params"] == 8 * 16 + 16 + 16 * 4 + 4
    assert result["max_abs_diff"] <= 1e-5
    assert set(result["median_s"]) == {"fax_bridge", "hand"}
    assert set(result["times_s"]) == {"fax_bridge", "hand"}
    assert all(len(t) == 2 for t in result["times_s"].values())
    assert result["ratio"] > 0
    assert json.loads(out.read_text())["config"]["aggregate"] == aggregate
    assert "ratio fax_bridge/hand" in capsys.readouterr().out


def test_rounds_match_outside_the_harness(bench):
    import jax

    args = bench.make_inputs(jax.random.key(1), (6, 12, 3), clients=4, steps=3, batch=5)
    fax_round = jax.jit(bench.make_fax_round(4, 0.1, 0.5, "mean"))
    hand_round = jax.jit(bench.make_hand_round(4, 0.1, 0.5, "mean"))
    (p_fax, loss_fax), (p_hand, loss_hand) = fax_round(*args), hand_round(*args)
    np.testing.assert_allclose(loss_fax, loss_hand, rtol=1e-6)
    for k in p_hand:
        np.testing.assert_allclose(p_fax[k], p_hand[k], rtol=1e-5, atol=1e-6)
    # The round does move the model.
    assert max(float(np.abs(p_hand[k] - args[0][k]).max()) for k in p_hand) > 0
