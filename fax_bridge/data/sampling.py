"""Seeded cohort sampling: which clients take part in each round.

The cohort of round r depends only on `(seed, r)`, so a run can be resumed or replayed
from any round and two runs with the same seed see the same clients.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from fax_bridge.data import checks
from fax_bridge.errors import DataError

MAX_POISSON_CLIENTS = 2 ** 30  # 8 GiB of draws a round; a larger population is refused


def sample_cohort(num_clients: int, cohort_size: int, round_index: int, seed: int = 0,
                  weights: Optional[np.ndarray] = None) -> np.ndarray:
    """`cohort_size` distinct client ids in [0, num_clients), sorted.

    With `weights` (one non-negative value per client, e.g. dataset sizes) clients are
    drawn with probability proportional to their weight, still without replacement.

    Args:
      num_clients: the population's size.
      cohort_size: the clients to draw.
      round_index: the round (an integer >= 0); the cohort depends only on it and `seed`.
      seed: the run's seed.
      weights: optional sampling weights, one per client.

    Returns:
      The sorted client ids.

    Example:
      >>> from fax_bridge.data import sample_cohort
      >>> ids = sample_cohort(100, 10, round_index=3, seed=0)
      >>> len(ids), bool((ids == sample_cohort(100, 10, round_index=3, seed=0)).all())
      (10, True)
    """
    num_clients = checks.integer("num_clients", num_clients, 1, 2 ** 62)
    cohort_size = checks.integer("cohort_size", cohort_size, 1, num_clients,
                                 fix="a cohort is drawn from num_clients clients")
    round_index = checks.integer("round_index", round_index, 0)
    seed = checks.seed(seed)
    p = None
    if weights is not None:
        p = _probabilities(weights, num_clients, cohort_size)
    return draw(round_generator(seed, round_index), num_clients, cohort_size, p)


def round_generator(seed: int, round_index: int) -> np.random.Generator:
    """The random generator of round `round_index` of a run seeded `seed`: the cohort is
    its first draw (`draw`), here and in a fleet's round plan (`rounds.policy`)."""
    return np.random.default_rng([seed, round_index])


def draw(rng: np.random.Generator, num_clients: int, cohort_size: int,
         p: Optional[np.ndarray] = None) -> np.ndarray:
    """`cohort_size` distinct ids of `num_clients`, sorted, drawn from `rng` (the draw of
    `sample_cohort` and of a fleet's round plan; arguments checked by the caller)."""
    return np.sort(rng.choice(num_clients, size=cohort_size, replace=False, p=p))


def _probabilities(weights, num_clients: int, cohort_size: int) -> np.ndarray:
    try:
        w = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError):
        w = np.full(1, np.nan)
    if w.shape != (num_clients,) or not np.isfinite(w).all() or (w < 0).any() or \
            np.count_nonzero(w) < cohort_size:
        raise DataError(
            f"weights must be {num_clients} finite non-negative numbers (one per client) "
            f"with at least cohort_size={cohort_size} non-zero; got {checks.shown(weights)}"
            ". Pass e.g. each client's number of examples.")
    p = w / w.max()  # no overflow in the sum below
    p = p / p.sum()
    if np.count_nonzero(p) < cohort_size:
        raise DataError(
            f"weights: fewer than cohort_size={cohort_size} clients keep a non-zero "
            "probability next to the largest weight (the others underflow); raise the "
            "smallest weights or lower cohort_size.")
    return p


class CohortSampler:
    """Draws the cohort of each round: `sampler(r)` is `sample_cohort(..., r, seed)`.

    Example:
      >>> from fax_bridge.data import CohortSampler
      >>> sampler = CohortSampler(num_clients=100, cohort_size=5, seed=1)
      >>> len(sampler(0)), bool((sampler(0) == sampler(0)).all())
      (5, True)
    """

    def __init__(self, num_clients: int, cohort_size: int, seed: int = 0,
                 weights: Optional[np.ndarray] = None):
        sample_cohort(num_clients, cohort_size, 0, seed, weights)  # validates arguments
        self.num_clients = num_clients
        self.cohort_size = cohort_size
        self.seed = seed
        self.weights = weights

    def __call__(self, round_index: int) -> np.ndarray:
        """The sorted client ids of round `round_index` (an integer >= 0)."""
        return sample_cohort(self.num_clients, self.cohort_size, round_index, self.seed,
                             self.weights)


class PoissonSampler:
    """Poisson cohorts: each client joins round r independently with probability `rate`.

    The cohort size varies from round to round; a program has a fixed number of client
    slots, so `capacity` bounds it and `sampler(r)` raises when a draw exceeds it (choose
    a capacity a few standard deviations above `rate * num_clients`). This is the
    sampling that `PoissonSampledDpEvent` accounts for.

    Example:
      >>> from fax_bridge.data import PoissonSampler
      >>> sampler = PoissonSampler(num_clients=1000, rate=0.01, capacity=40, seed=0)
      >>> bool((sampler(2) == sampler(2)).all()), len(sampler(2)) <= 40
      (True, True)
    """

    def __init__(self, num_clients: int, rate: float, capacity: int, seed: int = 0):
        self.num_clients = checks.integer(
            "num_clients", num_clients, 1, MAX_POISSON_CLIENTS,
            fix="a Poisson draw takes one random number per client each round")
        self.rate = checks.real("rate", rate, 0.0, 1.0, low_open=True,
                                fix="each client's probability of joining a round")
        self.capacity = checks.integer(
            "capacity", capacity, 1, self.num_clients,
            fix="a few standard deviations above rate * num_clients")
        self.seed = checks.seed(seed)

    def __call__(self, round_index: int) -> np.ndarray:
        round_index = checks.integer("round_index", round_index, 0)
        rng = np.random.default_rng([self.seed, round_index, 1])
        ids = np.flatnonzero(rng.random(self.num_clients) < self.rate)
        if ids.size > self.capacity:
            raise DataError(
                f"round {round_index} drew {ids.size} clients, more than the capacity "
                f"{self.capacity} of the program's client slots; build the program with "
                "more clients (slots) and a larger capacity.")
        return ids
