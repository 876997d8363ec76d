"""Export to TFF building blocks: the mapping table, type signatures, fusion, gradients,
errors, and that the exported protos compute what the local path computes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from federated_language.compiler import building_blocks as bb
from federated_language.proto import computation_pb2

import fax_bridge as fb
from fax_bridge.runtime import run_computation
from fax_bridge.tff import export
from fax_bridge.tff import xla as tff_xla

N = 5


def block(proto):
    return bb.ComputationBuildingBlock.from_proto(proto)


def intrinsics(proto) -> list[str]:
    found = []

    def walk(c):
        kind = c.WhichOneof("computation")
        if kind == "intrinsic":
            found.append(c.intrinsic.uri)
        elif kind == "lambda":
            walk(c.__getattribute__("lambda").result)
        elif kind == "block":
            for loc in c.block.local:
                walk(loc.value)
            walk(c.block.result)
        elif kind == "call":
            walk(c.call.function)
            if c.call.HasField("argument"):
                walk(c.call.argument)
        elif kind == "struct":
            for e in c.struct.element:
                walk(e.value)
        elif kind == "selection":
            walk(c.selection.source)
    walk(proto)
    return found


def xla_parts(proto) -> list:
    """Every Xla computation nested anywhere in the proto."""
    parts = []

    def walk(msg):
        if isinstance(msg, computation_pb2.Computation) and msg.WhichOneof("computation") == "xla":
            parts.append(msg)
            return
        for field, value in msg.ListFields():
            if field.message_type is None:
                continue
            items = value if field.is_repeated else [value]
            for item in items:
                walk(item)

    walk(proto)
    return parts


def assert_well_formed(proto):
    """Deserializes, type-checks, has unique local names and no unbound reference."""
    b = block(proto)
    names = [name for name, _ in b.result.locals] if isinstance(b.result, bb.Block) else []
    assert len(names) == len(set(names))
    bound = {b.parameter_name} | set(names)
    for ref in re.findall(r"\b(_[a-z]+\d+|arg)\b", b.compact_representation()):
        assert ref in bound, ref
    return b


@fb.program(clients=N)
def fedavg_step(w, x):
    wc = fb.federated_broadcast(w)
    g = fb.federated_map_clients(lambda a, b: jnp.tanh(b @ a) @ b, (wc, x))
    return w - 0.1 * fb.federated_mean(g)


W = jnp.array([0.1, -0.2, 0.3])
X = jnp.arange(N * 5 * 3, dtype=jnp.float32).reshape(N, 5, 3) / 50


def test_signature_of_a_fedavg_round():
    proto = fb.export_tff(fedavg_step, W, X, placements=("server", "clients"))
    b = assert_well_formed(proto)
    assert str(b.type_signature) == \
        "(<w=float32[3]@SERVER,x={float32[5,3]}@CLIENTS> -> float32[3]@SERVER)"
    uris = intrinsics(proto)
    assert uris.count("federated_broadcast") == 1
    assert uris.count("federated_map") == 1
    assert uris.count("federated_zip_at_clients") == 1
    assert uris.count("federated_mean") == 1
    assert uris.count("federated_apply") == 1
    np.testing.assert_allclose(run_computation(proto, W, X), fedavg_step(W, X), rtol=1e-6)


def test_per_client_hlo_has_no_clients_axis():
    proto = fb.export_tff(fedavg_step, W, X, placements=("server", "clients"))
    shapes = [str(block(part).type_signature) for part in xla_parts(proto)]
    assert shapes
    # The per-client computation takes one client's data f32[5,3], never f32[5,5,3].
    assert any("float32[5,3]" in s for s in shapes)
    assert not any("[5,5,3]" in s for s in shapes)


def test_sum_weighted_mean_pytrees_and_several_outputs():
    @fb.program(clients=N)
    def stats(state, data):
        pc = fb.federated_broadcast(state["scale"])
        scaled = fb.federated_map_clients(lambda s, d: {"x": d["x"] * s, "n": d["n"]},
                                          (pc, data))
        total = fb.federated_sum(scaled["n"])
        mean_x = fb.federated_weighted_mean(scaled["x"], scaled["n"])
        new_state = fb.federated_map_server(lambda s, t: {"scale": s * 2.0, "seen": t},
                                            (state["scale"], total))
        return new_state, {"mean_x": mean_x, "total": total}

    state = {"scale": jnp.float32(1.5)}
    data = {"x": jnp.arange(N * 2, dtype=jnp.float32).reshape(N, 2),
            "n": jnp.arange(1.0, N + 1.0)}
    proto = fb.export_tff(stats, state, data, placements=("server", "clients"))
    b = assert_well_formed(proto)
    assert str(b.type_signature) == (
        "(<state=<scale=float32>@SERVER,data={<n=float32,x=float32[2]>}@CLIENTS> -> "
        "<<scale=float32,seen=float32>,<mean_x=float32[2],total=float32>>@SERVER)")
    uris = set(intrinsics(proto))
    assert {"federated_sum", "federated_weighted_mean", "federated_apply", "federated_map",
            "federated_broadcast", "federated_zip_at_server"} <= uris
    got = run_computation(proto, state, data)
    want = stats(state, data)
    for a, b_ in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(a, b_, rtol=1e-6)


def test_mixed_placement_argument_is_a_struct_of_federated_values():
    @fb.program(clients=N)
    def f(inputs):
        return fb.federated_mean(fb.federated_map_clients(
            lambda s, x: s * x, (fb.federated_broadcast(inputs["s"]), inputs["x"])))

    inputs = {"s": jnp.float32(2.0), "x": jnp.ones((N,))}
    proto = fb.export_tff(f, inputs, placements=({"s": "server", "x": "clients"},))
    assert str(block(proto).type_signature) == \
        "(<s=float32@SERVER,x={float32}@CLIENTS> -> float32@SERVER)"
    np.testing.assert_allclose(run_computation(proto, **inputs), 2.0)


def test_consecutive_work_at_one_placement_is_fused():
    @fb.program(clients=N)
    def f(w, x):
        a = jnp.sin(w) * 2.0
        b = jnp.exp(a) + w
        c = fb.federated_broadcast(b)
        d = fb.federated_map_clients(lambda u, v: u * v, (c, x))
        e = fb.federated_map_clients(jnp.tanh, d)
        e = e + 1.0
        return fb.federated_sum(e)

    proto = fb.export_tff(f, W, jnp.ones((N, 3)), placements=("server", "clients"))
    uris = intrinsics(proto)
    assert uris.count("federated_map") == 1  # both maps and the add: one per-client stage
    assert uris.count("federated_apply") == 1  # sin, mul, exp, add: one server stage
    np.testing.assert_allclose(run_computation(proto, W, jnp.ones((N, 3))),
                               f(W, jnp.ones((N, 3))), rtol=1e-6)


def test_constants_and_literals():
    @fb.program(clients=N)
    def f(x):
        offset = jnp.array([1.0, 2.0])  # folded into the HLO of the clients stage
        y = fb.federated_map_clients(lambda v: v + offset, x)
        return fb.federated_mean(y) * 3.0, fb.federated_broadcast(jnp.float32(4.0))

    x = jnp.ones((N, 2))
    proto = fb.export_tff(f, x, placements=("clients",))
    b = assert_well_formed(proto)
    assert str(b.type_signature) == \
        "({float32[2]}@CLIENTS -> <float32[2]@SERVER,float32@CLIENTS>)"
    assert "federated_value_at_clients" in intrinsics(proto)
    mean, bcast = run_computation(proto, x)
    np.testing.assert_allclose(mean, [6.0, 9.0])


@pytest.mark.parametrize("mode", ["grad", "value_and_grad"])
def test_gradients_export_with_the_same_intrinsics(mode):
    @fb.program(clients=N)
    def loss(w, x):
        wc = fb.federated_broadcast(w)
        per = fb.federated_map_clients(lambda a, b: jnp.mean((b @ a - 1.0) ** 2), (wc, x))
        return fb.federated_mean(per)

    transform = jax.grad(loss) if mode == "grad" else jax.value_and_grad(loss)
    proto = fb.export_tff(transform, W, X, placements=("server", "clients"), clients=N)
    b = assert_well_formed(proto)
    allowed = {"federated_broadcast", "federated_map", "federated_zip_at_clients",
               "federated_mean", "federated_sum", "federated_apply",
               "federated_zip_at_server", "federated_value_at_clients",
               "federated_eval_at_clients", "federated_eval_at_server"}
    assert set(intrinsics(proto)) <= allowed
    assert "federated_sum" in intrinsics(proto)  # broadcast's transpose
    expected = "float32[3]@SERVER" if mode == "grad" else \
        "<float32,float32[3]>@SERVER"
    assert str(b.type_signature) == \
        f"(<w=float32[3]@SERVER,x={{float32[5,3]}}@CLIENTS> -> {expected})"
    got = run_computation(proto, W, X)
    want = transform(W, X)
    for a, b_ in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(a, b_, rtol=1e-5, atol=1e-7)


def test_single_argument_and_no_struct():
    @fb.program(clients=N)
    def f(x):
        return fb.federated_sum(x)

    proto = fb.export_tff(f, jnp.ones((N, 2)), placements="clients")
    assert str(block(proto).type_signature) == "({float32[2]}@CLIENTS -> float32[2]@SERVER)"


def test_reading_one_client_is_an_export_error():
    @fb.program(clients=N)
    def peek(x):
        return x[0]

    with pytest.raises(fb.ExportError) as e:
        fb.export_tff(peek, jnp.ones((N, 2)), placements="clients")
    msg = str(e.value)
    assert "test_tff_export.py" in msg and "federated_map_clients" in msg


def test_cross_client_reduction_is_an_export_error():
    @fb.program(clients=N)
    def total(x):
        return jnp.sum(x, axis=0) + fb.federated_sum(x)

    with pytest.raises(fb.ExportError, match="federated_sum"):
        fb.export_tff(total, jnp.ones((N, 2)), placements="clients")


def test_federated_ops_in_control_flow_are_an_export_error():
    @fb.program(clients=N)
    def rounds(w, x):
        def body(w, _):
            return w + fb.federated_mean(fb.federated_map_clients(
                lambda a, b: a * b, (fb.federated_broadcast(w), x))), None
        return jax.lax.scan(body, w, None, length=2)[0]

    with pytest.raises(fb.ExportError, match="control flow"):
        fb.export_tff(rounds, W, jnp.ones((N, 3)), placements=("server", "clients"))


def test_pytree_communication_is_one_intrinsic_per_struct():
    @fb.program(clients=N)
    def f(params, x):
        pc = fb.federated_broadcast(params)
        d = fb.federated_map_clients(
            lambda p, v: jax.tree_util.tree_map(lambda a: a * v.sum(), p), (pc, x))
        return fb.federated_mean(d)

    params = {"a": jnp.ones(2), "b": jnp.ones((2, 2)), "c": jnp.float32(1.0)}
    proto = fb.export_tff(f, params, jnp.ones((N, 3)), placements=("server", "clients"))
    uris = intrinsics(proto)
    assert uris.count("federated_broadcast") == 1 and uris.count("federated_mean") == 1


def test_constant_with_distinct_rows_per_client_is_an_export_error():
    @fb.program(clients=N)
    def f(x):
        w = jnp.arange(float(N))  # one different constant per client
        return fb.federated_weighted_mean(x, w)

    with pytest.raises(fb.ExportError, match="CLIENTS argument"):
        fb.export_tff(f, jnp.ones((N, 2)), placements="clients")


def test_server_work_runs_as_late_as_its_consumers_allow():
    @fb.program(clients=N)
    def f(w, x):
        wm = fb.federated_weighted_mean(x, jnp.ones(N))  # depth 1
        side = jnp.sum(wm) * 2.0                         # could run at depth 1 or 2
        y = fb.federated_mean(fb.federated_map_clients(
            lambda a, b: a * b, (fb.federated_broadcast(w), x)))  # depth 2
        return y + side

    proto = fb.export_tff(f, W, jnp.ones((N, 3)), placements=("server", "clients"))
    assert intrinsics(proto).count("federated_apply") == 1  # one server stage, not two
    np.testing.assert_allclose(run_computation(proto, W, jnp.ones((N, 3))),
                               f(W, jnp.ones((N, 3))), rtol=1e-6)


@fb.program(clients=N)
def _round_two_client_args(state, x, scale):
    w = fb.federated_broadcast(state["w"])
    loss = fb.federated_map_clients(lambda w, x, s: jnp.mean((x @ w) * s), (w, x, scale))
    mean = fb.federated_mean(loss)
    new = fb.federated_map_server(lambda w, m: {"w": w - 0.1 * m, "n": 1.0}, (state["w"], mean))
    return new, {"loss": mean}


def test_round_form_zips_client_arguments_and_splits_state_from_output():
    state = {"w": W}
    scale = jnp.arange(N, dtype=jnp.float32)
    args = (state, X, scale)
    default = fb.export_tff(_round_two_client_args, *args,
                            placements=("server", "clients", "clients"))
    proto = fb.export_tff(_round_two_client_args, *args,
                          placements=("server", "clients", "clients"), round_form=True)
    assert str(block(default).type_signature).startswith("(<state=<w=float32[3]>@SERVER,x=")
    assert str(block(proto).type_signature) == (
        "(<<w=float32[3]>@SERVER,{<x=float32[5,3],scale=float32>}@CLIENTS> -> "
        "<<n=float32,w=float32[3]>@SERVER,<loss=float32>@SERVER>)")
    new, out = run_computation(proto, state, (X, scale))
    want_new, want_out = _round_two_client_args(*args)
    np.testing.assert_allclose(new["w"], want_new["w"], rtol=1e-6)
    np.testing.assert_allclose(out["loss"], want_out["loss"], rtol=1e-6)


@pytest.mark.parametrize("placements,result,match", [
    (("server", "clients"), lambda s, x: s, "returns \\(new_state, output\\)"),
    (("server", "clients"), lambda s, x: (s, fb.federated_map_clients(jnp.sum, x)),
     "two values placed at SERVER"),
    (({"a": "server", "b": "clients"}, "clients"), lambda s, x: (s["a"], s["a"]),
     "mixes placements"),
    (("server", "server"), lambda s, x: (s, x), "needs a CLIENTS argument"),
])
def test_round_form_refuses_other_shapes(placements, result, match):
    prog = fb.program(clients=N)(result)
    state = {"a": W, "b": X} if isinstance(placements[0], dict) else W
    with pytest.raises(fb.ExportError, match=match):
        fb.export_tff(prog, state, X, placements=placements, round_form=True)


def test_decode_sum_exports_as_federated_aggregate_and_carries_the_codes():
    def decode(codes, scale):
        return codes.astype(jnp.float32) * scale

    @fb.program(clients=3)
    def prog(w, codes, scales):
        return w + fb.federated_decode_sum(decode, (codes, scales)) / 3.0

    args = (jnp.zeros(8), np.arange(24, dtype=np.uint8).reshape(3, 8),
            np.array([1.0, 0.5, 2.0], np.float32))
    places = ("server", "clients", "clients")
    proto = fb.export_tff(prog, *args, placements=places)
    tree = block(proto)
    assert "federated_aggregate(" in tree.compact_representation()
    assert str(tree.type_signature) == (
        "(<w=float32[8]@SERVER,codes={uint8[8]}@CLIENTS,scales={float32}@CLIENTS> -> "
        "float32[8]@SERVER)")
    np.testing.assert_allclose(run_computation(proto, *args), jax.jit(prog)(*args), rtol=1e-6)
    with fb.LocalFleet(devices=2) as fleet:
        _, rep = fleet.run(proto, *args, report=True)
        # up: every client's 8 one-byte codes and its 4-byte scale, nothing decoded
        assert rep.payload_up == 3 * (8 + 4)
        assert fb.check_parity(prog, *args, placements=places, fleet=fleet).ok


def test_native_custom_calls_in_client_work_are_refused_at_export_naming_the_line():
    def client_solve(a, b):
        return jnp.linalg.solve(b.T @ b + jnp.eye(3), a)

    @fb.program(clients=N)
    def solve_step(w, x):
        return fb.federated_mean(fb.federated_map_clients(
            client_solve, (fb.federated_broadcast(w), x)))

    where = f"{__file__}:{client_solve.__code__.co_firstlineno + 1}"
    with pytest.raises(fb.ExportError, match=r"custom call `lapack_sgetrf_ffi` \(from `lu` at "
                       + re.escape(where)):
        fb.export_tff(solve_step, W, X, placements=("server", "clients"))
    assert np.all(np.isfinite(solve_step(W, X)))  # jit runs it in this process


def test_typed_prng_keys_are_refused_naming_the_argument():
    @fb.program(clients=N)
    def noisy(seed, x):
        keys = fb.federated_broadcast(seed)
        return fb.federated_mean(fb.federated_map_clients(
            lambda k, xx: jax.random.normal(k, ()) + xx.sum(), (keys, x)))

    with pytest.raises(fb.ExportError, match=r"argument `seed` is a typed PRNG key .*key_data"):
        fb.export_tff(noisy, jax.random.key(0), X, placements=("server", "clients"))
    with pytest.raises(fb.ExportError, match=r"argument `state`\['rng'\] is a typed PRNG key"):
        fb.export_tff(lambda state, x: noisy(state["rng"], x), {"rng": jax.random.key(1)}, X,
                      placements=("server", "clients"))


@settings(max_examples=6, deadline=None)
@given(where=st.sampled_from(["server argument", "clients argument", "made and broadcast",
                              "result", "summed"]),
       path=st.sampled_from(["export", "parity"]))
def test_typed_prng_keys_are_refused_wherever_they_would_cross(where, path):
    """A typed key anywhere TFF needs a tensor (an argument, a value crossing placements,
    a result) is refused by export and parity alike, naming key_data / PRNGKey; jit runs
    every program that its placement rules allow."""
    n = 2
    x = np.ones((n,), np.float32)
    keys = jax.vmap(jax.random.key)(jnp.arange(n))

    @fb.program(clients=n)
    def f(k, x):
        if where == "made and broadcast":
            k = jax.random.key(3)
        if where == "summed":
            return fb.federated_sum(k)
        def draw(kk, xx):
            typed = jax.dtypes.issubdtype(kk.dtype, jax.dtypes.prng_key)
            return jax.random.normal(kk if typed else jax.random.wrap_key_data(kk)) + xx

        placed = k if where == "clients argument" else fb.federated_broadcast(k)
        noise = fb.federated_map_clients(draw, (placed, x))
        total = fb.federated_sum(noise)
        return (total, jax.random.key(1)) if where == "result" else total

    k = keys if where in ("clients argument", "summed") else jax.random.key(0)
    if where in ("made and broadcast", "result"):  # only the key made inside is typed
        k = jax.random.key_data(k)
    places = ("clients" if where in ("clients argument", "summed") else "server", "clients")
    if where == "summed":
        with pytest.raises(fb.PlacementError, match="typed PRNG keys .*key_data"):
            jax.jit(f)(k, x)
        return
    jax.jit(f)(k, x)
    want = {"server argument": r"argument `k` is a typed PRNG key",
            "clients argument": r"argument `k` is a typed PRNG key",
            "made and broadcast": r"federated_broadcast at .*typed PRNG key crosses placements",
            "result": r"result out1 is a typed PRNG key"}[where]
    with pytest.raises(fb.ExportError, match=want + r".*jax\.random\.key_data.*PRNGKey"):
        if path == "export":
            fb.export_tff(f, k, x, placements=places)
        else:
            fb.check_parity(f, k, x, placements=places)
    if where == "server argument":  # the suggested fix exports, and agrees with jit
        raw = jax.random.key_data(k)
        proto = fb.export_tff(f, raw, x, placements=places)
        np.testing.assert_allclose(run_computation(proto, raw, x), jax.jit(f)(raw, x),
                                   rtol=1e-6)


def _nested(tree_kinds, leaf):
    for kind in tree_kinds:
        leaf = {"a": leaf} if kind == "dict" else [leaf] if kind == "list" else (leaf,)
    return leaf


@settings(max_examples=12, deadline=None, database=None)
@given(st.lists(st.sampled_from(["tuple", "dict", "list"]), min_size=1, max_size=60))
def test_deeply_nested_pytrees_export_or_get_a_named_error(kinds):
    @fb.program(clients=N)
    def scale(p, x):
        return fb.federated_mean(fb.federated_map_clients(
            lambda q, xx: jax.tree_util.tree_map(lambda a: a * xx.sum(), q),
            (fb.federated_broadcast(p), x)))

    tree = _nested(kinds, jnp.ones(2))
    try:
        proto = fb.export_tff(scale, tree, X, placements=("server", "clients"))
    except fb.ExportError as e:
        assert "nests deeper than protobuf allows" in str(e)
        assert f"nest {len(kinds)} levels deep" in str(e)
        return
    assert proto.ByteSize() > 0


def _many_leaves_round(leaves: int):
    """A round over a dict of `leaves` float32[2] parameters: each client updates every
    leaf; the mean of the updates and the sum of a loss are two communications, so the
    mean's operands are picked out of the client stage's results, and the result dict
    out of the server's."""
    @fb.program(clients=2)
    def round_(w, x):
        def local(w, x):
            new = jax.tree_util.tree_map(lambda p: p - 0.1 * x * p, w)
            return new, sum(jnp.sum(p * p) for p in new.values())
        new, loss = fb.federated_map_clients(local, (fb.federated_broadcast(w), x))
        return fb.federated_mean(new), fb.federated_sum(loss)

    w = {f"p{i:04d}": np.full((2,), i, np.float32) for i in range(leaves)}
    return round_, w, np.arange(2, dtype=np.float32)


