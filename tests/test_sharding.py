"""Sharding that composes, on 8 emulated CPU devices (one subprocess): placed values are
split on their leading axis only and keep the model's sharding in every other dimension,
through every primitive and its derivatives, on Auto and Explicit meshes, under
`jax.set_mesh`, `clients_mesh`, `jit_program` and `mesh=`, with nested placements and
`shard_map` inside per-client functions; bad meshes get clear errors."""

import textwrap

import pytest
from processes import run_on_cpu_devices

SCRIPT = textwrap.dedent(r"""
    import json, re
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import fax_bridge as fb

    out = {}
    def shards(a):
        return sorted({tuple(s.data.shape) for s in a.addressable_shards})
    def specs(tree):
        def padded(a):
            return str(tuple(a.sharding.spec) + (None,) * (a.ndim - len(a.sharding.spec)))
        return jax.tree.map(padded, tree)
    def collectives(text):
        return {k: len(re.findall(rf"\b{k}(?:-start)?\(", text))
                for k in ("all-gather", "all-reduce")}

    # 2x2 (clients, data): a [10] array sharded over data, broadcast to 100 clients.
    N = 100
    @fb.program(clients=N)
    def bcast(x):
        return fb.federated_broadcast(x)
    @fb.program(clients=N)
    def add(x):
        a, b = fb.federated_broadcast(x), fb.federated_broadcast(2 * x)
        return fb.federated_map_clients(lambda u, v: u + v, (a, b))
    @fb.program(clients=N)
    def reductions(xc, wts):
        return (fb.federated_sum(xc), fb.federated_mean(xc),
                fb.federated_weighted_mean(xc, wts), fb.federated_weighted_mean(xc, xc + 1))
    @fb.program(clients=N)
    def loss(x, xc):
        y = fb.federated_map_clients(lambda a, b: jnp.sin(a) * b, (fb.federated_broadcast(x), xc))
        return jnp.sum(fb.federated_mean(y))

    x_np = np.arange(10, dtype=np.float32) / 10
    xc_np = np.arange(N * 10, dtype=np.float32).reshape(N, 10) / 1000
    w_np = np.linspace(1, 2, N, dtype=np.float32)
    ref_red = reductions(xc_np, w_np)
    ref_grad = jax.grad(loss, argnums=(0, 1))(x_np, xc_np)
    for kind in ("auto", "explicit"):
        t = AxisType.Auto if kind == "auto" else AxisType.Explicit
        mesh = jax.make_mesh((2, 2), ("clients", "data"), axis_types=(t, t),
                             devices=jax.devices()[:4])
        x = jax.device_put(x_np, NamedSharding(mesh, P("data")))
        xc = jax.device_put(xc_np, NamedSharding(mesh, P("clients", "data")))
        w = jax.device_put(w_np, NamedSharding(mesh, P("clients")))
        with jax.set_mesh(mesh):
            r = {"broadcast": shards(jax.jit(bcast)(x)), "map": shards(jax.jit(add)(x))}
            red = jax.jit(reductions)(xc, w)
            r["reductions"] = [shards(a) for a in red]
            r["reductions_err"] = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                                      for a, b in zip(red, ref_red))
            g = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, xc)
            r["grads"] = [shards(a) for a in g]
            r["grads_err"] = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                                 for a, b in zip(g, ref_grad))
            r["jvp"] = shards(jax.jit(lambda x, t: jax.jvp(bcast, (x,), (t,))[1])(x, x))
        out[kind + "_2x2"] = r

    # 2x4 (clients, model): FedAvg round of a model-parallel MLP vs jit + vmap.
    ps = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)}
    rng = np.random.default_rng(0)
    p_np = {"w1": rng.normal(size=(16, 64)).astype(np.float32) * .1,
            "b1": np.zeros(64, np.float32), "w2": rng.normal(size=(64, 4)).astype(np.float32) * .1}
    xs_np = rng.normal(size=(8, 6, 16)).astype(np.float32)
    def mlp_loss(p, x):
        return jnp.mean((jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"]) ** 2)
    def local(p, x):
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, jax.grad(mlp_loss)(p, x))
    @fb.program(clients=8)
    def fed_round(p, xs):
        return fb.federated_mean(fb.federated_map_clients(local, (fb.federated_broadcast(p), xs)))
    def base_round(p, xs):
        return jax.tree.map(lambda a: jnp.mean(a, 0), jax.vmap(local, in_axes=(None, 0))(p, xs))
    def round_loss(p, xs):
        return sum(jnp.sum(v ** 2) for v in jax.tree.leaves(fed_round(p, xs)))
    mesh = jax.make_mesh((2, 4), ("clients", "model"), axis_types=(AxisType.Auto,) * 2)
    p = {k: jax.device_put(v, NamedSharding(mesh, ps[k])) for k, v in p_np.items()}
    xs = jax.device_put(xs_np, NamedSharding(mesh, P("clients")))
    r = {}
    with fb.clients_mesh(mesh):
        fax = jax.jit(fed_round)
        r["round_specs"] = specs(fax(p, xs))
        r["round_shards"] = jax.tree.map(shards, fax(p, xs))
        r["fax"] = collectives(fax.lower(p, xs).compile().as_text())
        r["grad_specs"] = specs(jax.jit(jax.grad(round_loss))(p, xs))
        bc = jax.jit(lambda p: fb.program(clients=8)(fb.federated_broadcast)(p))(p)
        r["broadcast_shards"] = jax.tree.map(shards, bc)
    base = jax.jit(base_round)
    r["base"] = collectives(base.lower(p, xs).compile().as_text())
    import drjax
    @drjax.program(clients=8)
    def drjax_round(p, xs):
        return drjax.reduce_mean(drjax.map_fn(local, (drjax.broadcast(p), xs)))
    with jax.set_mesh(mesh):
        dr = jax.jit(drjax_round)
        r["drjax"] = collectives(dr.lower(p, xs).compile().as_text())
        r["drjax_specs"] = specs(dr(p, xs))
    r["round_err"] = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(
        jax.tree.leaves(fax(p, xs)), jax.tree.leaves(base(p, xs))))
    run = fb.jit_program(fed_round, mesh, placements=("server", "clients"))
    r["jit_program_specs"] = specs(run(p, xs))
    emesh = jax.make_mesh((2, 4), ("clients", "model"))  # Explicit axes, jax's default
    ep = {k: jax.device_put(v, NamedSharding(emesh, P())) for k, v in p_np.items()}
    explicit_run = fb.jit_program(fed_round, emesh, ("server", "clients"))
    r["explicit_jit_program"] = specs(explicit_run(ep, xs_np))
    out["2x4"] = r
""") + textwrap.dedent(r"""
    # mesh= on the primitives, without any ambient mesh.
    mesh = jax.make_mesh((2, 4), ("clients", "model"), axis_types=(AxisType.Auto,) * 2)
    @fb.program(clients=4)
    def with_mesh_arg(v):
        c = fb.federated_broadcast(v, mesh=mesh)
        return fb.federated_map_clients(jnp.sin, c, mesh=mesh)
    v = jax.device_put(np.ones(8, np.float32), NamedSharding(mesh, P("model")))
    out["mesh_arg"] = shards(jax.jit(with_mesh_arg)(v))

    # shard_map over the model axis inside a per-client function.
    def colsum(w):
        f = jax.shard_map(lambda b: jax.lax.psum(jnp.sum(b, axis=1), "model"), mesh=mesh,
                          in_specs=P(None, "model"), out_specs=P())
        return f(w)
    @fb.program(clients=4)
    def with_shard_map(w):
        return fb.federated_map_clients(colsum, fb.federated_broadcast(w))
    wm = jax.device_put(np.arange(32, dtype=np.float32).reshape(4, 8),
                        NamedSharding(mesh, P(None, "model")))
    with fb.clients_mesh(mesh):
        sm = jax.jit(with_shard_map)(wm)
    expect = np.tile(np.asarray(wm).sum(1), (4, 1))
    out["shard_map"] = {"shards": shards(sm), "ok": bool(np.allclose(sm, expect))}

    # Nested placements: 4 clients each holding 2 workers, on a (clients, workers, model) mesh.
    @fb.program(placements={"workers": 2})
    def inner(v, x):
        return fb.federated_map_clients(lambda a, b: a * b, (fb.federated_broadcast(v), x))
    @fb.program(clients=4)
    def outer(v, x):
        return fb.federated_map_clients(inner, (fb.federated_broadcast(v), x))
    mesh3 = jax.make_mesh((2, 2, 2), ("clients", "workers", "model"),
                          axis_types=(AxisType.Auto,) * 3)
    xv = np.arange(4 * 2 * 6, dtype=np.float32).reshape(4, 2, 6)
    with fb.clients_mesh(mesh3):
        nested = jax.jit(outer)(np.ones(6, np.float32), xv)
    out["nested"] = {"shards": shards(nested), "ok": bool(np.allclose(nested, xv))}

    # Bad meshes.
    errors = {}
    @fb.program(placements={"workers": 4})
    def needs_workers(v):
        return fb.federated_broadcast(v, mesh=mesh)
    @fb.program(clients=3)
    def three(v):
        return fb.federated_broadcast(v)
    for name, call in (("missing_axis", lambda: needs_workers(np.ones(2))),
                       ("uneven", lambda: jax.jit(three)(np.ones(2)))):
        try:
            with fb.clients_mesh(mesh):
                call()
            errors[name] = ""
        except fb.PlacementError as e:
            errors[name] = str(e)
    out["errors"] = errors

    # jax.set_mesh as a global setting (not a context manager), Explicit axes.
    emesh = jax.make_mesh((2, 4), ("clients", "model"))
    jax.set_mesh(emesh)
    out["global_set_mesh"] = shards(jax.jit(fb.program(clients=8)(fb.federated_broadcast))(
        jax.device_put(np.ones(16, np.float32), NamedSharding(emesh, P("model")))))
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def result():
    return run_on_cpu_devices(SCRIPT)


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_inner_dimensions_keep_their_sharding_on_a_2x2_mesh(result, kind):
    r = result[kind + "_2x2"]
    assert r["broadcast"] == [[50, 5]]  # P('clients', 'data'), not the replicated (50, 10)
    assert r["map"] == [[50, 5]]
    assert r["reductions"] == [[[5]]] * 4  # the reduced value keeps P('data')
    assert r["grads"] == [[[5]], [[50, 5]]]  # gradients sharded like their primals
    assert r["jvp"] == [[50, 5]]
    assert r["reductions_err"] < 1e-5 and r["grads_err"] < 1e-5


def test_fedavg_round_over_a_model_sharded_mlp_on_a_2x4_mesh(result):
    r = result["2x4"]
    model = {"b1": "('model',)", "w1": "(None, 'model')", "w2": "('model', None)"}
    assert r["round_specs"] == model
    assert r["grad_specs"] == model
    assert r["jit_program_specs"] == model
    assert r["round_shards"] == {"b1": [[16]], "w1": [[16, 16]], "w2": [[16, 4]]}
    assert r["broadcast_shards"] == {"b1": [[4, 16]], "w1": [[4, 16, 16]], "w2": [[4, 16, 4]]}
    assert r["fax"]["all-gather"] <= r["base"]["all-gather"]
    assert r["fax"]["all-reduce"] == r["base"]["all-reduce"]
    assert r["fax"] == r["drjax"] and r["drjax_specs"] == model  # DrJAX on the same mesh
    assert r["round_err"] < 1e-6
    # An Explicit mesh (jax.make_mesh's default) used as it is, and jax.set_mesh globally.
    assert set(r["explicit_jit_program"].values()) == {"(None, None)", "(None,)"}
    assert result["global_set_mesh"] == [[4, 4]]


def test_mesh_argument_shard_map_and_nested_placements(result):
    assert result["mesh_arg"] == [[2, 2]]
    assert result["shard_map"] == {"shards": [[2, 4]], "ok": True}
    assert result["nested"] == {"shards": [[2, 1, 6]], "ok": True}


def test_bad_meshes_get_clear_errors(result):
    errors = result["errors"]
    assert "no 'workers' axis" in errors["missing_axis"]
    assert "do not split evenly" in errors["uneven"] and "3 members" in errors["uneven"]
