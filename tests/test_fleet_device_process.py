"""The device process's own setup: XLA calls run inline in the calling thread."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fax_bridge.fleet import device_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A long jitted call: with jax's asynchronous CPU dispatch its result is not ready when
# the call returns; run inline, it is.
_READY = """
import sys
import jax, jax.numpy as jnp
if sys.argv[1] == "inline":
    from fax_bridge.fleet import device_process
    device_process._run_xla_inline()
f = jax.jit(lambda x: jnp.linalg.matrix_power(x, 64))
x = jnp.ones((400, 400)) / 400
f(x).block_until_ready()
print(all(f(x).is_ready() for _ in range(3)))
"""


def _ready_on_return(mode: str) -> bool:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", _READY, mode], env=env, check=True,
                         capture_output=True, text=True, timeout=120)
    return out.stdout.strip().splitlines()[-1] == "True"


def test_xla_calls_finish_before_they_return_in_a_device_process():
    assert _ready_on_return("inline")
    assert not _ready_on_return("async")  # the check can tell the two apart


def test_serve_runs_xla_inline_before_the_servicer_exists(monkeypatch):
    order = []

    class Stop(Exception):
        pass

    def servicer(*args, **kwargs):
        order.append("servicer")
        raise Stop

    monkeypatch.setattr(device_process, "_run_xla_inline", lambda: order.append("inline"))
    monkeypatch.setattr(device_process, "DeviceServicer", servicer)
    with pytest.raises(Stop):
        device_process.serve(token="t")
    assert order == ["inline", "servicer"]
