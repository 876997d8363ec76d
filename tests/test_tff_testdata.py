"""The committed TFF 0.87 test computations, and tools/tff_check.py's comparison of the two readers.

The data in tests/data/tff087/ was written by TFF itself (tools/tff087/make_testdata.py).
Here it must parse with federated_language 0.5.4 to exactly the recorded signature, and
its npz files must follow the project's convention (dotted element-name keys, `arg` /
`result` for non-structs, a leading clients axis on CLIENTS values).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import sys
import time

import numpy as np
import pytest
from processes import alive

from federated_language.compiler import building_blocks
from federated_language.proto import computation_pb2
import federated_language as fl

REPO = pathlib.Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data" / "tff087"
TFF_PYTHON = REPO / ".venv-tff" / "bin" / "python"
NAMES = sorted(p.stem for p in DATA.glob("*.pb"))

_spec = importlib.util.spec_from_file_location("tff_check", REPO / "tools" / "tff_check.py")
tff_check = importlib.util.module_from_spec(_spec)
sys.modules["tff_check"] = tff_check
_spec.loader.exec_module(tff_check)

needs_tff_venv = pytest.mark.skipif(
    not TFF_PYTHON.exists(),
    reason=f"{TFF_PYTHON.relative_to(REPO)} is absent; build it with tools/tff087/setup.sh "
           "(make test does)")


def _meta(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


def _block(name: str) -> building_blocks.ComputationBuildingBlock:
    proto = computation_pb2.Computation.FromString((DATA / f"{name}.pb").read_bytes())
    return building_blocks.ComputationBuildingBlock.from_proto(proto)


def _leaves(t: fl.Type, prefix: str, placement=None):
    """Yields (npz key, placement, TensorType) for each tensor in `t`, keys per the convention."""
    if isinstance(t, fl.FederatedType):
        yield from _leaves(t.member, prefix, t.placement)
    elif isinstance(t, fl.StructType):
        for i, (name, element) in enumerate(t.items()):
            part = name if name is not None else str(i)
            yield from _leaves(element, f"{prefix}.{part}" if prefix else part, placement)
    elif isinstance(t, fl.TensorType):
        yield prefix, placement, t
    else:
        raise AssertionError(f"unexpected type {t} in the test data")


def _expected_keys(t: fl.Type, top: str):
    """Leaves of a parameter/result: a non-struct gets the single key `top`."""
    if isinstance(t, fl.StructType):
        return list(_leaves(t, ""))
    return [(top, placement, tensor) for _, placement, tensor in _leaves(t, "")]


def test_data_present():
    assert len(NAMES) >= 8, f"expected the generated cases in {DATA}, found {NAMES}"
    for name in NAMES:
        for suffix in (".json", ".inputs.npz", ".expected.npz"):
            assert (DATA / f"{name}{suffix}").is_file(), f"{name}{suffix} is missing"


@pytest.mark.parametrize("name", NAMES)
def test_parses_with_recorded_signature(name):
    assert str(_block(name).type_signature) == _meta(name)["type_signature"]


@pytest.mark.parametrize("name", NAMES)
def test_npz_follow_convention(name):
    signature = _block(name).type_signature
    clients = _meta(name)["clients"]
    assert 3 <= clients <= 5
    for kind, t, top in (("inputs", signature.parameter, "arg"),
                         ("expected", signature.result, "result")):
        with np.load(DATA / f"{name}.{kind}.npz") as npz:
            arrays = dict(npz)
        want = _expected_keys(t, top)
        assert sorted(arrays) == sorted(k for k, _, _ in want), f"{name}.{kind}.npz keys"
        for key, placement, tensor in want:
            lead = (clients,) if placement is fl.CLIENTS else ()
            assert arrays[key].shape == lead + tuple(tensor.shape), f"{name}.{kind}[{key}]"
            assert arrays[key].dtype == np.dtype(tensor.dtype), f"{name}.{kind}[{key}]"


def test_expected_results_spot_checks():
    """Re-derives two expected results from the inputs, independently of the generator."""
    with np.load(DATA / "federated_weighted_mean.inputs.npz") as i, \
            np.load(DATA / "federated_weighted_mean.expected.npz") as e:
        v, w = i["values"], i["weights"]
        np.testing.assert_allclose(e["result"], np.average(v, axis=0, weights=w), rtol=1e-6)
    with np.load(DATA / "server_apply.inputs.npz") as i, \
            np.load(DATA / "server_apply.expected.npz") as e:
        np.testing.assert_allclose(e["result"], i["0"] - 0.25 * i["1"].sum(0), rtol=1e-6)


# --- tools/tff_check.py ------------------------------------------------------------------

def test_compare_classifies_rows():
    paths = ["a.pb", "b.pb", "c.pb", "d.pb"]
    fl_sigs = {"a.pb": ("(int32 -> int32)", None), "b.pb": ("(int32 -> int32)", None),
               "c.pb": (None, "DecodeError: bad"), "d.pb": ("(int32 -> int32)", None)}
    tff_sigs = {"a.pb": {"type_signature": "(int32 -> int32)", "error": None},
                "b.pb": {"type_signature": "(int32 -> float32)", "error": None},
                "c.pb": {"type_signature": None, "error": "DecodeError: bad"},
                "d.pb": {"type_signature": "(int32 -> int32)", "error": None}}
    recorded = {"d.pb": "(float32 -> int32)"}
    rows = tff_check.compare(paths, fl_sigs, tff_sigs, recorded)
    assert [r.status for r in rows] == ["OK", "MISMATCH", "ERROR", "MISMATCH"]
    assert "DecodeError" in rows[2].detail and "recorded" in rows[3].detail


def _fake_reader(tmp_path: pathlib.Path, body: str) -> pathlib.Path:
    """An executable standing in for .venv-tff/bin/python (argv[1] is the reader script)."""
    exe = tmp_path / "fake_tff_python"
    exe.write_text(f"#!{sys.executable}\nimport json, sys, os, time\n{body}\n")
    exe.chmod(0o755)
    return exe


def test_main_exit_status_on_mismatch(tmp_path, capsys):
    good = DATA / "federated_mean.pb"
    fake = _fake_reader(tmp_path, (
        "paths = sys.argv[2:]\n"
        "print(json.dumps({p: {'type_signature': '(int32 -> int32)', 'error': None} "
        "for p in paths}))"))
    assert tff_check.main([str(good), "--tff-python", str(fake)]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out and "federated_mean.pb" in out


def test_reader_timeout_kills_process_group(tmp_path):
    pid_file = tmp_path / "child.pid"
    fake = _fake_reader(tmp_path, (
        "import subprocess\n"
        "child = subprocess.Popen(['sleep', '300'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(300)"))
    with pytest.raises(tff_check.CheckError, match="did not finish"):
        tff_check.read_tff_signatures([DATA / "federated_mean.pb"], tff_python=fake, timeout_s=3)
    pid = int(pid_file.read_text())
    for _ in range(50):  # the killed child may take a moment to die
        if not alive(pid):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the reader's child process {pid} survived the timeout")


def test_missing_tff_venv_is_a_clear_error(tmp_path):
    with pytest.raises(tff_check.CheckError, match="setup.sh"):
        tff_check.read_tff_signatures([DATA / "federated_mean.pb"],
                                      tff_python=tmp_path / "no-such-python")


@needs_tff_venv
def test_real_tff_reader_agrees(tmp_path):
    broken = tmp_path / "empty.pb"
    broken.write_bytes(b"")  # parses as a proto, but holds no computation
    paths = [DATA / f"{n}.pb" for n in NAMES] + [broken]
    rows = tff_check.compare_signatures(paths, tff_python=TFF_PYTHON)
    by_name = {pathlib.Path(r.path).stem: r for r in rows}
    for name in NAMES:
        row = by_name[name]
        assert row.status == "OK", f"{name}: {row}"
        assert row.tff_signature == _meta(name)["type_signature"]
    assert by_name["empty"].status == "ERROR"
    assert "TFF:" in by_name["empty"].detail
