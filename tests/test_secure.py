"""Secure aggregation: TFF's secure-sum intrinsics, the modular sum, range errors on every
path, the float secure mean's error bound, its export, fleet parity, and the closure of
its derivative."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from federated_language.compiler import building_blocks

import fax_bridge as fb
from fax_bridge.errors import AggregationError, FleetError
from fax_bridge.runtime import run_computation

N = 4
X = np.array([[1, 2], [3, 4], [250, 0], [5, 5]], np.int32)
Y = np.array([1, 999, 3, 4], np.int32)


@fb.program(clients=N)
def int_sums(x, y):
    return fb.federated_secure_sum_bitwidth(x, 8), fb.federated_secure_sum(y, 1000)


@fb.program(clients=N)
def modular_sums(x, y):
    return fb.federated_secure_modular_sum(x, 7), fb.federated_secure_modular_sum(y, 1000)


def _keys(n, seed=0):
    return jax.vmap(lambda i: jax.random.key_data(jax.random.key(i)))(
        jnp.arange(seed * n, (seed + 1) * n))


@fb.program(clients=N)
def secure_round(w, data, keys):
    v = fb.federated_map_clients(lambda w, d: w * d, (fb.federated_broadcast(w), data))
    return fb.federated_secure_mean(v, keys, value_range=(-4.0, 4.0), bits=16)


D = np.array([[0.5, 1.0], [0.25, -1.0], [1.0, 2.0], [-0.3, 0.1]], np.float32)
W = np.array([1.0, 0.5], np.float32)


def _block(proto):
    return building_blocks.ComputationBuildingBlock.from_proto(proto)


def test_integer_sums_locally_exported_and_on_a_fleet():
    want = (X.sum(0), Y.sum())
    for got in (int_sums(X, Y), jax.jit(int_sums)(X, Y)):
        np.testing.assert_array_equal(got[0], want[0])
        assert int(got[1]) == want[1]
    proto = fb.export_tff(int_sums, X, Y, placements=("clients", "clients"))
    rep = _block(proto).compact_representation()
    assert "federated_secure_sum_bitwidth(<_arg0,8>)" in rep
    assert "federated_secure_sum(<_arg1,1000>)" in rep
    ran = run_computation(proto, X, Y)
    np.testing.assert_array_equal(ran[0], want[0])
    with fb.LocalFleet(devices=2) as fleet:
        assert fb.check_parity(int_sums, X, Y, placements=("clients", "clients"),
                               fleet=fleet).ok
        assert fb.check_parity(secure_round, W, D, _keys(N),
                               placements=("server", "clients", "clients"), fleet=fleet).ok
        signed = X - 3                                   # negatives reduce into range too
        assert fb.check_parity(modular_sums, signed, Y, placements=("clients", "clients"),
                               fleet=fleet).ok
        bad = X.copy()
        bad[1, 0] = 256
        with pytest.raises(FleetError, match=r"device .*outside \[0, 2\*\*8 - 1\]"):
            fleet.run(proto, bad, Y)
        # federated_secure_sum too is checked by the device holding the client, which
        # returns only its partial sum
        with pytest.raises(FleetError, match=r"device .*outside \[0, max_input\] = \[0, 1000\]"):
            fleet.run(proto, X, np.where(Y == 4, 1001, Y).astype(np.int32))


def test_modular_sum_reduces_at_clients_then_sums_securely():
    signed = X - 3
    got = jax.jit(modular_sums)(signed, Y)
    np.testing.assert_array_equal(got[0], np.mod(np.mod(signed, 7).sum(0), 7))
    assert int(got[1]) == Y.sum() % 1000
    proto = fb.export_tff(modular_sums, signed, Y, placements=("clients", "clients"))
    rep = _block(proto).compact_representation()
    assert "federated_secure_sum_bitwidth(<_s3,3>)" in rep          # bitwidth of 6
    assert "federated_secure_sum_bitwidth(<_s5,10>)" in rep         # bitwidth of 999
    with pytest.raises(fb.SecureAggregationError, match="more than int32 holds"):
        fb.program(clients=N)(lambda x: fb.federated_secure_modular_sum(x, 2 ** 30))(X)


def test_out_of_range_values_are_refused_on_every_path():
    bad = X.copy()
    bad[2, 1] = 256
    with pytest.raises(fb.SecureAggregationError, match=r"outside \[0, 2\*\*8 - 1\] = \[0, 255\]"):
        int_sums(bad, Y)
    with pytest.raises(fb.SecureAggregationError, match=r"max_input\] = \[0, 1000\]"):
        int_sums(X, np.where(Y == 1, 1001, Y))
    with pytest.raises(jax.errors.JaxRuntimeError, match="a client value lies outside"):
        jax.jit(int_sums)(np.where(X == 1, -1, X).astype(np.int32), Y)
    proto = fb.export_tff(int_sums, X, Y, placements=("clients", "clients"))
    with pytest.raises(AggregationError, match="outside"):
        run_computation(proto, bad, Y)
    with pytest.raises(fb.SecureAggregationError, match="bitwidth"):
        fb.program(clients=N)(lambda x: fb.federated_secure_sum_bitwidth(x, 70))(X)
    with pytest.raises(fb.PlacementError, match="integers"):
        fb.program(clients=N)(lambda x: fb.federated_secure_sum_bitwidth(x, 8))(D)


def test_secure_mean_error_bound():
    n, bits, lo, hi = 64, 8, -1.0, 3.0
    step = (hi - lo) / (2 ** bits - 1)
    x = np.random.default_rng(0).uniform(lo, hi, size=(n, 200)).astype(np.float32)

    @fb.program(clients=n)
    def mean(x, keys):
        return fb.federated_secure_mean(x, keys, value_range=(lo, hi), bits=bits)

    run = jax.jit(mean)
    errors = np.stack([np.asarray(run(x, _keys(n, s))) - x.mean(0) for s in range(20)])
    assert np.abs(errors).max() <= step * 1.0001                # always within one step
    assert errors.std() <= step / (2 * np.sqrt(n)) * 1.1         # and unbiased, averaging
    assert abs(errors.mean()) < step / (2 * np.sqrt(n * errors.size)) * 4
    clipped = run(np.full((n, 200), 10.0, np.float32), _keys(n))
    np.testing.assert_allclose(clipped, hi, rtol=1e-6)           # outside: the nearest end
    batched = jax.vmap(mean, in_axes=(1, None))(x[:, :3, None], _keys(n))  # outer vmap
    assert batched.shape == (3, 1)
    assert np.abs(np.asarray(batched)[:, 0] - x[:, :3].mean(0)).max() <= step * 1.0001


def _secure_round_of(clients: int):
    @fb.program(clients=clients)
    def secure_round_n(w, data, keys):
        v = fb.federated_map_clients(lambda w, d: w * d, (fb.federated_broadcast(w), data))
        return fb.federated_secure_mean(v, keys, value_range=(-4.0, 4.0), bits=16)
    return secure_round_n


@settings(max_examples=6, deadline=None)
@given(taking=st.integers(1, 6), seed=st.integers(0, 3))
def test_an_exported_secure_mean_averages_the_clients_that_took_part(taking, seed):
    """Exported for 6 clients and run over fewer (a cohort, a lost client), the secure
    mean divides by the clients whose codes were summed, bit for bit as jit's program
    written for that many; it never divides by the 6 the program was exported with."""
    n = 6
    data = np.random.default_rng(seed).uniform(-2, 2, (n, 2)).astype(np.float32)
    keys = _keys(n, seed)
    proto = fb.export_tff(_secure_round_of(n), W, data, keys,
                          placements=("server", "clients", "clients"))
    got = run_computation(proto, W, data[:taking], keys[:taking])
    want = jax.jit(_secure_round_of(taking))(W, data[:taking], keys[:taking])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_gradient_of_a_secure_mean_uses_only_federated_primitives():
    def loss(w, data, keys):
        return jnp.sum(secure_round(w, data, keys) ** 2)

    grad = fb.program(clients=N)(lambda w, d, k: jax.grad(loss)(w, d, k))
    g = grad(W, D, _keys(N))
    m = secure_round(W, D, _keys(N))
    np.testing.assert_allclose(g, 2 * m * D.mean(0), rtol=1e-4)   # straight-through
    jaxpr = jax.make_jaxpr(grad)(W, D, _keys(N)).jaxpr
    names = {e.primitive.name for e in jaxpr.eqns}
    assert {"federated_secure_mean", "federated_broadcast"} <= names
    # the only aggregation of client data in the forward pass is the secure one, and the
    # backward pass needs broadcasts (the mean's transpose) and a sum (the broadcast's)
    assert "federated_mean" not in names
    comp = fb.trace(grad, W, D, _keys(N), placements=("server", "clients", "clients"))
    assert comp is not None
    proto = fb.export_tff(grad, W, D, _keys(N), placements=("server", "clients", "clients"))
    rep = _block(proto).compact_representation()
    assert "federated_secure_sum_bitwidth" in rep and "federated_broadcast" in rep
    np.testing.assert_allclose(run_computation(proto, W, D, _keys(N)), g, rtol=1e-5)


@settings(max_examples=12, deadline=None)
@given(dtype=st.sampled_from([np.int8, np.uint8, np.int16, np.int32, np.uint32]),
       kind=st.sampled_from(["bitwidth", "max_input"]), clients=st.integers(1, 6),
       bits=st.integers(1, 32))
def test_secure_sums_that_could_wrap_are_refused_when_traced(dtype, kind, clients, bits):
    """The sum keeps the values' dtype (TFF's typing): a bound whose clients' sum cannot
    fit it is refused at trace time on every path, and one that fits sums exactly."""
    bits = min(bits, np.iinfo(dtype).bits - (np.dtype(dtype).kind == "i"))
    top = 2 ** bits - 1

    @fb.program(clients=clients)
    def f(x):
        if kind == "bitwidth":
            return fb.federated_secure_sum_bitwidth(x, bits)
        return fb.federated_secure_sum(x, top)

    x = np.full((clients, 2), top, dtype)
    runs = (f, jax.jit(f), lambda x: fb.export_tff(f, x, placements="clients"))
    if clients * top > np.iinfo(dtype).max:
        for run in runs:
            with pytest.raises(fb.SecureAggregationError,
                               match=rf"{clients} clients .*{kind} .*more than "
                                     rf"{np.dtype(dtype).name} holds"):
                run(x)
        return
    want = np.full(2, clients * top, dtype)
    np.testing.assert_array_equal(jax.jit(f)(x), want)
    proto = fb.export_tff(f, x, placements="clients")
    got = run_computation(proto, x)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, want)


def test_the_runtime_and_fleet_refuse_a_sum_that_could_wrap_with_the_clients_they_hold():
    """A proto written for 1 client (bitwidth 31 fits int32) run over 4 clients."""
    one = fb.program(clients=1)(lambda x: (fb.federated_secure_sum_bitwidth(x, 31),
                                           fb.federated_secure_sum(x, 2 ** 31 - 1)))
    proto = fb.export_tff(one, np.ones((1,), np.int32), placements="clients")
    assert run_computation(proto, np.full((1,), 2 ** 31 - 1, np.int32))[0] == 2 ** 31 - 1
    x = np.full((4,), 2 ** 31 - 1, np.int32)
    with pytest.raises(AggregationError, match="bitwidth of at most 29 for 4 clients"):
        run_computation(proto, x)
    with fb.LocalFleet(devices=2) as fleet:
        with pytest.raises(AggregationError, match="bitwidth of at most 29 for 4 clients"):
            fleet.run(proto, x)
        # the weighted mean's weight rule, on the same fleet
        wm = fb.program(clients=4)(lambda v, w: fb.federated_weighted_mean(v, w))
        v = np.ones((4, 2), np.float32)
        p = fb.export_tff(wm, v, np.ones(4, np.float32), placements=("clients", "clients"))
        with pytest.raises(fb.WeightError, match="sum to zero"):
            fleet.run(p, v, np.zeros(4, np.float32))
        with pytest.raises(FleetError, match="WeightError: .*weight is negative"):
            fleet.run(p, v, np.array([1, -1, 0, 1], np.float32))
        np.testing.assert_array_equal(fleet.run(p, v, np.array([0, 0, 2, 0], np.float32)),
                                      [1, 1])


def test_modular_sums_obey_the_dtype_of_their_values():
    f = fb.program(clients=4)(lambda x: fb.federated_secure_modular_sum(x, 100))
    x8 = np.array([99, 1, 50, 7], np.int8)
    with pytest.raises(fb.SecureAggregationError, match="modulus of at most 32 for 4 clients"):
        f(x8)  # 4 * 127 codes would wrap int8
    assert int(jax.jit(f)(x8.astype(np.int16))) == (99 + 1 + 50 + 7) % 100


@settings(max_examples=10, deadline=None)
@given(clients=st.integers(1, 6), shape=st.sampled_from([(), (1,), (3,), (2, 2)]),
       bits=st.integers(4, 16), value_range=st.sampled_from(
           [(-5.0, 5.0), (-1.0, 1.0), (0.0, 1.0), (-0.3, 2.0)]), seed=st.integers(0, 3))
def test_a_secure_means_bits_are_jits_eagerly_and_in_the_runtime(
        clients, shape, bits, value_range, seed):
    """The dequantizing division is the same division everywhere: jit does not fold the
    clients' count into a constant divisor (which XLA would turn into a product with its
    rounded reciprocal for a scalar mean, 10 ulps off the runtime's counted division)."""
    @fb.program(clients=clients)
    def mean(x, keys):
        return fb.federated_secure_mean(x, keys, value_range=value_range, bits=bits)

    x = np.random.default_rng(seed).normal(size=(clients,) + shape).astype(np.float32)
    keys = _keys(clients, seed)
    want = np.asarray(jax.jit(mean)(x, keys))
    assert np.asarray(mean(x, keys)).tobytes() == want.tobytes()
    proto = fb.export_tff(mean, x, keys, placements=("clients", "clients"))
    assert np.asarray(run_computation(proto, x, keys)).tobytes() == want.tobytes()


@pytest.mark.parametrize("shape", [(0,), (2, 0)])
def test_secure_sums_of_no_elements_are_empty_sums_on_every_path(shape):
    """No value to check the range of, no minimum to take: an empty sum, eagerly, under
    jit and in the runtime."""
    @fb.program(clients=3)
    def sums(x):
        return (fb.federated_secure_sum_bitwidth(x, 8), fb.federated_secure_sum(x, 100),
                fb.federated_secure_modular_sum(x, 7))

    x = np.zeros((3,) + shape, np.int32)
    proto = fb.export_tff(sums, x, placements=("clients",))
    for got in (sums(x), jax.jit(sums)(x), run_computation(proto, x)):
        assert [(np.asarray(g).shape, np.asarray(g).dtype) for g in got] == \
            [(shape, np.int32)] * 3
