"""Smoke test of benchmarks/fleet_sizes.py: every path runs one small round and reports
its figures (no timing assertions)."""

import importlib.util
import math
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location(
        "fleet_sizes", ROOT / "benchmarks" / "fleet_sizes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sizes_parse_and_every_path_reports(capsys):
    sizes = _module()
    assert [sizes.parse_count(t) for t in ("100k", "4M", "2500", "1.5k")] == [
        100_000, 4_000_000, 2500, 1500]
    rows = [sizes.measure(path, 2500, 1, 1, None) for path in ("jit", "runtime", "fleet")]
    for row in rows:
        assert row["params"] == 2500 and row["d"] == 50
        assert row["seconds"] > 0 and math.isfinite(row["cpu_seconds"])
        assert row["peak_rss_mb"] > 0
    fleet = rows[2]
    # Up: each device's float64 partial sums (8 bytes a parameter) and framing.
    assert 8 <= fleet["up_bytes_per_param_per_device"] < 9
    assert fleet["payload_up"] == 8 * 2500 + 8  # the model's sums and the weights' sum
    assert len(fleet["device_peak_rss_mb"]) == 1
    sizes._print(rows)
    table = capsys.readouterr().out
    assert "| 2,500 |" in table and "fleet/jit" in table


def test_sizes_mlp_model_runs_model_parallels_round():
    sizes = _module()
    assert sizes.mlp_width(100_000_000) == 4096  # model_parallel.py's 100.7M default
    row = sizes.measure("runtime", 2500, 1, 1, None, model="mlp")
    assert row["model"] == "mlp" and row["d"] == 20
    assert row["params"] == 6 * 20 * 20 + 4 * 20  # w1, b1, w2, b2 at hidden = 3 width
    assert row["seconds"] > 0 and row["peak_rss_mb"] > 0


def test_fleet_bytes_count_shared_memory_and_the_grpc_path_apart():
    sizes = _module()
    shared, grpc = (sizes.measure(path, 40_000, 1, 1, None) for path in ("fleet", "fleet-grpc"))
    # Above the cut, the partials go through shared memory: counted as moved bytes.
    assert shared["shared_up"] > 0.9 * shared["payload_up"] and shared["shared_share_up"] > 0.9
    assert grpc["shared_up"] == grpc["shared_down"] == 0 and grpc["shared_share_up"] == 0
    assert shared["payload_up"] == grpc["payload_up"]
    for row in (shared, grpc):
        assert 8 <= row["up_bytes_per_param_per_device"] < 9
