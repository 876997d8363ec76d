"""Per-client L2 clipping and the geometric quantile update of the clip norm.

Clipping follows TensorFlow's `clip_by_global_norm` arithmetic (scale = clip * min(1 /
norm, 1 / clip) over the global L2 norm of every leaf of a client's update), so a clipped
update equals what TFF's DP aggregators compute. The adaptive clip norm follows Andrew
et al. 2021 ("Differentially Private Learning with Adaptive Clipping"), geometric form:
the server estimates the fraction b of clients whose update norm was at most the clip,
and moves the clip by `clip * exp(-learning_rate * (b - target_quantile))`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def global_l2_norm(tree: Any) -> jax.Array:
    """The L2 norm of all leaves of `tree` taken together (float32 scalar)."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.zeros((), jnp.float32)
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))


def clip_by_global_norm(tree: Any, clip: jax.Array) -> tuple[Any, jax.Array]:
    """`(tree scaled to global norm <= clip, the norm before clipping)`.

    A tree whose norm is at most `clip` is scaled by `clip * (1 / clip)`, 1 up to one
    rounding, exactly as TensorFlow's `clip_by_global_norm` does.
    """
    norm = global_l2_norm(tree)
    clip = jnp.asarray(clip, jnp.float32)
    scale = clip * jnp.minimum(1.0 / norm, 1.0 / clip)
    return jax.tree.map(lambda x: (x * scale).astype(x.dtype), tree), norm


def below_indicator(norm: jax.Array, clip: jax.Array) -> jax.Array:
    """+0.5 when the update was not clipped (norm <= clip), -0.5 otherwise.

    Centring the 0/1 indicator on zero halves the sensitivity of its sum to 0.5, which is
    why the clipped count is noised with `clipped_count_stddev` as a sum of sensitivity
    0.5 (the privacy cost of a Gaussian of noise multiplier `2 * clipped_count_stddev`).
    """
    return (norm <= clip).astype(jnp.float32) - 0.5


def geometric_clip_update(clip: jax.Array, below_sum: jax.Array, expected_clients: float,
                          target_quantile: float, learning_rate: float) -> tuple[jax.Array,
                                                                                 jax.Array]:
    """`(new clip, estimated unclipped fraction)` from a (noised) sum of indicators.

    `below_sum` is the sum over clients of `below_indicator` plus its noise; the fraction
    is normalised by the *expected* number of clients and clamped to [0, 1].
    """
    fraction = jnp.clip(below_sum / jnp.float32(expected_clients) + 0.5, 0.0, 1.0)
    update = jnp.float32(learning_rate) * (fraction - jnp.float32(target_quantile))
    new_clip = jnp.maximum(clip * jnp.exp(-update), 0.0)
    return new_clip, fraction
