"""Processes forked from one interpreter that has already imported what they run.

A device process spends most of its start importing jax, grpc and fax_bridge (about
three CPU-seconds, several times that on a busy machine), and its XLA import helper
another half second loading jaxlib; a fleet starts several of each. So `LocalFleet`
starts its devices through a fork server: one process, `python PATH/forks.py FD
IDLE_SECONDS MODULE...` (by path: no package imported that no module needs), imports
the given modules once (it starts no thread and no XLA backend, and checks that it
runs one thread), then forks a child for each request. A child runs a module as
`python -m MODULE ARGS...` would (`runpy`, as `__main__`), or an entry point
`MODULE:FUNCTION` as its console script would (`sys.argv` is the request's argv, its
first the command's name), with the environment, working directory and CPUs it was
given, its standard streams on the descriptors the requester sent, in a session of its
own: the process a fresh interpreter would be, less the imports.

A forked child can ask the same server for children of its own (`inherited()`: a device
forks its XLA import helper so): each child gets its own socket to the server, named by
`FAX_BRIDGE_FORK_SERVER` ("FD:PID", valid only in that process). A server started with
`listen=PATH` also takes requesters that connect to that Unix socket (`connect(PATH)`):
any process of the same user, such as the commands Flower's SuperNodes start
(`flower.forked_apps`). A child such a requester asked for is killed when the
requester's connection closes while the child runs (the requester ended, however).

One server serves every request of a launching process that uses the same interpreter,
environment and modules (`shared`; secrets such as the fleet token travel with each
request, never in the server's environment or command line). The server exits when the
launcher's end of its socket closes (the launcher exited, however it exited), and
children watching their parent then see it gone; it also exits after `IDLE_SECONDS` with
no request and no child alive.

Protocol: datagrams on Unix SOCK_SEQPACKET sockets, each a JSON object, descriptors
passed beside them (SCM_RIGHTS). The server first says `{"ready": pid}` (to one that
connects, once it has checked its user). A request `{"run": module, "argv", "env",
"cwd", "cpus", "stdin"}` with [stdin if asked, stdout, stderr] is answered `{"pid": N}`
with a pidfd of the child; `{"status": pid}` (asked once the pidfd says the child ended)
is answered `{"returncode": code}` as `subprocess` gives it (negative: the signal that
ended it), or null while it still runs; one it cannot serve, `{"error": text}`.

Where it cannot run (not Linux, no pidfds) `available()` is False, and where the server
does not start or answer `ForkServerError` is raised: callers then start a fresh
interpreter, as they would without it.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional, Sequence

IDLE_SECONDS = 300.0  # with no request and no child alive, the server exits
ENV = "FAX_BRIDGE_FORK_SERVER"  # "FD:PID" in a forked child: its socket to the server
MAX_DATAGRAM = 1 << 20


class ForkServerError(Exception):
    """The fork server could not start, answer or fork; start a fresh interpreter."""


def available() -> bool:
    """Whether this platform has what the fork server needs (Linux: fork, pidfds,
    descriptor passing)."""
    return (sys.platform.startswith("linux") and hasattr(os, "pidfd_open")
            and hasattr(socket, "send_fds") and hasattr(signal, "pidfd_send_signal"))


# Variables that change from one request to the next and that no import reads: the test
# runner's name of the test running now (pytest sets it for each test's every phase).
# They stay out of `shared`'s key, so a suite's fleets share one server; each child gets
# the requester's own value.
VOLATILE = ("PYTEST_CURRENT_TEST",)

_servers: dict = {}  # (python, environment, modules) -> the server `shared` started
_failed: dict = {}  # the same keys -> (pid, ForkServerError) of a start that failed
_servers_lock = threading.Lock()
_inherited: Optional[tuple] = None  # (pid, handle) in a forked child

# The requester's side


class ForkedProcess:
    """A child of the server, with the part of `subprocess.Popen`'s interface callers
    use: `pid`, `stdin`, `stdout`, `returncode`, `poll`, `wait`, `send_signal`, `kill`,
    `terminate`. Its end is watched through a pidfd (no later process can take its
    place); its exit status comes from the server, which reaps it."""

    def __init__(self, server: "ForkServer", pid: int, pidfd: int, stdin=None, stdout=None):
        self.pid, self.stdin, self.stdout, self.returncode = pid, stdin, stdout, None
        self._server, self._pidfd, self.args = server, pidfd, [f"forked:{pid}"]

    def _ended(self, timeout: Optional[float]) -> bool:
        return self._pidfd < 0 or bool(select.select([self._pidfd], [], [], timeout)[0])

    def _collect(self) -> int:
        self.returncode = self._server.returncode(self.pid)
        os.close(self._pidfd)
        self._pidfd = -1
        return self.returncode

    def poll(self) -> Optional[int]:
        """The exit status if the child has ended, else None."""
        if self.returncode is None and self._ended(0):
            self._collect()
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        """Waits for the child to end (`subprocess.TimeoutExpired` after `timeout`)."""
        if self.returncode is None:
            if not self._ended(timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._collect()
        return self.returncode

    def send_signal(self, signum: int) -> None:
        """Sends `signum` to the child itself (not its group) while it runs."""
        if self.returncode is None and self._pidfd >= 0:
            try:
                signal.pidfd_send_signal(self._pidfd, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:  # as Popen's
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:  # as Popen's
        self.send_signal(signal.SIGTERM)

    def __del__(self):
        if getattr(self, "_pidfd", -1) >= 0:
            os.close(self._pidfd)


class ForkServer:
    """A requester's handle on a server (thread-safe: one request at a time). Made by
    `start` (a new server process) or `inherited` (a forked child's own socket)."""

    def __init__(self, sock: socket.socket, pid: int, proc=None, log=None):
        self._sock, self.pid, self._proc, self._log = sock, pid, proc, log
        self._lock = threading.Lock()
        self._owner = os.getpid()

    @classmethod
    def start(cls, python: str, env: dict, modules: Sequence[str],
              startup_timeout_s: float = 120.0, idle_seconds: float = IDLE_SECONDS, *,
              listen: Optional[str] = None, prefix: Sequence[str] = (),
              log_path: Optional[str] = None) -> "ForkServer":
        """A new server run by `python` in `env`, having imported `modules`; with `listen`
        also serving whoever connects to that Unix socket path (`connect`; keep its
        folder private), run under the command `prefix` (`ip netns exec HOST`), its
        stderr and a line for each child it forks in `log_path` (else a temporary file)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        log = open(log_path, "ab+") if log_path else tempfile.TemporaryFile()
        options = (["--listen", listen] if listen else []) + (
            ["--log-children"] if log_path else [])
        try:
            proc = subprocess.Popen(
                [*prefix, python, os.path.abspath(__file__), str(theirs.fileno()),
                 str(idle_seconds), *options, *modules],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
        except OSError as e:
            ours.close()
            log.close()
            raise ForkServerError(f"cannot start {python}: {e}") from None
        finally:
            theirs.close()
        server = cls(ours, 0, proc, log)
        try:
            server.pid = server._hello(startup_timeout_s)
        except ForkServerError:
            server.close()
            raise
        return server

    @classmethod
    def connect(cls, path: str, timeout_s: float = 30.0) -> "ForkServer":
        """A handle on the server listening at `path` (`start(listen=path)`)."""
        server = cls(socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET), 0)
        try:
            try:
                server._sock.connect(path)
            except OSError as e:
                raise ForkServerError(f"no fork server listens at {path} ({e})") from None
            server.pid = server._hello(timeout_s)
        except ForkServerError:
            server.close()
            raise
        return server

    def _hello(self, timeout_s: float) -> int:
        hello = self._receive(timeout_s)[0]
        if "ready" not in hello:
            raise ForkServerError(f"the fork server refused to serve: {hello.get('error')}")
        return int(hello["ready"])

    @classmethod
    def inherited(cls) -> Optional["ForkServer"]:
        """In a forked child, its handle on the server that forked it; else None."""
        global _inherited
        fd, _, pid = os.environ.get(ENV, "").partition(":")
        if not (fd.isdigit() and pid.isdigit() and int(pid) == os.getpid()):
            return None
        with _servers_lock:
            if _inherited is None or _inherited[0] != os.getpid():
                try:
                    sock = socket.socket(fileno=int(fd))
                except OSError:
                    return None
                _inherited = (os.getpid(), cls(sock, os.getppid()))
            return _inherited[1]

    def _receive(self, timeout: Optional[float]) -> tuple[dict, list]:
        if not select.select([self._sock], [], [], timeout)[0]:
            raise ForkServerError(f"the fork server did not answer within {timeout:g} s")
        try:
            data, fds, _, _ = socket.recv_fds(self._sock, MAX_DATAGRAM, 2)
        except OSError as e:
            raise ForkServerError(f"the fork server's socket failed: {e}") from None
        if not data:
            raise ForkServerError(f"the fork server exited{self._last_words()}")
        return json.loads(data), fds

    def _last_words(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        lines = self._log.read().decode(errors="replace").strip().splitlines()
        return f" ({lines[-1][-300:]})" if lines else ""

    def _ask(self, request: dict, fds: Sequence[int] = (),
             timeout: Optional[float] = 60.0) -> tuple[dict, list]:
        if os.getpid() != self._owner:
            raise ForkServerError("this handle belongs to the process that made it, not "
                                  "to a process forked from that one")
        with self._lock:
            try:
                socket.send_fds(self._sock, [json.dumps(request).encode()], list(fds))
            except OSError as e:  # the server is gone, or the request too large to send
                raise ForkServerError(f"could not send the fork server a request ({e})"
                                      ) from None
            return self._receive(timeout)

    def alive(self) -> bool:
        """Whether this process may use the handle and the server it started still runs."""
        return os.getpid() == self._owner and (self._proc is None or self._proc.poll() is None)

    def run(self, module: str, argv: Sequence[str], *, env: dict, cwd: str,
            cpus: Optional[set] = None, stderr_fd: int = 2, stdin_pipe: bool = False,
            stdio: Optional[Sequence[int]] = None) -> ForkedProcess:
        """Forks a child running `python -m module *argv`, or the entry point
        `module:function` with `sys.argv = argv`. Its stdout is a pipe (the result's
        `stdout`), its stdin one too with `stdin_pipe` (else /dev/null), its stderr
        `stderr_fd`; or, with `stdio`, its standard streams are those three descriptors
        (a command that forks its work in its own place passes its own: 0, 1, 2)."""
        mine, theirs = [], []
        try:
            if stdio is None:
                out_r, out_w = os.pipe()
                mine.append(out_r)
                theirs.append(out_w)
                if stdin_pipe:
                    in_r, in_w = os.pipe()
                    mine.append(in_w)
                    theirs.insert(0, in_r)
                sent = theirs + [stderr_fd]
            else:
                stdin_pipe, sent = False, list(stdio)
            answer, fds = self._ask({"run": module, "argv": list(argv), "env": env, "cwd": cwd,
                                     "cpus": sorted(cpus) if cpus is not None else None,
                                     "stdin": stdin_pipe or stdio is not None}, sent)
        except BaseException:
            for fd in mine:
                os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        if "pid" not in answer or len(fds) != 1:
            for fd in fds + mine:
                os.close(fd)
            raise ForkServerError(f"the fork server could not fork: {answer.get('error')}")
        stdin = open(mine[1], "wb", buffering=0) if stdin_pipe else None
        stdout = open(mine[0], "rb") if stdio is None else None
        return ForkedProcess(self, int(answer["pid"]), fds[0], stdin, stdout)

    def returncode(self, pid: int, wait_s: float = 5.0) -> int:
        """The exit status of a child whose pidfd says it ended (asked again for up to
        `wait_s` while the server has yet to see it end); -SIGKILL when the server is
        gone or cannot say (its children were then killed or ended on their own)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                answer = self._ask({"status": pid})[0]
            except ForkServerError:
                return -signal.SIGKILL
            if answer.get("returncode") is not None:
                return int(answer["returncode"])
            if "error" in answer or time.monotonic() > deadline:
                return -signal.SIGKILL
            time.sleep(0.01)

    def close(self) -> None:
        """Closes this handle; a server it started then exits (its children, watching
        their parent, exit on their own)."""
        self._sock.close()
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._log is not None:
            self._log.close()


def shared(python: str, env: dict, modules: Sequence[str], secrets: Sequence[str] = (),
           startup_timeout_s: float = 120.0) -> ForkServer:
    """The server for children started by `python` in `env` (less the `secrets`
    variables; `VOLATILE` ones are not told apart) having imported `modules`: started
    on first use, kept while it runs. A server that failed to start is not tried again
    by this process: its error is raised again at once (each of a fleet's devices would
    otherwise pay a start)."""
    server_env = {k: v for k, v in env.items() if k not in secrets}
    key = (python, tuple(sorted((k, v) for k, v in server_env.items() if k not in VOLATILE)),
           tuple(modules))
    with _servers_lock:
        failed = _failed.get(key)
        if failed is not None and failed[0] == os.getpid():
            raise failed[1]
        server = _servers.get(key)
        if server is None or not server.alive():
            if server is not None and server._owner == os.getpid():
                server.close()
            try:
                server = _servers[key] = ForkServer.start(python, server_env, modules,
                                                          startup_timeout_s)
            except ForkServerError as e:
                _servers.pop(key, None)
                _failed[key] = (os.getpid(), e)
                raise
        return server


@atexit.register
def _close_all() -> None:
    with _servers_lock:
        servers = [server for server in _servers.values() if server._owner == os.getpid()]
        _servers.clear()
    for server in servers:
        server.close()


# The server


class _Child(Exception):
    """Raised in a forked child to leave the server's loop: the interpreter then runs
    the module as its main program and exits as that program would (atexit, threads)."""

    def __init__(self, module: str, argv: list):
        super().__init__(module)
        self.module, self.argv = module, argv


_RUN_TYPES = {"run": str, "argv": list, "env": dict, "cwd": str, "cpus": (list, type(None)),
              "stdin": bool}


def _checked(data: bytes, fds: int) -> dict:
    """A request as `_serve` may act on it, or ValueError saying what is wrong with it."""
    try:
        request = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"not JSON ({e})") from None
    if isinstance(request, dict) and request.keys() == {"status"}:
        if type(request["status"]) is not int:
            raise ValueError(f"a status request names a pid, not {request['status']!r}")
        return request
    if not isinstance(request, dict) or request.keys() != _RUN_TYPES.keys():
        raise ValueError(f"expected {{'status': pid}} or a run request with "
                         f"{sorted(_RUN_TYPES)}, got {data[:80]!r}")
    for key, kind in _RUN_TYPES.items():
        if not isinstance(request[key], kind):
            raise ValueError(f"{key} is {request[key]!r}")
    if not all(isinstance(a, str) for a in request["argv"]) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in request["env"].items()):
        raise ValueError("argv and env must hold strings")
    if request["cpus"] is not None and not all(type(c) is int and c >= 0
                                               for c in request["cpus"]):
        raise ValueError(f"cpus is {request['cpus']!r}")
    if ":" in request["run"] and not request["argv"]:
        raise ValueError("an entry point's argv starts with the command's name")
    if fds != 2 + request["stdin"]:
        raise ValueError(f"{fds} descriptors with a run request (stdin={request['stdin']})")
    return request


