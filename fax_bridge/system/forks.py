"""Processes forked from one interpreter that has already imported what they run.

A device process spends most of its start importing jax, grpc and fax_bridge (about
three CPU-seconds, several times that on a busy machine), and its XLA import helper
another half second loading jaxlib; a fleet starts several of each. So `LocalFleet`
starts its devices through a fork server (`fork_server`: one process that imports the
given modules once, then forks a child for each request; its module docstring states
its trust model). This module is the requester's side: `ForkServer.start` starts a
server, `ForkServer.run` asks it for a child (`ForkedProcess`, with the part of
`subprocess.Popen`'s interface callers use), `shared` keeps one server per launching
process, interpreter, environment and modules.

A forked child can ask the same server for children of its own (`inherited()`: a device
forks its XLA import helper so). A server started with `listen=PATH` also takes
requesters of the same user that connect to that Unix socket (`connect(PATH)`), such as
the commands Flower's SuperNodes start (`flower.forked_apps`). A child dies with its
requester, whatever dies first: the server kills the children of a requester whose
connection closes, and a child gets SIGTERM when its server dies. Its exit status is
exact: the server's answer to the requester that asked for it; where the server is
gone, the kernel's (through the pidfd: Linux 6.15 and later), else -SIGKILL.

One server serves every request of a launching process that uses the same interpreter,
environment and modules (`shared`; secrets such as the fleet token travel with each
request, never in the server's environment or command line). The server exits when the
launcher's end of its socket closes (the launcher exited, however it exited); it also
exits after `IDLE_SECONDS` with no request and no child alive.

The protocol (`fork_protocol`) is versioned: a server of another version is refused,
as one that does not start or answer is, with `ForkServerError`; where it cannot run
(not Linux, no pidfds) `available()` is False. Callers then start a fresh interpreter,
as they would without it.

This file and its protocol import only the standard library, and load each other by
path where fax_bridge's package is not imported (Flower's forked commands).
"""

from __future__ import annotations

import atexit
import fcntl
import importlib
import importlib.util
import os
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional, Sequence



def _sibling(name: str):
    """fax_bridge's module `name`: imported where this module was, else loaded by its
    path (as Flower's forked commands load this file: without the package)."""
    if __package__:
        return importlib.import_module(f"{__package__}.{name}")
    key = f"_fax_bridge_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, os.path.join(
            os.path.dirname(os.path.abspath(__file__)), f"{name}.py"))
        sys.modules[key] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[key])
    return sys.modules[key]


protocol = _sibling("fork_protocol")

IDLE_SECONDS = 300.0  # with no request and no child alive, the server exits
ENV = "FAX_BRIDGE_FORK_SERVER"  # "FD:PID" in a forked child: its socket to the server
SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fork_server.py")
# The kernel's record of an ended process, read through a pidfd (Linux 6.15+).
_PIDFD_GET_INFO = 0xC040FF0B  # _IOWR(0xFF, 11, struct pidfd_info), 64 bytes
_PIDFD_INFO_EXIT = 1 << 3


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

class ForkedProcess:
    """A child of the server, with the part of `subprocess.Popen`'s interface callers
    use: `pid`, `stdin`, `stdout`, `returncode`, `poll`, `wait`, `send_signal`, `kill`,
    `terminate`. Its end is watched through a pidfd (no later process can take its
    place); its exit status comes from the server, which reaps it."""

    def __init__(self, server: "ForkServer", pid: int, pidfd: int, stdin=None, stdout=None):
        self.pid, self.stdin, self.stdout, self.returncode = pid, stdin, stdout, None
        self._server, self._pidfd, self.args = server, pidfd, [f"forked:{pid}"]

    def _ended(self, timeout: Optional[float]) -> bool:
        if self._pidfd < 0:
            return True
        poll = select.poll()
        poll.register(self._pidfd, select.POLLIN)
        return bool(poll.poll(None if timeout is None else max(0, int(timeout * 1000))))

    def _collect(self) -> int:
        self.returncode = self._server.returncode(self.pid, pidfd=self._pidfd)
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


