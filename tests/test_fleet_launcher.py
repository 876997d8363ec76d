"""Device processes: the CLI's port line, and no process outliving its LocalFleet."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import sample_computations as sc
from processes import alive, running
from fax_bridge.fleet import device_cli, security
from fax_bridge.fleet.coordinator import GrpcClientsBackend
from fax_bridge.fleet.launcher import LocalFleet


def _wait_gone(pids, timeout_s=10.0) -> list:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return running(pids)


def test_register_adds_the_device_subcommand():
    parser = argparse.ArgumentParser()
    device_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["device", "--listen", "127.0.0.1:0", "--device-id", "d7"])
    assert args.func is not None and args.listen == "127.0.0.1:0" and args.device_id == "d7"


def test_device_process_prints_its_port_and_serves():
    token = security.new_token()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fax_bridge.fleet.device_cli", "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, security.TOKEN_ENV: token})
    try:
        info = json.loads(proc.stdout.readline())
        assert info["listening"] == f"127.0.0.1:{info['port']}" and info["pid"] == proc.pid
        with GrpcClientsBackend([info["listening"]], connect_timeout_s=30,
                                token=token) as backend:
            assert backend.health()[0].status == "SERVING"
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0  # SIGTERM is a clean shutdown
        proc.stdout.close()


def test_no_device_outlives_the_fleet_even_after_an_exception():
    proto = sc.scaled_aggregate((2,), "sum")
    with pytest.raises(RuntimeError, match="inside the block"):
        with LocalFleet(devices=2) as fleet:
            pids = fleet.pids
            assert len(pids) == 2 and all(alive(p) for p in pids)
            got = fleet.run(proto, np.ones((4, 2), np.float32), np.ones(2, np.float32))
            np.testing.assert_array_equal(got, [4.0, 4.0])
            raise RuntimeError("inside the block")
    assert _wait_gone(pids) == []
    with LocalFleet(devices=1) as fleet:
        pids = fleet.pids
        assert len(pids) == 1 and alive(pids[0])
    assert _wait_gone(pids) == []


def test_devices_exit_when_their_launcher_is_killed():
    script = ("from fax_bridge.fleet.launcher import LocalFleet\n"
              "f = LocalFleet(devices=1).start()\n"
              "print(f.pids[0], flush=True)\n"
              "import time; time.sleep(60)\n")
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        pid = int(launcher.stdout.readline())
        assert alive(pid)
    finally:
        os.killpg(launcher.pid, 9)  # no atexit, no __exit__: only the device's watchdog
        launcher.wait(timeout=10)
        launcher.stdout.close()
    assert _wait_gone([pid]) == []


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 12), st.lists(st.integers(0, 63), min_size=0, max_size=16, unique=True))
def test_cpu_shares_split_the_cpus_evenly_or_round_robin(devices, cpus):
    from fax_bridge.fleet.launcher import cpu_shares

    cpus = sorted(cpus)
    shares = cpu_shares(devices, cpus)
    assert len(shares) == devices
    if len(cpus) < 2:
        assert shares == [None] * devices  # nothing to split
        return
    assert all(share and share <= set(cpus) for share in shares)
    if devices >= len(cpus):  # one CPU each, every CPU used as evenly as it can be
        assert all(len(share) == 1 for share in shares)
        counts = [sum(c in share for share in shares) for c in cpus]
        assert max(counts) - min(counts) <= 1
    else:  # disjoint runs covering every CPU, sizes within one of each other
        assert set().union(*shares) == set(cpus)
        assert sum(len(share) for share in shares) == len(cpus)
        assert max(map(len, shares)) - min(map(len, shares)) <= 1


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs at least two CPUs to split")
def test_devices_start_on_their_own_share_of_the_cpus():
    mine = os.sched_getaffinity(0)
    with LocalFleet(devices=2) as fleet:
        shares = [os.sched_getaffinity(pid) for pid in fleet.pids]
        assert shares[0] and shares[1] and not shares[0] & shares[1]
        assert shares[0] | shares[1] == mine
        restarted = fleet.restart_device(1)
        assert restarted and os.sched_getaffinity(fleet.pids[1]) == shares[1]
    with LocalFleet(devices=2, share_cpus=False) as fleet:
        assert all(os.sched_getaffinity(pid) == mine for pid in fleet.pids)


@pytest.mark.parametrize("planted", ["link", "open folder"])
def test_a_log_folder_or_log_another_user_could_plant_is_refused_before_devices_start(
        tmp_path, planted):
    precious = tmp_path / "precious"
    precious.write_bytes(b"kept\n")
    logs = tmp_path / "logs"
    logs.mkdir(mode=0o700)
    if planted == "link":
        os.symlink(precious, logs / "device-0.log")
        match = f"{logs / 'device-0.log'} is a symbolic link"
    else:
        logs.chmod(0o777)
        match = f"{logs} is writable by others"
    fleet = LocalFleet(devices=1, log_dir=str(logs))
    with pytest.raises(PermissionError, match=match):
        fleet.start()
    assert fleet.pids == [] and precious.read_bytes() == b"kept\n"
