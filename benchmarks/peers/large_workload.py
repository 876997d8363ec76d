"""The large workload: a cohort of 1,000 clients per round from a population of 10,000.

Same model, initial weights, local training (``LOCAL_STEPS`` SGD steps of ``BATCH``
rows, lr ``LR``) and held-out test set as ``workload.py``; only the clients differ.
Like ``workload.py`` it needs only numpy and scikit-learn, so every peer venv imports it.

* Data: client ``c`` of the ``POPULATION`` holds ``LOCAL_STEPS * BATCH`` (80) examples
  of the shared training set (the 1438 non-test digits of ``workload.load_split``):
  row ``c`` of one ``np.random.default_rng(DATA_SEED)`` draw, client after client, each
  a sample without replacement. Its local stream is those 80 rows in drawn order, so
  local step ``s`` takes rows ``s*BATCH .. s*BATCH+BATCH-1``. Every client holds the
  same number of examples, so FedAvg's example-count weights are all equal (80): the
  server model is the mean of the cohort's models.
* Rounds: round ``r`` (0-based) samples its cohort with
  ``np.random.default_rng(seed + r).choice(POPULATION, COHORT, replace=False)``, as
  ``workload.cohort`` does for the shared workload.
* Reported loss of a round: the mean over the cohort of each client's mean training
  loss over its local steps.

The ids of every client's rows (int32 [POPULATION, 80], 3 MiB) are all a process keeps;
batches are gathered from the training set when asked for.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

import workload

POPULATION = 10_000
COHORT = 1_000
ROUNDS = 3  # the first is the warm-up (compilation, first use), not in the median
DATA_SEED = 1
EXAMPLES = workload.LOCAL_STEPS * workload.BATCH


class Population:
    """The large workload's clients: their example rows and batches."""

    def __init__(self, population: int = POPULATION, seed: int = DATA_SEED,
                 split: Optional[workload.Split] = None) -> None:
        self.split = split if split is not None else workload.load_split()
        self.size = int(population)
        rng = np.random.default_rng(seed)
        n_train = len(self.split.y_train)
        self.rows = np.stack([rng.choice(n_train, EXAMPLES, replace=False)
                              for _ in range(self.size)]).astype(np.int32)

    def batches(self, ids: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """Clients ``ids``' batches: x float32 [n, LOCAL_STEPS, BATCH, 64], y int32
        [n, LOCAL_STEPS, BATCH]."""
        rows = self.rows[np.asarray(ids, dtype=np.int64)]
        n = len(rows)
        steps, batch = workload.LOCAL_STEPS, workload.BATCH
        x = self.split.x_train[rows].reshape(n, steps, batch, workload.N_FEATURES)
        y = self.split.y_train[rows].reshape(n, steps, batch)
        return x.astype(np.float32), y.astype(np.int32)

    def clients(self) -> Iterator[Dict[str, np.ndarray]]:
        """Every client's dataset in population order, for ``write_population``: one
        example of each round argument, ``xb`` [LOCAL_STEPS, BATCH, 64], ``yb``
        [LOCAL_STEPS, BATCH] and ``counts`` (its example count, ``EXAMPLES``)."""
        count = np.asarray([EXAMPLES], dtype=np.float32)
        for c in range(self.size):
            x, y = self.batches(np.asarray([c]))
            yield {"xb": x, "yb": y, "counts": count}


def cohort(seed: int, round_index: int, population: int = POPULATION,
           size: int = COHORT) -> np.ndarray:
    """The clients (int64 ids) sampled for 0-based round ``round_index``."""
    return workload.cohort(seed, round_index, num_clients=population, size=size)


def fedavg(rounds: int, seed: int = 0, pop: Optional[Population] = None,
           cohort_size: int = COHORT) -> Tuple[List[float], List[workload.Params]]:
    """The large workload in numpy: (loss per round, server model after each round)."""
    import numpy_mlp

    pop = pop if pop is not None else Population()
    params = workload.load_init_params()
    losses, history = [], []
    for r in range(rounds):
        x, y = pop.batches(cohort(seed, r, pop.size, cohort_size))
        results = [numpy_mlp.local_train(params, x[i], y[i]) for i in range(len(x))]
        weights = np.full(len(x), float(EXAMPLES))
        params = numpy_mlp.weighted_average([m for m, _ in results], weights)
        losses.append(float(np.mean([l for _, l in results])))
        history.append(params)
    return losses, history
