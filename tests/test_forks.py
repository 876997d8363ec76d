"""Processes forked from one server (fax_bridge.system.forks, fork_server, fork_protocol): a
fleet's devices and their XLA import helpers, their exit status, the server's lifetime,
the fresh-interpreter start where the server cannot fork, and the server as a trust
boundary (hostile requesters, planted paths, another user)."""

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
from processes import alive, as_nobody, children, parent
from fax_bridge.system import fork_protocol, fork_server, forks
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
            assert len(fleet._procs) == 2
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


def test_the_serving_loop_stays_while_a_child_lives_and_leaves_at_its_first_quiet_poll(
        monkeypatch):
    """The idle rule itself, on quiet polls counted instead of waited for: with an idle
    time of 0 the loop leaves at its first quiet poll once no child is alive, never
    while one is."""
    launcher, other = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    polls = []

    class QuietPoll:
        def register(self, *args) -> None:
            pass

        def poll(self, timeout_ms):
            if len(polls) == 3:
                server.owners.clear()  # the last child ends after three quiet polls
            polls.append(bool(server.owners))
            return []

    try:
        server = fork_server.Server(launcher, idle_seconds=0.0)
        server.owners[12345] = server.launcher
        monkeypatch.setattr(server, "_reap", lambda: None)
        monkeypatch.setattr(fork_server.select, "poll", QuietPoll)
        server.serve()
        assert polls == [True, True, True, False]  # left at the first poll with none
    finally:
        launcher.close()
        other.close()


def test_the_server_stays_while_a_device_lives_and_leaves_once_idle(tmp_path):
    env = _device_env()
    server = forks.ForkServer.start(sys.executable, env, DEVICE_MODULES, idle_seconds=0.0)
    try:
        proc = _spawn(server, env, tmp_path / "device.log", "--listen", "127.0.0.1:0",
                      "--parent-pid", str(server.pid))
        json.loads(proc.stdout.readline())
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
                               ["json"])  # whatever it imports (the fleet's: below)
    proto = sc.scaled_aggregate((2,), "sum")
    starts = []
    start = forks.ForkServer.start
    monkeypatch.setattr(forks.ForkServer, "start",
                        classmethod(lambda cls, *a, **k: starts.append(a) or start(*a, **k)))
    with caplog.at_level(logging.WARNING, logger="fax_bridge.fleet"):
        with LocalFleet(devices=2) as fleet:
            assert len(fleet._procs) == 2
            assert not any(isinstance(p, forks.ForkedProcess) for p in fleet._procs)
            assert {parent(pid) for pid in fleet.pids} == {os.getpid()}
            got = fleet.run(proto, np.ones((3, 2), np.float32), np.ones(2, np.float32))
    np.testing.assert_array_equal(got, [3.0, 3.0])
    assert "without a fork server" in caplog.text and "threads after the imports" in caplog.text
    assert len(starts) == 1  # tried once for the fleet, not once a device


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.sampled_from(["kind", "pid", "target", "argv",
                                                        "env", "cpus", "x"]),
                                       inner, max_size=3), max_leaves=8)
_REQUESTS = st.fixed_dictionaries(
    {"kind": st.sampled_from(["run", "status", "other"]) | _JSON},
    optional={key: _JSON for key in ("pid", "target", "argv", "env", "cpus")})


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@settings(max_examples=30, deadline=None)
@given(st.one_of(st.binary(min_size=1, max_size=40),
                 st.one_of(_JSON, _REQUESTS).map(lambda v: json.dumps(v).encode())),
       st.integers(0, 6))
def test_a_request_the_server_cannot_serve_is_refused_and_keeps_none_of_its_descriptors(
        server, request, sent):
    """Whatever a requester sends that is no run with its four descriptors nor the
    status of one of its own children, with any number of descriptors (a status request
    with some, a run with too few or too many), the answer is an error naming it, every
    descriptor sent is closed, and the next request is served."""
    server, _ = server
    try:
        parsed = fork_protocol.decode_request(request, sent)
        assume(not isinstance(parsed, fork_protocol.Run))  # a run it could serve forks
    except fork_protocol.ProtocolError:
        pass
    before = _open_fds(server.pid)
    with open(os.devnull, "rb") as devnull, server._lock:
        socket.send_fds(server._sock, [request], [devnull.fileno()] * sent)
        answer, fds = server._receive(30)
    assert fds == [] and set(answer) == {"error"} and answer["error"], answer
    assert server.returncode(os.getpid(), wait_s=0) == -signal.SIGKILL  # not its child
    assert _open_fds(server.pid) == before


