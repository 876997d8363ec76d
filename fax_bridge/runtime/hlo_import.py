"""XLA's HLO -> StableHLO import, run in a separate process that a crash cannot spread from.

XLA stops its process on internal CHECK failures, and some malformed modules that pass
`hlo_check` may still make it crash. `Importer.convert` sends the module to a helper
process (this file run as a script, loading only jaxlib: about 0.25 s to start; in a
device forked by `fax_bridge.system.forks`, forked by the same server, with jaxlib loaded) and
reads the StableHLO bytecode back; if the helper dies, the caller gets `Died` with the
signal and XLA's last words, and the next module starts a fresh helper. `Died.crash`
says whether XLA itself stopped the helper (SIGABRT on a CHECK, SIGSEGV, ..., or a
non-zero exit): a helper killed from outside (SIGKILL, SIGTERM, ...) or past its time
limit says nothing about the module. The time limit is armed before the module is
written: a helper that stops reading (SIGSTOP) cannot hold the caller past it, however
large the module (writes go through a non-blocking pipe, waiting with `select`). It
counts from a helper that is ready: a new helper's start (loading jaxlib, seconds on a
busy machine) has a limit of its own, `STARTUP_SECONDS`. The helper is
reused for later modules and exits by itself after `IDLE_SECONDS` without one, or when
its parent goes away (end of its input).

Protocol, on the helper's stdin and stdout: once it has loaded jaxlib the helper writes
one byte, `READY`; then a request is an 8-byte little-endian length
and the module's bytes; an answer is one status byte (0: converted, 1: XLA refused the
module), an 8-byte length and the StableHLO bytecode or XLA's error text.
"""

from __future__ import annotations

import os
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

IDLE_SECONDS = 60.0
TIMEOUT_SECONDS = 600.0  # one module's import; XLA converting a large model takes seconds
STARTUP_SECONDS = 120.0  # a new helper's start, up to its READY byte
READY = b"\x01"
_HEAD = struct.Struct("<BQ")
_LENGTH = struct.Struct("<Q")


class Died(Exception):
    """The helper process died (or hung) importing a module; `crash`: XLA stopped it
    itself (the module may be at fault), not a signal from outside or the time limit
    (`timed_out`)."""

    def __init__(self, message: str, crash: bool = False, timed_out: bool = False):
        super().__init__(message)
        self.crash, self.timed_out = crash, timed_out


# Signals XLA raises in its own process when it fails on a module; any other signal
# came from outside (a user, a supervisor, the OOM killer).
CRASH_SIGNALS = frozenset({signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL,
                           signal.SIGFPE, signal.SIGTRAP})


def _read_exact(fd: int, count: int, deadline: Optional[float]) -> Optional[bytes]:
    """`count` bytes from `fd`; None at end of input before the first byte."""
    chunks, got = [], 0
    while got < count:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
        chunk = os.read(fd, min(count - got, 1 << 20))
        if not chunk:
            if got == 0:
                return None
            raise EOFError("the stream ended inside a message")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes, deadline: Optional[float] = None) -> None:
    """Writes `data` to `fd`; with a `deadline`, `fd` must be non-blocking, and a reader
    that stops reading raises TimeoutError at the deadline instead of blocking."""
    view = memoryview(data)
    while view:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [fd], [], left)[1]:
                raise TimeoutError
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            continue


def _last_words(log: bytes) -> str:
    """XLA's reason for stopping, from the helper's stderr (its CHECK line if any)."""
    lines = [line.strip() for line in log.decode(errors="replace").splitlines()]
    lines = [line for line in lines if line and not line.startswith(("***", "@", "PC:"))]
    checks = [line for line in lines if "Check failed" in line or "CHECK" in line]
    text = (checks or lines or [""])[-1]
    return text[-300:]


