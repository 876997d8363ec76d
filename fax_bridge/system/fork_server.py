"""The fork server: one process, having imported some modules, forks children on request.

    python PATH/fork_server.py FD IDLE_SECONDS [--listen PATH] [--log-children] MODULE...

`forks.ForkServer.start` runs it (by its path: no package imported that no module
needs). It imports the modules, checks that it runs one thread (forking carries no
other), says hello on the launcher's socket FD and serves requests (`fork_protocol`)
until the launcher's end closes, or, with no child alive, for `IDLE_SECONDS` after the
last request. A child is the process a fresh interpreter would be, less the imports: it
runs its module as `python -m` would (`runpy`, as `__main__`) or its entry point as its
console script would, with the environment, working directory, CPUs and standard
streams the request gave, in a session of its own, with its own socket to this server
(`FAX_BRIDGE_FORK_SERVER`, "FD:PID") to ask for children of its own.

Trust model. The server runs as the user who started it and serves:
- the launcher (the socket it was started with), each child (its own socket), and,
  with `--listen PATH`, whoever connects there and is of the same user, checked by
  SO_PEERCRED; a process of another user gets `{"error": ...}` naming its uid, and
  is closed. The listening socket is made mode 0600; its folder should be private too.
  A link, folder or other file at PATH is refused, naming PATH, never followed; a
  socket there is replaced only when no server answers on it. At most
  `MAX_REQUESTERS` connections are served at once; past that, or out of descriptors,
  it stops accepting until one closes (it never spins on a listener it cannot drain).
- Requests of at most `fork_protocol.MAX_DATAGRAM` bytes and `MAX_FDS` descriptors,
  each of a kind `fork_protocol.decode_request` parses, with exactly the descriptors
  that kind takes. Every descriptor of a request it refuses, and every one a request
  took once used, is closed: a requester cannot make it hold descriptors.
- Each connection is served on its own: answers are sent without blocking, kept for a
  requester whose socket is full, and a requester that leaves more than `MAX_UNREAD`
  answers unread is dropped; none waits on another.
- A child's exit status goes only to the connection that asked for that child, and
  exactly (`waitpid`). At most `MAX_CHILDREN` children of one requester, ended or
  running, are kept.
- A requester's children die with it whatever dies first: when its connection closes
  (it ended, however) they are killed (SIGKILL); when this server dies, the kernel
  sends each child SIGTERM (PR_SET_PDEATHSIG, set in the child and checked against
  this server's pid, so a server gone before that is seen too). The launcher's end
  closing ends the server: its children get that SIGTERM (a device then cleans up).
It never runs anything for another user, never follows a link at its socket's path,
never reads a secret from its own environment or command line (a run's environment
travels with it), and never blocks on one requester.
"""

from __future__ import annotations

import collections
import errno
import importlib
import importlib.util
import os
import select
import signal
import socket
import stat
import struct
import sys
import time
from typing import Callable, Optional, Sequence


def _protocol():
    """`fork_protocol`: the package's module where it is imported, else loaded by its
    path (as this file runs: without the package)."""
    if __package__:
        return importlib.import_module("fax_bridge.system.fork_protocol")
    name = "_fax_bridge_fork_protocol"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(
            os.path.dirname(os.path.abspath(__file__)), "fork_protocol.py"))
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


protocol = _protocol()

ENV = "FAX_BRIDGE_FORK_SERVER"  # "FD:PID" in a forked child: its socket to the server
MAX_REQUESTERS = 256  # connections served at once (each live child holds one too)
MAX_UNREAD = 8  # answers a requester may leave unread before it is dropped
MAX_CHILDREN = 4096  # children of one requester kept, running or not yet asked for
DEATH_SIGNAL = signal.SIGTERM  # what a child gets when this server dies
_PR_SET_PDEATHSIG = 1


class _Child(Exception):
    """Raised in a forked child to leave the server's loop: the interpreter then runs
    the target as its main program and exits as that program would (atexit, threads)."""

    def __init__(self, target: str, argv: list):
        super().__init__(target)
        self.target, self.argv = target, argv


