"""The local path across processes: 2 and 4 JAX processes on 127.0.0.1 (2 CPU devices
each), joined by `jax.distributed`, run one program over a `clients` axis spanning them;
each loads only its own clients, and the results equal the single-process run."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fax_bridge as fb
from fax_bridge.local import multihost

N = 16

WORKER = textwrap.dedent("""
    import json, sys
    import numpy as np
    process_id, num_processes, port, n = map(int, sys.argv[1:5])
    from fax_bridge.local import multihost
    multihost.initialize(f"127.0.0.1:{port}", num_processes, process_id,
                         initialization_timeout_s=60)
    import jax, jax.numpy as jnp
    import fax_bridge as fb

    @fb.program(clients=n)
    def step(w, x):
        wc = fb.federated_broadcast(w)
        g = fb.federated_map_clients(lambda a, b: jnp.tanh(b @ a) @ b, (wc, x))
        return w - 0.1 * fb.federated_mean(g), g

    mesh = multihost.global_clients_mesh()
    rows = multihost.process_clients(n, mesh)
    try:
        multihost.process_clients(n + 1, mesh)
        uneven_error = ""
    except ValueError as e:
        uneven_error = str(e)
    # Each process produces (as if reading from its own disk) only its clients' rows.
    x = np.stack([np.arange(12, dtype=np.float32).reshape(4, 3) / 100 + 0.01 * c
                  for c in rows])
    w = np.full(3, 0.1, np.float32)
    new_w, g = multihost.run_program_multihost(step, mesh, ("server", "clients"), w, x)
    print(json.dumps({
        "process": jax.process_index(), "processes": jax.process_count(),
        "devices": jax.device_count(), "local_devices": jax.local_device_count(),
        "rows": [rows.start, rows.stop], "w": multihost.server_value(new_w).tolist(),
        "g_local": multihost.local_clients(g).tolist(),
        "g_all": multihost.gather(g).tolist(),
        "g_spec": str(g.sharding.spec), "uneven_error": uneven_error}), flush=True)
    multihost.shutdown()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(num_processes: int, timeout_s: float = 150.0, worker: str = WORKER,
            devices: int = 2) -> list[dict]:
    """Runs the worker in `num_processes` processes; kills them all on any failure."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-c", worker, str(i), str(num_processes), str(port), str(N)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True) for i in range(num_processes)]
    deadline = time.monotonic() + timeout_s
    outputs = []
    try:
        for i, proc in enumerate(procs):
            try:
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"process {i} of {num_processes} did not finish within "
                            f"{timeout_s:.0f}s")
            assert proc.returncode == 0, f"process {i} failed:\n{err[-3000:]}"
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
    return outputs


WORKER_2D = textwrap.dedent("""
    import json, sys
    import numpy as np
    process_id, num_processes, port, n = map(int, sys.argv[1:5])
    from fax_bridge.local import multihost
    multihost.initialize(f"127.0.0.1:{port}", num_processes, process_id,
                         initialization_timeout_s=60)
    import jax, jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    import fax_bridge as fb

    def local(p, x):
        g = jax.grad(lambda p: jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2))(p)
        return jax.tree.map(lambda a, b: a - 0.5 * b, p, g)

    @fb.program(clients=n)
    def step(p, x):
        pc = fb.federated_map_clients(local, (fb.federated_broadcast(p), x))
        return fb.federated_mean(pc), pc["w1"]

    mesh = multihost.global_mesh((2, 4), ("clients", "model"))
    rows = multihost.process_clients(n, mesh)
    rng = np.random.default_rng(0)
    params = {"w1": rng.normal(size=(6, 8)).astype(np.float32),
              "w2": rng.normal(size=(8, 3)).astype(np.float32)}
    x_all = rng.normal(size=(n, 5, 6)).astype(np.float32)
    p = multihost.global_server_array(params, mesh, {"w1": P(None, "model"), "w2": P("model")})
    new_p, w1c = multihost.run_program_multihost(step, mesh, ("server", "clients"), p,
                                                 x_all[rows.start:rows.stop])
    print(json.dumps({
        "process": jax.process_index(), "rows": [rows.start, rows.stop],
        "p": {k: v.tolist() for k, v in multihost.server_value(new_p).items()},
        "w1c": multihost.local_clients(w1c).tolist(),
        "specs": {k: str(v.sharding.spec) for k, v in new_p.items()},
        "w1c_spec": str(w1c.sharding.spec),
        "shards": sorted({str(s.data.shape) for s in w1c.addressable_shards})}), flush=True)
    multihost.shutdown()
