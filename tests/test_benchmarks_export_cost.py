"""Smoke test of benchmarks/export_cost.py: tiny sizes, the proto does not grow with the model.

No timing assertions: only that the script runs and what it measures behaves.
"""

import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fax_bridge as fb

_SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "export_cost.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("export_cost", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_main_runs_and_proto_is_not_proportional_to_params(bench, tmp_path, capsys):
    out = tmp_path / "result.json"
    result = bench.main(["--sizes", "2k,20k", "--repeats", "1", "--clients", "3",
                         "--json", str(out)])
    small, large = result["rows"]
    assert small["params"] == bench.param_count(small["layers"])
    assert large["params"] / small["params"] > 8
    # HLO holds shapes, not values: ~10x the parameters, barely more proto bytes.
    assert large["proto_bytes"] / small["proto_bytes"] < 1.5
    assert large["ratio"] < small["ratio"] / 5
    for row in result["rows"]:
        assert row["hlo_modules"] >= 1
        assert 0 < row["hlo_bytes"] < row["proto_bytes"]
        assert row["hlo_bytes"] + row["rest_bytes"] == row["proto_bytes"]
        assert row["largest_constant_elements"] < 100
        assert row["concrete_identical"] is True
    assert result["slopes"]["proto_bytes"] < 0.5
    assert json.loads(out.read_text())["config"]["clients"] == 3
    assert "log-log slope" in capsys.readouterr().out


def test_layer_sizes_hit_the_target(bench):
    for target in (10_000, 1_000_000, 10_000_000):
        assert abs(bench.param_count(bench.layer_sizes(target)) - target) / target < 0.02


def test_breakdown_sees_a_constant_the_program_closes_over(bench):
    """The detector works: a closed-over table is folded into the HLO and found there."""
    def export_with(table):
        @fb.program(clients=2)
        def shift(x):
            return fb.federated_map_server(lambda v: v + jnp.asarray(table), x)

        return fb.export_tff(shift, jax.ShapeDtypeStruct((1000,), jnp.float32))

    table = np.arange(1000, dtype=np.float32)
    proto = export_with(table)
    breakdown = bench.proto_breakdown(proto)
    assert breakdown["largest_constant_elements"] == 1000
    assert breakdown["hlo_bytes"] > 4 * 1000
    assert bench.canonical_bytes(proto) == bench.canonical_bytes(export_with(table))
    assert bench.canonical_bytes(proto) != bench.canonical_bytes(export_with(table + 1))


def test_stablehlo_conversion_of_the_round_does_not_grow_with_the_model(bench):
    small, _ = bench.stablehlo_conversion(2_000, clients=3, repeats=1)
    large, proto = bench.stablehlo_conversion(20_000, clients=3, repeats=1)
    assert large["xla_parts"] == small["xla_parts"] >= 2
    assert 0 < large["stablehlo_bytes"] < 1.2 * small["stablehlo_bytes"]
    assert large["round_form_bytes"] < 1.5 * small["round_form_bytes"]
    from federated_language.compiler import building_blocks

    signature = str(building_blocks.ComputationBuildingBlock.from_proto(proto).type_signature)
    assert signature.endswith("@SERVER,float32@SERVER>)")  # state and output apart


def test_leaves_sweep_runs_and_its_proto_grows_linearly(bench, tmp_path):
    """`--leaves`: each count exported and run on the host; the proto grows by the same
    bytes per leaf from 12 to 24 to 48 leaves (quadratic: 3 times as many per leaf)."""
    result = bench.main(["--leaves", "12,24,48", "--runs", "host",
                         "--json", str(tmp_path / "leaves.json")])
    rows = result["rows"]
    assert [r["leaves"] for r in rows] == [12, 24, 48]
    for row in rows:
        assert row["host_first_s"] > 0 and row["host_second_s"] > 0
        assert row["host_first_xla_compile_s"] >= row["host_second_xla_compile_s"] >= 0
    per_leaf = [(b["proto_bytes"] - a["proto_bytes"]) / (b["leaves"] - a["leaves"])
                for a, b in zip(rows, rows[1:])]
    assert 0.8 < per_leaf[1] / per_leaf[0] < 1.25, per_leaf
    assert json.loads((tmp_path / "leaves.json").read_text())["config"]["runs"] == ["host"]
