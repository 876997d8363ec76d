"""A coordinator killed mid-run resumes from its checkpoint with bit-identical results."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from hypothesis import given, settings, strategies as st

from fax_bridge.errors import CheckpointError, FleetError
import sample_computations as sc
from fax_bridge.rounds import checkpoint
from fax_bridge.fleet.launcher import LocalFleet
from fax_bridge.rounds.policy import RoundPolicy

HERE = os.path.dirname(os.path.abspath(__file__))
ROUNDS = 6
POLICY = dict(cohort_size=6, dropout=0.2, seed=3)

# The run, as a script: the killed coordinator and the references run the same code.
SCRIPT = """
import json, sys, time
import numpy as np
import sample_computations as sc
from fax_bridge.fleet.launcher import LocalFleet

def data(r):
    rng = np.random.default_rng(r)
    return (rng.normal(size=(10, 6, 5)).astype(np.float32),
            rng.normal(size=(10, 6)).astype(np.float32))

proto = sc.linear_regression_step(features=5, examples=6)
w0 = np.zeros(5, np.float32)
"""


def _namespace() -> dict:
    scope: dict = {}
    exec(SCRIPT, scope)
    return scope


def test_checkpoints_round_trip_without_pickle(tmp_path):
    state = {"w": np.arange(3, dtype=np.float32), "opt": (np.int64(4), [np.ones((2, 2))]),
             "none": None}
    checkpoint.save(tmp_path, 2, state, {"k": "v"})
    saved = checkpoint.load(tmp_path)
    assert saved.round == 2 and saved.meta == {"k": "v"}
    np.testing.assert_array_equal(saved.state["opt"][1][0], np.ones((2, 2)))
    assert saved.state["none"] is None and saved.state["w"].dtype == np.float32
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".state-")]
    (tmp_path / checkpoint.FILE_NAME).write_bytes(b"not an npz")
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        checkpoint.load(tmp_path)
    for header in ["[" * 300_000 + "]" * 300_000, '{"format": NaN}', "[1e400]"]:
        np.savez(tmp_path / checkpoint.FILE_NAME,
                 header=np.frombuffer(header.encode(), np.uint8))
        with pytest.raises(CheckpointError, match="truncated or corrupt.*not JSON"):
            checkpoint.load(tmp_path)
    os.unlink(tmp_path / checkpoint.FILE_NAME)
    os.mkfifo(tmp_path / checkpoint.FILE_NAME)  # opened without blocking
    with pytest.raises(CheckpointError, match="is a FIFO"):
        checkpoint.load(tmp_path)


STATE = {"w": np.arange(6, dtype=np.float32), "opt": (np.int64(4), [np.ones((2, 2))])}


@settings(max_examples=40, deadline=None, database=None)
@given(st.data())
def test_truncated_or_damaged_checkpoints_give_a_named_error(tmp_path_factory, data):
    directory = tmp_path_factory.mktemp("ckpt")
    path = checkpoint.save(directory, 1, STATE, {"k": "v"})
    raw = bytearray(path.read_bytes())
    if data.draw(st.booleans(), label="truncate"):
        raw = raw[:data.draw(st.integers(0, len(raw) - 1), label="keep")]
    else:
        for _ in range(data.draw(st.integers(1, 4), label="flips")):
            at = data.draw(st.integers(0, len(raw) - 1), label="at")
            raw[at] ^= data.draw(st.integers(1, 255), label="xor")
    path.write_bytes(bytes(raw))
    try:
        saved = checkpoint.load(directory)
    except CheckpointError as e:
        assert str(path) in str(e)
        return
    # a flip the zip format does not cover (e.g. in a file comment) leaves the state intact
    np.testing.assert_array_equal(saved.state["w"], STATE["w"])
    np.testing.assert_array_equal(saved.state["opt"][1][0], STATE["opt"][1][0])


def test_a_checkpoint_folder_another_user_could_write_is_refused(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(PermissionError, match=f"{folder} is writable by others"):
        checkpoint.save(folder, 1, STATE, {"k": "v"})
    assert os.listdir(folder) == []
    link = tmp_path / "link"
    os.symlink(tmp_path, link)
    with pytest.raises(PermissionError, match=f"{link} is a symbolic link"):
        checkpoint.save(link, 1, STATE, {"k": "v"})


def test_a_checkpoint_flagged_encrypted_gives_a_named_error(tmp_path, flag_encrypted):
    """A damaged bit that marks the archive's entries encrypted (zipfile's RuntimeError)
    is reported like every other damage: naming the file, saying how to start over."""
    path = checkpoint.save(tmp_path, 1, STATE, {"k": "v"})
    path.write_bytes(flag_encrypted(path.read_bytes()))
    with pytest.raises(CheckpointError, match="truncated or corrupt.*delete it"):
        checkpoint.load(tmp_path)


def test_the_program_fingerprint_ignores_where_a_program_was_built_only():
    a = sc.linear_regression_step(features=5, examples=6)
    assert checkpoint.program_fingerprint(a) == checkpoint.program_fingerprint(
        sc.linear_regression_step(features=5, examples=6))
    assert checkpoint.program_fingerprint(a) != checkpoint.program_fingerprint(
        sc.linear_regression_step(features=5, examples=6, lr=0.2))


def test_a_killed_coordinator_resumes_with_identical_results(tmp_path):
    ns = _namespace()
    ckpt = tmp_path / "ckpt"
    driver = SCRIPT + f"""
