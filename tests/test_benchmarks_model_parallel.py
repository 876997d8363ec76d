"""Smoke test of benchmarks/model_parallel.py at a tiny size on 8 emulated devices (one
subprocess): every mesh and version compiles and runs, parameters per device shrink with
the model axis, fax_bridge has no more all-gathers than the hand-written round and the
three versions agree (no timing or memory figure checked: those are the benchmark's)."""

import json
import os
import pathlib
import subprocess
import sys

_SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "model_parallel.py"


def test_benchmark_runs_at_a_small_size(tmp_path):
    out = tmp_path / "mp.json"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, str(_SCRIPT), "--width", "32", "--hidden", "64", "--time-width", "32",
         "--time-hidden", "64", "--repeats", "1", "--meshes", "8x1,2x4", "--json",
         str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["config"]["params"] == 2 * 32 * 64 + 64 + 32
    meshes = result["meshes"]
    params = {m: meshes[m]["param_bytes_per_device"] for m in meshes}
    assert params["8x1"] > params["2x4"]
    for entry in meshes.values():
        assert entry["fax_bridge"]["all-gather"] <= entry["baseline"]["all-gather"]
        for version in ("fax_bridge", "drjax", "baseline"):
            assert entry[version]["argument_bytes"] > 0 and entry[version]["temp_bytes"] > 0
        assert entry["time"]["max_abs_diff"] < 1e-5
