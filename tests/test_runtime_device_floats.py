"""Float casts, products and quotients by integer operations: numpy's bits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fax_bridge.runtime import device_floats
from fax_bridge.runtime.float_bits import float_params

FLOATS = [np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]
SIZE = 64  # one shape: each function compiles once per dtype


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _same(got, want) -> None:
    """Equal bits, any NaN standing for any NaN (a sum of them is the same NaN)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
    np.testing.assert_array_equal(_bits(got)[~nan], _bits(want)[~nan])


def _values(draw, dtype: np.dtype) -> np.ndarray:
    """Random bit patterns (every class), values of a few binades around a drawn scale
    (products and quotients that round, underflow to subnormals or overflow), and the
    specials: zeros, the extreme subnormals and normals, infinities, NaN."""
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    p, nexp, _, uint = float_params(dtype)
    nbits = 8 * dtype.itemsize
    raw = rng.integers(0, 1 << nbits, SIZE, dtype=np.uint64).astype(uint).view(dtype)
    scale = draw(st.integers(-150, 130))
    near = (rng.standard_normal(SIZE) * 2.0 ** scale).astype(np.float32)
    with np.errstate(over="ignore"):
        near = near.astype(dtype)
    top = (1 << nexp) - 1
    words = [0, 1, (1 << (p - 1)) - 1, 1 << (p - 1), (top << (p - 1)) - 1,
             top << (p - 1), (top << (p - 1)) | 1]
    sign = 1 << (nbits - 1)
    specials = np.array(words + [w | sign for w in words], uint).view(dtype)
    pick = rng.integers(0, 3, SIZE)
    return np.where(pick == 0, raw, np.where(pick == 1, near,
                                             specials[rng.integers(0, 14, SIZE)]))


_astype = jax.jit(device_floats.astype, static_argnums=1)
_product = jax.jit(device_floats.product)
_quotient = jax.jit(device_floats.quotient)


@pytest.mark.parametrize("source", FLOATS, ids=str)
@pytest.mark.parametrize("target", FLOATS, ids=str)
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_casts_round_as_numpy(source, target, data):
    x = _values(data.draw, source)
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(target)
    _same(_astype(jnp.asarray(x), target), want)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_float32_products_and_quotients_round_as_numpy(data):
    a, b = _values(data.draw, FLOATS[0]), _values(data.draw, FLOATS[0])
    if data.draw(st.booleans()):  # the same binade: ties and exact results
        b = np.where(np.isfinite(b), np.float32(data.draw(st.sampled_from(
            [1.0, 2.0, 3.0, 0.5, 7.0, 1e-40, 3e38]))) * np.sign(b), b).astype(np.float32)
    with np.errstate(all="ignore"):
        _same(_product(jnp.asarray(a), jnp.asarray(b)), a * b)
        _same(_quotient(jnp.asarray(a), jnp.asarray(b)), a / b)


@pytest.mark.parametrize("dtype", FLOATS[1:], ids=str)
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_narrow_products_are_float32_products_rounded_as_numpy(dtype, data):
    """A product of two 16-bit floats as numpy (and ml_dtypes) make it: in float32,
    rounded to the dtype."""
    a, b = _values(data.draw, dtype), _values(data.draw, dtype)

    @jax.jit
    def narrow(x, y):
        return device_floats.astype(device_floats.product(
            device_floats.astype(x, np.float32), device_floats.astype(y, np.float32)), dtype)

    with np.errstate(all="ignore"):
        _same(narrow(jnp.asarray(a), jnp.asarray(b)), a * b)
