"""The comparisons of tools/forms_check.py and tools/tff_check.py, on answers that must
fail: the tools themselves run in `make test` against TFF 0.87's side environment, so
their verdicts are checked here on small canned inputs, without it."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import numpy as np
import pytest

TOOLS = pathlib.Path(__file__).resolve().parents[1] / "tools"


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


forms_check = _tool("forms_check")
tff_check = _tool("tff_check")

F32 = np.float32


def test_forms_max_error_passes_float32_rounding_and_fails_wrong_results():
    want = [np.array([1.0, -2.0, 3.0], F32), np.array(0.5, F32)]
    near = [w + w * F32(1e-6) for w in want]
    assert 0 < forms_check.max_error(want, near) <= 3.1e-6
    wrong = [
        [want[0] + F32(1e-3), want[1]],                   # beyond float32 tolerance
        [want[0], np.array(np.nan, F32)],                 # a NaN for a number
        [want[0]],                                        # a result missing
        [want[0], want[1], want[1]],                      # one too many
        [np.array(1.0, F32), want[1]],                    # a scalar numpy would broadcast
        [want[0][:2], want[1]],                           # another shape
    ]
    for got in wrong:
        with pytest.raises(AssertionError):
            forms_check.max_error(want, got)


def test_forms_exact_error_needs_integer_leaves_equal():
    want = [np.array([3, 4], np.int32), np.array([1.0], F32), np.array(True)]
    assert forms_check.exact_error(want, [w.copy() for w in want]) == 0.0
    # A PRNG key or counter is exact: one off fails, where a float would pass.
    with pytest.raises(AssertionError, match="integer leaf"):
        forms_check.exact_error(want, [np.array([3, 5], np.int32), want[1], want[2]])
    with pytest.raises(AssertionError, match="integer leaf"):
        forms_check.exact_error(want, [want[0], want[1], np.array(False)])
    with pytest.raises(AssertionError):
        forms_check.exact_error(want, [want[0], want[1] + F32(1e-3), want[2]])
    # Unsigned leaves come back from TensorFlow as signed bits: the same bits pass.
    key = np.array([2**32 - 1], np.uint32)
    assert forms_check.exact_error([key], [key.view(np.int32)]) == 0.0


def test_forms_refusals_must_be_the_expected_ones():
    # Only the rounds that cannot fit one form may be refused, each for its reason.
    assert set(forms_check.EXPECTED_REFUSALS) == {
        "fed_sgd", "learned_server_lr", "learned_client_weights", "streaming_diloco"}
    assert all(forms_check.EXPECTED_REFUSALS[name] for name in (
        "fed_sgd", "learned_server_lr", "learned_client_weights", "streaming_diloco"))


def test_tff_compare_fails_every_disagreement():
    sig = "(int32 -> int32)"
    paths = ["ok.pb", "other.pb", "tff_error.pb", "fl_error.pb", "recorded.pb",
             "silent.pb", "both_silent.pb"]
    fl = {p: (sig, None) for p in paths}
    tff = {p: {"type_signature": sig, "error": None} for p in paths}
    tff["other.pb"] = {"type_signature": "(int32 -> float32)", "error": None}
    tff["tff_error.pb"] = {"type_signature": None, "error": "ValueError: bad"}
    fl["fl_error.pb"] = (None, "DecodeError: bad")
    tff["silent.pb"] = {"type_signature": None, "error": None}   # no answer at all
    fl["both_silent.pb"] = (None, None)
    tff["both_silent.pb"] = {"type_signature": None, "error": None}
    rows = tff_check.compare(paths, fl, tff, {"recorded.pb": "(float32 -> int32)"})
    status = {pathlib.Path(r.path).name: r.status for r in rows}
    assert status == {"ok.pb": "OK", "other.pb": "MISMATCH", "tff_error.pb": "ERROR",
                      "fl_error.pb": "ERROR", "recorded.pb": "MISMATCH",
                      "silent.pb": "ERROR", "both_silent.pb": "ERROR"}
    assert [r.ok for r in rows].count(True) == 1


def test_tff_check_refuses_a_folder_with_no_computation(tmp_path):
    empty = tmp_path / "exported"
    empty.mkdir()
    (tmp_path / "one.pb").write_bytes(b"")
    with pytest.raises(tff_check.CheckError, match="holds no .pb file"):
        tff_check.collect_pb_paths([empty, tmp_path])
    assert tff_check.main(["--pb-dir", str(empty), "--pb-dir", str(tmp_path)]) == 2
