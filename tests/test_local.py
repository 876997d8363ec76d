"""Local path: CLIENTS values and the per-client computation sharded over a `clients` mesh
axis (8 CPU devices in a subprocess), and the HLO text of a whole program."""

import textwrap

import jax.numpy as jnp
import pytest
from processes import run_on_cpu_devices

import fax_bridge as fb

SHARDED_SCRIPT = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    import fax_bridge as fb

    N = 16
    @fb.program(clients=N)
    def step(w, x):
        wc = fb.federated_broadcast(w)
        g = fb.federated_map_clients(lambda a, b: jnp.tanh(b @ a) @ b, (wc, x))
        return w - 0.1 * fb.federated_mean(g), g

    mesh = jax.make_mesh((8,), ("clients",))
    w = jnp.ones(3) * 0.1
    x = jnp.arange(N * 4 * 3, dtype=jnp.float32).reshape(N, 4, 3) / 100
    run = fb.jit_program(step, mesh, placements=("server", "clients"))
    new_w, g = run(w, x)
    ref_w, ref_g = step(w, x)
    hlo = run.lower(w, x).compile().as_text()
    print(json.dumps({
        "devices": jax.device_count(),
        "w_spec": str(new_w.sharding.spec), "g_spec": str(g.sharding.spec),
        "g_shard_shapes": sorted({tuple(s.data.shape) for s in g.addressable_shards}),
        "max_err": float(np.max(np.abs(np.asarray(new_w) - np.asarray(ref_w)))),
        "g_err": float(np.max(np.abs(np.asarray(g) - np.asarray(ref_g)))),
        "per_device_x": "f32[2,4,3]" in hlo,
        "has_all_reduce": "all-reduce" in hlo,
    }))
""")


def test_clients_are_sharded_over_the_mesh_axis():
    r = run_on_cpu_devices(SHARDED_SCRIPT)
    assert r["devices"] == 8
    assert r["g_spec"] in ("P('clients',)", "P('clients', None)")
    assert r["w_spec"] in ("P()", "P(None,)")  # SERVER values are replicated
    assert r["g_shard_shapes"] == [[2, 3]]  # 16 clients over 8 devices
    assert r["per_device_x"], "the per-client computation should see 2 clients per device"
    assert r["has_all_reduce"], "federated_mean across devices is a cross-device reduction"
    assert r["max_err"] < 1e-6 and r["g_err"] < 1e-6


def test_mesh_without_clients_axis_is_rejected():
    import jax
    mesh = jax.make_mesh((1,), ("data",))
    with pytest.raises(ValueError, match="no 'clients' axis"):
        fb.jit_program(lambda x: x, mesh)


def test_to_hlo_is_the_whole_program():
    @fb.program(clients=3)
    def f(w, x):
        return fb.federated_mean(fb.federated_map_clients(jnp.sin, x)) + w

    text = fb.to_hlo(f, jnp.ones(2), jnp.ones((3, 2)))
    assert text.startswith("HloModule")
    assert "sine" in text and "ENTRY" in text