# A module the listening server's children run: exits with argv[1] (a negative one by
# that signal), or sleeps ("sleep"; "term3": exits 3 on SIGTERM), or prints where its
# working directory is ("cwd").
_CHILD = """
import os, signal, sys, time
what = sys.argv[1] if __name__ == "__main__" else "import"
if what == "cwd":
    print(os.readlink("/proc/self/cwd"), flush=True)
elif what in ("sleep", "term3"):
    if what == "term3":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))
    os.write(1, b"ready\\n")  # one write: print() makes two where stdout is unbuffered
    time.sleep(600)
elif what == "import":
    pass
elif int(what) < 0:
    os.kill(os.getpid(), -int(what))
else:
    sys.exit(int(what))
"""


def _listening_server(folder):
    folder.mkdir(exist_ok=True)
    (folder / "fork_test_child.py").write_text(_CHILD)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(folder)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    path = str(folder / "forks.sock")
    return forks.ForkServer.start(sys.executable, env, ("json.tool", "fork_test_child"),
                                  listen=path), path, env


@pytest.fixture(scope="module")
def listening(tmp_path_factory):
    server, path, env = _listening_server(tmp_path_factory.mktemp("listening"))
    yield path, env
    server.close()


def _child(handle, env, *argv, cwd="/"):
    read, write = os.pipe()
    try:
        with open(os.devnull, "rb") as devnull:
            child = handle.run("fork_test_child", list(argv), env=env, cwd=cwd,
                               stdio=(devnull.fileno(), write, 2))
    finally:
        os.close(write)
    return child, os.fdopen(read, "rb")


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 255) | st.sampled_from([-signal.SIGTERM, -signal.SIGKILL,
                                               -signal.SIGUSR1]))
def test_a_child_status_is_exact_and_goes_only_to_the_connection_that_asked(listening,
                                                                            code):
    path, env = listening
    owner, other = forks.ForkServer.connect(path), forks.ForkServer.connect(path)
    try:
        child, out = _child(owner, env, str(code))
        out.close()
        assert other.returncode(child.pid, wait_s=0) == -signal.SIGKILL
        with other._lock:
            socket.send_fds(other._sock, [fork_protocol.encode_request(
                fork_protocol.Status(child.pid))], [])
            assert "only to the connection that asked" in other._receive(30)[0]["error"]
        assert child.wait(60) == code and child.poll() == code
    finally:
        owner.close()
        other.close()


def test_a_requester_that_never_reads_is_dropped_and_holds_up_no_other(listening):
    """It sends requests and never reads the answers: once more than MAX_UNREAD wait
    for it the server drops it, and serves the others all the while."""
    path, env = listening
    stuck = forks.ForkServer.connect(path)
    stuck._sock.settimeout(30)
    request = fork_protocol.encode_request(fork_protocol.Status(1))
    with pytest.raises(OSError):  # the server closed it: EPIPE, ECONNRESET
        for sent in range(1_000_000):
            stuck._sock.send(request)
            if sent % 100 == 0:  # meanwhile another is served
                honest = forks.ForkServer.connect(path)
                child, out = _child(honest, env, "7")
                out.close()
                assert child.wait(60) == 7
                honest.close()
    assert sent > fork_server.MAX_UNREAD
    stuck.close()


_REQUESTER = """
import importlib.util, json, os, sys
spec = importlib.util.spec_from_file_location("_fax_bridge_forks", sys.argv[3])
forks = importlib.util.module_from_spec(spec)  # by path, as Flower's commands load it
spec.loader.exec_module(forks)
server = forks.ForkServer.connect(sys.argv[1])
with open(os.devnull, "rb") as devnull:
    child = server.run("fork_test_child", ["sleep"], env=json.loads(sys.argv[2]),
                       stdio=(devnull.fileno(), 1, 2))
os.write(1, b"%d\\n" % child.pid)  # one write, which the child's line cannot split
child.wait()
"""


def _wait_gone(pid: int) -> bool:
    deadline = time.monotonic() + 30
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not alive(pid)


def _kernel_keeps_exit_status() -> bool:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(5)"])
    pidfd = os.pidfd_open(proc.pid)
    try:
        proc.wait()
        return forks.kernel_exit_status(pidfd) == 5
    finally:
        os.close(pidfd)