class Importer:
    """One helper process at a time, started on demand; thread-safe (one import at a time)."""

    def __init__(self, idle_seconds: float = IDLE_SECONDS,
                 timeout_seconds: float = TIMEOUT_SECONDS,
                 startup_seconds: float = STARTUP_SECONDS):
        self._idle = idle_seconds
        self._timeout = timeout_seconds
        self._startup = startup_seconds
        self._lock = threading.Lock()
        self._proc: Optional[subprocess.Popen] = None
        self._log = None

    def _process(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._close()
        self._log = tempfile.TemporaryFile()
        self._proc = self._forked()
        if self._proc is None:
            self._proc = subprocess.Popen(
                [sys.executable, "-P", os.path.abspath(__file__), str(self._idle)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                close_fds=True)
        os.set_blocking(self._proc.stdin.fileno(), False)  # writes wait under the deadline
        try:
            ready = _read_exact(self._proc.stdout.fileno(), len(READY),
                                time.monotonic() + self._startup)
        except TimeoutError:
            ready = None
        if ready != READY:
            code = self._proc.poll()
            self._log.seek(0)
            words = _last_words(self._log.read())
            self._close()
            why = (f"did not start within {self._startup:g} s" if code is None
                   else f"exited with status {code} as it started")
            raise Died(f"the XLA import process {why}" + (f" ({words})" if words else ""),
                       timed_out=code is None)
        return self._proc

    def _forked(self):
        """A helper (`forks.ForkedProcess`) forked by the server that forked this process
        (a fleet's device), which has jaxlib loaded already; None where there is none."""
        from fax_bridge.system import forks  # here: the helper, run as a script, loads jaxlib only

        server = forks.ForkServer.inherited()
        if server is None:
            return None
        try:
            return server.run("fax_bridge.runtime.hlo_import", [str(self._idle)],
                              env=dict(os.environ), cwd=os.getcwd(),
                              stderr_fd=self._log.fileno(), stdin_pipe=True)
        except forks.ForkServerError:
            return None  # a fresh interpreter, as without the server

    def _close(self) -> None:
        if self._proc is not None:
            for stream in (self._proc.stdin, self._proc.stdout):
                try:
                    stream.close()
                except OSError:  # unwritten bytes of a stopped helper's pipe
                    pass
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def convert(self, module: bytes) -> tuple[bool, bytes]:
        """(True, StableHLO bytecode) or (False, XLA's error text); raises `Died` when
        the helper dies or exceeds the time limit on this module (counted from before
        the module is written)."""
        with self._lock:
            for attempt in (0, 1):
                proc = self._process()
                log_start = self._log.seek(0, os.SEEK_END)
                deadline = time.monotonic() + self._timeout
                try:
                    _write_all(proc.stdin.fileno(), _LENGTH.pack(len(module)) + module,
                               deadline)
                    head = _read_exact(proc.stdout.fileno(), _HEAD.size, deadline)
                    if head is None:
                        raise EOFError("no answer")
                    status, length = _HEAD.unpack(head)
                    payload = _read_exact(proc.stdout.fileno(), length, deadline) or b""
                    return status == 0, payload
                except TimeoutError:
                    self._close()
                    raise Died(f"XLA did not finish importing it within {self._timeout:g} s",
                               timed_out=True) from None
                except (BrokenPipeError, EOFError):
                    code = proc.wait()
                    self._log.seek(log_start)
                    words = _last_words(self._log.read())
                    self._close()
                    if code == 0 and attempt == 0:
                        continue  # the idle helper exited as this request came: retry once
                    crash = code > 0 or (code < 0 and -code in CRASH_SIGNALS)
                    how = (f"killed by {signal.Signals(-code).name}" if code < 0
                           else f"exited with status {code}")
                    if not crash:
                        how += " from outside (not by XLA)"
                    raise Died(f"the XLA import process was {how}"
                               + (f" ({words})" if words else ""), crash) from None
        raise Died("the XLA import process exited twice before answering")  # unreachable


def _serve(idle_seconds: float) -> int:
    """The helper's loop: import modules until end of input or `idle_seconds` of quiet."""
    from jaxlib import _jax  # jaxlib alone, not jax: a quarter of the start-up time

    _write_all(1, READY)
    while True:
        if not select.select([0], [], [], idle_seconds)[0]:
            return 0
        head = _read_exact(0, _LENGTH.size, None)
        if head is None:
            return 0
        module = _read_exact(0, _LENGTH.unpack(head)[0], None) or b""
        try:
            status, payload = 0, bytes(_jax.mlir.hlo_to_stablehlo(module))
        except Exception as e:  # XLA's refusals are plain RuntimeErrors
            status, payload = 1, str(e).encode(errors="replace")
        _write_all(1, _HEAD.pack(status, len(payload)) + payload)


if __name__ == "__main__":
    sys.exit(_serve(float(sys.argv[1]) if len(sys.argv) > 1 else IDLE_SECONDS))
