"""Seeded cohort sampling: which clients take part in each round.

The cohort of round r depends only on `(seed, r)`, so a run can be resumed or replayed
from any round and two runs with the same seed see the same clients.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from fax_bridge.errors import DataError


def sample_cohort(num_clients: int, cohort_size: int, round_index: int, seed: int = 0,
                  weights: Optional[np.ndarray] = None) -> np.ndarray:
    """`cohort_size` distinct client ids in [0, num_clients), sorted.

    With `weights` (one non-negative value per client, e.g. dataset sizes) clients are
    drawn with probability proportional to their weight, still without replacement.
    """
    if not 1 <= cohort_size <= num_clients:
        raise DataError(
            f"cohort_size must be between 1 and num_clients={num_clients}; got {cohort_size}.")
    if round_index < 0:
        raise DataError(f"round_index must be >= 0, got {round_index}.")
    p = None
    if weights is not None:
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != (num_clients,) or (w < 0).any() or np.count_nonzero(w) < cohort_size:
            raise DataError(
                f"weights must be {num_clients} non-negative numbers with at least "
                f"{cohort_size} non-zero; got shape {w.shape}.")
        p = w / w.sum()
    rng = np.random.default_rng([seed, round_index])
    return np.sort(rng.choice(num_clients, size=cohort_size, replace=False, p=p))


class CohortSampler:
    """Draws the cohort of each round: `sampler(r)` is `sample_cohort(..., r, seed)`."""

    def __init__(self, num_clients: int, cohort_size: int, seed: int = 0,
                 weights: Optional[np.ndarray] = None):
        sample_cohort(num_clients, cohort_size, 0, seed, weights)  # validates arguments
        self.num_clients = num_clients
        self.cohort_size = cohort_size
        self.seed = seed
        self.weights = weights

    def __call__(self, round_index: int) -> np.ndarray:
        return sample_cohort(self.num_clients, self.cohort_size, round_index, self.seed,
                             self.weights)


class PoissonSampler:
    """Poisson cohorts: each client joins round r independently with probability `rate`.

    The cohort size varies from round to round; a program has a fixed number of client
    slots, so `capacity` bounds it and `sampler(r)` raises when a draw exceeds it (choose
    a capacity a few standard deviations above `rate * num_clients`). This is the
    sampling that `PoissonSampledDpEvent` accounts for.
    """

    def __init__(self, num_clients: int, rate: float, capacity: int, seed: int = 0):
        if not 0.0 < rate <= 1.0:
            raise DataError(f"rate must lie in (0, 1], got {rate}.")
        if not 1 <= capacity <= num_clients:
            raise DataError(
                f"capacity must be between 1 and num_clients={num_clients}; got {capacity}.")
        self.num_clients = num_clients
        self.rate = float(rate)
        self.capacity = capacity
        self.seed = seed

    def __call__(self, round_index: int) -> np.ndarray:
        if round_index < 0:
            raise DataError(f"round_index must be >= 0, got {round_index}.")
        rng = np.random.default_rng([self.seed, round_index, 1])
        ids = np.flatnonzero(rng.random(self.num_clients) < self.rate)
        if ids.size > self.capacity:
            raise DataError(
                f"round {round_index} drew {ids.size} clients, more than the capacity "
                f"{self.capacity} of the program's client slots; build the program with "
                "more clients (slots) and a larger capacity.")
        return ids
