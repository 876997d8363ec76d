"""Tests of fax_bridge.runtime.hlo_lax: HLO modules as exported (`typed_xla_computation`)
read into lax operations give their own executables' results, vmap over clients as
per-row calls do, and a module the reader cannot read is named with the op and line."""

import federated_language as fl
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fax_bridge.runtime import hlo, hlo_lax, hlo_lax_ops
from fax_bridge.tff.xla import typed_xla_computation

F32, I32 = np.float32, np.int32


def _executable(fn, *specs) -> hlo.HloExecutable:
    """`fn`'s module as the project's export writes it, compiled (a fresh executable)."""
    types = [fl.TensorType(d, list(s)) for s, d in specs]
    param = types[0] if len(types) == 1 else fl.StructType([(None, t) for t in types])
    comp = typed_xla_computation(fn, param)
    return hlo.HloExecutable(comp.xla.hlo_module.value)


def _inputs(specs, rng) -> list:
    out = []
    for shape, dtype in specs:
        if np.issubdtype(dtype, np.integer):
            out.append(rng.integers(-5, 6, shape).astype(dtype))
        elif dtype == np.bool_:
            out.append(rng.integers(0, 2, shape).astype(bool))
        else:
            out.append((rng.standard_normal(shape) * 2).astype(dtype))
    return out