""")


def test_two_dimensional_mesh_across_processes_matches_one_process():
    one = _launch(1, worker=WORKER_2D, devices=8)[0]
    two = sorted(_launch(2, worker=WORKER_2D, devices=4), key=lambda r: r["process"])
    assert one["specs"] == {"w1": "P(None, 'model')", "w2": "P('model',)"}
    assert one["w1c_spec"] == "P('clients', None, 'model')" and one["shards"] == ["(8, 6, 2)"]
    assert [r["rows"] for r in two] == [[0, N // 2], [N // 2, N]]
    for r in two:
        assert r["specs"] == one["specs"] and r["w1c_spec"] == one["w1c_spec"]
        assert r["shards"] == one["shards"]
        for k in one["p"]:
            np.testing.assert_allclose(r["p"][k], one["p"][k], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(two[0]["w1c"] + two[1]["w1c"], one["w1c"], rtol=1e-5,
                               atol=1e-6)


def _reference():
    @fb.program(clients=N)
    def step(w, x):
        wc = fb.federated_broadcast(w)
        g = fb.federated_map_clients(lambda a, b: jnp.tanh(b @ a) @ b, (wc, x))
        return w - 0.1 * fb.federated_mean(g), g

    x = np.stack([np.arange(12, dtype=np.float32).reshape(4, 3) / 100 + 0.01 * c
                  for c in range(N)])
    w, g = step(jnp.full(3, 0.1, jnp.float32), jnp.asarray(x))
    return np.asarray(w), np.asarray(g)


@pytest.mark.parametrize("num_processes", [2, 4])
def test_processes_match_the_single_process_run(num_processes):
    outputs = _launch(num_processes)
    ref_w, ref_g = _reference()
    per = N // num_processes
    for i, r in enumerate(sorted(outputs, key=lambda r: r["process"])):
        assert r["processes"] == num_processes and r["local_devices"] == 2
        assert r["devices"] == 2 * num_processes
        assert r["rows"] == [i * per, (i + 1) * per]  # contiguous block per process
        assert r["g_spec"] == "P('clients',)"
        assert "split evenly" in r["uneven_error"]
        np.testing.assert_allclose(r["w"], ref_w, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(r["g_local"], ref_g[i * per:(i + 1) * per], rtol=1e-6,
                                   atol=1e-7)
        np.testing.assert_allclose(r["g_all"], ref_g, rtol=1e-6, atol=1e-7)


def test_single_process_helpers_and_errors():
    mesh = multihost.global_clients_mesh()
    size = mesh.shape["clients"]
    assert multihost.process_clients(4 * size, mesh) == range(0, 4 * size)
    x = np.arange(4 * size * 2, dtype=np.float32).reshape(4 * size, 2)
    g = multihost.global_clients_array(x, mesh)
    np.testing.assert_array_equal(multihost.local_clients(g), x)
    with pytest.raises(ValueError, match="passed 3 clients"):
        multihost.global_clients_array(x[:3], mesh, num_clients=4 * size)
    with pytest.raises(ValueError, match="not HOST:PORT"):
        multihost.initialize("nowhere", 2, 0)
    with pytest.raises(ValueError, match="process_id=2"):
        multihost.initialize("127.0.0.1:1", 2, 2)
    s = multihost.server_value(multihost.global_server_array(np.ones(3), mesh))
    np.testing.assert_array_equal(s, np.ones(3))
    assert jax.process_count() == 1
