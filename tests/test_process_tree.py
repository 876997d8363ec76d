"""fax_bridge.system.process_tree: a process's tree read from /proc, and ending it whole."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from fax_bridge.system import process_tree

pytestmark = pytest.mark.skipif(not os.path.isdir(f"/proc/{os.getpid()}"),
                                reason="needs Linux /proc")

# A child that starts a grandchild in a session of its own (out of its process group),
# says the grandchild's pid, and waits.
_TREE = ("import subprocess, sys, time\n"
         "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],\n"
         "                     start_new_session=True)\n"
         "print(g.pid, flush=True)\n"
         "time.sleep(600)\n")


def test_end_group_ends_a_process_and_what_it_started_in_a_session_of_its_own():
    proc = subprocess.Popen([sys.executable, "-c", _TREE], stdout=subprocess.PIPE,
                            start_new_session=True)
    try:
        grandchild = int(proc.stdout.readline())
        assert process_tree.parent(grandchild) == proc.pid
        assert process_tree.children(proc.pid) == {grandchild}
        assert process_tree.descendants(proc.pid) == [grandchild]
        assert grandchild in process_tree.descendants(os.getpid())
        process_tree.end_group(proc, grace_s=5.0)
        assert proc.returncode == -signal.SIGTERM
        deadline = time.monotonic() + 30  # a signal sent is not yet a process ended
        while process_tree.alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not process_tree.alive(proc.pid) and not process_tree.alive(grandchild)
    finally:
        proc.kill()
        proc.stdout.close()


def test_a_zombie_counts_as_ended_and_a_gone_process_has_no_parent_nor_children():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # ended, not yet reaped
    assert not process_tree.alive(proc.pid) and process_tree.running([proc.pid]) == []
    proc.wait()
    assert process_tree.parent(proc.pid) == 0 and process_tree.children(proc.pid) == set()
    process_tree.signal_all([proc.pid], signal.SIGKILL)  # gone: nothing to signal
    process_tree.signal_group(proc, signal.SIGKILL)