def _send(sock: socket.socket, message: dict, fds: Sequence[int] = ()) -> None:
    try:
        socket.send_fds(sock, [json.dumps(message).encode()], list(fds))
    except OSError:  # a requester already gone: its socket's end is read next
        pass


def _become_child(request: dict, fds: list, own: socket.socket, others: list) -> None:
    """In the forked child: its session, CPUs, descriptors, directory, environment."""
    for sock in others:
        sock.close()
    os.setsid()
    if request["cpus"] is not None:
        os.sched_setaffinity(0, request["cpus"])
    if not request["stdin"]:
        fds = [os.open(os.devnull, os.O_RDONLY)] + fds
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ[ENV] = f"{own.fileno()}:{os.getpid()}"
    raise _Child(request["run"], list(request["argv"]))


def _accept(listener: socket.socket, sockets: list, connected: dict) -> None:
    """Takes a requester connecting to the listening socket if it runs as our user."""
    try:
        sock, _ = listener.accept()
    except OSError:
        return
    uid = int.from_bytes(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)[4:8],
                         sys.byteorder)
    _send(sock, {"ready": os.getpid()} if uid == os.getuid() else
          {"error": f"a requester of user {uid}, not {os.getuid()}"})
    if uid == os.getuid():
        sockets.append(sock)
        connected[sock] = []
    else:
        sock.close()


