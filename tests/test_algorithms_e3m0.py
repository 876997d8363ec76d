"""E3M0: the 4-bit grid, signs and scales, codes packed two per byte."""

import jax
import jax.numpy as jnp
import numpy as np

from fax_bridge.algorithms import e3m0


def test_e3m0_grid_sign_scale_and_error():
    x = jnp.asarray(np.random.default_rng(0).normal(size=1000).astype(np.float32))
    q = np.asarray(jax.jit(e3m0.quantize)(x))
    scale = float(jnp.max(jnp.abs(x)))
    levels = scale * 2.0 ** np.arange(-6, 1)
    assert np.all(np.isclose(np.abs(q[:, None]), levels[None], rtol=1e-6).any(1) | (q == 0))
    assert len(np.unique(np.abs(q))) <= 8                  # 7 magnitudes and zero
    assert np.all(np.sign(q[q != 0]) == np.sign(np.asarray(x)[q != 0]))
    assert np.isclose(np.abs(q).max(), scale)
    normal = np.abs(np.asarray(x)) >= scale * 2.0 ** -6
    rel = np.abs(q - np.asarray(x))[normal] / np.abs(np.asarray(x))[normal]
    assert rel.max() <= 1 / 3 + 1e-6                      # round to nearest power of two
    np.testing.assert_array_equal(jax.jit(e3m0.quantize)(q), q)    # idempotent
    np.testing.assert_array_equal(e3m0.quantize(jnp.zeros(4)), np.zeros(4))


def test_e3m0_codes_are_four_bits_and_decode():
    x = jnp.array([0.0, 1e-3, -0.02, 0.3, -0.5, 0.74, 0.76, -1.0])
    codes, scale = e3m0.encode(x)
    assert codes.dtype == jnp.uint8 and int(codes.max()) < 16
    np.testing.assert_allclose(e3m0.decode(codes, scale),
                               [0, 0, -2.0 ** -6, 0.25, -0.5, 0.5, 1.0, -1.0])


def test_packed_codes_round_trip_two_per_byte():
    rng = np.random.default_rng(1)
    for shape in [(1,), (7,), (4, 5), (3, 3, 3), ()]:
        codes = rng.integers(0, 16, size=shape).astype(np.uint8)
        packed = e3m0.pack(codes)
        assert packed.dtype == jnp.uint8 and packed.shape == (-(-codes.size // 2),)
        np.testing.assert_array_equal(e3m0.unpack(packed, shape), codes)
        assert e3m0.packed_bytes(shape) == packed.size + 4
    x = jnp.asarray(rng.normal(size=(5, 3)).astype(np.float32))
    np.testing.assert_array_equal(e3m0.decode_packed(*e3m0.encode_packed(x), (5, 3)),
                                  e3m0.quantize(x))