def _assert_close(got, want, ulps: int = 4) -> None:
    """Integers and booleans exact; floats within `ulps` of the leaf's largest magnitude."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    if np.issubdtype(want.dtype, np.floating):
        scale = max(1.0, float(np.abs(want.astype(np.float64)).max(initial=0.0)))
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=0,
                                   atol=ulps * float(np.finfo(want.dtype).eps) * scale)
    else:
        assert got.tobytes() == want.tobytes()


def _ops() -> list:
    """(name, fn, specs): the ops the export writes, one or a few per case."""
    v, m, i = ((6,), F32), ((4, 3), F32), ((6,), I32)
    pool = lambda x: jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1),  # noqa: E731
                                           (1, 2, 2, 1), "VALID")
    return [
        ("elementwise", lambda x, y: (jnp.tanh(x) * jnp.exp(y) - jnp.log1p(jnp.abs(x)) /
                                      (1 + y ** 2), jnp.maximum(x, y), jnp.sign(x),
                                      jnp.floor(x), jnp.round(x), jax.nn.sigmoid(y)), [v, v]),
        ("integers", lambda a, b: (a // (jnp.abs(b) + 1), a % 3, a << 2, a >> 1, a & b,
                                   a | b, a ^ b, ~a, jax.lax.population_count(a)), [i, i]),
        ("compare_select_clamp", lambda x, y: (jnp.where(x > y, x, y), x == y,
                                               jnp.clip(x, -1, 1)), [v, v]),
        ("convert_bitcast", lambda x: (x.astype(I32), x.astype(jnp.bfloat16),
                                       jax.lax.bitcast_convert_type(x, I32)), [v]),
        ("shapes", lambda x: (x.T, x.reshape(3, 4), x[1:3, ::2], jnp.flip(x, 0),
                              jnp.pad(x, ((1, 2), (0, 1))), jnp.concatenate([x, x], 1),
                              jnp.broadcast_to(x[:, :1], (4, 3)), jnp.arange(12) * 2), [m]),
        ("dot", lambda a, b: (a @ b, jnp.einsum("ij,ij->i", a, a)), [m, ((3, 5), F32)]),
        ("batched_dot", lambda a, b: jnp.einsum("bij,bjk->bik", a, b),
         [((2, 3, 4), F32), ((2, 4, 5), F32)]),
        ("convolution", lambda x, k: jax.lax.conv_general_dilated(
            x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")),
         [((2, 6, 6, 3), F32), ((3, 3, 3, 4), F32)]),
        ("reduce", lambda x: (x.sum(0), x.max(1), jnp.argmax(x, 1), x.prod()), [m]),
        ("reduce_window", lambda x: (pool(x), jnp.cumsum(x, axis=1)), [((1, 4, 4, 2), F32)]),
        ("pool_gradient", lambda x: jax.grad(lambda y: pool(y).sum())(x), [((1, 4, 4, 2), F32)]),
        ("dynamic_slices", lambda x, k: (jax.lax.dynamic_slice(x, (k[0], 0), (2, 3)),
                                         jax.lax.dynamic_update_slice(x, x[:1] * 0, (k[1], 0))),
         [m, ((2,), I32)]),
        ("gather_scatter", lambda x, k: (x[jnp.abs(k) % 4], x.at[jnp.abs(k) % 4].add(1.0),
                                         x.at[jnp.abs(k) % 4].set(0.0)), [m, ((2,), I32)]),
        ("while_cond_case", lambda x, k: (
            jax.lax.fori_loop(0, 3, lambda j, c: c * 1.5 + j, x),
            jax.lax.cond(x.sum() > 0, lambda: x, lambda: -x),
            jax.lax.switch(k[0], [lambda: x, lambda: x * 2, lambda: x * 3])), [v, ((1,), I32)]),
    ]


_CASES = _ops()


@pytest.mark.parametrize("name,fn,specs", _CASES, ids=[c[0] for c in _CASES])
def test_each_op_reads_as_the_modules_own_executable_computes(name, fn, specs):
    exe = _executable(fn, *specs)
    program = exe.lax_program()
    for seed in range(2):
        args = _inputs(specs, np.random.default_rng(seed))
        want = exe(args)
        got = jax.jit(lambda *a: program(*a))(*args)
        assert len(got) == len(want) == len(exe.results)
        for g, w in zip(got, want):
            _assert_close(g, w)


@pytest.mark.parametrize("name,fn,specs", _CASES, ids=[c[0] for c in _CASES])
def test_the_read_module_vmaps_as_per_row_calls(name, fn, specs):
    # Every parameter batched over 3 rows: each row as the program on that row alone.
    program = _executable(fn, *specs).lax_program()
    rows = [_inputs(specs, np.random.default_rng(seed)) for seed in range(3)]
    stacked = [np.stack(col) for col in zip(*rows)]
    got = jax.jit(jax.vmap(lambda *a: program(*a)))(*stacked)
    for r, row in enumerate(rows):
        for g, w in zip(got, jax.jit(lambda *a: program(*a))(*row)):
            _assert_close(np.asarray(g)[r], w)


@settings(max_examples=10, deadline=None)
@given(shape=st.sampled_from([(3,), (2, 5)]), dtype=st.sampled_from([F32, I32]),
       seed=st.integers(0, 2**16))
def test_integer_results_stay_exact_and_floats_close_over_shapes(shape, dtype, seed):
    def fn(a, b):
        return (a * b + a - b, jnp.sum(a * b), jnp.max(a - b), jnp.cumsum(a))

    exe = _executable(fn, (shape, dtype), (shape, dtype))
    args = _inputs([(shape, dtype)] * 2, np.random.default_rng(seed))
    for g, w in zip(jax.jit(lambda *a: exe.lax_program()(*a))(*args), exe(args)):
        _assert_close(g, w)


def test_an_op_without_a_reading_is_named_with_its_source_line(monkeypatch):
    monkeypatch.delitem(hlo_lax_ops.TABLE, "stablehlo.cosine")
    exe = _executable(lambda x: jnp.cos(x) + 1, ((3,), F32))
    with pytest.raises(hlo_lax.Unreadable, match=r"stablehlo\.cosine.*test_runtime_hlo_lax"):
        exe.lax_program()
    # Inside `reading_as_lax`, `call_traced` needs the reading; outside it calls the module.
    with pytest.raises(hlo_lax.Unreadable, match="cosine"), hlo.reading_as_lax():
        jax.jit(lambda x: exe.call_traced([x]))(np.ones(3, F32))
    got = jax.jit(lambda x: exe.call_traced([x]))(np.ones(3, F32))
    _assert_close(got[0], np.cos(np.ones(3, F32)) + 1)


def test_refusals_name_what_they_cannot_read():
    sort = _executable(lambda x: jnp.sort(x), ((5,), F32))
    with pytest.raises(hlo_lax.Unreadable, match="TOTALORDER|sort"):
        sort.lax_program()
    # jax's rng_bit_generator module holds 64-bit words even when jax runs 32-bit ones
    rng = _executable(lambda key: jax.lax.rng_bit_generator(key, (3,), jnp.uint32)[1],
                      ((4,), np.uint32))
    with pytest.raises(hlo_lax.Unreadable, match="64-bit tensor .* jax_enable_x64 is off"):
        rng.lax_program()
    with pytest.raises(hlo_lax.Unreadable, match="no entry function"):
        hlo_lax.read("module {}")