fleet = LocalFleet(devices=2, cohort_size={POLICY['cohort_size']}, dropout={POLICY['dropout']},
                   seed={POLICY['seed']}).start()
print(json.dumps({{"devices": fleet.pids}}), flush=True)
def on_round(r, result, rep):
    print(json.dumps({{"round": r}}), flush=True)
    if r == 1:
        sys.stdin.read()  # held here (the test never writes) until it is killed
fleet.run_loop(proto, w0, {ROUNDS}, data, next_state=lambda out: out["w"],
               checkpoint_dir={str(ckpt)!r}, on_round=on_round)
print(json.dumps({{"finished": True}}), flush=True)
"""
    proc = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE,
                            stdin=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            start_new_session=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu",
                                 "PYTHONPATH": os.pathsep.join(  # sample_computations
                                     [HERE, os.environ.get("PYTHONPATH", "")])})
    device_pids = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = json.loads(proc.stdout.readline() or "{}")
            device_pids = line.get("devices", device_pids)
            if line.get("round") == 1 or line.get("finished") or not line:
                break
        os.killpg(proc.pid, signal.SIGKILL)  # the coordinator dies; no cleanup runs
    finally:
        proc.wait(timeout=30)
        proc.stdout.close()
        proc.stdin.close()
    saved = checkpoint.load(ckpt)
    assert saved is not None and saved.round < ROUNDS - 1  # it really was interrupted
    deadline = time.monotonic() + 120  # its devices notice and exit by themselves
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") and open(
            f"/proc/{p}/stat").read().split()[2] != "Z" for p in device_pids):
        time.sleep(0.1)
    with LocalFleet(devices=3, **POLICY) as fleet:  # another device count, on purpose
        resumed = fleet.run_loop(ns["proto"], ns["w0"], ROUNDS, ns["data"],
                                 next_state=lambda out: out["w"], checkpoint_dir=ckpt)
        fleet.next_round = 0
        straight = fleet.run_loop(ns["proto"], ns["w0"], ROUNDS, ns["data"],
                                  next_state=lambda out: out["w"])
        with pytest.raises(CheckpointError, match="its program differs"):
            other = sc.linear_regression_step(features=5, examples=6, lr=0.2)  # same type
            fleet.run_loop(other, ns["w0"], ROUNDS, ns["data"],
                           next_state=lambda out: out["w"], checkpoint_dir=ckpt)
        with pytest.raises(FleetError, match="another run"):
            fleet.policy = RoundPolicy(seed=99)
            fleet.run_loop(ns["proto"], ns["w0"], ROUNDS, ns["data"],
                           next_state=lambda out: out["w"], checkpoint_dir=ckpt)
    assert resumed.tobytes() == straight.tobytes()
    assert checkpoint.load(ckpt).round == ROUNDS - 1
    alive = [p for p in device_pids if os.path.exists(f"/proc/{p}")
             and open(f"/proc/{p}/stat").read().split()[2] != "Z"]
    assert alive == []


@settings(max_examples=10, deadline=None)
@given(key=st.sampled_from(checkpoint.RUN_KEYS), setting=st.sampled_from(
    ["checkpoint_dir", "checkpoint-dir"]))
def test_a_checkpoint_of_another_run_is_refused_by_the_key_that_differs(tmp_path_factory,
                                                                         key, setting):
    folder = tmp_path_factory.mktemp("ckpt")
    meta = {"computation": "(x -> y)", "program": "abc", "policy": "P()", "num_rounds": 3}
    assert checkpoint.resume(folder, meta, setting=setting) is None  # nothing saved yet
    checkpoint.save(folder, 1, np.arange(3.0), meta)
    saved = checkpoint.resume(folder, dict(meta, num_rounds=9), setting=setting)
    assert saved.round == 1 and saved.state.tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(CheckpointError, match=f"its {key} differs.*fresh {setting}"):
        checkpoint.resume(folder, dict(meta, **{key: "other"}), setting=setting)
