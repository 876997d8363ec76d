"""DP aggregation: clipping, the noise it adds (checked statistically), empty slots, errors."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

import fax_bridge as fb
from fax_bridge import privacy
from fax_bridge.errors import PrivacyError
from fax_bridge.privacy import aggregator as A


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-50, 50, width=32, allow_subnormal=False), min_size=1, max_size=6),
       st.floats(1e-3, 20.0))
@example(xs=[1.1754943508222875e-38], clip=0.14003004869921507)  # flushed to 0 by XLA
def test_clipping_bounds_the_norm_and_keeps_the_direction(xs, clip):
    tree = {"u": jnp.asarray(xs[: len(xs) // 2], jnp.float32),
            "v": jnp.asarray(xs[len(xs) // 2:], jnp.float32)}
    clipped, norm = privacy.clip_by_global_norm(tree, clip)
    flat = np.concatenate([np.asarray(tree["u"]), np.asarray(tree["v"])]).astype(np.float64)
    got = np.concatenate([np.asarray(clipped["u"]), np.asarray(clipped["v"])])
    np.testing.assert_allclose(norm, np.linalg.norm(flat), rtol=1e-5, atol=1e-6)
    if np.linalg.norm(flat) <= clip:
        want = flat.astype(np.float32)
        # Scaled by clip * (1 / clip): 1 up to two roundings, so a value within them of
        # float32's smallest normal may come out subnormal, which XLA on CPU flushes to 0.
        edge = np.abs(want) < np.finfo(np.float32).tiny / (1 - 2.0**-23)
        np.testing.assert_allclose(got[~edge], want[~edge], rtol=2e-7)
        assert np.all((got[edge] == 0) | (np.abs(got[edge] - want[edge])
                                          <= 2e-7 * np.abs(want[edge])))
    else:
        np.testing.assert_allclose(np.linalg.norm(got), clip, rtol=1e-5)
        np.testing.assert_allclose(got * np.linalg.norm(flat) / clip, flat, rtol=1e-4,
                                   atol=1e-4)


def _round(agg, clients):
    @fb.program(clients=clients)
    def one_round(state, value, present):
        return agg.aggregate(state, value, present)

    return jax.jit(one_round)


def test_fixed_noise_std_is_clip_times_multiplier_over_expected_clients():
    z, clip, n = 1.3, 0.5, 4.0
    agg = privacy.gaussian_fixed(z, n, clip)
    zeros = {"a": jnp.zeros((3, 3000)), "b": jnp.zeros((3, 50, 20))}
    step = _round(agg, 3)
    mean, state, metrics = step(agg.init(5), zeros, jnp.ones(3))
    noise = np.concatenate([np.ravel(mean["a"]), np.ravel(mean["b"])])
    want = clip * z / n
    assert abs(noise.mean()) < 4 * want / np.sqrt(noise.size)
    assert abs(noise.std() / want - 1) < 0.05          # std error ~1%
    assert float(metrics["clip"]) == clip and float(state.clip) == clip
    again, state2, _ = step(state, zeros, jnp.ones(3))  # the key moved on: fresh noise
    assert not np.allclose(again["a"], mean["a"])
    same, _, _ = step(agg.init(5), zeros, jnp.ones(3))  # same key: same noise
    np.testing.assert_array_equal(same["a"], mean["a"])


def test_adaptive_noise_on_values_and_on_the_clipped_count():
    z, n = 0.5, 100.0
    agg = privacy.gaussian_adaptive(z, n)
    z_value, sigma_b = agg.value_noise_multiplier, agg.clipped_count_stddev
    assert sigma_b == pytest.approx(0.05 * n)
    assert z_value ** -2 + (2 * sigma_b) ** -2 == pytest.approx(z ** -2)
    update = functools.partial(
        A.server_update, value_noise_multiplier=z_value, clipped_count_stddev=sigma_b,
        clients_per_round=n, adaptive=True)
    keys = jax.vmap(lambda k: jax.random.key_data(jax.random.key(k)))(jnp.arange(4000))
    states = privacy.DPState(jnp.full((4000,), 0.1, jnp.float32), keys)
    mean, new, metrics = jax.vmap(update)(states, {"w": jnp.zeros((4000, 8))},
                                          jnp.zeros((4000,)))
    np.testing.assert_allclose(np.std(mean["w"]), 0.1 * z_value / n, rtol=0.05)
    # the count: fraction = (sum of +-0.5 + N(0, sigma_b)) / n + 0.5
    np.testing.assert_allclose(np.std(metrics["unclipped_fraction"]), sigma_b / n, rtol=0.05)
    np.testing.assert_allclose(np.mean(metrics["unclipped_fraction"]), 0.5, atol=0.005)
    np.testing.assert_allclose(
        new.clip, 0.1 * np.exp(-0.2 * (np.asarray(metrics["unclipped_fraction"]) - 0.5)),
        rtol=1e-5)


def test_empty_slots_contribute_nothing():
    agg = privacy.gaussian_adaptive(0.0, 2.0, initial_l2_norm_clip=1.0)
    x = jnp.asarray([[3.0, 4.0], [0.3, 0.4], [100.0, 1.0]])
    mean, state, metrics = _round(agg, 3)(agg.init(0), {"x": x}, jnp.asarray([1.0, 1.0, 0.0]))
    np.testing.assert_allclose(mean["x"], ([0.6, 0.8] + np.array([0.3, 0.4])) / 2, rtol=1e-6)
    np.testing.assert_allclose(metrics["unclipped_fraction"], 0.5)   # 1 of 2 real clients


def test_bad_settings_are_privacy_errors():
    with pytest.raises(PrivacyError, match="clipped_count_stddev=0.25 is too small"):
        privacy.gaussian_adaptive(1.0, 5.0, clipped_count_stddev=0.25)  # 2 * 0.25 < 1
    with pytest.raises(PrivacyError, match="noise_multiplier"):
        privacy.gaussian_fixed(-1.0, 5.0, 1.0)
    with pytest.raises(PrivacyError, match="clip"):
        privacy.gaussian_fixed(1.0, 5.0, 0.0)
    with pytest.raises(PrivacyError, match="target_unclipped_quantile"):
        privacy.gaussian_adaptive(0.0, 5.0, target_unclipped_quantile=1.5)
    assert privacy.adaptive_clip_noise_params(0.0, 10.0) == (0.0, 0.0)


@settings(max_examples=50, deadline=None)
@given(z=st.floats(1e-3, 20.0), n=st.floats(1.0, 5000.0))
def test_the_default_clipped_count_noise_fits_every_noise_multiplier(z, n):
    agg = privacy.gaussian_adaptive(z, n)        # TFF's 0.05 * n alone is refused below 40 z
    sigma_b = agg.clipped_count_stddev
    assert sigma_b == pytest.approx(max(0.05 * n, 2 * z))
    assert z < 2 * sigma_b
    assert agg.value_noise_multiplier ** -2 + (2 * sigma_b) ** -2 == pytest.approx(z ** -2)
    assert z < agg.value_noise_multiplier <= z / np.sqrt(15 / 16) * (1 + 1e-9)
    small = z / 2 * 0.99
    with pytest.raises(PrivacyError, match="is too small for noise_multiplier"):
        privacy.gaussian_adaptive(z, n, clipped_count_stddev=small)


@functools.lru_cache(maxsize=None)
def _masked_mean():
    """(aggregator, a program of its mean, that program under jit), made once."""
    agg = privacy.gaussian_fixed(0.0, 3.0, clip=1.0)

    @fb.program(clients=3)
    def one_round(state, value, present):
        return agg.aggregate(state, value, present)[0]

    return agg, one_round, jax.jit(one_round)


@settings(max_examples=40, deadline=None)
@given(present=st.lists(st.sampled_from([0.0, 1.0, 2.0, 0.5, -1.0, 16.0, float("nan")]),
                        min_size=3, max_size=3))
def test_present_is_a_mask_never_a_weight(present):
    """Weights passed as `present` (e.g. example counts) cannot scale a client past the
    clip: concrete, anything but 0/1 is a PrivacyError naming it; under jit every
    nonzero entry counts as 1, so the clipped sum stays within clip per client."""
    agg, one_round, jitted = _masked_mean()
    x = {"x": jnp.asarray([[3.0, 4.0], [0.3, 0.4], [6.0, 8.0]])}
    mask = jnp.asarray(present, jnp.float32)
    as_mask = jnp.asarray([p != 0 for p in present], jnp.float32)   # nan != 0
    want = jitted(agg.init(0), x, as_mask)
    np.testing.assert_array_equal(jitted(agg.init(0), x, mask)["x"], want["x"])
    assert np.linalg.norm(np.asarray(want["x"]) * 3.0) <= 3.0 * (1 + 1e-6)
    if all(p in (0.0, 1.0) for p in present):
        np.testing.assert_array_equal(one_round(agg.init(0), x, mask)["x"], want["x"])
    else:
        with pytest.raises(PrivacyError, match="present must be 0 or 1 per client"):
            one_round(agg.init(0), x, mask)


def test_present_of_another_shape_is_refused_when_traced():
    agg = privacy.gaussian_fixed(0.0, 2.0, clip=1.0)

    @fb.program(clients=2)
    def one_round(state, value, present):
        return agg.aggregate(state, value, present)[0]

    with pytest.raises(PrivacyError, match=r"one CLIENTS vector.*\(2, 3\)"):
        jax.jit(one_round)(agg.init(0), jnp.ones((2, 3)), jnp.ones((2, 3)))