def kernel_exit_status(pidfd: int) -> Optional[int]:
    """The exit status of the reaped process `pidfd` refers to, as `subprocess` gives
    it, from the kernel (PIDFD_GET_INFO; Linux 6.15 and later); None where the kernel
    cannot say (older, or the process not yet reaped)."""
    info = bytearray(64)
    struct.pack_into("Q", info, 0, _PIDFD_INFO_EXIT)
    try:
        fcntl.ioctl(pidfd, _PIDFD_GET_INFO, info)
    except OSError:
        return None
    if not struct.unpack_from("Q", info, 0)[0] & _PIDFD_INFO_EXIT:
        return None
    return os.waitstatus_to_exitcode(struct.unpack_from("i", info, 60)[0])


def _open_socket(path: str) -> int:
    """An O_PATH descriptor of the socket at `path`, or ForkServerError naming `path`:
    a link there is not followed, a folder or file is no server."""
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise ForkServerError(f"no fork server listens at {path} ({e})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISSOCK(mode):
        os.close(fd)
        what = ("a link" if stat.S_ISLNK(mode) else "a folder" if stat.S_ISDIR(mode)
                else "a file")
        raise ForkServerError(f"{path} is {what}, not a fork server's socket: remove it, "
                              "or name the socket the server listens at")
    return fd


class ForkServer:
    """A requester's handle on a server (thread-safe: one request at a time). Made by
    `start` (a new server process), `connect` (a listening one) or `inherited` (a
    forked child's own socket)."""

    def __init__(self, sock: socket.socket, pid: int, proc=None, log=None):
        self._sock, self.pid, self._proc, self._log = sock, pid, proc, log
        self._lock = threading.Lock()
        self._owner = os.getpid()

    @classmethod
    def start(cls, python: str, env: dict, modules: Sequence[str],
              startup_timeout_s: float = 120.0, idle_seconds: float = IDLE_SECONDS, *,
              listen: Optional[str] = None, prefix: Sequence[str] = (),
              log_path: Optional[str] = None) -> "ForkServer":
        """A new server run by `python` in `env`, having imported `modules`.

        Args:
            python: the interpreter the server (and so each child) runs.
            env: the server's environment (no secrets: each run brings its own).
            modules: what it imports before it serves.
            startup_timeout_s: how long its imports may take.
            idle_seconds: with no request and no child alive for this long, it exits.
            listen: also serve whoever of this user connects to this Unix socket path
                (`connect`; keep its folder private). A link, folder or file there is
                refused, naming the path.
            prefix: the command it runs under (`ip netns exec HOST`).
            log_path: its stderr and a line for each child it forks (else a
                temporary file).
        """
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        log = open(log_path, "ab+") if log_path else tempfile.TemporaryFile()
        options = (["--listen", listen] if listen else []) + (
            ["--log-children"] if log_path else [])
        try:
            proc = subprocess.Popen(
                [*prefix, python, SERVER, str(theirs.fileno()), str(idle_seconds),
                 *options, *modules],
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
        """A handle on the server listening at `path` (`start(listen=path)`), run by
        this user; ForkServerError naming `path` where no such server serves there."""
        server = cls(socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET), 0)
        try:
            fd = _open_socket(path)
            try:  # the socket opened, by its descriptor: no link swapped in since
                server._sock.connect(f"/proc/self/fd/{fd}")
            except OSError as e:
                raise ForkServerError(f"no fork server listens at {path} ({e})") from None
            finally:
                os.close(fd)
            _, uid, _ = struct.unpack("3i", server._sock.getsockopt(
                socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
            if uid != os.getuid():
                raise ForkServerError(f"the fork server at {path} runs as user {uid}, "
                                      f"not {os.getuid()}")
            server.pid = server._hello(timeout_s)
        except ForkServerError:
            server.close()
            raise
        return server

    def _hello(self, timeout_s: float) -> int:
        try:
            return protocol.check_hello(self._receive(timeout_s)[0])
        except protocol.ProtocolError as e:
            raise ForkServerError(str(e)) from None

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
            data, fds, _, _ = socket.recv_fds(self._sock, protocol.MAX_DATAGRAM, 2)
        except OSError as e:
            raise ForkServerError(f"the fork server's socket failed: {e}") from None
        if not data:
            raise ForkServerError(f"the fork server exited{self._last_words()}")
        try:
            return protocol.decode_answer(data), fds
        except protocol.ProtocolError as e:
            for fd in fds:
                os.close(fd)
            raise ForkServerError(str(e)) from None

    def _last_words(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        lines = self._log.read().decode(errors="replace").strip().splitlines()
        return f" ({lines[-1][-300:]})" if lines else ""

    def _ask(self, request, fds: Sequence[int] = (),
             timeout: Optional[float] = 60.0) -> tuple[dict, list]:
        if os.getpid() != self._owner:
            raise ForkServerError("this handle belongs to the process that made it, not "
                                  "to a process forked from that one")
        with self._lock:
            try:
                socket.send_fds(self._sock, [protocol.encode_request(request)], list(fds))
            except OSError as e:  # the server is gone, or the request too large to send
                raise ForkServerError(f"could not send the fork server a request ({e})"
                                      ) from None
            return self._receive(timeout)

    def alive(self) -> bool:
        """Whether this process may use the handle and the server it started still runs."""
        return os.getpid() == self._owner and (self._proc is None or self._proc.poll() is None)

    def run(self, module: str, argv: Sequence[str], *, env: dict,
            cwd: Optional[str] = None, cpus: Optional[set] = None, stderr_fd: int = 2,
            stdin_pipe: bool = False, stdio: Optional[Sequence[int]] = None
            ) -> ForkedProcess:
        """Forks a child running `python -m module *argv`, or the entry point
        `module:function` with `sys.argv = argv`.

        Args:
            module: MODULE or MODULE:FUNCTION.
            argv: its arguments (an entry point's first: the command's name).
            env: its whole environment.
            cwd: its working directory (None: this process's own, even one deleted
                since, as a fresh process would inherit it).
            cpus: the CPUs it may run on (None: the server's).
            stderr_fd: its stderr (without `stdio`).
            stdin_pipe: its stdin a pipe (the result's `stdin`), else /dev/null.
            stdio: its standard streams, these three descriptors (a command that forks
                its work in its own place passes its own: 0, 1, 2); else its stdout is
                a pipe (the result's `stdout`).
        """
        mine, theirs = [], []
        try:
            try:
                theirs.append(os.open(cwd if cwd is not None else ".",
                                      os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
            except OSError as e:
                raise ForkServerError(f"cannot open the working directory "
                                      f"{cwd if cwd is not None else '.'}: {e}") from None
            if stdio is None:
                out_r, out_w = os.pipe()
                mine.append(out_r)
                theirs.append(out_w)
                if stdin_pipe:
                    in_r, in_w = os.pipe()
                    mine.append(in_w)
                else:
                    in_r = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
                theirs.append(in_r)
                sent = [in_r, out_w, stderr_fd, theirs[0]]
            else:
                stdin_pipe, sent = False, [*stdio, theirs[0]]
            request = protocol.Run(module, tuple(argv), dict(env),
                                   None if cpus is None else tuple(sorted(cpus)))
            answer, fds = self._ask(request, sent)
        except protocol.ProtocolError as e:
            for fd in mine:
                os.close(fd)
            raise ForkServerError(f"the fork server cannot take this request: {e}") from None
        except BaseException:
            for fd in mine:
                os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        if type(answer.get("pid")) is not int or len(fds) != 1:
            for fd in fds + mine:
                os.close(fd)
            raise ForkServerError(f"the fork server could not fork: {answer.get('error')}")
        stdin = open(mine[1], "wb", buffering=0) if stdin_pipe else None
        stdout = open(mine[0], "rb") if stdio is None else None
        return ForkedProcess(self, answer["pid"], fds[0], stdin, stdout)

    def returncode(self, pid: int, wait_s: float = 5.0, pidfd: Optional[int] = None) -> int:
        """The exit status of a child (of this handle's requests) whose pidfd says it
        ended, asked again for up to `wait_s` while the server has yet to see it end.
        Where the server is gone: the kernel's record through `pidfd`
        (`kernel_exit_status`), else -SIGKILL."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                answer = self._ask(protocol.Status(pid))[0]
            except (ForkServerError, protocol.ProtocolError):
                break
            code = answer.get("returncode")
            if type(code) is int:
                return code
            if "error" in answer or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        while pidfd is not None:  # the server is gone; its children's new parent reaps
            code = kernel_exit_status(pidfd)
            if code is not None or time.monotonic() > deadline:
                return -signal.SIGKILL if code is None else code
            time.sleep(0.01)
        return -signal.SIGKILL

    def close(self) -> None:
        """Closes this handle; a server it started then exits, and the children it
        forked get SIGTERM."""
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
