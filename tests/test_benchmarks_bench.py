"""Smoke tests of benchmarks/bench.py and benchmarks/peers/fax_bridge_peer.py (no timing).

fax_bridge's local mode runs one round in a subprocess and must report the peers' JSON
fields and the numpy reference's round-0 loss; the gradient check must match plain
numpy backprop; the table formatter and the goal verdicts run on canned data, agreeing
and disagreeing. The comparisons with google-fax and Flower (marked ``peers``) run with
``--peers``: ``make test-peers`` builds their venvs and runs them.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys
from typing import Any, Dict

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PEERS_DIR = ROOT / "benchmarks" / "peers"
sys.path.insert(0, str(PEERS_DIR))

import numpy_mlp  # noqa: E402
import workload  # noqa: E402

FIELDS = ("setup_s", "round_s_median", "round_s_all", "peak_rss_mb", "final_test_accuracy",
          "loss_per_round", "bytes_moved")


@pytest.fixture(scope="module")
def bench() -> Any:
    spec = importlib.util.spec_from_file_location("bench", ROOT / "benchmarks" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _numpy_round0_loss() -> float:
    data = workload.client_data(workload.load_split())
    params = workload.load_init_params()
    ids = workload.cohort(0, 0)
    losses = [numpy_mlp.local_train(params, data.x[i], data.y[i])[1] for i in ids]
    return float(np.average(losses, weights=data.counts[ids]))


def test_local_mode_one_round_matches_numpy(bench: Any) -> None:
    result = bench.run_runner("fax_bridge_local", bench.runner_args("fax_bridge_local", 1, 0, 2),
                              timeout_s=300)
    for field in FIELDS:
        assert field in result, field
    assert result["peer"] == "fax_bridge_local"
    assert len(result["round_s_all"]) == 1 and len(result["loss_per_round"]) == 1
    assert result["bytes_moved"] is None
    assert result["peak_rss_mb"] > 0
    assert abs(result["loss_per_round"][0] - _numpy_round0_loss()) <= 1e-5
    ref_losses, _ = numpy_mlp.fedavg(1)
    assert abs(result["loss_per_round"][0] - ref_losses[0]) <= 1e-5


def test_grad_check_matches_numpy_backprop(bench: Any) -> None:
    result = bench.run_runner("fax_bridge_local", ["--grad-check"], timeout_s=300)
    params, x, y = workload.check_program_inputs()
    per_client = [numpy_mlp.loss_and_grad(params, x[c], y[c]) for c in range(len(x))]
    loss = np.mean([l for l, _ in per_client])
    assert abs(result["loss"] - loss) <= 1e-5
    for k in workload.PARAM_NAMES:
        want = np.mean([g[k] for _, g in per_client], axis=0)
        np.testing.assert_allclose(np.asarray(result["grad"][k]), want, atol=1e-6)


@pytest.mark.peers
def test_grad_check_agrees_with_google_fax(bench: Any, peer_venv: Any) -> None:
    peer_venv("fax")
    ours = bench.run_runner("fax_bridge_local", ["--grad-check"], timeout_s=300)
    theirs = bench.run_runner("fax", ["--grad-check"], timeout_s=300)
    agreement = bench.grad_agreement(ours, theirs)
    assert agreement["ok"], agreement


def test_proc_tree_rss_counts_children() -> None:
    import subprocess

    import fax_bridge_peer

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in fax_bridge_peer._proc_descendants(os.getpid())
        assert fax_bridge_peer._proc_rss_bytes(child.pid) > 0
    finally:
        child.kill()
        child.wait()


def _canned_result(peer: str, round_s: float, setup_s: float, peak: float,
                   bytes_moved: Any = None) -> Dict[str, Any]:
    return {"peer": peer, "setup_s": setup_s, "round_s_median": round_s,
            "round_s_all": [round_s * 10] + [round_s] * 3, "peak_rss_mb": peak,
            "final_test_accuracy": 0.9, "loss_per_round": [2.0, 1.5, 1.0, 0.5],
            "bytes_moved": bytes_moved}


def test_summary_ratios_verdicts_and_table(bench: Any) -> None:
    runs = {
        "fax_bridge_local": [_canned_result("fax_bridge_local", 0.002, 4.0, 350.0)] * 3,
        "fax_bridge_fleet": [_canned_result("fax_bridge_fleet", 0.05, 6.0, 800.0, 6_000_000)],
        "fax": [_canned_result("fax", 0.0025, 3.0, 420.0)],
        "tff": [_canned_result("tff", 0.05, 12.0, 1000.0)],
        "flower": [_canned_result("flower", 0.4, 20.0, 1400.0, 8_000_000)],
    }
    summary = bench.summarize_runs(runs)
    assert summary["fax_bridge_local"]["repeats"] == 3
    assert summary["fax_bridge_local"]["first_round_s"] == pytest.approx(0.02)
    ratios = bench.compare(summary)
    assert ratios["local_vs_fax"]["round_s_median_ours_over_theirs"] == pytest.approx(0.8)
    assert ratios["local_vs_tff"]["round_speedup"] == pytest.approx(25.0)
    assert ratios["fleet_vs_flower"]["round_speedup"] == pytest.approx(8.0)
    assert ratios["fleet_vs_flower"]["bytes_moved_ours_over_theirs"] == pytest.approx(0.75)
    assert ratios["fleet_vs_local"]["round_s_median_ours_over_theirs"] == pytest.approx(25.0)
    v = bench.verdicts(ratios)
    assert v == {"local_vs_fax_round": True, "local_vs_tff_round": True,
                 "fleet_vs_flower_round": False, "fleet_vs_local_round": False,
                 "fleet_wire_bytes": None, "fleet_vs_flower_memory": True}
    # The fleet goals: 20x Flower in every repeat (the slowest repeat decides), 5x the
    # local path, wire bytes within 1.1x of the payload.
    fast = dict(runs, flower=runs["flower"] * 3, fax_bridge_fleet=[
        dict(_canned_result("fax_bridge_fleet", 0.008, 6.0, 800.0, 1_050_000),
             payload_moved=1_000_000)] * 2 + [_canned_result("fax_bridge_fleet", 0.019, 6.0,
                                                             800.0, 1_050_000)])
    fast_ratios = bench.compare(bench.summarize_runs(fast))
    assert fast_ratios["fleet_vs_flower"]["round_speedup_each"] == pytest.approx(
        [50.0, 50.0, 400 / 19])
    assert fast_ratios["fleet_wire"]["wire_over_payload"] == pytest.approx(1.05)
    fast_v = bench.verdicts(fast_ratios)
    assert fast_v["fleet_vs_flower_round"] and fast_v["fleet_vs_local_round"]
    assert fast_v["fleet_wire_bytes"]
    slow_repeat = dict(fast, fax_bridge_fleet=fast["fax_bridge_fleet"][:2] + [
        _canned_result("fax_bridge_fleet", 0.021, 6.0, 800.0, 1_050_000)])
    assert bench.verdicts(bench.compare(bench.summarize_runs(slow_repeat)))[
        "fleet_vs_flower_round"] is False
    losses = bench.loss_agreement(summary, [2.0, 1.5, 1.0, 0.5])
    assert set(losses) == set(runs) and all(a["vs_numpy"] == 0.0 for a in losses.values())
    grad = bench.grad_agreement({"loss": 1.0, "grad": {"w": [[1.0, 2.0]]}},
                                {"loss": 1.0, "grad": {"w": [[1.0, 2.0 + 1e-8]]}})
    assert grad["ok"]
    report = {"config": {"repeats": 3, "rounds": 4, "seed": 0, "devices": 2},
              "summary": summary, "ratios": ratios, "verdicts": v, "loss_agreement": losses,
              "grad_agreement": grad, "skipped": {}, "failed": {}}
    table = bench.format_table(report)
    assert "| fax_bridge_local | 4.00 | 0.00200 | 0.020 | 350 | - | 0.9000 |" in table
    assert "| fax_bridge fleet vs Flower | 0.125 | 8.00x |" in table
    assert "| fax_bridge fleet vs local | 25.000 |" in table
    assert "| Flower round time / fax_bridge fleet >= 20, in every repeat | MISSED |" in table
    assert "within float32 tolerance" in table


def test_table_reports_skipped_and_missed(bench: Any) -> None:
    runs = {
        "fax_bridge_local": [_canned_result("fax_bridge_local", 0.003, 4.0, 350.0)],
        "fax": [_canned_result("fax", 0.002, 3.0, 420.0)],
    }
    summary = bench.summarize_runs(runs)
    ratios = bench.compare(summary)
    v = bench.verdicts(ratios)
    assert v["local_vs_fax_round"] is False and v["local_vs_tff_round"] is None
    skipped = {"tff": "skipped: no .venv-tff (build it with "
                      "`benchmarks/peers/setup_venvs.sh tff`)"}
    report = {"config": {"repeats": 1, "rounds": 4, "seed": 0, "devices": 2},
              "summary": summary, "ratios": ratios, "verdicts": v,
              "loss_agreement": bench.loss_agreement(summary, None), "grad_agreement": None,
              "skipped": skipped, "failed": {}}
    table = bench.format_table(report)
    assert "| tff | skipped: no .venv-tff (build it with `benchmarks/peers/setup_venvs.sh tff`)" \
        in table
    assert "| fax_bridge local round time / google-fax <= 1.0 | MISSED |" in table
    assert "not measured" in table and "Gradient check: not run" in table


def test_missing_venv_is_skipped_not_failed(bench: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(bench, "available", lambda runner, repo=bench.REPO: False)
    report = bench.run_bench(["tff", "flower"], repeats=1, rounds=1, seed=0, devices=2,
                             grad_check=False)
    assert set(report["skipped"]) == {"tff", "flower"}
    assert not report["failed"] and report["summary"] == {}
    assert "setup_venvs.sh flower" in report["skipped"]["flower"]


@pytest.mark.parametrize("data_on", ["device", "coordinator"])
def test_fleet_mode_one_round_matches_numpy(bench: Any, data_on: str) -> None:
    args = bench.runner_args("fax_bridge_fleet", 1, 0, 2) + ["--data", data_on]
    result = bench.run_runner("fax_bridge_fleet", args, timeout_s=300)
    for field in FIELDS:
        assert field in result, field
    assert result["devices"] == 2 and result["bytes_moved"] > 0
    assert result["client_data"] == data_on and result["round_path"] == "plan"
    report = result["round_reports"][0]
    model_bytes = 4 * (64 * 64 + 64 + 64 * 10 + 10)
    if data_on == "device":  # the broadcast model once per device, no client data
        assert report["payload_down"] == 2 * model_bytes
    else:
        assert report["payload_down"] > 2 * model_bytes
    assert abs(result["loss_per_round"][0] - _numpy_round0_loss()) <= 1e-5


def test_from_json_rerenders_a_saved_report(bench: Any, tmp_path: pathlib.Path,
                                            capsys: Any) -> None:
    import json

    runs = {"fax_bridge_local": [_canned_result("fax_bridge_local", 0.002, 4.0, 350.0)],
            "fax": [_canned_result("fax", 0.0025, 3.0, 420.0)]}
    saved = {"config": {"repeats": 1, "rounds": 4, "seed": 0, "devices": 2}, "runs": runs,
             "numpy_reference_loss": [2.0, 1.5, 1.0, 0.5], "skipped": {}, "failed": {},
             "grad_agreement": None}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(saved))
    assert bench.main(["--from-json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| fax_bridge local vs google-fax | 0.800 | 1.25x | 1.25x |" in out


# ---------------------------------------------------------------------------------------
# The large workload (a cohort of 1,000 from 10,000 clients), shrunk for the tests.

SMALL = ["--population-size", "200", "--cohort-size", "30"]


def _large_reference(rounds: int, population: int, cohort: int) -> Any:
    import large_workload

    pop = large_workload.Population(population)
    return large_workload.fedavg(rounds, 0, pop=pop, cohort_size=cohort)


def test_large_fleet_reads_its_cohort_on_the_devices(bench: Any, tmp_path: pathlib.Path) -> None:
    args = bench.bench_large.runner_args("fax_bridge_fleet", 2, 0, 2, 10_000,
                                         str(tmp_path / "population"))
    result = bench.run_runner("fax_bridge_fleet", args + SMALL, timeout_s=300)
    assert result["workload"] == "large" and result["population"] == 200
    assert result["round_path"] == "plan" and result["one_request_per_device"]
    assert result["rpcs_per_round"][1] == 2  # one Round request per device
    assert result["population_write_s"] > 0 and result["warmup_rounds"] == 1
    assert result["round_s_median"] == result["round_s_all"][1]
    # Down: the model and 30 client ids, not 30 clients' rows (30 x 5 KiB of pixels).
    assert result["round_reports"][1]["bytes_down"] < 2 * 20_000 + 30 * 5120
    losses, history = _large_reference(2, 200, 30)
    np.testing.assert_allclose(result["loss_per_round"], losses, atol=1e-5)
    for k in workload.PARAM_NAMES:
        np.testing.assert_allclose(np.asarray(result["final_params"][k]), history[-1][k],
                                   atol=1e-5)


def test_large_population_is_written_once(tmp_path: pathlib.Path) -> None:
    import fax_bridge_peer
    import large_workload

    directory = str(tmp_path / "population")
    pop = large_workload.Population(12)
    assert fax_bridge_peer.write_large_population(directory, pop) > 0
    assert fax_bridge_peer.write_large_population(directory, pop) == 0.0
    from fax_bridge.data import ClientStore

    store = ClientStore(directory)
    x, y = pop.batches(np.asarray([7]))
    np.testing.assert_array_equal(store.client(7)["xb"], x)
    np.testing.assert_array_equal(store.client(7)["yb"], y)
    with pytest.raises(SystemExit, match="holds another population"):
        fax_bridge_peer.write_large_population(directory, large_workload.Population(10))


@pytest.mark.peers
def test_large_flower_maps_clients_onto_fewer_supernodes(bench: Any, peer_venv: Any) -> None:
    peer_venv("flower")
    args = bench.bench_large.runner_args("flower", 2, 0, 2, 20, "unused")
    result = bench.run_runner("flower", args + SMALL, timeout_s=600)
    assert result["supernodes"] == 20 and result["population"] == 200
    losses, history = _large_reference(2, 200, 30)
    np.testing.assert_allclose(result["loss_per_round"], losses, atol=1e-5)
    for k in workload.PARAM_NAMES:
        np.testing.assert_allclose(np.asarray(result["final_params"][k]), history[-1][k],
                                   atol=1e-5)


def _canned_large(peer: str, round_s: float, peak: float, params: Dict[str, Any],
                  **extra: Any) -> Dict[str, Any]:
    out = dict(_canned_result(peer, round_s, 5.0, peak, 1_000_000), final_params=params,
               warmup_rounds=1, **extra)
    out["round_s_all"] = [round_s * 3] + [round_s] * 3
    return out


def test_large_report_agreement_and_tables(bench: Any) -> None:
    params = {"w": [[1.0, 2.0]]}
    near = {"w": [[1.0, 2.0 + 1e-7]]}
    fleet = _canned_large("fax_bridge_fleet", 0.5, 900.0, params, one_request_per_device=True,
                          round_path="plan")
    flower = _canned_large("flower", 20.0, 3000.0, near, supernodes=10_000)
    reference = {"loss_per_round": [2.0, 1.5, 1.0, 0.5], "final_params": params}
    config = {"repeats": 2, "rounds": 4, "seed": 0, "devices": 2, "supernodes": 10_000,
              "population": 10_000, "cohort": 1_000}
    large = bench.bench_large.make_report({"fax_bridge_fleet": [fleet] * 2, "flower": [flower] * 2},
                                          config, {}, {}, reference, bench.LOSS_ATOL)
    assert large["ratios"]["round_speedup"] == pytest.approx(40.0)
    assert large["ratios"]["round_speedup_each"] == [pytest.approx(40.0)] * 2
    assert large["ratios"]["peak_rss_mb_ours_over_theirs"] == pytest.approx(0.3)
    a = large["agreement"]
    assert a["ok"] and a["fleet_one_request_per_device"]
    assert a["params_fleet_vs_flower"] == pytest.approx(1e-7)
    table = bench.format_table({"config": {}, "large": large})
    assert "a cohort of 1,000 of 10,000 clients" in table and "Flower on 10,000 SuperNodes" in table
    assert "| fax_bridge_fleet | 5.00 | 0.500 | 0.500, 0.500 | 1.500 | 900 | 1,000,000 |" in table
    assert "| fax_bridge fleet vs Flower, large | 0.025 | 40.00x | 40.00x, 40.00x |" in table
    assert "(round plan): yes" in table and "within float32 tolerance" in table
    assert bench.succeeded({"failed": {}, "large": large})
    # A fleet round that fell back to phase by phase, or models that drift, fail the check.
    phases = dict(fleet, one_request_per_device=False)
    far = dict(flower, final_params={"w": [[1.0, 2.1]]})
    bad = bench.bench_large.make_report({"fax_bridge_fleet": [phases], "flower": [far]},
                                        config, {}, {}, reference, bench.LOSS_ATOL)
    assert not bad["agreement"]["ok"] and not bench.succeeded({"failed": {}, "large": bad})
    assert "(round plan): NO" in bench.bench_large.format_tables(bad)


def test_large_workload_from_json_and_skipped(bench: Any, monkeypatch: Any,
                                              tmp_path: pathlib.Path, capsys: Any) -> None:
    import json

    monkeypatch.setattr(bench, "available", lambda runner, repo=bench.REPO: False)
    path = tmp_path / "report.json"
    code = bench.main(["--workload", "large", "--json", str(path), "--large-rounds", "1",
                       "--population-dir", str(tmp_path / "population")])
    out = capsys.readouterr().out
    assert code == 0 and "| flower | skipped: no .venv-flower" in out
    assert "fax_bridge local vs google-fax" not in out  # the shared workload did not run
    assert bench.main(["--from-json", str(path)]) == 0
    assert "| fax_bridge_fleet | skipped: no .venv" in capsys.readouterr().out
    assert json.loads(path.read_text())["config"]["workload"] == "large"


# ---------------------------------------------------------------------------------------
# The agreement verdicts fail on inputs that disagree.

def test_grad_agreement_fails_on_each_kind_of_disagreement(bench: Any) -> None:
    ours = {"loss": 1.0, "grad": {"b": [0.5], "w": [[1.0, 2.0]]}}

    def theirs(**change: Any) -> Dict[str, Any]:
        grad = dict(ours["grad"], **change.pop("grad", {}))
        return dict(ours, grad=grad, **change)

    assert bench.grad_agreement(ours, theirs())["ok"]
    assert bench.grad_agreement(ours, theirs(grad={"w": [[1.0, 2.0 + 1e-7]]}))["ok"]
    wrong = [theirs(grad={"w": [[1.0, 2.0 + 1e-5]]}),      # a gradient leaf off by 1e-5
             theirs(loss=1.0 + 1e-4),                      # the loss off
             theirs(loss=float("nan")),
             theirs(grad={"w": [[1.0, float("nan")]]}),    # a NaN after a close leaf
             theirs(grad={"w": [1.0]}),                    # a shape numpy would broadcast
             {"loss": 1.0, "grad": {"w": [[1.0, 2.0]]}},   # a leaf missing
             theirs(grad={"extra": [0.0]})]                # a leaf ours lacks
    for other in wrong:
        assert not bench.grad_agreement(ours, other)["ok"], other
        assert not bench.grad_agreement(other, ours)["ok"], other


def test_loss_agreement_fails_on_each_kind_of_disagreement(bench: Any) -> None:
    reference = [2.0, 1.5, 1.0, 0.5]

    def agreeing(curve: Any) -> bool:
        summary = {"fax_bridge_local": {"loss_per_round": curve}}
        diffs = bench.loss_agreement(summary, reference)["fax_bridge_local"]
        return all(v is None or v <= bench.LOSS_ATOL for v in diffs.values())

    assert agreeing([2.0, 1.5, 1.0 + 1e-6, 0.5])
    assert not agreeing([2.0, 1.5, 1.0 + 1e-4, 0.5])
    assert not agreeing([2.0, 1.5, float("nan"), 0.5])   # Python's max would skip it
    assert not agreeing([2.0, 1.5])                      # fewer rounds than the reference
    fax = {"loss_per_round": [2.0, 1.5, 1.1, 0.5]}
    vs_fax = bench.loss_agreement({"fax_bridge_local": {"loss_per_round": reference},
                                   "fax": fax}, None)["fax_bridge_local"]["vs_fax"]
    assert vs_fax == pytest.approx(0.1)


def test_large_agreement_fails_on_models_that_cannot_be_compared(bench: Any) -> None:
    params = {"w": [[1.0, 2.0]]}
    reference = {"loss_per_round": [2.0], "final_params": params}
    fleet = {"loss_per_round": [2.0], "final_params": params,
             "one_request_per_device": True, "round_path": "plan"}
    ok = bench.bench_large.agreement({"fax_bridge_fleet": [fleet]}, reference, 1e-5)
    assert ok["ok"]
    for final in ({"w": [1.0]}, {"v": [[1.0, 2.0]]}, {"w": [[1.0, float("nan")]]}):
        bad = bench.bench_large.agreement(
            {"fax_bridge_fleet": [dict(fleet, final_params=final)]}, reference, 1e-5)
        assert not bad["ok"], final