def test_a_child_dies_with_its_requester_whatever_dies_first(listening, tmp_path):
    path, env = listening
    requester = subprocess.Popen([sys.executable, "-c", _REQUESTER, path, json.dumps(env),
                                  forks.__file__], stdout=subprocess.PIPE, env=env)
    # the requester's line (the child's pid) and the child's own "ready", in either
    # order: both write to the requester's stdout
    lines = sorted((requester.stdout.readline(), requester.stdout.readline()),
                   key=lambda line: line != b"ready\n")
    assert lines[0] == b"ready\n"
    pid = int(lines[1].split()[0])
    assert alive(pid)
    requester.kill()  # the requester first: the server kills its child
    requester.wait()
    requester.stdout.close()
    assert _wait_gone(pid)

    # The server first (killed), then the requester: the child got SIGTERM as its
    # server died, and its exit status is still reported exactly where the kernel
    # keeps it for the pidfd's holder.
    server, own_path, own_env = _listening_server(tmp_path / "own")
    handle = forks.ForkServer.connect(own_path)
    child, out = _child(handle, own_env, "term3")
    assert out.readline() == b"ready\n"
    out.close()
    server._proc.kill()
    server._proc.wait()
    assert _wait_gone(child.pid)
    want = 3 if _kernel_keeps_exit_status() else -signal.SIGKILL
    assert child.wait(60) == want
    handle.close()
    server.close()


def test_a_child_runs_in_its_requesters_deleted_working_directory_as_a_fresh_one_would(
        listening, tmp_path):
    path, env = listening
    handle = forks.ForkServer.connect(path)
    here = os.getcwd()
    gone = tmp_path / "gone"
    gone.mkdir()
    os.chdir(gone)
    try:
        os.rmdir(gone)
        child, out = _child(handle, env, "cwd", cwd=None)
        with out:
            forked = out.read()
        fresh = subprocess.run([sys.executable, "-m", "fork_test_child", "cwd"], env=env,
                               capture_output=True, check=True).stdout
    finally:
        os.chdir(here)
    assert child.wait(60) == 0
    assert forked == fresh == f"{gone} (deleted)\n".encode()
    handle.close()


@pytest.mark.parametrize("planted", ["folder", "link", "file"])
def test_a_link_folder_or_file_at_the_socket_path_is_refused_by_name(listening, tmp_path,
                                                                    planted):
    live, _ = listening
    path = str(tmp_path / "forks.sock")
    if planted == "folder":
        os.mkdir(path)
    elif planted == "link":
        os.symlink(live, path)  # a live server's socket: never reached through the link
    else:
        open(path, "w").close()
    with pytest.raises(forks.ForkServerError, match=f"{path} is a {planted}"):
        forks.ForkServer.connect(path)
    with pytest.raises(forks.ForkServerError, match=f"{path} is a {planted}, not a socket"):
        forks.ForkServer.start(sys.executable, dict(os.environ, OMP_NUM_THREADS="1"),
                               ("json",), listen=path)
    assert os.path.lexists(path) and os.path.islink(path) == (planted == "link")


def test_a_server_of_another_protocol_version_is_refused_by_name(listening, monkeypatch):
    path, _ = listening
    monkeypatch.setattr(fork_protocol, "VERSION", fork_protocol.VERSION + 1)
    with pytest.raises(forks.ForkServerError, match="speaks protocol version"):
        forks.ForkServer.connect(path)


def _connect_as_nobody(path: str) -> dict:
    """What the server says to a requester of user nobody (a forked child of ours)."""
    read, write = os.pipe()

    def connect():
        os.close(read)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(path)
        sock.settimeout(30)
        os.write(write, sock.recv(4096))  # within the pipe's buffer: read after it exits

    try:
        as_nobody(connect)
    finally:
        os.close(write)
    with os.fdopen(read, "rb") as f:
        return json.loads(f.read())


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
            request = fork_protocol.Run("json.tool:main", ("json-tool", "--help"),
                                        dict(os.environ))
            with open(os.devnull, "rb") as devnull, open(os.devnull, "wb") as sink:
                root = os.open("/", os.O_RDONLY)
                socket.send_fds(gone._sock, [fork_protocol.encode_request(request)],
                                [devnull.fileno(), sink.fileno(), sink.fileno(), root])
                os.close(root)
            gone._sock.close()
        assert forks.ForkServer.connect(path).pid == server.pid  # the server still serves
        assert stat_mode(path) == 0o600
        if os.getuid() == 0:
            os.chmod(path, 0o777)
            assert _connect_as_nobody(path) == {
                "error": "a requester of user 65534, not 0"}
        connected.close()
        server.close()
        assert not os.path.exists(path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def stat_mode(path: str) -> int:
    return os.stat(path).st_mode & 0o777
