"""Differentially private mean of client updates: clip at clients, Gaussian noise at the server.

Written with the federated primitives, so a program that aggregates through it traces,
exports to TFF and runs on a fleet like any other. One round of `aggregate`:

1. the server broadcasts the current clip norm C;
2. every client clips its update to global L2 norm C (and, for adaptive clipping, reports
   +-0.5: whether its norm was at most C);
3. `federated_sum` adds the clipped updates (and the indicators);
4. at the server, from the server-placed PRNG key in the state: the sum gets Gaussian
   noise of standard deviation `C * value_noise_multiplier` on every coordinate, and is
   divided by `clients_per_round` (the expected cohort size, a constant, so the division
   costs no privacy); the indicator sum gets noise of standard deviation
   `clipped_count_stddev` and moves C geometrically toward the target quantile.

These are the conventions of TFF's `DifferentiallyPrivateFactory` (`gaussian_fixed`,
`gaussian_adaptive`): noise on the sum, before normalisation; the adaptive clip's
defaults from Andrew et al. 2021 (initial clip 0.1, target quantile 0.5, learning rate
0.2, clipped-count stddev 0.05 x clients per round when noise is added, raised to twice
the noise multiplier where that is smaller, so the defaults always fit together: TFF
refuses those cohorts); and the split of
a total noise multiplier z between the values and the clipped count,
`z_value = (z**-2 - (2 * clipped_count_stddev)**-2) ** -0.5`, so that the round as a
whole is one Gaussian mechanism of noise multiplier z for accounting.

Empty slots: `present` (one 0/1 per client) zeroes the contribution of padding slots, so
a cohort of varying size (Poisson sampling) fits a program of fixed cardinality.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from fax_bridge import api as fx
from fax_bridge.errors import PrivacyError
from fax_bridge.privacy import clipping


class DPState(NamedTuple):
    """SERVER state of a DP aggregator: the clip norm of the next round and the noise key.

    `key` is raw threefry key data (uint32[2], `jax.random.key_data`), so the state is a
    pytree of plain arrays that exports as TFF tensors.
    """

    clip: jax.Array
    key: jax.Array


class DPAggregator(NamedTuple):
    """A DP mean: `init(seed) -> DPState`; `aggregate(state, value, present=None)`.

    `aggregate` must be called inside a `fax_bridge.program`; `value` is a CLIENTS pytree,
    `present` an optional CLIENTS vector of 0/1 (1 = a real client). It returns
    `(mean, new_state, metrics)`, all at SERVER; `metrics['clip']` is the clip norm this
    round used, and for adaptive clipping `metrics['unclipped_fraction']` is the noised
    estimate that moved it. `noise_multiplier` is the total noise multiplier to account
    for; `value_noise_multiplier` the one applied to the values.
    """

    init: Callable[..., DPState]
    aggregate: Callable
    noise_multiplier: float
    value_noise_multiplier: float
    clipped_count_stddev: float
    clients_per_round: float
    adaptive: bool


def _check_nonneg(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
            value) or value < 0:
        raise PrivacyError(f"{name} must be a finite number >= 0, got {value!r}.")
    return float(value)


def _check_positive(value, name: str) -> float:
    v = _check_nonneg(value, name)
    if v <= 0:
        raise PrivacyError(f"{name} must be > 0, got {value!r}.")
    return v


def default_clipped_count_stddev(noise_multiplier: float, clients_per_round: float) -> float:
    """The clipped count's noise standard deviation when none is given.

    TFF's `gaussian_adaptive` default, `0.05 * clients_per_round`, raised to
    `2 * noise_multiplier` where it is smaller (TFF refuses those settings: the count
    would need more than the whole budget), so the clipped count spends at most 1/16 of
    the budget and the values' multiplier is at most `z / sqrt(15/16)`, about 1.033 z.
    0 without noise.
    """
    if noise_multiplier == 0:
        return 0.0
    return max(0.05 * clients_per_round, 2.0 * noise_multiplier)


def adaptive_clip_noise_params(noise_multiplier: float, clients_per_round: float,
                               clipped_count_stddev: Optional[float] = None
                               ) -> tuple[float, float]:
    """`(value_noise_multiplier, clipped_count_stddev)` for a total noise multiplier.

    The clipped count is a Gaussian sum of sensitivity 0.5, i.e. noise multiplier
    `2 * clipped_count_stddev`; the values get the larger multiplier that leaves the
    composition of both at `noise_multiplier`, which needs
    `noise_multiplier < 2 * clipped_count_stddev`. The default stddev
    (`default_clipped_count_stddev`) always meets it. With no noise, both are 0.
    """
    z = _check_nonneg(noise_multiplier, "noise_multiplier")
    n = _check_positive(clients_per_round, "clients_per_round")
    if z == 0.0:
        return 0.0, 0.0 if clipped_count_stddev is None else _check_nonneg(
            clipped_count_stddev, "clipped_count_stddev")
    sigma_b = default_clipped_count_stddev(z, n) if clipped_count_stddev is None else \
        _check_nonneg(clipped_count_stddev, "clipped_count_stddev")
    if z >= 2 * sigma_b:
        raise PrivacyError(
            f"clipped_count_stddev={sigma_b:g} is too small for noise_multiplier={z:g}: the "
            f"clipped count alone would spend more than the whole budget (it needs "
            f"noise_multiplier < 2 * clipped_count_stddev). Raise clipped_count_stddev "
            f"(above {z / 2:g}; leaving it unset gives max(0.05 * clients_per_round, "
            f"2 * noise_multiplier) = {default_clipped_count_stddev(z, n):g}), or lower "
            f"the noise multiplier.")
    return (z ** -2 - (2 * sigma_b) ** -2) ** -0.5, sigma_b


def _init_fn(initial_clip: float) -> Callable[..., DPState]:
    def init(seed: Any = 0) -> DPState:
        """The SERVER state before round 1: the initial clip norm and the noise key.

        Args:
          seed: an int, a jax PRNG key (`jax.random.key(0)`) or raw key data (uint32[2],
            `jax.random.PRNGKey(0)`): where the server's noise starts.

        Returns:
          A `DPState(clip, key)`: float32 `clip`, and `key` as raw uint32[2] key data, so
          the state exports as TFF tensors. Pass it to the first `aggregate`.

        Example:
          >>> from fax_bridge import privacy
          >>> dp = privacy.gaussian_fixed(noise_multiplier=1.0, clients_per_round=8, clip=0.5)
          >>> state = dp.init(0)
          >>> float(state.clip), state.key.dtype, state.key.shape
          (0.5, dtype('uint32'), (2,))
        """
        if isinstance(seed, (int,)) and not isinstance(seed, bool):
            key = jax.random.key(seed)
        else:
            key = seed
            if not jnp.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key):
                key = jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32))
        return DPState(jnp.float32(initial_clip), jax.random.key_data(key))

    return init


def _client_clip(adaptive: bool):
    def clip_one(clip, value, present):
        clipped, norm = clipping.clip_by_global_norm(value, clip)
        present = (present != 0).astype(jnp.float32)  # a mask: never scales the clip
        clipped = jax.tree.map(lambda x: x * present.astype(x.dtype), clipped)
        if adaptive:
            return clipped, clipping.below_indicator(norm, clip) * present
        return clipped

    return clip_one


def _check_mask(present) -> None:
    """PrivacyError unless `present` is a mask: one scalar per client, each 0 or 1 where
    the values are concrete (traced values pass, and count nonzero as 1)."""
    if present is None:
        return
    leaves = jax.tree.leaves(present)
    if len(leaves) != 1 or jnp.ndim(leaves[0]) != 1:
        shapes = [tuple(jnp.shape(x)) for x in leaves]
        raise PrivacyError(
            f"DP aggregate: present must be one CLIENTS vector, one 0 or 1 per client, got "
            f"{len(leaves)} array(s) of shape(s) {shapes}.")
    mask = leaves[0]
    if isinstance(mask, jax.core.Tracer):
        return
    values = np.asarray(mask)  # read on the host: a jnp op would be staged into a trace
    odd = values[(values != 0) & (values != 1)]
    if odd.size:
        raise PrivacyError(
            f"DP aggregate: present must be 0 or 1 per client (1: a real client, 0: an "
            f"empty slot), got {odd[:4].tolist()}{' ...' if odd.size > 4 else ''}. The DP "
            "mean is unweighted, every client counts once (as TFF's), so weights such as "
            "example counts cannot be honoured within the clip the noise is calibrated to: "
            "pass a 0/1 mask (jnp.asarray(counts > 0, jnp.float32)) or present=None.")


def _noise_like(key, tree, stddev):
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(key, max(len(leaves), 1))
    noised = [x + (stddev * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype)
              for k, x in zip(keys, leaves)]
    return jax.tree.unflatten(treedef, noised)


def server_update(state: DPState, total, below_sum, *, value_noise_multiplier: float,
                  clipped_count_stddev: float, clients_per_round: float,
                  adaptive: bool, target_quantile: float = 0.5, learning_rate: float = 0.2):
    """The server half of a round (a pure function): noise, normalise, move the clip."""
    key = jax.random.wrap_key_data(state.key)
    key, k_value, k_count = jax.random.split(key, 3)
    clip = state.clip
    noised = _noise_like(k_value, total, clip * jnp.float32(value_noise_multiplier))
    mean = jax.tree.map(lambda x: x / jnp.asarray(clients_per_round, x.dtype), noised)
    metrics = {"clip": clip}
    new_clip = clip
    if adaptive:
        noisy_below = below_sum + jnp.float32(clipped_count_stddev) * jax.random.normal(
            k_count, (), jnp.float32)
        new_clip, fraction = clipping.geometric_clip_update(
            clip, noisy_below, clients_per_round, target_quantile, learning_rate)
        metrics["unclipped_fraction"] = fraction
    return mean, DPState(new_clip, jax.random.key_data(key)), metrics


def _make(noise_multiplier: float, value_noise_multiplier: float, clipped_count_stddev: float,
          clients_per_round: float, initial_clip: float, adaptive: bool,
          target_quantile: float = 0.5, learning_rate: float = 0.2) -> DPAggregator:
    clip_one = _client_clip(adaptive)

    def aggregate(state: DPState, value, present=None):
        """The DP mean of the clients' `value`: clip each, sum, noise and normalise.

        Call it inside a `fax_bridge.program`. Each client's update is clipped to global
        L2 norm `state.clip`; the server adds Gaussian noise to the sum and divides by
        `clients_per_round`. The mean is unweighted: every client counts once, whatever
        its number of examples (TFF's `DifferentiallyPrivateFactory` does the same: a
        weight would scale a client's contribution past the clip the noise is
        calibrated to). A FedAvg round that weights by examples
        (`federated_weighted_mean`) therefore becomes an unweighted one with DP.

        Args:
          state: the SERVER `DPState`, from `init` or the previous round.
          value: a CLIENTS pytree of floating-point updates.
          present: optional CLIENTS vector, one 0 or 1 per client (1: a real client,
            0: an empty slot, which adds nothing): a mask, not a weight. A value other
            than 0 or 1 (an example count, say) is refused where it is concrete (an
            eager call) with a `PrivacyError`; under `jit` and on the exported paths
            any nonzero value counts as 1.

        Returns:
          `(mean, new_state, metrics)`, all at SERVER: the noised mean with `value`'s
          structure; the next round's `DPState`; `metrics['clip']`, the clip norm this
          round used, and, adaptive, `metrics['unclipped_fraction']`, the noised
          fraction of clients whose norm was within it.

        Example:
          >>> import jax.numpy as jnp, fax_bridge as fb
          >>> from fax_bridge import privacy
          >>> dp = privacy.gaussian_fixed(noise_multiplier=0.0, clients_per_round=2, clip=5.0)
          >>> @fb.program(clients=2)
          ... def dp_mean(state, updates, present):
          ...     mean, new_state, metrics = dp.aggregate(state, updates, present)
          ...     return mean
          >>> updates = jnp.array([[6.0, 8.0], [1.0, 2.0]])  # norm 10, clipped to 5: [3, 4]
          >>> print(dp_mean(dp.init(0), updates, jnp.array([1.0, 1.0])))  # ([3, 4] + [1, 2]) / 2
          [2. 3.]
          >>> dp_mean(dp.init(0), updates, jnp.array([16.0, 3.0]))  # doctest: +ELLIPSIS
          Traceback (most recent call last):
          ...
          fax_bridge.errors.PrivacyError: DP aggregate: present must be 0 or 1 per client ...
        """
        _check_mask(present)
        if present is None:
            present = fx.federated_map_clients(
                lambda leaf: jnp.ones((), jnp.float32), jax.tree.leaves(value)[0])
        clip_at_clients = fx.federated_broadcast(state.clip)
        out = fx.federated_map_clients(clip_one, (clip_at_clients, value, present))
        clipped, below = out if adaptive else (out, None)
        total = fx.federated_sum(clipped)

        def server(s, t, b=None):
            return server_update(s, t, b, value_noise_multiplier=value_noise_multiplier,
                                 clipped_count_stddev=clipped_count_stddev,
                                 clients_per_round=clients_per_round, adaptive=adaptive,
                                 target_quantile=target_quantile,
                                 learning_rate=learning_rate)

        if adaptive:
            return fx.federated_map_server(server, (state, total, fx.federated_sum(below)))
        return fx.federated_map_server(server, (state, total))

    return DPAggregator(_init_fn(initial_clip), aggregate, noise_multiplier,
                        value_noise_multiplier, clipped_count_stddev, clients_per_round,
                        adaptive)


def gaussian_fixed(noise_multiplier: float, clients_per_round: float,
                   clip: float) -> DPAggregator:
    """Fixed L2 clip norm `clip`; noise standard deviation `clip * noise_multiplier` on the sum."""
    z = _check_nonneg(noise_multiplier, "noise_multiplier")
    n = _check_positive(clients_per_round, "clients_per_round")
    c = _check_positive(clip, "clip")
    return _make(z, z, 0.0, n, c, adaptive=False)


def gaussian_adaptive(noise_multiplier: float, clients_per_round: float,
                      initial_l2_norm_clip: float = 0.1,
                      target_unclipped_quantile: float = 0.5, learning_rate: float = 0.2,
                      clipped_count_stddev: Optional[float] = None) -> DPAggregator:
    """Adaptive clip norm (geometric quantile tracking, Andrew et al. 2021) and Gaussian noise.

    `noise_multiplier` is the total noise multiplier of the round; the values get the
    slightly larger `value_noise_multiplier` (see `adaptive_clip_noise_params`).
    `clipped_count_stddev`: the standard deviation of the noise on the clipped count
    (the sum of the clients' +-0.5 indicators); it must exceed `noise_multiplier / 2`.
    Default `max(0.05 * clients_per_round, 2 * noise_multiplier)`
    (`default_clipped_count_stddev`).
    """
    z = _check_nonneg(noise_multiplier, "noise_multiplier")
    n = _check_positive(clients_per_round, "clients_per_round")
    c = _check_positive(initial_l2_norm_clip, "initial_l2_norm_clip")
    q = _check_nonneg(target_unclipped_quantile, "target_unclipped_quantile")
    if q > 1:
        raise PrivacyError(f"target_unclipped_quantile must lie in [0, 1], got {q}.")
    lr = _check_nonneg(learning_rate, "learning_rate")
    z_value, sigma_b = adaptive_clip_noise_params(z, n, clipped_count_stddev)
    return _make(z, z_value, sigma_b, n, c, adaptive=True, target_quantile=q,
                 learning_rate=lr)


# doctest sees module-level docstrings only: these are the examples `help(dp.init)` and
# `help(dp.aggregate)` show (made here without running anything).
__test__ = {"DPAggregator.init": _init_fn(0.1),
            "DPAggregator.aggregate": _make(0.0, 0.0, 0.0, 1.0, 1.0, adaptive=False).aggregate}
