"""Whether test processes still run, read from /proc (Linux).

A zombie (ended, not yet reaped) counts as ended: a test that killed a process group
asks whether anything of it still works, not whether its parent has reaped it. The
state letter is read after the last ')' of /proc/PID/stat, since a command name may
hold spaces and parentheses.
"""

from __future__ import annotations

import pathlib
from typing import Iterable


def alive(pid: int) -> bool:
    """True while `pid` runs (neither gone nor a zombie)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def running(pids: Iterable[int]) -> list:
    """Those of `pids` that still run."""
    return [pid for pid in pids if alive(pid)]


def parent(pid: int) -> int:
    """The parent's pid of `pid` (0 once it is gone)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return 0
    return int(stat.rsplit(")", 1)[1].split()[1])


def children(pid: int) -> set:
    """The processes whose parent is `pid` (empty once it is gone)."""
    found = set()
    try:
        tasks = list(pathlib.Path(f"/proc/{pid}/task").iterdir())
    except (FileNotFoundError, ProcessLookupError):
        return found
    for task in tasks:
        try:
            found |= {int(c) for c in (task / "children").read_text().split()}
        except (FileNotFoundError, ProcessLookupError):
            pass
    return found


def descendants(pid: int) -> set:
    """Every process below `pid`: its children, theirs, and so on."""
    found, todo = set(), [pid]
    while todo:
        for child in children(todo.pop()) - found:
            found.add(child)
            todo.append(child)
    return found