def _serve(launcher: socket.socket, idle_seconds: float,
           listener: Optional[socket.socket] = None, log_children: bool = False) -> None:
    """Forks children on request until the launcher's end closes or the server idles."""
    statuses: dict[int, int] = {}
    live: set[int] = set()
    sockets = [launcher]  # the launcher's, then each live child's and connected requester's
    connected: dict = {}  # a connected requester -> its children, which end with it
    quiet_since = time.monotonic()

    def reap() -> None:
        while live:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                live.clear()
                return
            if pid == 0:
                return
            live.discard(pid)
            statuses[pid] = os.waitstatus_to_exitcode(status)

    while True:
        reap()
        ready = select.select(sockets + ([listener] if listener else []), [], [], 1.0)[0]
        if not ready:
            if not live and time.monotonic() - quiet_since > idle_seconds:
                return
            continue
        quiet_since = time.monotonic()
        for sock in ready:
            if sock is listener:
                _accept(listener, sockets, connected)
                continue
            try:
                data, fds, _, _ = socket.recv_fds(sock, MAX_DATAGRAM, 3)
            except OSError:  # a requester gone before it read our answer: reset
                data, fds = b"", []
            if not data:
                if sock is launcher:
                    return  # the launcher is gone
                for pid in connected.pop(sock, ()):
                    if pid in live:  # its requester is gone, however it ended
                        os.kill(pid, signal.SIGKILL)
                sockets.remove(sock)
                sock.close()
                continue
            try:
                request = _checked(data, len(fds))
            except ValueError as e:
                for fd in fds:
                    os.close(fd)
                _send(sock, {"error": f"malformed request: {e}"})
                continue
            if "status" in request:
                pid = request["status"]
                if pid in live:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done == 0:
                        _send(sock, {"returncode": None})  # it still runs
                        continue
                    live.discard(pid)
                    statuses[pid] = os.waitstatus_to_exitcode(status)
                if pid in statuses:
                    _send(sock, {"returncode": statuses.pop(pid)})
                else:
                    _send(sock, {"error": f"no ended child {pid} to report"})
                continue
            own, kept = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                pid = os.fork()
            except OSError as e:
                for fd in fds:
                    os.close(fd)
                own.close()
                kept.close()
                _send(sock, {"error": f"fork failed: {e}"})
                continue
            if pid == 0:
                try:
                    _become_child(request, fds, own,
                                  sockets + [kept] + ([listener] if listener else []))
                except _Child:
                    raise
                except BaseException as e:  # its log says why; the requester sees it end
                    os.write(2, f"fax_bridge.forks: the child could not start: {e!r}\n"
                             .encode(errors="replace"))
                    os._exit(1)
            own.close()
            sockets.append(kept)
            live.add(pid)
            connected.get(sock, []).append(pid)
            if log_children:
                os.write(2, f"fax_bridge.forks: forked {pid} to run {request['run']}\n"
                         .encode(errors="replace"))
            for fd in fds:
                os.close(fd)
            pidfd = os.pidfd_open(pid)
            _send(sock, {"pid": pid}, [pidfd])
            os.close(pidfd)


