"""Process lifetimes: who runs under whom, and ending a process with all it started.

Read from Linux's /proc (elsewhere every process looks childless): `parent`,
`children` and `descendants` follow the parent links of every process, so a process
that started a session of its own (as some of Flower's do) is still found under the
one that started it; `alive` counts a zombie (ended, not yet reaped) as ended, since a
caller that killed something asks whether anything of it still works. A process's
state and parent are read after the last ')' of /proc/PID/stat, since a command's name
may hold spaces and parentheses.

`signal_group` signals a process group (a child started with `start_new_session`
leads its own), `end_group` ends a group and every process started under it, SIGKILL
for what a grace period leaves; `signal_all` signals pids that may be gone already.
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Iterable, Optional

MAX_DESCENDANTS = 10_000  # a bound on one walk, should the tree change under it


def _stat(pid: int) -> Optional[list]:
    """The fields of /proc/PID/stat after the command's name (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:].split()


def alive(pid: int) -> bool:
    """True while `pid` runs (neither gone nor a zombie)."""
    fields = _stat(pid)
    return bool(fields) and fields[0] not in ("Z", "X")


def running(pids: Iterable[int]) -> list:
    """Those of `pids` that still run."""
    return [pid for pid in pids if alive(pid)]


def parent(pid: int) -> int:
    """The parent's pid of `pid` (0 once it is gone)."""
    fields = _stat(pid)
    return int(fields[1]) if fields and len(fields) > 1 else 0


def children_map() -> dict:
    """{parent pid: [child pids]} of every process (empty where there is no /proc)."""
    out: dict = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if name.isdigit():
            fields = _stat(int(name))
            if fields and len(fields) > 1:
                out.setdefault(int(fields[1]), []).append(int(name))
    return out


def children(pid: int) -> set:
    """The processes whose parent is `pid` (empty once it is gone)."""
    return set(children_map().get(pid, ()))


def descendants(pid: int) -> list:
    """Every process started under `pid`, however deep."""
    tree, found, stack = children_map(), [], [pid]
    while stack and len(found) < MAX_DESCENDANTS:
        for child in tree.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def signal_all(pids: Iterable[int], sig: int) -> None:
    """Sends `sig` to each of `pids` that still exists (and may be signalled)."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Sends `sig` to the process group `proc` leads (started with
    `start_new_session`), or to `proc` alone where that group is gone or not ours."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass


def end_group(proc: subprocess.Popen, sig: int = signal.SIGTERM,
              grace_s: float = 5.0) -> None:
    """Sends `sig` to `proc`'s process group and to every process started under it
    (SIGKILL to what is left after `grace_s`), and reaps `proc`."""
    below = descendants(proc.pid)
    signal_group(proc, sig)
    signal_all(below, sig)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    below += descendants(proc.pid) if proc.poll() is None else []
    signal_group(proc, signal.SIGKILL)  # whatever of the group is left
    signal_all(below, signal.SIGKILL)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
