"""Processes forked from one server (fax_bridge.forks): a fleet's devices and their XLA
import helpers, their exit status, the server's lifetime, and the fresh-interpreter
start where the server cannot fork."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

import sample_computations as sc
from processes import alive, children, parent
from fax_bridge import forks
from fax_bridge.fleet import security
from fax_bridge.fleet.launcher import DEVICE_MODULES, LocalFleet

DEVICE = "fax_bridge.fleet.device_cli"

pytestmark = pytest.mark.skipif(not forks.available(), reason="needs Linux pidfds")


def _device_env(**extra) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1", **extra)
    env[security.TOKEN_ENV] = security.new_token()
    return env


def _spawn(server, env, log_path, *argv):
    with open(log_path, "ab") as log:
        return server.run(DEVICE, list(argv), env=env, cwd=os.getcwd(),
                          stderr_fd=log.fileno())


@pytest.fixture(scope="module")
def server():
    env = _device_env()
    server = forks.ForkServer.start(sys.executable, {k: v for k, v in env.items()
                                                     if k != security.TOKEN_ENV},
                                    DEVICE_MODULES)
    yield server, env
    server.close()


def test_fleets_fork_their_devices_from_one_server_that_never_holds_a_token():
    proto = sc.scaled_aggregate((2,), "sum")
    servers = set()
    for _ in range(2):
        with LocalFleet(devices=2) as fleet:
            assert all(isinstance(p, forks.ForkedProcess) for p in fleet._procs)
            parents = {parent(pid) for pid in fleet.pids}
            assert len(parents) == 1 and parents.pop() not in fleet.pids + [os.getpid()]
            servers.add(parent(fleet.pids[0]))
            got = fleet.run(proto, np.ones((4, 2), np.float32), np.ones(2, np.float32))
            np.testing.assert_array_equal(got, [4.0, 4.0])
            # each device's XLA import helper was forked by the server too
            assert not any(children(pid) for pid in fleet.pids)
            assert len(children(parent(fleet.pids[0])) - set(fleet.pids)) >= 2
            token = fleet._token
            pids = fleet.pids
        assert not any(alive(p) for p in pids)
    (server_pid,) = servers  # the second fleet's devices came from the same server
    with open(f"/proc/{server_pid}/environ", "rb") as f:
        environ = f.read()
    with open(f"/proc/{server_pid}/cmdline", "rb") as f:
        cmdline = f.read()
    assert token.encode() not in environ and token.encode() not in cmdline
    assert security.TOKEN_ENV.encode() not in environ


def test_one_server_serves_requests_whose_environments_differ_only_in_volatile_names():
    """pytest names the running test in PYTEST_CURRENT_TEST, so every test's fleet
    would otherwise start (and pay the imports of) a server of its own; a change of
    any other variable still gets its own server, since imports may read it."""
    base = {k: v for k, v in _device_env(FAX_BRIDGE_FORKS_TEST="1").items()
            if k != security.TOKEN_ENV}
    started = []
    try:
        first = forks.shared(sys.executable, dict(base, PYTEST_CURRENT_TEST="a (call)"),
                             ("json",))
        started.append(first)
        again = forks.shared(sys.executable, dict(base, PYTEST_CURRENT_TEST="b (setup)"),
                             ("json",))
        other = forks.shared(sys.executable, dict(base, FAX_BRIDGE_FORKS_TEST="2"),
                             ("json",))
        started.append(other)
        assert again is first and other is not first and other.pid != first.pid
    finally:
        for server in started:
            server.close()


# A device stops cleanly on SIGTERM and SIGINT; any other signal ends it as it would end
# a fresh interpreter, which subprocess reports as minus the signal's number.
@settings(max_examples=6, deadline=None)
@given(st.sampled_from([signal.SIGTERM, signal.SIGINT, signal.SIGKILL, signal.SIGHUP,
                        signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM]))
def test_a_forked_device_reports_its_exit_status_as_subprocess_would(server, tmp_path_factory,
                                                                      signum):
    # A signal this process ignores, its children (the server, and a fresh interpreter
    # alike) ignore too: only signals whose action is the default's end a device.
    assume(signum in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL)
           or signal.getsignal(signum) == signal.SIG_DFL)
    server, env = server
    log_path = tmp_path_factory.mktemp("device") / "device.log"
    proc = _spawn(server, env, log_path, "--listen", "127.0.0.1:0")
    try:
        info = json.loads(proc.stdout.readline())
        assert info["pid"] == proc.pid and parent(proc.pid) == server.pid
        assert proc.poll() is None
        proc.send_signal(signum)
        want = 0 if signum in (signal.SIGTERM, signal.SIGINT) else -signum
        assert proc.wait(timeout=30) == want and proc.poll() == want
    finally:
        proc.kill()
        proc.stdout.close()


def test_a_device_that_cannot_start_gives_its_status_and_its_reason(server, tmp_path):
    server, env = server
    proc = _spawn(server, env, tmp_path / "device.log", "--listen", "no-port-here")
    assert proc.wait(timeout=30) == 2
    assert proc.stdout.read() == b""
    assert "--listen" in (tmp_path / "device.log").read_text()
    proc.stdout.close()


def test_the_server_stays_while_a_device_lives_and_leaves_once_idle(tmp_path):
    env = _device_env()
    server = forks.ForkServer.start(sys.executable, env, DEVICE_MODULES, idle_seconds=1.0)
    try:
        proc = _spawn(server, env, tmp_path / "device.log", "--listen", "127.0.0.1:0",
                      "--parent-pid", str(server.pid))
        json.loads(proc.stdout.readline())
        time.sleep(2.5)
        assert server.alive() and proc.poll() is None  # a live device keeps it
        proc.terminate()
        assert proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 30
        while server.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not server.alive()
        with pytest.raises(forks.ForkServerError, match="could not send|exited"):
            _spawn(server, env, tmp_path / "device.log", "--listen", "127.0.0.1:0")
    finally:
        server.close()
        proc.stdout.close()


def test_a_server_with_threads_refuses_and_the_fleet_starts_fresh_interpreters(
        tmp_path, monkeypatch, caplog):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(site)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    with pytest.raises(forks.ForkServerError, match="2 threads after the imports"):
        forks.ForkServer.start(sys.executable, _device_env(PYTHONPATH=os.environ["PYTHONPATH"]),
                               DEVICE_MODULES)
    proto = sc.scaled_aggregate((2,), "sum")
    starts = []
    start = forks.ForkServer.start
    monkeypatch.setattr(forks.ForkServer, "start",
                        classmethod(lambda cls, *a, **k: starts.append(a) or start(*a, **k)))
    with caplog.at_level(logging.WARNING, logger="fax_bridge.fleet"):
        with LocalFleet(devices=2) as fleet:
            assert not any(isinstance(p, forks.ForkedProcess) for p in fleet._procs)
            assert {parent(pid) for pid in fleet.pids} == {os.getpid()}
            got = fleet.run(proto, np.ones((3, 2), np.float32), np.ones(2, np.float32))
    np.testing.assert_array_equal(got, [3.0, 3.0])
    assert "without a fork server" in caplog.text and "threads after the imports" in caplog.text
    assert len(starts) == 1  # tried once for the fleet, not once a device


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.sampled_from(["run", "status", "argv", "env", "x"]),
                                       inner, max_size=3), max_leaves=8)


_RUNS = st.fixed_dictionaries({key: _JSON for key in ("run", "argv", "env", "cwd", "cpus",
                                                     "stdin")})


@settings(max_examples=80, deadline=None)
@given(st.one_of(st.binary(min_size=1, max_size=40),
                 st.one_of(_JSON, _RUNS).map(lambda v: json.dumps(v).encode())))
def test_a_request_the_server_cannot_serve_is_answered_and_serving_goes_on(server, request):
    """Whatever a requester sends that is no run of a module (with its descriptors) nor
    the status of one of its children, the answer is an error naming it, and the next
    request is served."""
    import socket as sockets

    server, _ = server
    with server._lock:
        sockets.send_fds(server._sock, [request], [])
        answer, fds = server._receive(30)
    assert fds == [] and set(answer) == {"error"} and answer["error"], answer
    assert server.returncode(os.getpid(), wait_s=0) == -signal.SIGKILL  # not its child


_CONNECT_AS_ANOTHER_USER = """
import json, socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
sock.connect(sys.argv[1])
print(json.loads(sock.recv(4096)))
"""


def test_a_listening_server_serves_its_users_processes_and_refuses_others(tmp_path):
    """A server started with `listen=PATH` serves whoever connects as its own user (an
    entry point runs as its console script would: argv as given, the exit status its
    return), refuses an entry point without the command's name, answers a requester of
    another user with an error naming that user, and removes the socket when it ends."""
    import shutil
    import tempfile

    folder = tempfile.mkdtemp()
    try:
        os.chmod(folder, 0o755)
        path = os.path.join(folder, "forks.sock")
        server = forks.ForkServer.start(sys.executable, dict(os.environ, OMP_NUM_THREADS="1"),
                                        ("json.tool",),
                                        listen=path, log_path=str(tmp_path / "log"))
        connected = forks.ForkServer.connect(path)
        assert connected.pid == server.pid
        (tmp_path / "in.json").write_text('{"a": [1, 2]}')
        read, write = os.pipe()
        with open(os.devnull, "rb") as devnull:
            child = connected.run("json.tool:main", ["json-tool", "--compact",
                                                     str(tmp_path / "in.json")],
                                  env=dict(os.environ), cwd=str(tmp_path),
                                  stdio=(devnull.fileno(), write, 2))
        os.close(write)
        with open(read, "rb") as out:
            assert out.read() == b'{"a":[1,2]}\n'
        assert child.wait(60) == 0 and child.stdout is None
        with pytest.raises(forks.ForkServerError, match="command's name"):
            connected.run("json.tool:main", [], env={}, cwd="/", stdio=(0, 1, 2))
        assert "forked" in (tmp_path / "log").read_text()
        for _ in range(5):  # requesters gone before they read the answer (a reset socket)
            gone = forks.ForkServer.connect(path)
            request = {"run": "json.tool:main", "argv": ["json-tool", "--help"],
                       "env": dict(os.environ), "cwd": "/", "cpus": None, "stdin": True}
            with open(os.devnull, "rb") as devnull, open(os.devnull, "wb") as sink:
                socket.send_fds(gone._sock, [json.dumps(request).encode()],
                                [devnull.fileno(), sink.fileno(), sink.fileno()])
            gone._sock.close()
        assert forks.ForkServer.connect(path).pid == server.pid  # the server still serves
        if os.getuid() == 0 and shutil.which("python3", path="/usr/bin"):
            os.chmod(path, 0o777)
            other = subprocess.run(["/usr/bin/python3", "-c", _CONNECT_AS_ANOTHER_USER,
                                    path], user=65534, capture_output=True, text=True,
                                   timeout=60)
            assert "a requester of user 65534, not 0" in other.stdout, other.stderr
        connected.close()
        server.close()
        assert not os.path.exists(path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