def main(argv: Sequence[str]) -> int:
    """The server process: imports the modules, checks it runs one thread, says ready,
    serves; in a forked child, runs the requested module instead."""
    import importlib
    import runpy

    launcher = socket.socket(fileno=int(argv[0]))
    modules, listener, log_children = list(argv[2:]), None, False
    if modules[:1] == ["--listen"]:
        path, modules = modules[1], modules[2:]
        try:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            listener.bind(path)
            listener.listen(64)
        except OSError as e:
            _send(launcher, {"error": f"cannot listen at {path}: {e}"})
            return 1
    if modules[:1] == ["--log-children"]:
        log_children, modules = True, modules[1:]
    try:
        for name in modules:
            importlib.import_module(name)
        threads = len(os.listdir("/proc/self/task"))
        if threads != 1:
            _send(launcher, {"error": f"{threads} threads after the imports (forking "
                                      "needs one; set OMP_NUM_THREADS=1)"})
            return 1
        _send(launcher, {"ready": os.getpid()})
        try:
            _serve(launcher, float(argv[1]), listener, log_children)
        finally:  # in the server, not in a child leaving through _Child
            if listener is not None and listener.fileno() >= 0:
                listener.close()
                os.unlink(path)
    except _Child as child:
        module, _, function = child.module.partition(":")
        if not function:
            sys.argv = [child.module, *child.argv]
            runpy.run_module(child.module, run_name="__main__", alter_sys=True)
            return 0
        sys.argv = child.argv
        return getattr(importlib.import_module(module), function)()
    return 0


if __name__ == "__main__":
    if not __package__:  # run by its path (no package imported): as `-m` would, the
        sys.path[0] = os.getcwd()  # working directory leads the path, not this folder
    sys.exit(main(sys.argv[1:]))
