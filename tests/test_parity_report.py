"""How a parity report reads: the summary first (verdict, what ran, chunks, the worst
leaf and the share of its allowance it used), the type signature cut short, the worst
rows with `top`, and every leaf in its JSON; `fax-bridge parity --top/--json`."""

from __future__ import annotations

import json
import math

import numpy as np
from hypothesis import given, settings, strategies as st

import fax_bridge as fb
from fax_bridge import cli
from fax_bridge.parity.report import LeafParity, ParityReport, chunking_of, compare_leaves

QUICKSTART = "examples/quickstart.py"


def _report(diffs, bounds, signature="(<x={float32[3]}@CLIENTS> -> float32[3]@SERVER)",
            **kwargs) -> ParityReport:
    leaves = [LeafParity(f"result['w{i}']", (3,), "float32", d, d, d <= b, bound=b,
                         bound_method="shadow" if i % 2 else "first-order")
              for i, (d, b) in enumerate(zip(diffs, bounds))]
    return ParityReport(leaves, 0.0, 0.0, 2, 0.001, 0.002, signature,
                        client_runtime="litert", **kwargs)


def test_many_leaves_print_a_summary_a_short_signature_and_the_worst_rows():
    diffs = [1e-9 * (i + 1) for i in range(73)]
    bounds = [1e-6] * 73
    bounds[40] = 2e-8  # leaf 40 uses 205% of its bound: the one mismatch
    report = _report(diffs, bounds, signature="(<" + "w=float32[64,64]," * 170 + "> -> x)",
                     chunking=chunking_of(fb.program(clients=64, clients_per_step=4)(
                         lambda x: x), 64))
    text = report.table(top=5)
    lines = text.splitlines()
    assert lines[0] == ("PARITY MISMATCH: 73 output leaves, 1 mismatched; jit against a "
                        "fleet of 2 device(s) running client parts in litert; jit ran the "
                        "clients in chunks of 4 (of 64 clients)")
    assert lines[1].startswith("worst leaf: result['w40'] float32[3]: max abs err 4.100e-08, "
                               "bound 2.000e-08, first-order: 205.0% of what it may differ by")
    assert lines[2].startswith("parity: (<w=float32") and len(lines[2]) < 300
    assert f"({len(report.signature):,} characters; whole in the report's JSON)" in lines[2]
    rows = [line for line in lines if line.startswith("result[")]
    # the mismatch first, then the largest shares of their bounds
    assert [r.split()[0] for r in rows] == ["result['w40']", "result['w72']", "result['w71']",
                                           "result['w70']", "result['w69']"]
    assert rows[0].endswith("MISMATCH  first-order") and rows[4].endswith("ok        shadow")
    assert "... 68 more leaves, all ok (every row: the report's JSON)" in lines
    assert lines[-1] == "PARITY MISMATCH"
    assert len(report.table().splitlines()) == len(lines) - 2 + 68  # every row, no "..."
    whole = report.to_json()
    assert json.loads(json.dumps(whole)) == whole and whole["signature"] == report.signature
    assert [leaf["path"] for leaf in whole["leaves"]] == [leaf.path for leaf in report.leaves]
    assert whole["leaves"][40]["used"] == 4.1e-08 / 2e-8 and whole["ok"] is False


def test_a_leaf_that_may_not_differ_and_does_is_the_worst_and_says_so():
    report = _report([0.0, 1e-9, 3e-7], [0.0, 1e-6, 1e-6])
    assert [leaf.used for leaf in report.leaves] == [0.0, 1e-3, 0.3]
    report.leaves[0].max_abs, report.leaves[0].ok = 1e-9, False
    assert math.isinf(report.leaves[0].used) and report.worst()[0] is report.leaves[0]
    assert "it may not differ" in report.summary()[1]
    assert report.to_json()["leaves"][0]["used"] == "inf"


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-1024, 1024, width=32), min_size=1, max_size=6),
       st.lists(st.floats(-2**-10, 2**-10, width=32), min_size=6, max_size=6),
       st.floats(0, 1e-3), st.floats(1e-9, 1e-5))
def test_the_share_used_says_whether_the_tolerance_holds(want, noise, rtol, atol):
    want = np.asarray(want, np.float32)
    got = want + np.asarray(noise[:len(want)], np.float32)
    [leaf] = compare_leaves(want, got, rtol, atol)
    assert leaf.ok == (leaf.used <= 1.0) or math.isclose(leaf.used, 1.0, rel_tol=1e-6)


def test_parity_command_prints_the_worst_rows_and_writes_every_leaf(tmp_path, capsys,
                                                                     monkeypatch):
    from fax_bridge.parity import check as parity

    def fake(fn, *args, **kwargs):
        return _report([1e-9, 5e-7, 2e-9], [1e-6, 1e-6, 1e-6])

    monkeypatch.setattr(parity, "check_parity", fake)
    out = tmp_path / "report.json"
    assert cli.main(["parity", f"{QUICKSTART}:fedavg_round", "--clients", "2", "--top", "1",
                     "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("PARITY OK: 3 output leaves") and "result['w1']" in lines[1]
    assert [line.split()[0] for line in lines if line.startswith("result[")] == [
        "result['w1']"]
    assert len(json.loads(out.read_text())["leaves"]) == 3


INTEGERS = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32,
            np.int64, np.uint64]


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(INTEGERS), st.data())
def test_integers_of_every_width_differing_by_one_mismatch(dtype, data):
    info = np.iinfo(dtype) if dtype is not np.bool_ else None
    low, high = (0, 1) if info is None else (int(info.min), int(info.max))
    values = st.one_of(st.integers(low, high), st.integers(max(low, high - 2**20), high),
                       st.integers(low, min(high, low + 2**20)))  # and near both ends
    want = np.asarray(data.draw(st.lists(values, min_size=1, max_size=5)), dtype)
    i = data.draw(st.integers(0, want.size - 1))
    got = want.copy()
    step = 1 if int(want[i]) < high else -1  # one more, or one less at the top
    got[i] = int(want[i]) + step
    [leaf] = compare_leaves(want, got, 0.0, 0.0)
    assert not leaf.ok and leaf.max_abs == 1.0, (want, got, leaf)
    [leaf] = fb.parity.bounded_leaves(want, got, [np.zeros(want.shape)], ["result"])
    assert not leaf.ok, (want, got, leaf)
    [leaf] = compare_leaves(want, want.copy(), 0.0, 0.0)
    assert leaf.ok and leaf.max_abs == 0.0
