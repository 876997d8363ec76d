"""The public building blocks as users write them: weighted means with one weight per
client, element-wise weights and pytrees of weights; one rule for aggregating integer
and bool values on every path; placement names; jit refusing what trace refuses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import fax_bridge as fb
from fax_bridge.language import primitives as P
from fax_bridge.runtime import run_computation

N = 4
rng = np.random.default_rng(0)


@settings(max_examples=12, deadline=None)
@given(member=st.lists(st.integers(1, 3), min_size=0, max_size=2),
       kind=st.sampled_from(["client", "elementwise", "trailing"]))
def test_weights_per_client_elementwise_or_broadcast(member, kind):
    member = tuple(member)
    x = rng.normal(size=(N,) + member).astype(np.float32)
    w_member = {"client": (), "elementwise": member, "trailing": member[-1:]}[kind]
    w = rng.uniform(0.5, 2.0, size=(N,) + w_member).astype(np.float32)

    @fb.program(clients=N)
    def f(x, w):
        return fb.federated_weighted_mean(x, w)

    # numpy's broadcasting of each client's weight against its value, then the mean.
    wb = np.broadcast_to(w.reshape((N,) + (1,) * (len(member) - len(w_member)) + w_member),
                         x.shape)
    expect = (wb * x).sum(0) / wb.sum(0)
    np.testing.assert_allclose(f(x, w), expect, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jax.jit(f)(x, w), expect, rtol=1e-5, atol=1e-6)


def test_pytree_weights_and_gradients():
    x = {"a": rng.normal(size=(N, 2)).astype(np.float32),
         "b": rng.normal(size=(N,)).astype(np.float32)}
    w = {"a": rng.uniform(1, 2, size=(N, 2)).astype(np.float32),
         "b": rng.uniform(1, 2, size=(N,)).astype(np.float32)}

    @fb.program(clients=N)
    def f(x, w):
        return fb.federated_weighted_mean(x, w)

    out = f(x, w)
    for k in x:
        np.testing.assert_allclose(out[k], (w[k] * x[k]).sum(0) / w[k].sum(0), rtol=1e-5)

    def loss(x, w):
        return sum(jnp.sum(jnp.sin(v)) for v in jax.tree.leaves(f(x, w)))

    def ref(x, w):
        return sum(jnp.sum(jnp.sin((w[k] * x[k]).sum(0) / w[k].sum(0))) for k in x)

    got, want = jax.grad(loss, (0, 1))(x, w), jax.grad(ref, (0, 1))(x, w)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)


def test_weights_that_fit_nothing_name_the_shapes():
    @fb.program(clients=N)
    def f(x, w):
        return fb.federated_weighted_mean(x, w)

    x = np.ones((N, 3), np.float32)
    with pytest.raises(fb.PlacementError, match=r"shape \(4, 4\).*shape \(4, 3\)"):
        f(x, np.ones((N, 4), np.float32))
    with pytest.raises(fb.PlacementError, match="leading axis of 4"):
        f(x, np.ones((3,), np.float32))
    with pytest.raises(fb.PlacementError, match="structure"):
        f({"a": x, "b": x}, {"a": np.ones(N, np.float32), "c": np.ones(N, np.float32)})


def test_elementwise_weighted_mean_exports_and_runs():
    @fb.program(clients=N)
    def f(x, w):
        return fb.federated_weighted_mean(x, w)

    x = rng.normal(size=(N, 3)).astype(np.float32)
    w = rng.uniform(1, 2, size=(N, 3)).astype(np.float32)
    proto = fb.export_tff(f, x, w, placements=("clients", "clients"))
    np.testing.assert_allclose(run_computation(proto, x, w), f(x, w), rtol=1e-5)
    one = fb.trace(f, x, w[:, 0], placements="clients")
    assert any(e.primitive is P.federated_weighted_mean_p for e in one.jaxpr.jaxpr.eqns)


@settings(max_examples=10, deadline=None)
@given(dtype=st.sampled_from([np.int8, np.int32, np.uint8, np.int64, np.bool_]),
       op=st.sampled_from(["federated_mean", "federated_weighted_mean"]))
def test_integer_means_are_refused_on_every_path(dtype, op):
    @fb.program(clients=3)
    def f(x):
        fn = getattr(fb, op)
        return fn(x) if op == "federated_mean" else fn(x, jnp.ones(3))

    x = np.array([1, 2, 4]).astype(dtype)
    for run in (f, jax.jit(f), lambda x: fb.trace(f, x, placements="clients"),
                lambda x: fb.export_tff(f, x, placements="clients")):
        with pytest.raises(fb.PlacementError, match="floating-point.*truncate"):
            run(x)
    np.testing.assert_allclose(f(x.astype(np.float32)), x.astype(np.float32).mean(),
                               rtol=1e-6)


def test_bool_sums_are_refused_integer_sums_are_exact():
    @fb.program(clients=3)
    def f(x):
        return fb.federated_sum(x)

    with pytest.raises(fb.PlacementError, match="bool.*astype"):
        jax.jit(f)(np.array([True, False, True]))
    with pytest.raises(fb.PlacementError, match="bool"):
        fb.export_tff(f, np.array([True, False, True]), placements="clients")
    assert int(jax.jit(f)(np.array([1, 2, 4], np.int32))) == 7


def test_the_runtime_applies_the_same_rule():
    from fax_bridge.errors import AggregationError
    from fax_bridge.runtime import aggregation

    with pytest.raises(AggregationError, match="bool"):
        aggregation.reduce("sum", [np.array(True), np.array(False)])
    with pytest.raises(AggregationError, match="truncate"):
        aggregation.reduce("mean", [np.array(1, np.int32), np.array(2, np.int32)])
    assert int(aggregation.reduce("sum", [np.array(1, np.int32), np.array(2, np.int32)])) == 3


def test_jit_program_refuses_server_and_clients_arithmetic_like_trace():
    @fb.program(clients=N)
    def mixed(w, x):
        return fb.federated_mean(fb.federated_broadcast(w) + w + x)

    w, x = np.ones(3, np.float32), np.ones((N, 3), np.float32)
    with pytest.raises(fb.PlacementError, match="combines SERVER operand"):
        fb.trace(mixed, w, x, placements=("server", "clients"))
    mesh = jax.make_mesh((1,), ("clients",))
    with pytest.raises(fb.PlacementError, match="combines SERVER operand"):
        fb.jit_program(mixed, mesh, placements=("server", "clients"))(w, x)


def test_any_placement_name():
    @fb.program(placements={"workers": 3})
    def f(x):
        return fb.federated_sum(fb.federated_map_clients(jnp.square, x))

    np.testing.assert_allclose(f(np.arange(3.0)), 5.0)
    comp = fb.trace(f, np.arange(3.0), placements="clients")
    assert comp.axis == "workers" and comp.clients == 3
    with pytest.raises(fb.PlacementError, match="placed at 'workers'.*size 3"):
        f(np.arange(4.0))


@settings(max_examples=25, deadline=None)
@given(spec=st.one_of(
    st.fixed_dictionaries({"clients": st.one_of(st.integers(-3, 0), st.booleans(),
                                                st.just(2.5), st.just("8"))}),
    st.fixed_dictionaries({"placements": st.one_of(
        st.just({}), st.just({"clients": 2, "workers": 2}),
        st.dictionaries(st.sampled_from(["server", "SERVER", "1x", "a b", ""]),
                        st.integers(1, 4), min_size=1, max_size=1))})))
def test_malformed_program_declarations_are_program_errors(spec):
    """Every wrong declaration is a ProgramError (a ValueError, as before) naming the fix."""
    with pytest.raises(fb.ProgramError) as info:
        fb.program(lambda x: x, **spec)
    assert isinstance(info.value, ValueError)
    assert "clients" in str(info.value) or "placement" in str(info.value)


def test_wrong_operands_of_primitives_are_placement_or_argument_errors():
    """Operands the primitives cannot take fail with the project's TypeErrors."""
    params = dict(clients=N, axis="clients", mesh=None)
    with pytest.raises(fb.PlacementError, match=f"leading axis of size {N}"):
        P.federated_sum_p.bind(jnp.ones((N + 1, 2)), **params)
    with pytest.raises(fb.PlacementError, match="weights of shape"):
        P.federated_weighted_mean_p.bind(jnp.ones((N, 2)), jnp.ones((N + 1,)), **params)
    with pytest.raises(fb.errors.ArgumentError, match="floating-point weights"):
        P.federated_weighted_mean_p.bind(jnp.ones((N, 2)), jnp.ones((N,), jnp.int32),
                                         **params)


@settings(max_examples=15, deadline=None)
@given(weights=st.lists(st.sampled_from([0.0, 0.25, 1.0, 2.0, -0.5]), min_size=3,
                        max_size=3),
       elementwise=st.booleans())
def test_weights_are_checked_where_concrete(weights, elementwise):
    """Eager calls refuse negative weights and a zero total (WeightError, a ValueError);
    under jit the weights are traced and the division is jnp's."""
    @fb.program(clients=3)
    def f(x, w):
        return fb.federated_weighted_mean(x, w)

    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    w = np.array(weights, np.float32)
    if elementwise:
        w = np.stack([w, w[::-1]], axis=1)
    negative, zero = (w < 0).any(), (w.sum(0) == 0).any()
    if negative or zero:
        with pytest.raises(ValueError, match="negative" if negative else "sum to zero"):
            f(x, w)
        with pytest.raises(fb.WeightError):
            f(x, w)
        jax.jit(f)(x, w)  # traced: not checked (see federated_weighted_mean)
        return
    wb = w if elementwise else w[:, None]
    want = (wb * x).sum(0) / wb.sum(0)
    np.testing.assert_allclose(f(x, w), want, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(f)(x, w), want, rtol=1e-6)
