"""The StableHLO rewrites into TFLite builtins compute what the ops they replace do:
jit of a client function against XLA running the rewritten module (`fcp_client.lower`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax import lax

from fax_bridge.errors import ExportError
from fax_bridge.litert import builtin_rewrites
from fax_bridge.runtime import hlo
from fax_bridge.tff import fcp_client


def _hlo(fn, *args) -> bytes:
    return jax.jit(fn, keep_unused=True).lower(*args).compiler_ir(
        "hlo").as_serialized_hlo_module_proto()


def _lowered(fn, *args):
    """(the rewritten module run by XLA on `args`, the rewrite counts)."""
    module, counts = fcp_client.rewritten(_hlo(fn, *args))
    return hlo.HloExecutable(b"", stablehlo=module)(list(args)), counts


UNSIGNED = {
    "and_or_not": lambda a, b, k: ((a & b) | ~a) ^ (a | b),
    "shift_left": lambda a, b, k: lax.shift_left(a, k.astype(jnp.uint32)),
    "shift_right_logical": lambda a, b, k: lax.shift_right_logical(a, k.astype(jnp.uint32)),
    "compare_max_min": lambda a, b, k: jnp.where(a < b, jnp.maximum(a, b), jnp.minimum(a, b)),
    "to_float": lambda a, b, k: a.astype(jnp.float32),
    "widen": lambda a, b, k: a.astype(jnp.uint16).astype(jnp.uint32)
    + (a.astype(jnp.uint8).astype(jnp.float32) > 100),
    # a reduction's region (and its block arguments) made signless too: a wrapping sum
    "reduce_sum": lambda a, b, k: (a * b).reshape(2, 2).sum(0).repeat(2)
    + jnp.max(a).astype(jnp.uint32),
}

words = st.integers(0, 2**32 - 1)


_COMPILED: dict = {}  # op name -> (jitted, rewritten executable), built once


def _pair(name: str):
    if name not in _COMPILED:
        spec = (np.zeros(4, np.uint32), np.zeros(4, np.uint32), np.zeros(4, np.int32))
        module, _ = fcp_client.rewritten(_hlo(UNSIGNED[name], *spec))
        _COMPILED[name] = (jax.jit(UNSIGNED[name]), hlo.HloExecutable(b"", stablehlo=module))
    return _COMPILED[name]


@settings(max_examples=60, deadline=None)
@given(a=st.lists(words, min_size=4, max_size=4), b=st.lists(words, min_size=4, max_size=4),
       k=st.lists(st.integers(-3, 40), min_size=4, max_size=4),
       name=st.sampled_from(sorted(UNSIGNED)))
def test_unsigned_and_bitwise_rewrites_keep_every_bit(a, b, k, name):
    args = (np.array(a, np.uint32), np.array(b, np.uint32), np.array(k, np.int32))
    jitted, rewritten = _pair(name)
    want = np.asarray(jitted(*args))
    (got,) = rewritten(list(args))
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


# jax's threefry counters are an iota times a stride per dimension, added up: every
# shape's counter must fold (one element, odd sizes, several dimensions).
@pytest.mark.parametrize("shape", [(1,), (5,), (3, 5), (2, 3, 4)])
def test_jax_random_in_a_client_lowers_to_signed_ops_with_the_same_bits(shape):
    def client(key, x):
        return x + jax.random.uniform(jax.random.wrap_key_data(key), x.shape)

    key = np.asarray(jax.random.key_data(jax.random.key(3)))
    x = np.zeros(shape, np.float32)
    (got,), counts = _lowered(client, key, x)
    np.testing.assert_array_equal(got, np.asarray(jax.jit(client)(key, x)))
    assert counts["bitwise_ops"] > 0


def test_take_along_axis_gradient_is_a_one_hot_sum_with_the_same_bits():
    def grad(logits, labels):
        return jax.grad(lambda z: -jnp.mean(jnp.take_along_axis(
            jax.nn.log_softmax(z), labels[:, None], axis=1)))(logits)

    logits = np.random.default_rng(0).normal(size=(8, 10)).astype(np.float32)
    labels = np.array([0, 9, 3, 3, 12, -1, 5, 7], np.int32)  # 12: dropped, -1: the last
    (got,), counts = _lowered(grad, logits, labels)
    assert counts["scatter_adds"] == 1
    np.testing.assert_array_equal(got, np.asarray(jax.jit(grad)(logits, labels)))


@pytest.mark.parametrize("select_elements", [builtin_rewrites.SELECT_ELEMENTS, 0])
def test_embedding_gradient_sums_repeated_rows(monkeypatch, select_elements):
    monkeypatch.setattr(builtin_rewrites, "SELECT_ELEMENTS", select_elements)  # 0: a dot

    def grad(table, tokens):
        return jax.grad(lambda t: jnp.sum(t[tokens] ** 2))(table)

    table = np.random.default_rng(1).normal(size=(6, 3)).astype(np.float32)
    tokens = np.array([1, 4, 1, 1, 0], np.int32)
    (got,), counts = _lowered(grad, table, tokens)
    assert counts["scatter_adds"] == 1
    np.testing.assert_allclose(got, np.asarray(jax.jit(grad)(table, tokens)), rtol=1e-6)


def test_what_no_rewrite_covers_is_refused_with_its_source_line():
    def client(a, b):
        return a // b  # an unsigned divide

    args = (np.array([7], np.uint32), np.array([2], np.uint32))
    with pytest.raises(ExportError, match=r"stablehlo.divide at .*test_builtin_rewrites.py"):
        fcp_client.lower(_hlo(client, *args))


def test_a_bfloat16_tensor_in_the_client_work_is_refused_with_its_source_line():
    def client(x):
        return (x * 2).astype(jnp.bfloat16)  # a bfloat16 client result

    with pytest.raises(ExportError, match=r"stablehlo.convert at .*test_builtin_rewrites.py"
                       r".*bfloat16.*float32"):
        fcp_client.lower(_hlo(client, np.ones(3, np.float32)))


def test_a_float_converted_to_an_unsigned_integer_is_refused_naming_the_fix():
    def client(x):
        return x.astype(jnp.uint8) * jnp.uint8(3)

    with pytest.raises(ExportError, match=r"stablehlo.convert at .*test_builtin_rewrites.py"
                       r".*a float converted to an unsigned integer.*int32 first"):
        fcp_client.lower(_hlo(client, np.ones(3, np.float32)))