def test_proto_bytes_grow_linearly_with_the_leaves():
    """Every node of a proto carries its type: picking leaves out of a struct one
    selection each repeated the struct's type per leaf, bytes quadratic in the leaves.
    From 16 to 32 to 64 leaves the proto grows by equal steps per leaf (a quadratic
    proto's second step is 4 times its first per leaf, not 1); the sizes, not a timing."""
    sizes = []
    for leaves in (16, 32, 64):
        fn, w, x = _many_leaves_round(leaves)
        sizes.append(fb.export_tff(fn, w, x, placements=("server", "clients")).ByteSize())
    first, second = (sizes[1] - sizes[0]) / 16, (sizes[2] - sizes[1]) / 32
    assert 0.8 < second / first < 1.25, sizes


@pytest.mark.parametrize("leaves", [5, 12])
def test_leaves_picked_out_of_their_groups_compute_what_jit_computes(leaves):
    """5 leaves: selected one by one; 12 (more than `SELECT_AT_MOST`): by Xla parts.
    The same type and results either way."""
    fn, w, x = _many_leaves_round(leaves)
    proto = fb.export_tff(fn, w, x, placements=("server", "clients"))
    got, want = run_computation(proto, w, x), jax.jit(fn)(w, x)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, e in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(g, e, rtol=1e-6)
    names = ",".join(f"p{i:04d}=float32[2]" for i in range(leaves))
    assert str(block(proto).type_signature).endswith(f"-> <<{names}>,float32>@SERVER)")
    # the clients' update; beyond SELECT_AT_MOST, the mean's operands and the result
    assert len(xla_parts(proto)) == 1 + 2 * (leaves > export.SELECT_AT_MOST)
