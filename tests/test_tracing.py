"""Tracing: placements of inputs, outputs and intermediates, printing, and early errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fax_bridge as fb

N = 5


@fb.program(clients=N)
def round_fn(w, x):
    wc = fb.federated_broadcast(w)
    g = fb.federated_map_clients(lambda a, b: (b @ a).sum() * b.sum(0), (wc, x))
    return w - 0.1 * fb.federated_mean(g)


W = jnp.ones(3)
X = jnp.ones((N, 4, 3))


def test_placements_of_inputs_outputs_and_intermediates():
    comp = fb.trace(round_fn, W, X, placements=("server", "clients"))
    assert comp.clients == N
    assert comp.in_placements == [fb.Placement.SERVER, fb.Placement.CLIENTS]
    assert comp.out_placements == [fb.Placement.SERVER]
    by_prim = {e.primitive.name: comp.placement_of(e.outvars[0])
               for e in comp.jaxpr.jaxpr.eqns}
    assert by_prim["federated_broadcast"] is fb.Placement.CLIENTS
    assert by_prim["federated_map"] is fb.Placement.CLIENTS
    assert by_prim["federated_mean"] is fb.Placement.SERVER
    assert comp.signature() == "(arg0: f32[3]@SERVER, arg1: {f32[4,3]}@CLIENTS) -> f32[3]@SERVER"
    text = str(comp)
    assert "{f32[3]}@CLIENTS = federated_broadcast" in text
    assert "f32[3]@SERVER = federated_mean" in text


def test_placements_prefix_over_pytrees():
    @fb.program(clients=N)
    def f(state, data):
        return fb.federated_mean(data["x"]) + state["w"]

    state = {"w": jnp.ones(2)}
    data = {"x": jnp.ones((N, 2)), "y": jnp.ones((N,))}
    comp = fb.trace(f, state, data, placements=("server", {"x": "clients", "y": "clients"}))
    assert comp.in_placements == [fb.Placement.SERVER] * 1 + [fb.Placement.CLIENTS] * 2
    assert comp.in_paths == ["arg0['w']", "arg1['x']", "arg1['y']"]
    np.testing.assert_allclose(comp(state, data), 2 * np.ones(2))


def test_server_clients_mix_is_a_placement_error_naming_the_line():
    @fb.program(clients=N)
    def bad(w, x):
        return fb.federated_mean(w + x)

    with pytest.raises(fb.PlacementError) as e:
        fb.trace(bad, jnp.ones(3), jnp.ones((N, 3)), placements=("server", "clients"))
    msg = str(e.value)
    assert "test_tracing.py" in msg and "SERVER" in msg and "federated_broadcast" in msg


def test_clients_value_where_server_is_needed():
    @fb.program(clients=N)
    def bad(x):
        return fb.federated_broadcast(x)

    with pytest.raises(fb.PlacementError, match="federated_broadcast sends a SERVER value"):
        fb.trace(bad, jnp.ones((N, 3)), placements="clients")

    @fb.program(clients=N)
    def bad_map(x):
        return fb.federated_map_server(jnp.sin, x)

    with pytest.raises(fb.PlacementError, match="SERVER values"):
        fb.trace(bad_map, jnp.ones((N, 3)), placements="clients")


def test_server_value_aggregated_is_an_error():
    @fb.program(clients=N)
    def bad(w):
        return fb.federated_sum(w)

    with pytest.raises(fb.PlacementError, match="aggregates a CLIENTS value"):
        fb.trace(bad, jnp.ones((N, 3)), placements="server")


def test_wrong_leading_axis_is_named():
    with pytest.raises(fb.PlacementError, match=r"argument arg1 .* leading axis of size 5"):
        fb.trace(round_fn, W, jnp.ones((4, 4, 3)), placements=("server", "clients"))

    @fb.program(clients=N)
    def f(x):
        return fb.federated_mean(x)

    with pytest.raises(fb.PlacementError, match=r"value\['a'\] has shape \(3,\).*size 5"):
        f({"a": jnp.ones(3)})


def test_non_array_leaves_are_rejected():
    @fb.program(clients=N)
    def f(x):
        return fb.federated_broadcast(x)

    with pytest.raises(fb.PlacementError, match=r"value\['name'\] is a str"):
        f({"name": "alice"})


def test_outside_a_program_is_an_error():
    with pytest.raises(fb.PlacementError, match="@fax_bridge.program"):
        fb.federated_broadcast(jnp.ones(3))


def test_program_decorator_forms():
    @fb.program(placements={"clients": 3})
    def f(x):
        return fb.federated_sum(x)

    assert f.clients == 3
    np.testing.assert_allclose(f(jnp.ones((3, 2))), [3.0, 3.0])
    with pytest.raises(ValueError, match="positive integer"):
        fb.program(clients=0)
    with pytest.raises(ValueError, match="needs no entry"):
        fb.program(placements={"server": 1})
    with pytest.raises(ValueError, match="one {name: N} entry"):
        fb.program(placements={"clients": 2, "workers": 3})
    assert fb.program(placements={"workers": 4})(lambda x: x).placement == "workers"


def test_cross_client_ops_are_recorded_not_rejected():
    @fb.program(clients=N)
    def peek(x):
        return x[0] + fb.federated_mean(x)

    comp = fb.trace(peek, jnp.arange(float(N * 2)).reshape(N, 2), placements="clients")
    assert comp.violations
    assert "test_tracing.py" in comp.violations[0].location
    assert "not exportable" in str(comp)


def test_per_client_plain_ops_stay_at_clients():
    @fb.program(clients=N)
    def f(x):
        y = jnp.tanh(x) * 2.0 + 1.0
        z = jnp.sum(y, axis=1)
        return fb.federated_sum(z.reshape(N, 1))

    comp = fb.trace(f, jnp.ones((N, 3)), placements="clients")
    assert not comp.violations
    for eqn in comp.jaxpr.jaxpr.eqns[:-1]:
        assert comp.placement_of(eqn.outvars[0]) is fb.Placement.CLIENTS


def test_scan_carry_placement():
    @fb.program(clients=N)
    def f(w, x):
        def body(w, _):
            return w + fb.federated_mean(x), None
        return jax.lax.scan(body, w, None, length=3)[0]

    comp = fb.trace(f, jnp.zeros(2), jnp.ones((N, 2)), placements=("server", "clients"))
    assert comp.out_placements == [fb.Placement.SERVER]
    np.testing.assert_allclose(comp(jnp.zeros(2), jnp.ones((N, 2))), [3.0, 3.0])


def test_trace_of_jit_and_custom_vjp_is_inlined():
    @jax.custom_vjp
    def clip_grad(x):
        return x

    clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1, 1),))

    @fb.program(clients=N)
    def f(w, x):
        return jax.jit(lambda w: fb.federated_mean(fb.federated_broadcast(clip_grad(w)) * x))(w)

    comp = fb.trace(f, jnp.ones(2), jnp.ones((N, 2)), placements=("server", "clients"))
    names = [e.primitive.name for e in comp.jaxpr.jaxpr.eqns]
    assert "jit" not in names and "pjit" not in names
    assert "federated_broadcast" in names


def test_locations_point_at_the_program_s_own_code_algorithms_included():
    """An equation's location is the innermost frame of the program's own code: the
    user's file for a user's program, the algorithm's line for `fax_bridge.algorithms`
    (whose rounds are programs like a user's), never fax_bridge's machinery."""
    import os

    from fax_bridge.language import tracing
    from fax_bridge.algorithms import fed_sgd

    def _loc_files(comp):
        return {tracing.eqn_location(e).split(":")[0] for e in comp.jaxpr.jaxpr.eqns
                if e.primitive.name.startswith("federated")}

    mine = fb.trace(round_fn, W, X, placements=("server", "clients"))
    assert _loc_files(mine) == {os.path.abspath(__file__)}

    def loss(p, b):
        return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)

    algo = fed_sgd(loss, clients=3)
    data = {"x": np.ones((3, 2, 4, 2), np.float32), "y": np.ones((3, 2, 4), np.float32)}
    comp = fb.trace(algo.next, algo.init({"w": jnp.zeros(2)}), data,
                    np.ones((3, 2, 4), bool), placements=algo.placements)
    files = _loc_files(comp)
    assert files and all(os.sep + os.path.join("fax_bridge", "algorithms") + os.sep in f
                         for f in files), files
    assert not tracing.is_machinery(next(iter(files)))
    assert tracing.is_machinery(tracing.__file__) and not tracing.is_machinery(__file__)


def test_machinery_is_the_package_directory_itself_not_its_name_as_a_prefix():
    """A sibling directory whose name starts like the package's (a user's
    `fax_bridge_examples/`) is the user's code; the package's files and subpackages are
    machinery, except `fax_bridge.algorithms`."""
    import os

    from fax_bridge.language import tracing

    package = os.path.dirname(os.path.dirname(os.path.abspath(tracing.__file__)))
    assert tracing.is_machinery(os.path.join(package, "api.py"))
    assert tracing.is_machinery(os.path.join(package, "fleet", "plan.py"))
    assert not tracing.is_machinery(os.path.join(package, "algorithms", "fedsgd.py"))
    assert not tracing.is_machinery(package + "_examples" + os.sep + "run.py")
    # The algorithms' exception stops at that directory too.
    assert tracing.is_machinery(os.path.join(package, "algorithms_extra.py"))


def test_a_trace_s_avals_are_built_once_not_on_every_read():
    """Callers index `in_avals` leaf by leaf (the exporter's member types): a list
    built anew on each read made that quadratic in the leaves (4 s of a 3,000-leaf
    export). Every read is the one tuple, matching the jaxpr's avals."""
    w = {f"p{i}": jnp.zeros(2) for i in range(50)}
    comp = fb.trace(fb.program(clients=2)(lambda w: fb.federated_map_server(
        lambda w: jax.tree_util.tree_map(lambda p: p + 1, w), w)), w)
    assert comp.in_avals is comp.in_avals and comp.out_avals is comp.out_avals
    assert list(comp.in_avals) == list(comp.jaxpr.in_avals)
    assert list(comp.out_avals) == list(comp.jaxpr.out_avals) and len(comp.out_avals) == 50
