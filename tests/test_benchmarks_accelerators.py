"""Smoke test of benchmarks/accelerators.py on the CPU: the tiny decoder, every jit
variant and the exported round agree with the hand-written round, and the largest-cohort
search agrees with the compiled rounds' memory_analysis (no timing)."""

import importlib.util
import json
import pathlib

import jax
import pytest

_SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "accelerators.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("accelerators", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.peers  # every variant compiled and run end to end: make test-peers
def test_every_variant_computes_the_hand_written_round(bench, tmp_path):
    out = tmp_path / "accel.jsonl"
    (report,) = bench.main(["--model", "tiny", "--clients", "4", "--steps", "1", "--chunk",
                            "2", "--repeats", "1", "--json", str(out), "--layout",
                            "per-layer", "--variants", "hand_vmap,fax_bridge_chunked,exported"])
    assert report["layout"] == "per-layer" and report["leaves"] == 12
    rows = {r["variant"]: r for r in report["rows"]}
    assert set(rows) == {"hand_vmap", "fax_bridge_chunked", "exported"}
    assert not [r for r in rows.values() if "error" in r]
    assert all(r["max_diff"] < 1e-6 for r in rows.values())
    assert rows["fax_bridge_chunked"]["temp_gib"] < rows["hand_vmap"]["temp_gib"]
    assert json.loads(out.read_text().splitlines()[0])["clients"] == 4
    assert "| fax_bridge_chunked |" in bench.table(report)


@pytest.mark.parametrize("rows", ["SUITE", "QUICK"])
def test_the_row_sets_name_only_known_variants(bench, rows):
    for model, clients, steps, chunk, variants, *how in getattr(bench, rows):
        assert model in bench.MODELS and set(variants.split(",")) <= set(bench.VARIANTS)
        assert not how or how[0].get("layout", "stacked") in bench.LAYOUTS
        assert clients % chunk == 0 or chunk >= clients


def test_the_quick_set_covers_both_layouts_both_sizes_and_every_path(bench):
    layouts = {(m, how[0].get("layout", "stacked")) for m, _, _, _, v, *how in bench.QUICK
               if "fax_bridge" in v.split(",")}
    assert layouts == {(m, lay) for m in ("110M", "268M") for lay in bench.LAYOUTS}
    cohorts = {n for _, n, _, _, v, *_ in bench.QUICK if "fax_bridge_chunked" in v}
    assert cohorts == {64, 1024}
    assert any("exported" in v.split(",") for *_, v, _ in bench.QUICK)


def test_the_peak_comes_from_the_table_or_is_none_on_a_cpu(bench):
    class Chip:
        device_kind, platform = "TPU v5 lite", "tpu"
    assert bench.chip_peak(Chip()) == (197.0, "table")
    assert bench.chip_peak(jax.devices("cpu")[0])[0] is None


def test_suite_and_quick_are_refused_together(bench):
    with pytest.raises(SystemExit):
        bench.main(["--suite", "--quick"])


def test_an_unknown_variant_is_refused(bench):
    with pytest.raises(SystemExit):
        bench.main(["--variants", "hand_vmap,warp"])


def _analysed_bytes(bench, variant, clients, chunk):
    """The round's memory_analysis, read here: arguments + results + temporaries - alias."""
    fn = bench._jitted(variant, bench.MODELS["tiny"][2], clients, chunk)
    m = fn.lower(*bench.round_specs("tiny", clients, 1)).compile().memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)


# Compiles rounds of many cohort sizes: 20-25 s, kept out of the suite's ten minutes
# (make test-peers runs it, as CI does).
@pytest.mark.peers
def test_the_largest_cohort_fits_and_its_double_does_not(bench):
    # The limit is the vmap round's own need at 4 clients: 4 fits, 8 does not, while the
    # chunked round (2 clients a step) stays under it up to the cap. The cohort, chunk and
    # steps are the first test's, whose compiled rounds the search reuses.
    limit = _analysed_bytes(bench, "hand_vmap", 4, 2)
    (report,) = bench.main(["--model", "tiny", "--clients", "4", "--steps", "1", "--chunk",
                            "2", "--repeats", "1", "--variants",
                            "hand_vmap,fax_bridge_chunked", "--largest-cohort", "8",
                            "--memory-bytes", str(limit)])
    rows = {r["variant"]: r["largest_cohort"] for r in report["rows"]}
    vmap, chunked = rows["hand_vmap"], rows["fax_bridge_chunked"]
    n = vmap["clients"]
    assert not vmap.get("capped") and n is not None
    assert vmap["bytes"] == _analysed_bytes(bench, "hand_vmap", n, 2) <= limit
    assert _analysed_bytes(bench, "hand_vmap", 2 * n, 2) > limit
    assert str(2 * n) in vmap["stop"]
    assert chunked["clients"] == 8 and chunked["capped"] and "stop" not in chunked
    assert chunked["bytes"] == _analysed_bytes(bench, "fax_bridge_chunked", 8, 2) <= limit
    text = bench.table(report)
    assert "largest cohort (to 8)" in text and f"| {n} |" in text and "| 8+ |" in text


@pytest.mark.skipif(bool((jax.devices()[0].memory_stats() or {}).get("bytes_limit")),
                    reason="the device reports a memory limit")
def test_without_a_memory_limit_the_column_says_why(bench):
    (report,) = bench.main(["--model", "tiny", "--clients", "4", "--steps", "1", "--chunk",
                            "2", "--repeats", "1", "--variants", "hand_vmap",
                            "--largest-cohort", "8"])
    assert "--memory-bytes" in report["rows"][0]["largest_cohort"]["absent"]
    assert "give --memory-bytes" in bench.table(report)


@pytest.mark.parametrize("argv", [["--memory-bytes", "1000"],
                                  ["--largest-cohort", "--memory-bytes", "0"],
                                  ["--clients", "8", "--largest-cohort", "4"]])
def test_bad_cohort_options_are_refused(bench, argv, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert "--" in capsys.readouterr().err.splitlines()[-1]
