"""RemoteFleet: devices started on their own (not by the fleet) joined by address or fleet
file; rounds equal to a direct computation; a device lost mid-round (killed on loopback,
or its network namespace cut off) leaves the round to the survivors, or fails it when
fewer than min_clients are left."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import pathlib
import secrets
import select
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import fax_bridge
from fax_bridge.errors import FleetError
import sample_computations as sc
from processes import at_round_requests
from fax_bridge.fleet import device, device_cli, fleet_file
from fax_bridge.fleet.coordinator import GrpcClientsBackend
from fax_bridge.fleet.protocol import partition
from fax_bridge.fleet.remote import RemoteFleet

PACKAGE_ROOT = str(pathlib.Path(fax_bridge.__file__).resolve().parents[1])
TESTS_DIR = str(pathlib.Path(__file__).resolve().parent)  # sample_computations
sys.path.insert(0, str(pathlib.Path(TESTS_DIR).parent / "benchmarks"))

import netns  # noqa: E402
TOKEN = secrets.token_hex(16)
N = 12


# ---------------------------------------------------------------------------------------
# Starting devices by hand, as an operator would on each host


def _device_options() -> set:
    parser = argparse.ArgumentParser()
    device_cli._add_arguments(parser)
    return {o for action in parser._actions for o in action.option_strings}


def _coordinator_sends_token() -> bool:
    return "token" in inspect.signature(GrpcClientsBackend).parameters


def _env() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1",
               XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
    env["PYTHONPATH"] = os.pathsep.join(
        [PACKAGE_ROOT, TESTS_DIR, env.get("PYTHONPATH", "")]).strip(os.pathsep)
    if _coordinator_sends_token():
        env["FAX_BRIDGE_FLEET_TOKEN"] = TOKEN
    for key in ("http_proxy", "https_proxy", "grpc_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        env.pop(key, None)
    return env


def _device_argv(listen: str, name: str) -> list:
    argv = [sys.executable, "-m", "fax_bridge.fleet.device_cli", "--listen", listen,
            "--device-id", name]
    options = _device_options()
    if "--allow-remote" in options and not listen.startswith("127."):
        argv.append("--allow-remote")
    if "--allow-no-auth" in options and not _coordinator_sends_token():
        argv.append("--allow-no-auth")
    return argv


def _start_device(prefix: list, listen: str, name: str) -> subprocess.Popen:
    return subprocess.Popen(prefix + _device_argv(listen, name), env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def _read_address(proc: subprocess.Popen, timeout_s: float = 90.0) -> str:
    deadline = time.monotonic() + timeout_s
    buffer = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 4096)
            buffer += chunk
            for line in buffer.splitlines():
                if line.startswith(b"{"):
                    return json.loads(line)["listening"]
            if not chunk and proc.poll() is not None:
                break
        elif proc.poll() is not None:
            break
    err = proc.stderr.read().decode(errors="replace")[-2000:] if proc.poll() is not None else ""
    raise AssertionError(f"device did not print its address (exit {proc.poll()}): {err}")


def _stop(procs) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def _inputs():
    x = np.stack([np.full(2, i + 1, np.float32) for i in range(N)])
    return x, np.full(2, 0.5, np.float32)


def _expected(participants) -> np.ndarray:
    x, s = _inputs()
    return (x[list(participants)] * s).sum(axis=0)


@pytest.fixture
def loopback_devices():
    procs = [_start_device([], "127.0.0.1:0", f"dev-{i}") for i in range(3)]
    try:
        yield procs, [_read_address(p) for p in procs]
    finally:
        _stop(procs)


# ---------------------------------------------------------------------------------------
# Fleet files


def test_fleet_file_round_trip_and_errors(tmp_path):
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps({
        "devices": ["10.0.0.2:50051", {"address": "[fd00::3]:50051", "name": "n3"}],
        "token_file": "fleet.token",
        "tls": {"ca_cert": "ca.pem", "cert": "c.pem", "key": "c.key"}}))
    spec = fleet_file.load_fleet_file(path)
    assert spec.addresses == ("10.0.0.2:50051", "[fd00::3]:50051")
    assert spec.names == ("10.0.0.2:50051", "n3")
    assert spec.token_file == str(tmp_path / "fleet.token")
    assert spec.tls["ca_cert"] == str(tmp_path / "ca.pem")
    out = tmp_path / "out.json"
    fleet_file.write_fleet_file(out, ["h1:1", "h2:2"])
    assert fleet_file.load_fleet_file(out).addresses == ("h1:1", "h2:2")
    assert fleet_file.parse_devices(" h1:1, h2:2 ,") == ["h1:1", "h2:2"]

    cases = [({"devices": []}, "non-empty 'devices'"),
             ({"devices": ["h:0"]}, "port in 1..65535"),
             ({"devices": ["nohost"]}, "not HOST:PORT"),
             ({"devices": ["h:1", "h:1"]}, "twice"),
             ({"devices": ["h:1"], "secret": "x"}, "unknown keys"),
             ({"devices": ["h:1"], "tls": {"ca_cert": "a"}}, "ca_cert, cert, key")]
    for data, message in cases:
        path.write_text(json.dumps(data))
        with pytest.raises(FleetError, match=message):
            fleet_file.load_fleet_file(path)
    for text in ["{not json", "[" * 300_000 + "]" * 300_000, '{"devices": [1e400]}',
                 '{"devices": ["h:1"], "devices": ["h:2"]}']:
        path.write_text(text)
        with pytest.raises(FleetError, match="not valid JSON"):
            fleet_file.load_fleet_file(path)
    path.unlink()
    os.mkfifo(path)  # opened without blocking, refused by its type
    with pytest.raises(FleetError, match="is a FIFO"):
        fleet_file.load_fleet_file(path)
    with pytest.raises(FleetError, match="fd00::1"):
        fleet_file.parse_devices("fd00::1:50051")
    with pytest.raises(FleetError, match="exactly one of"):
        RemoteFleet()


def test_both_fleets_take_the_same_round_options():
    import dataclasses

    from fax_bridge.fleet.config import FleetConfig
    from fax_bridge.fleet.launcher import LocalFleet
    from fax_bridge.fleet.session import ROUND_OPTIONS, FleetRounds

    shared = inspect.signature(FleetRounds.__init__).parameters
    # LocalFleet takes the policy itself and the rest as FleetConfig fields
    local = {**inspect.signature(LocalFleet.__init__).parameters,
             **{f.name: f for f in dataclasses.fields(FleetConfig)}}
    remote = inspect.signature(RemoteFleet.__init__).parameters
    for name in ROUND_OPTIONS:
        assert name in local and name in remote, name
        assert local[name].default == remote[name].default, name
        if name != "policy":
            assert name in shared, name
    fleet = RemoteFleet(["127.0.0.1:1"], reject_nonfinite=True)  # not started: no devices
    assert fleet.reject_nonfinite is True
    assert RemoteFleet(["127.0.0.1:1"]).reject_nonfinite is False


# ---------------------------------------------------------------------------------------
# Loopback: devices started by hand, one killed mid-round


def _token_kwargs() -> dict:
    return {"token": TOKEN} if _coordinator_sends_token() else {}


def test_remote_fleet_runs_rounds_and_survives_a_killed_device(loopback_devices, tmp_path):
    procs, addresses = loopback_devices
    path = tmp_path / "fleet.json"
    token_file = None
    if _coordinator_sends_token():
        from fax_bridge.fleet import security

        token_file = "fleet.token"
        security.write_token_file(tmp_path / token_file, TOKEN)  # owner-only file
    fleet_file.write_fleet_file(path, addresses, token_file=token_file)
    proto = sc.scaled_aggregate((2,), "sum")
    x, s = _inputs()
    with RemoteFleet(fleet_file=path) as fleet:
        got, rep = fleet.run(proto, x, s, report=True)
        np.testing.assert_array_equal(got, _expected(range(N)))
        assert rep.devices == 3 and rep.lost_devices == []
    for proc in procs:
        assert proc.poll() is None  # closing a RemoteFleet leaves its devices running
    bad = x.copy()
    bad[1, 0] = np.nan
    with RemoteFleet(fleet_file=path) as fleet:  # by default NaN propagates, as in jit
        assert np.isnan(fleet.run(proto, bad, s)[0])
    with RemoteFleet(fleet_file=path, reject_nonfinite=True) as fleet:
        # The device holding client 1 is refused by name and its clients leave the round.
        got, rep = fleet.run(proto, bad, s, report=True)
        assert 1 in list(rep.lost_clients) and len(rep.lost_devices) == 1
        assert "reject_nonfinite" in rep.lost_devices[0]
        left = sorted(set(range(N)) - set(rep.lost_clients))
        np.testing.assert_array_equal(got, _expected(left))

    # `fax-bridge run --fleet-file`: the same round from files.
    from fax_bridge.fleet.run_cli import run_file
    from fax_bridge.tff.files import save_computation

    save_computation(proto, tmp_path / "comp.pb")
    np.savez(tmp_path / "in.npz", x=x, s=s)
    out, rep = run_file(str(tmp_path / "comp.pb"), str(tmp_path / "in.npz"), devices=1,
                        fleet_file=str(path))
    np.testing.assert_array_equal(out["result"], _expected(range(N)))
    assert rep.devices == 3

    # Device 2 is stopped as the round makes its requests (after its Load: it cannot
    # answer whenever its request comes) and killed once every request has gone.
    with RemoteFleet(addresses, rpc_timeout_s=20, probe_timeout_s=2.0, seed=2,
                     **_token_kwargs()) as fleet:
        with at_round_requests(lambda: os.killpg(procs[2].pid, signal.SIGSTOP),
                               lambda: os.killpg(procs[2].pid, signal.SIGKILL),
                               devices=3) as reached:
            got, rep = fleet.run(proto, x, s, report=True)
        assert reached["made"] and reached["sent"] >= 3, reached
        lost = [list(range(N))[j] for j in partition(N, 3)[2]]
        assert [w.split(": ", 1)[0] for w in rep.lost_devices] == [addresses[2]]
        assert "no Health answer" in rep.lost_devices[0] and rep.lost_clients == lost
        assert rep.participants == [c for c in range(N) if c not in lost]
        assert rep.devices == 2 and fleet.addresses == addresses[:2]
        np.testing.assert_array_equal(got, _expected(rep.participants))
        # The next round runs on the two survivors from the start.
        got, rep = fleet.run(proto, x, s, report=True)
        np.testing.assert_array_equal(got, _expected(range(N)))
        assert rep.lost_devices == [] and rep.devices == 2
    with pytest.raises(FleetError, match="did not become healthy"):
        RemoteFleet(addresses, connect_timeout_s=2, **_token_kwargs()).start()
    if _coordinator_sends_token():
        with pytest.raises(FleetError, match="token"):
            RemoteFleet(addresses[:2], token="not-the-fleet-token", connect_timeout_s=5).start()


# ---------------------------------------------------------------------------------------
# Network namespaces: every device in its own namespace, the coordinator in a hub
# namespace, veth links between them; a link cut mid-round.

COORDINATOR = textwrap.dedent("""
    import json, subprocess, sys
    import numpy as np
    from fax_bridge.errors import FleetError
    import sample_computations as sc
    from processes import at_round_requests
    from fax_bridge.fleet.remote import RemoteFleet

    cfg = json.loads(sys.argv[1])
    n = cfg["clients"]
    x = np.stack([np.full(2, i + 1, np.float32) for i in range(n)])
    s = np.full(2, 0.5, np.float32)
    proto = sc.scaled_aggregate((2,), "sum")
    out = {}

    def cut_at_requests(command):
        # The link goes down as the round makes its requests (after its Load).
        return at_round_requests(lambda: subprocess.run(command, check=True))

    with RemoteFleet(cfg["addresses"]) as fleet:
        got, rep = fleet.run(proto, x, s, report=True)
        out["full"] = {"result": got.tolist(), "devices": rep.devices}
    # Link of device 2 goes down mid-round: the round finishes on devices 0 and 1.
    with RemoteFleet(cfg["addresses"], rpc_timeout_s=2, probe_timeout_s=1.0,
                     seed=2) as fleet:
        with cut_at_requests(["ip", "link", "set", cfg["links"][2], "down"]) as reached:
            got, rep = fleet.run(proto, x, s, report=True)
        assert reached["made"], reached
        out["cut"] = {"result": got.tolist(), "lost_devices": rep.lost_devices,
                      "lost_clients": list(rep.lost_clients),
                      "participants": list(rep.participants),
                      "devices": rep.devices, "summary": rep.summary()}
    # Device 1's link is deleted mid-round and every client is required: FleetError.
    with RemoteFleet(cfg["addresses"][:2], rpc_timeout_s=2, probe_timeout_s=1.0,
                     min_clients=n, seed=2) as fleet:
        with cut_at_requests(["ip", "link", "del", cfg["links"][1]]) as reached:
            try:
                fleet.run(proto, x, s)
                out["strict"] = {"error": None}
            except FleetError as e:
                out["strict"] = {"error": str(e)}
        assert reached["made"], reached
    print(json.dumps(out), flush=True)
