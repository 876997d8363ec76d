"""Tests of fax_bridge.language.jax_compat: each helper gives the same answer on every jax
version fax_bridge runs on (0.10.2 to 0.12.x), checked against jax's public transforms."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend import core as xcore

from fax_bridge.language import jax_compat

F32 = jax.ShapeDtypeStruct((3,), jnp.float32)
F32_AVAL = jax.typeof(np.zeros(3, np.float32))  # what tracing takes


def _closed(fn, *avals) -> jax_compat.ClosedJaxpr:
    closed = jax.make_jaxpr(fn)(*avals)
    return jax_compat.ClosedJaxpr(closed.jaxpr, closed.consts)


def test_closed_jaxpr_is_what_make_jaxpr_gives():
    closed = jax.make_jaxpr(lambda x: x + 1)(F32)
    assert isinstance(closed, jax_compat.ClosedJaxpr)
    rebuilt = jax_compat.ClosedJaxpr(closed.jaxpr, closed.consts)
    np.testing.assert_array_equal(xcore.jaxpr_as_fun(rebuilt)(np.ones(3, np.float32))[0], 2.0)


def test_trace_lifting_lifts_the_enclosing_traces_values_and_keeps_constants():
    table = np.arange(3, dtype=np.float32)  # a constant: stays closed over
    seen = {}

    def outer(y):
        def member(a):
            return [a * y + table, a * 2]
        closed, lifted = jax_compat.trace_lifting(member, [F32_AVAL], "member",
                                                  lambda c: isinstance(c, jax.core.Tracer))
        seen["lifted"], seen["closed"] = len(lifted), closed
        return xcore.jaxpr_as_fun(closed)(*lifted, y)

    y = np.array([1.0, 2.0, 3.0], np.float32)
    got = jax.jit(outer)(y)
    assert seen["lifted"] == 1
    assert len(seen["closed"].in_avals) == 2  # the lifted value first, then the member
    assert len(seen["closed"].consts) == 1 and seen["closed"].consts[0] is not None
    np.testing.assert_allclose(got[0], y * y + table)
    np.testing.assert_allclose(got[1], 2 * y)


def test_trace_lifting_without_captures_lifts_nothing():
    closed, lifted = jax_compat.trace_lifting(lambda a: [jnp.sin(a)], [F32_AVAL], "f",
                                              lambda c: False)
    assert lifted == []
    np.testing.assert_allclose(xcore.jaxpr_as_fun(closed)(np.ones(3, np.float32))[0],
                               np.sin(np.ones(3, np.float32)))


def test_dce_closed_drops_the_outputs_and_consts_no_longer_read():
    table = np.arange(3, dtype=np.float32) + 7

    def fn(a, b):
        return a + table, b * 2

    closed = _closed(fn, F32, F32)
    assert len(closed.consts) == 1
    kept, used_inputs = jax_compat.dce_closed(closed, [False, True])
    assert used_inputs == [False, True]
    assert len(kept.consts) == 0 and len(kept.out_avals) == 1
    x = np.ones(3, np.float32)
    np.testing.assert_array_equal(xcore.jaxpr_as_fun(kept)(x)[0], 2 * x)  # used inputs only
    whole, used = jax_compat.dce_closed(closed, [True, False], instantiate=True)
    assert used == [True, True] and len(whole.consts) == 1
    np.testing.assert_array_equal(xcore.jaxpr_as_fun(whole)(x, x)[0], x + table)


def _bilinear(w, x, y, n):
    """Linear in x and y (n an integer operand); w enters non-linearly."""
    return [jnp.sin(w) * x, x.sum() + 0 * w.sum(), 3.0 * y, n * 2]


_AVALS = [F32, F32, F32, jax.ShapeDtypeStruct((3,), jnp.int32)]


@pytest.mark.parametrize("out_zeros", list(itertools.product([False, True], repeat=4)))
def test_transpose_closed_is_the_vjp_in_the_linear_inputs(out_zeros):
    closed = _closed(_bilinear, *_AVALS)
    in_linear = [False, True, True, True]
    t_closed, in_zeros = jax_compat.transpose_closed(closed, in_linear, out_zeros)
    # y is read only by output 2, n only by an integer output: their cotangents are
    # zero when nothing they feed has a cotangent, n's always
    assert in_zeros == [all(out_zeros[:2]), out_zeros[2], True]
    rng = np.random.default_rng(sum(out_zeros))
    w, x, y = (rng.normal(size=3).astype(np.float32) for _ in range(3))
    n = np.arange(3, dtype=np.int32)
    cts = [rng.normal(size=a.shape).astype(np.float32) for a in closed.out_avals[:3]]
    given = cts + [np.zeros(3, jax.dtypes.float0)]  # an integer output's cotangent
    outs = xcore.jaxpr_as_fun(t_closed)(w, *[c for c, z in zip(given, out_zeros) if not z])
    _, vjp = jax.vjp(lambda x, y: _bilinear(w, x, y, n)[:3], x, y)
    want = vjp([np.zeros_like(c) if z else c for c, z in zip(cts, out_zeros)])
    nonzero = iter(outs)
    for got_zero, expected in zip(in_zeros[:2], want):
        if got_zero:
            np.testing.assert_array_equal(expected, 0)
        else:
            np.testing.assert_allclose(next(nonzero), expected, rtol=1e-6)
    assert next(nonzero, None) is None


def test_scan_counts_are_the_consts_and_carries():
    def fn(a, b, init, xs):
        return lax.scan(lambda c, x: (c + a * x + b, c * x), init, xs)

    closed = jax.make_jaxpr(fn)(F32, F32, F32, jax.ShapeDtypeStruct((4, 3), jnp.float32))
    (scan,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    nc, nk = jax_compat.scan_counts(scan.params)
    assert nk == 1
    assert nc + nk + 1 == len(scan.invars)  # the consts, the carry, then the scanned xs
    assert scan.invars[nc + nk] is closed.jaxpr.invars[3]


def test_register_dce_rule_is_called_with_the_used_outputs_and_the_equation():
    calls = []
    prim = xcore.Primitive("jax_compat_test_pair")
    prim.multiple_results = True
    prim.def_abstract_eval(lambda a: [a, a])
    prim.def_impl(lambda a: [a, a])

    def rule(used_outputs, eqn):
        calls.append((list(used_outputs), eqn.primitive))
        return [any(used_outputs)], eqn if any(used_outputs) else None

    jax_compat.register_dce(prim, rule)
    from jax._src.interpreters import partial_eval as pe
    closed = jax.make_jaxpr(lambda a: [prim.bind(a)[0], a + 1])(F32)
    dced, _ = pe.dce_jaxpr(closed.jaxpr, [False, True])
    assert calls == [([False, False], prim)]
    assert [e.primitive for e in dced.eqns if e.primitive is prim] == []


def _fields_of(exp) -> dict:
    return {f.name: getattr(exp, f.name) for f in dataclasses.fields(exp)}


def test_exported_rebuilds_a_module_that_calls():
    exp = jax.export.export(jax.jit(lambda a, b: (a * b + 1,)))(F32, F32)
    # `_has_named_shardings`: a field of 0.10 only, left out where jax lacks it
    rebuilt = jax_compat.exported(**{**_fields_of(exp), "_has_named_shardings": False})
    x = np.arange(3, dtype=np.float32)
    np.testing.assert_array_equal(rebuilt.call(x, x)[0], x * x + 1)
    np.testing.assert_array_equal(jax.jit(lambda a: rebuilt.call(a, a)[0])(x), x * x + 1)


def test_exported_names_the_fields_it_was_not_given():
    exp = jax.export.export(jax.jit(lambda a: a))(F32)
    fields = _fields_of(exp)
    del fields["in_avals"], fields["nr_devices"]
    with pytest.raises(TypeError, match=r"requires \['in_avals', 'nr_devices'\]"):
        jax_compat.exported(**fields)


def test_lower_embedded_keeps_closed_over_arrays_in_the_module():
    """Every closed-over array is a constant of the lowered module, its parameters are
    the function's own (jax 0.12 hoists arrays over 1 KiB into parameters by default)."""
    table = np.arange(2048, dtype=np.float32)
    lowered = jax_compat.lower_embedded(jax.jit(lambda x: x * jnp.asarray(table)),
                                        jax.ShapeDtypeStruct((2048,), jnp.float32))
    assert len(lowered.compiler_ir("hlo").program_shape().parameter_shapes()) == 1
    x = np.full(2048, 2.0, np.float32)
    np.testing.assert_array_equal(np.asarray(lowered.compile()(x)), 2.0 * table)