class _Requester:
    """One connection: the launcher's, a forked child's own, or one accepted."""

    def __init__(self, sock: socket.socket):
        sock.setblocking(False)
        self.sock, self.open = sock, True
        self.outbox: collections.deque = collections.deque()  # (datagram, fds) unsent
        self.children: dict = {}  # pid -> exit status, None while it runs


class Server:
    """The serving loop's state: the requesters, which child is whose, and when it
    last had a request."""

    def __init__(self, launcher: socket.socket, idle_seconds: float,
                 listener: Optional[socket.socket] = None, log_children: bool = False,
                 pdeathsig: Optional[Callable[[int], None]] = None):
        self.pid = os.getpid()  # a child checks its parent is still this
        self.launcher = _Requester(launcher)
        self.requesters = {launcher.fileno(): self.launcher}
        self.owners: dict = {}  # a live child's pid -> the requester that asked for it
        self.listener, self.accepting = listener, listener is not None
        self.idle_seconds, self.quiet_since = idle_seconds, time.monotonic()
        self.log_children, self.pdeathsig = log_children, pdeathsig
        self.handlers = {protocol.Run: self._run, protocol.Status: self._status}

    def serve(self) -> None:
        """Serves until the launcher's connection closes or the server idles."""
        if self.listener is not None:
            self.listener.setblocking(False)
        while self.launcher.open:
            self._reap()
            poll = select.poll()
            for fd, requester in self.requesters.items():
                poll.register(fd, select.POLLIN | (select.POLLOUT if requester.outbox else 0))
            if self.accepting and len(self.requesters) < MAX_REQUESTERS:
                poll.register(self.listener.fileno(), select.POLLIN)
            events = poll.poll(1000)
            if not events:
                if not self.owners and time.monotonic() - self.quiet_since > self.idle_seconds:
                    return
                continue
            for fd, event in events:
                if self.listener is not None and fd == self.listener.fileno():
                    self._accept()
                    continue
                requester = self.requesters.get(fd)
                if requester is not None and event & select.POLLOUT:
                    self._flush(requester)
                if requester is not None and requester.open and event & ~select.POLLOUT:
                    self._receive(requester)

    def _accept(self) -> None:
        """Takes a requester connecting to the listening socket if it runs as our user."""
        try:
            sock, _ = self.listener.accept()
        except BlockingIOError:
            return
        except OSError as e:  # out of descriptors: wait until a connection or child ends
            self.accepting = e.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS,
                                             errno.ENOMEM)
            return
        _, uid, _ = struct.unpack("3i", sock.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        if uid != os.getuid():
            try:
                sock.setblocking(False)
                sock.send(protocol.answer(error=f"a requester of user {uid}, not {os.getuid()}"))
            except OSError:
                pass
            sock.close()
            return
        requester = _Requester(sock)
        self.requesters[sock.fileno()] = requester
        self._send(requester, protocol.hello(os.getpid()))

    def _receive(self, requester: _Requester) -> None:
        try:
            data, fds, flags, _ = socket.recv_fds(requester.sock, protocol.MAX_DATAGRAM,
                                                  protocol.MAX_FDS)
        except BlockingIOError:
            return
        except OSError:  # a requester gone before it read our answer: reset
            data, fds, flags = b"", [], 0
        self.quiet_since = time.monotonic()
        if not data:
            _close_all(fds)
            self._drop(requester)
            return
        try:
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise protocol.ProtocolError(
                    f"more than {protocol.MAX_DATAGRAM} bytes or {protocol.MAX_FDS} "
                    "descriptors")
            request = protocol.decode_request(data, len(fds))
        except protocol.ProtocolError as e:
            _close_all(fds)
            self._send(requester, protocol.answer(error=f"malformed request: {e}"))
            return
        self.handlers[type(request)](requester, request, fds)

    def _send(self, requester: _Requester, datagram: bytes, fds: Sequence[int] = ()) -> None:
        """Sends an answer (and then closes `fds`, ours), or keeps it until the
        requester's socket has room; drops a requester with too many unread."""
        requester.outbox.append((datagram, list(fds)))
        self._flush(requester)
        if requester.open and len(requester.outbox) > MAX_UNREAD:
            self._drop(requester)

    def _flush(self, requester: _Requester) -> None:
        while requester.outbox:
            datagram, fds = requester.outbox[0]
            try:
                socket.send_fds(requester.sock, [datagram], fds)
            except BlockingIOError:
                return
            except OSError:  # the requester is gone
                self._drop(requester)
                return
            requester.outbox.popleft()
            _close_all(fds)

    def _drop(self, requester: _Requester) -> None:
        """Closes a requester's connection, killing the children it asked for."""
        if not requester.open:
            return
        requester.open = False
        del self.requesters[requester.sock.fileno()]
        for pid, code in requester.children.items():
            # the launcher's children get DEATH_SIGNAL as the server exits, next
            if code is None and self.owners.get(pid) is requester \
                    and requester is not self.launcher:
                _kill(pid)
        for _, fds in requester.outbox:
            _close_all(fds)
        requester.outbox.clear()
        requester.sock.close()
        self.accepting = self.listener is not None

    def _reap(self) -> None:
        while self.owners:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.owners.clear()
                return
            if pid == 0:
                return
            self._ended(pid, os.waitstatus_to_exitcode(status))

    def _ended(self, pid: int, code: int) -> None:
        owner = self.owners.pop(pid, None)
        self.accepting = self.listener is not None
        if owner is not None and owner.open:
            owner.children[pid] = code

    def _status(self, requester: _Requester, request, fds: list) -> None:
        pid = request.pid
        if pid not in requester.children:
            self._send(requester, protocol.answer(
                error=f"no child {pid} of this requester to report (a child's status goes "
                      "only to the connection that asked for it)"))
            return
        if requester.children[pid] is None:
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = 0
            if done:
                self._ended(pid, os.waitstatus_to_exitcode(status))
        code = requester.children[pid]
        if code is not None:
            del requester.children[pid]
        self._send(requester, protocol.answer(returncode=code))

    def _run(self, requester: _Requester, request, fds: list) -> None:
        if len(requester.children) >= MAX_CHILDREN:
            _close_all(fds)
            self._send(requester, protocol.answer(
                error=f"{MAX_CHILDREN} children of this requester already (ask for the "
                      "status of those that ended)"))
            return
        own, kept = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            pid = os.fork()
        except OSError as e:
            _close_all(fds)
            own.close()
            kept.close()
            self._send(requester, protocol.answer(error=f"fork failed: {e}"))
            return
        if pid == 0:
            self._become_child(request, fds, own, kept)
        own.close()
        _close_all(fds)
        self.requesters[kept.fileno()] = _Requester(kept)
        requester.children[pid] = None
        self.owners[pid] = requester
        if self.log_children:
            os.write(2, f"fax_bridge.system.forks: forked {pid} to run {request.target}\n"
                     .encode(errors="replace"))
        self._send(requester, protocol.answer(pid=pid), [os.pidfd_open(pid)])

    def _become_child(self, request, fds: list, own: socket.socket,
                      kept: socket.socket) -> None:
        """In the forked child: tied to this server's life, its session, CPUs,
        descriptors, directory and environment; then `_Child` leaves the loop."""
        try:
            for requester in self.requesters.values():
                requester.sock.close()
                for _, pending in requester.outbox:
                    _close_all(pending)
            kept.close()
            if self.listener is not None:
                self.listener.close()
            if self.pdeathsig is not None:
                self.pdeathsig(DEATH_SIGNAL)
            if os.getppid() != self.pid:  # the server died before the signal was set
                os._exit(128 + DEATH_SIGNAL)
            os.setsid()
            if request.cpus is not None:
                os.sched_setaffinity(0, request.cpus)
            *streams, cwd = fds
            os.fchdir(cwd)
            for target, fd in enumerate(streams):
                os.dup2(fd, target)
            _close_all(fd for fd in fds if fd > 2)
            os.environ.clear()
            os.environ.update(request.env)
            os.environ[ENV] = f"{own.fileno()}:{os.getpid()}"
        except BaseException as e:  # its stderr says why; the requester sees it end
            os.write(2, f"fax_bridge.system.forks: the child could not start: {e!r}\n"
                     .encode(errors="replace"))
            os._exit(1)
        raise _Child(request.target, list(request.argv))


def _close_all(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _what(mode: int) -> str:
    return ("a link" if stat.S_ISLNK(mode) else "a folder" if stat.S_ISDIR(mode)
            else "a file" if stat.S_ISREG(mode) else "no socket")


def listen(path: str) -> socket.socket:
    """A socket listening at `path` (mode 0600), or OSError naming `path`: a link,
    folder or file there is refused, never followed; a socket of ours there is replaced
    when no server answers on it (one of an earlier run that ended)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise OSError(f"{path} is {_what(st.st_mode)}, not a socket: remove it, or "
                          "listen elsewhere")
        if st.st_uid != os.getuid():
            raise OSError(f"{path} is user {st.st_uid}'s socket, not ours")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # no server answers there any more
        else:
            raise OSError(f"a server already listens at {path}")
        finally:
            probe.close()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    umask = os.umask(0o177)  # created 0600 (bind never follows a link: EADDRINUSE)
    try:
        listener.bind(path)
    except OSError:
        listener.close()
        raise
    finally:
        os.umask(umask)
    listener.listen(64)
    return listener


def _pdeathsig() -> Optional[Callable[[int], None]]:
    """prctl(PR_SET_PDEATHSIG, sig) through the C library (loaded before any fork)."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (ImportError, OSError, AttributeError):
        return None

    def set_death_signal(signum: int) -> None:
        if prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")

    return set_death_signal


def _say(sock: socket.socket, datagram: bytes) -> None:
    try:
        sock.send(datagram)
    except OSError:
        pass


def main(argv: Sequence[str]) -> int:
    """The server process: imports the modules, checks it runs one thread, says hello,
    serves; in a forked child, runs the requested target instead."""
    import runpy

    launcher = socket.socket(fileno=int(argv[0]))
    modules, listener, log_children, path = list(argv[2:]), None, False, None
    if modules[:1] == ["--listen"]:
        path, modules = modules[1], modules[2:]
        try:
            listener = listen(path)
        except OSError as e:
            _say(launcher, protocol.answer(error=f"cannot listen at {path}: {e}"))
            return 1
        bound = os.stat(path).st_ino
    if modules[:1] == ["--log-children"]:
        log_children, modules = True, modules[1:]
    try:
        for name in modules:
            importlib.import_module(name)
        pdeathsig = _pdeathsig()
        threads = len(os.listdir("/proc/self/task"))
        if threads != 1:
            _say(launcher, protocol.answer(error=f"{threads} threads after the imports "
                                                 "(forking needs one; set OMP_NUM_THREADS=1)"))
            return 1
        _say(launcher, protocol.hello(os.getpid()))
        try:
            Server(launcher, float(argv[1]), listener, log_children, pdeathsig).serve()
        finally:  # in the server, not in a child leaving through _Child
            if listener is not None and listener.fileno() >= 0:
                listener.close()
                try:
                    if os.lstat(path).st_ino == bound:  # still ours: not one put there since
                        os.unlink(path)
                except OSError:
                    pass
    except _Child as child:
        module, _, function = child.target.partition(":")
        if not function:
            sys.argv = [child.target, *child.argv]
            runpy.run_module(child.target, run_name="__main__", alter_sys=True)
            return 0
        sys.argv = child.argv
        return getattr(importlib.import_module(module), function)()
    return 0


if __name__ == "__main__":
    if not __package__:  # run by its path (no package imported): as `-m` would, the
        sys.path[0] = os.getcwd()  # working directory leads the path, not this folder
    sys.exit(main(sys.argv[1:]))