""")


@pytest.fixture
def namespaces():
    """A hub namespace and three device namespaces joined by veth links
    (`benchmarks/netns.py`, the link benchmarks' hosts): (hub, [(namespace, address)],
    the hub's end of each device's link)."""
    why_not = netns.unavailable()
    if why_not:
        pytest.skip(why_not)
    with netns.Network(3, "fxr-", subnet="10.200.0") as network:
        yield (network.hub, [(network.ns(k), network.node_ip(k)) for k in range(3)],
               [f"hv{k}" for k in range(3)])
    assert netns.names("fxr-") == []


def test_devices_in_namespaces_with_a_link_cut_mid_round(namespaces):
    hub, hosts, links = namespaces
    procs = []
    try:
        for k, (ns, host) in enumerate(hosts):
            procs.append(_start_device(["ip", "netns", "exec", ns], f"{host}:0", f"ns-{k}"))
        addresses = [_read_address(p) for p in procs]
        assert [a.rsplit(":", 1)[0] for a in addresses] == [h for _, h in hosts]
        cfg = json.dumps({"addresses": addresses, "links": links, "clients": N})
        coordinator = subprocess.Popen(
            ["ip", "netns", "exec", hub, sys.executable, "-c", COORDINATOR, cfg],
            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True)
        procs.append(coordinator)
        try:
            out, err = coordinator.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            pytest.fail("the coordinator did not finish within 150s")
        assert coordinator.returncode == 0, err.decode(errors="replace")[-3000:]
        r = json.loads(out.decode().strip().splitlines()[-1])
    finally:
        _stop(procs)

    assert r["full"]["devices"] == 3
    np.testing.assert_array_equal(r["full"]["result"], _expected(range(N)))
    cut = r["cut"]
    lost = list(partition(N, 3)[2])
    assert [w.split(": ", 1)[0] for w in cut["lost_devices"]] == [addresses[2]]
    assert "no Health answer" in cut["lost_devices"][0] and cut["lost_clients"] == lost
    assert cut["participants"] == [c for c in range(N) if c not in lost]
    assert cut["devices"] == 2 and "lost with 1 unreachable" in cut["summary"]
    np.testing.assert_array_equal(cut["result"], _expected(cut["participants"]))
    error = r["strict"]["error"]
    assert error is not None and "min_clients=12" in error and addresses[1] in error
