"""Whether test processes still run: `fax_bridge.process_tree`'s readers of /proc, with
sets where the tests compare groups of processes; and scripts run in a fresh interpreter
on emulated CPU devices (`run_on_cpu_devices`).

A zombie (ended, not yet reaped) counts as ended: a test that killed a process group
asks whether anything of it still works, not whether its parent has reaped it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from fax_bridge.process_tree import alive, children, parent, running

__all__ = ["alive", "children", "descendants", "parent", "run_on_cpu_devices", "running"]


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


def descendants(pid: int) -> set:
    """Every process below `pid`: its children, theirs, and so on."""
    from fax_bridge import process_tree

    return set(process_tree.descendants(pid))
