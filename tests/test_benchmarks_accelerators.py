"""Smoke test of benchmarks/accelerators.py on the CPU: the tiny decoder, every jit
variant and the exported round agree with the hand-written round (no timing)."""

import importlib.util
import json
import pathlib

import pytest

_SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "accelerators.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("accelerators", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_variant_computes_the_hand_written_round(bench, tmp_path):
    out = tmp_path / "accel.jsonl"
    (report,) = bench.main(["--model", "tiny", "--clients", "4", "--steps", "1", "--chunk",
                            "2", "--repeats", "1", "--json", str(out),
                            "--variants", "hand_vmap,fax_bridge_chunked,exported"])
    rows = {r["variant"]: r for r in report["rows"]}
    assert set(rows) == {"hand_vmap", "fax_bridge_chunked", "exported"}
    assert not [r for r in rows.values() if "error" in r]
    assert all(r["max_diff"] < 1e-6 for r in rows.values())
    assert rows["fax_bridge_chunked"]["temp_gib"] < rows["hand_vmap"]["temp_gib"]
    assert json.loads(out.read_text().splitlines()[0])["clients"] == 4
    assert "| fax_bridge_chunked |" in bench.table(report)


def test_the_suite_names_only_known_variants(bench):
    for model, clients, steps, chunk, variants in bench.SUITE:
        assert model in bench.MODELS and set(variants.split(",")) <= set(bench.VARIANTS)
        assert clients % chunk == 0 or chunk >= clients


def test_an_unknown_variant_is_refused(bench):
    with pytest.raises(SystemExit):
        bench.main(["--variants", "hand_vmap,warp"])
