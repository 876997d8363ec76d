"""Whether test processes still run: `fax_bridge.process_tree`'s readers of /proc, with
sets where the tests compare groups of processes; scripts run in a fresh interpreter on
emulated CPU devices (`run_on_cpu_devices`); and a step run as another user
(`as_nobody`, for the trust-boundary tests).

A zombie (ended, not yet reaped) counts as ended: a test that killed a process group
asks whether anything of it still works, not whether its parent has reaped it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from fax_bridge.process_tree import alive, children, parent, running

__all__ = ["alive", "as_nobody", "children", "descendants", "parent", "run_on_cpu_devices",
           "running"]


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
    from fax_bridge import process_tree

    return set(process_tree.descendants(pid))
