"""DP-FedAvg (McMahan et al., 2018): FedAvg whose average is a differentially private mean.

Each round the server broadcasts the model; every client trains locally and returns its
model change; the changes are aggregated by a `fax_bridge.privacy` DP aggregator (each
clipped to L2 norm C at its client, summed, Gaussian noise of std C * z added at the
server from a server-placed PRNG key, divided by the expected cohort size), and the
server's optax optimizer applies the result as a negative pseudo-gradient. Every client
counts equally (no example weighting), as the privacy analysis requires.

Cohorts. The accounting (`fax_bridge.privacy`) assumes one of two samplings, which the
caller performs when it picks each round's clients:
- fixed size: `clients` clients drawn uniformly without replacement from the population
  (`fax_bridge.data.CohortSampler`); then `clients_per_round = clients`;
- Poisson: each client joins with probability q (`fax_bridge.data.PoissonSampler`); the
  program has `clients` slots (a capacity above q * population), unused slots are
  clients without data (mask all False), which contribute nothing, and
  `clients_per_round = q * population`, the expected cohort size, divides the sum.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from fax_bridge import api as fx
from fax_bridge import privacy
from fax_bridge.algorithms import common as C
from fax_bridge.algorithms.fedavg import client_update_fn
from fax_bridge.errors import ArgumentError


class DPServerState(NamedTuple):
    """Global model, server optimizer state, finished rounds and the DP aggregator's state."""

    params: Any
    opt_state: Any
    round: jax.Array
    dp: privacy.DPState


def dp_fed_avg(loss: C.Loss, client_optimizer: optax.GradientTransformation, *,
               clients: int, noise_multiplier: float, clip: Optional[float] = None,
               clients_per_round: Optional[float] = None,
               server_optimizer: Optional[optax.GradientTransformation] = None,
               local_epochs: int = 1,
               clipped_count_stddev: Optional[float] = None,
               aggregator: Optional[privacy.DPAggregator] = None,
               clients_per_step: C.ClientsPerStep = None,
               progress: bool = False) -> C.FederatedAlgorithm:
    """DP-FedAvg with `clients` client slots per round.

    `noise_multiplier` z is the total noise multiplier to account for. `clip` fixes the
    L2 clip norm (`privacy.gaussian_fixed`); without it the norm adapts to the median
    update norm (`privacy.gaussian_adaptive`, initial clip 0.1, learning rate 0.2).
    `clients_per_round` (default `clients`) is the expected cohort size. `aggregator`
    replaces both with any `privacy.DPAggregator`.

    `clipped_count_stddev` (adaptive clip only): the standard deviation of the noise on
    the clipped count, the sum of the clients' +-0.5 "my update norm was at most the
    clip" indicators that moves the clip. Part of z goes to it: the updates get the
    multiplier `(z**-2 - (2 * clipped_count_stddev)**-2) ** -0.5`, so it must exceed
    z / 2; larger values leave more of the budget to the updates and make the clip
    adapt more noisily. Default `max(0.05 * clients_per_round, 2 * z)`: TFF's
    `gaussian_adaptive` default, raised where it would be refused (the count then spends
    at most 1/16 of the budget).

    `init(params, seed=0)`; `next(state, batches, mask)` as in `fed_avg`; a client whose
    mask is all False is an empty slot. Metrics: `loss` (mean local training loss of the
    participants, not privatised), `participants`, `clip` (the norm this round used) and,
    adaptive, `unclipped_fraction`.
    """
    loss = C.check_loss(loss)
    n = C.check_clients(clients)
    client_optimizer = C.check_optimizer(client_optimizer, "client_optimizer")
    server_optimizer = C.check_optimizer(
        optax.sgd(1.0) if server_optimizer is None else server_optimizer, "server_optimizer")
    local_epochs = C.check_count(local_epochs, "local_epochs")
    if aggregator is None:
        expected = float(n) if clients_per_round is None else C.check_real(
            clients_per_round, "clients_per_round", 0.0, low_open=True)
        if clip is not None and clipped_count_stddev is not None:
            raise ArgumentError(
                "clipped_count_stddev sets the noise of the adaptive clip's count, but "
                f"clip={clip} fixes the clip norm; drop one of them.")
        aggregator = (privacy.gaussian_adaptive(
            noise_multiplier, expected, clipped_count_stddev=clipped_count_stddev)
                      if clip is None
                      else privacy.gaussian_fixed(noise_multiplier, expected, clip))
    elif clipped_count_stddev is not None:
        raise ArgumentError("clipped_count_stddev applies to the aggregator dp_fed_avg "
                            "builds; pass it to the aggregator you give instead "
                            "(privacy.gaussian_adaptive(..., clipped_count_stddev=...)).")
    elif not isinstance(aggregator, privacy.DPAggregator):
        raise ArgumentError(f"aggregator must be a fax_bridge.privacy.DPAggregator (e.g. "
                            f"privacy.gaussian_fixed(...)), got {type(aggregator).__name__}.")
    train = client_update_fn(loss, client_optimizer, local_epochs)
    server_update = C.server_step(server_optimizer)

    def client_update(params, batches, mask):
        delta, count, value = train(params, batches, mask)
        present = jnp.any(mask).astype(jnp.float32)
        return delta, present, value * count, count

    def apply(params, opt_state, round_, mean_delta, dp_state, loss_sum, count):
        s = server_update(params, opt_state, round_, mean_delta)
        return (DPServerState(s.params, s.opt_state, s.round, dp_state),
                loss_sum / jnp.maximum(count, 1.0))

    @fx.program(clients=n, clients_per_step=clients_per_step, progress=progress)
    def next_fn(state: DPServerState, batches, mask):
        params_c = fx.federated_broadcast(state.params)
        delta, present, loss_sums, counts = fx.federated_map_clients(
            client_update, (params_c, batches, mask))
        mean_delta, dp_state, dp_metrics = aggregator.aggregate(state.dp, delta, present)
        new_state, mean_loss = fx.federated_map_server(
            apply, (state.params, state.opt_state, state.round, mean_delta, dp_state,
                    fx.federated_sum(loss_sums), fx.federated_sum(counts)))
        metrics = {"loss": mean_loss, "participants": fx.federated_sum(present), **dp_metrics}
        return new_state, metrics

    base_init = C.init_server_state(server_optimizer)

    def init(params, seed: Any = 0) -> DPServerState:
        s = base_init(params)
        return DPServerState(s.params, s.opt_state, s.round, aggregator.init(seed))

    return C.FederatedAlgorithm(init, next_fn, ("server", "clients", "clients"))
