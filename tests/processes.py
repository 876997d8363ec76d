"""Whether test processes still run: `fax_bridge.system.process_tree`'s readers of /proc, with
sets where the tests compare groups of processes; scripts run in a fresh interpreter on
emulated CPU devices (`run_on_cpu_devices`); and a step run as another user
(`as_nobody`, for the trust-boundary tests); and a fault injected at a known point of a
fleet's round (`at_round_requests`), never after a sleep.

A zombie (ended, not yet reaped) counts as ended: a test that killed a process group
asks whether anything of it still works, not whether its parent has reaped it.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from typing import Callable, Iterator, Optional

from fax_bridge.system.process_tree import alive, children, parent, running

__all__ = ["alive", "as_nobody", "at_round_requests", "children", "descendants", "parent",
           "run_on_cpu_devices", "running"]


def run_on_cpu_devices(script: str, devices: int = 8) -> dict:
    """Runs python `script` in a fresh interpreter whose jax has `devices` CPU devices
    (XLA's host-platform device count is read once, at jax's start) and returns the JSON
    object on its last line of output; a failure shows the end of its stderr."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def as_nobody(step) -> None:
    """Runs `step()` in a forked child that is the user nobody (no supplementary groups);
    the child must exit 0, which it does only when `step` returned (the test needs root)."""
    import pwd

    nobody = pwd.getpwnam("nobody")
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            step()
            code = 0
        finally:
            os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, "the step as nobody failed"


def descendants(pid: int) -> set:
    """Every process below `pid`: its children, theirs, and so on."""
    from fax_bridge.system import process_tree

    return set(process_tree.descendants(pid))


@contextlib.contextmanager
def at_round_requests(on_made: Callable[[], None], on_sent: Optional[Callable[[], None]] = None,
                      devices: int = 0) -> Iterator[dict]:
    """Faults at known points of a fleet round run in this process: `on_made()` runs once,
    as the round makes its first Round request stream (after the round's Load: every
    device holds the computation, none has its clients yet); `on_sent()` once `devices`
    Round streams have been handed to gRPC in full. Yields the counts
    ({"made": bool, "sent": int}) for the test to check that both points were reached."""
    from fax_bridge.fleet import put_messages

    real, lock = put_messages.stream, threading.Lock()
    state = {"made": False, "sent": 0}

    def watched(messages, what="Put"):
        if what == "Round" and not state["made"]:
            state["made"] = True
            on_made()

        def each():
            yield from messages
            if what == "Round":
                with lock:
                    state["sent"] += 1
                    last = state["sent"] == devices
                if last and on_sent is not None:
                    on_sent()
        return real(each(), what)

    put_messages.stream = watched
    try:
        yield state
    finally:
        put_messages.stream = real
