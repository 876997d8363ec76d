"""How sums over clients lower: floating-point sums and weighted means as one dot over the
clients axis, integer sums as exact reductions; values against float64 references for
generated clients, shapes and dtypes, under jit, vmap and grad."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import fax_bridge as fb
from fax_bridge.language import lowering

FLOATS = {np.float32: 2e-6, jnp.bfloat16: 2e-2, np.float16: 2e-3}


def _program(clients, kind):
    @fb.program(clients=clients)
    def f(x, w):
        if kind == "sum":
            return fb.federated_sum(x)
        if kind == "mean":
            return fb.federated_mean(x)
        return fb.federated_weighted_mean(x, w)

    return f


@settings(max_examples=8, deadline=None)
@given(clients=st.integers(1, 40), member=st.lists(st.integers(1, 5), max_size=3),
       dtype=st.sampled_from(list(FLOATS)), kind=st.sampled_from(["sum", "mean", "weighted"]),
       weights=st.sampled_from(["client", "elementwise"]), seed=st.integers(0, 2 ** 16))
def test_float_aggregates_match_float64_reference(clients, member, dtype, kind, weights, seed):
    rng = np.random.default_rng(seed)
    x64 = rng.standard_normal([clients] + member)
    w_shape = [clients] + (member if weights == "elementwise" else [])
    w64 = rng.uniform(0.5, 2.0, w_shape)
    x, w = jnp.asarray(x64, dtype), jnp.asarray(w64, np.float32)
    x64 = np.asarray(x, np.float64)  # what the program sees, rounded to dtype
    w64 = np.asarray(w, np.float64)
    got = jax.jit(_program(clients, kind))(x, w)
    assert got.dtype == x.dtype and got.shape == tuple(member)
    if kind == "sum":
        want = x64.sum(0)
    elif kind == "mean":
        want = x64.mean(0)
    else:
        wb = w64.reshape(w64.shape + (1,) * (x64.ndim - w64.ndim))
        want = (wb * x64).sum(0) / wb.sum(0)
    scale = np.abs(x64).sum(0) / (clients if kind != "sum" else 1)
    tol = FLOATS[dtype] * (scale + 1e-30)
    assert np.all(np.abs(np.asarray(got, np.float64) - want) <= 4 * tol), (got, want)


@settings(max_examples=5, deadline=None)
@given(clients=st.integers(1, 30), member=st.lists(st.integers(1, 4), max_size=2),
       dtype=st.sampled_from([np.int32, np.int8, np.uint8]), seed=st.integers(0, 2 ** 16))
def test_integer_sums_are_exact(clients, member, dtype, seed):
    rng = np.random.default_rng(seed)
    info = np.iinfo(dtype)
    # Values a float32 dot could not add exactly (over 2**24), without overflow.
    hi = info.max // clients
    x = rng.integers(max(info.min // clients, -hi), hi + 1, [clients] + member).astype(dtype)
    got = jax.jit(_program(clients, "sum"))(jnp.asarray(x), jnp.ones(clients))
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, x.astype(np.int64).sum(0).astype(dtype))


def _hlo(clients, kind, x):
    f = _program(clients, kind)
    return jax.jit(f).lower(x, jnp.ones(clients)).compile().as_text()


@pytest.mark.parametrize("kind", ["sum", "mean", "weighted"])
def test_float_aggregates_are_one_dot_over_clients_not_a_reduce(kind):
    text = _hlo(6, kind, jnp.ones((6, 32, 16)))
    assert " dot(" in text
    # The only reduction left is a weighted mean's total of the (clients,) weights.
    big = [line for line in text.splitlines()
           if " reduce(" in line and "f32[6,32,16]" in line]
    assert not big, big


def test_integer_sum_stays_a_reduce():
    text = _hlo(6, "sum", jnp.ones((6, 32, 16), jnp.int32))
    assert " reduce(" in text
    assert " dot(" not in text


def test_weighted_mean_under_vmap_batches_the_weights():
    """An outer vmap over both values and weights gives weights of shape (clients, B):
    the dot batches over B."""
    clients, batch = 5, 3
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, clients, 7)).astype(np.float32)
    w = rng.uniform(0.5, 2.0, (batch, clients)).astype(np.float32)
    got = jax.jit(jax.vmap(_program(clients, "weighted")))(x, w)
    want = np.einsum("bc,bcd->bd", w, x) / w.sum(1)[:, None]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_gradients_through_the_dot_lowering():
    """Transposes bind federated sums again; their lowering is the dot as well."""
    clients = 4
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((clients, 3)), jnp.float32)
    w = jnp.asarray(rng.uniform(0.5, 2.0, clients), jnp.float32)

    def loss(x):
        return jnp.sum(_program(clients, "weighted")(x, w) ** 2)

    def ref(x):
        return jnp.sum((jnp.einsum("c,cd->d", w, x) / w.sum()) ** 2)

    np.testing.assert_allclose(jax.jit(jax.grad(loss))(x), jax.grad(ref)(x), rtol=1e-5)


def test_clients_sum_is_the_shared_helper():
    """federated_sum, mean and weighted mean all use `clients_sum`."""
    x = jnp.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(lowering.clients_sum(x), [12.0, 15.0, 18.0, 21.0])
    np.testing.assert_array_equal(lowering.clients_sum(x, jnp.array([1.0, 0.0, 2.0])),
                                  [16.0, 19.0, 22.0, 25.0])
    np.testing.assert_array_equal(lowering.clients_sum(x.astype(jnp.int32)), [12, 15, 18, 21])


@settings(max_examples=12, deadline=None)
@given(dtype=st.sampled_from([np.float16, jnp.bfloat16]),
       kind=st.sampled_from(["mean", "weighted_mean"]),
       n=st.sampled_from([2, 257, 2049, 65520, 70001]),
       value=st.sampled_from([1.0, 3.0, -2.5, 0.1, 1000.0, 0.3333]),
       chunk=st.sampled_from([None, 1000]))
def test_a_narrow_mean_of_identical_values_is_that_value_under_jit(dtype, kind, n, value,
                                                                  chunk):
    """Narrow floats are summed over clients in float32, in blocks of about sqrt(n)
    clients, and rounded once, after the division, whole or chunk by chunk: a float16
    sum of 2,049 ones is off, of 65,520 inf, and a one-level float32 sum of 65,520
    copies of 0.1 a float16 ulp off."""
    @fb.program(clients=n, clients_per_step=chunk if chunk and chunk < n else None)
    def f(x, w):
        if kind == "mean":
            return fb.federated_mean(x)
        return fb.federated_weighted_mean(x, w)

    x = jnp.full((n, 2), value, dtype).at[:, 1].set(dtype(3.0))
    w = jnp.full((n,), 7.0, jnp.float32)
    got = np.asarray(jax.jit(f)(x, w).astype(np.float32))
    np.testing.assert_array_equal(got, np.asarray(x[0].astype(np.float32)))
