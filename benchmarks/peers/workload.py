"""The one workload every peer benchmark runs: FedAvg of an MLP on scikit-learn's digits.

Only numpy and scikit-learn are used here, so the module imports in every peer venv
(numpy 1.x or 2.x) as well as in the main one. What it fixes:

* Data: scikit-learn's digits, read as ``load_digits`` reads them (1797 8x8 images, 10
  classes), pixels / 16 as float32. One ``np.random.default_rng(SPLIT_SEED)`` generator
  first permutes the examples and holds out the first 20% (359) as the test set, then
  splits the other 1438 over ``NUM_CLIENTS`` clients by Dirichlet label skew: for each
  class in turn, its examples (shuffled) are cut by proportions drawn from
  Dirichlet(``ALPHA``). A draw that leaves any client with fewer than
  ``MIN_CLIENT_EXAMPLES`` examples is redrawn (same generator, so still deterministic).
  Each client's examples are then shuffled once, so its batches mix its classes.
* Local data stream: a client's examples repeated end to end; local step ``s`` takes
  positions ``s*BATCH .. s*BATCH+BATCH-1`` of it (in order, cycling), so every batch
  has exactly ``BATCH`` rows and every round starts again from the first one.
* Model: MLP 64 -> 64 -> 10, ReLU, softmax cross-entropy (mean over the batch). Initial
  weights Glorot-uniform from ``np.random.default_rng(INIT_SEED)`` (w1 then w2), zero
  biases, stored once in ``init_params.npz`` beside this file; every peer loads it.
* Rounds: round ``r`` (0-based) samples its cohort with
  ``np.random.default_rng(seed + r).choice(NUM_CLIENTS, COHORT, replace=False)``;
  each cohort client runs ``LOCAL_STEPS`` SGD steps (lr ``LR``) from the broadcast
  model, and the server averages the client models weighted by their example counts.
* Reported loss of a round: the example-count-weighted mean over the cohort of each
  client's mean training loss over its local steps (loss before each step's update).
"""

from __future__ import annotations

import os
from typing import Dict, List, NamedTuple, Tuple

import numpy as np

NUM_CLIENTS = 100
COHORT = 10
LOCAL_STEPS = 5
LR = 0.1
BATCH = 16
ROUNDS = 20
ALPHA = 0.5
SPLIT_SEED = 0
INIT_SEED = 0
TEST_FRACTION = 0.2
MIN_CLIENT_EXAMPLES = 1
N_FEATURES = 64
N_HIDDEN = 64
N_CLASSES = 10

PARAM_NAMES = ("w1", "b1", "w2", "b2")
PARAM_SHAPES = {
    "w1": (N_FEATURES, N_HIDDEN),
    "b1": (N_HIDDEN,),
    "w2": (N_HIDDEN, N_CLASSES),
    "b2": (N_CLASSES,),
}
INIT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "init_params.npz")

Params = Dict[str, np.ndarray]


class Split(NamedTuple):
    """The train/test split and each client's share of the training examples."""

    x_train: np.ndarray  # [n_train, 64] float32
    y_train: np.ndarray  # [n_train] int32
    x_test: np.ndarray  # [n_test, 64] float32
    y_test: np.ndarray  # [n_test] int32
    client_indices: List[np.ndarray]  # per client: rows of x_train, in stream order


class ClientData(NamedTuple):
    """Every client's local batches, stacked over all clients."""

    x: np.ndarray  # [NUM_CLIENTS, LOCAL_STEPS, BATCH, 64] float32
    y: np.ndarray  # [NUM_CLIENTS, LOCAL_STEPS, BATCH] int32
    counts: np.ndarray  # [NUM_CLIENTS] float32, the clients' example counts


def load_digits_arrays() -> Tuple[np.ndarray, np.ndarray]:
    """The digits images as float32 [1797, 64] in [0, 1] and labels as int32.

    Read from the file scikit-learn ships, as ``load_digits`` reads it, without importing
    scikit-learn (seconds in every peer process); ``load_digits`` where the file is not
    found. (``fax_bridge.data.digits.digits_arrays`` does the same; this module cannot
    import fax_bridge, which not every peer venv holds.)"""
    import gzip
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    path = next((p for p in (os.path.join(folder, "datasets", "data", "digits.csv.gz")
                             for folder in (spec.submodule_search_locations or []))
                 if os.path.isfile(p)), None) if spec is not None else None
    if path is not None:
        with gzip.open(path, mode="rt", encoding="utf-8") as f:
            data = np.loadtxt(f, delimiter=",")
        pixels, labels = data[:, :-1], data[:, -1]
    else:
        from sklearn.datasets import load_digits

        digits = load_digits()
        pixels, labels = digits.data, digits.target
    x = (np.asarray(pixels, dtype=np.float64) / 16.0).astype(np.float32)
    y = np.asarray(labels, dtype=np.int32)
    return x, y


def _dirichlet_split(
    labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator
) -> List[np.ndarray]:
    classes = np.unique(labels)
    while True:
        shares: List[List[int]] = [[] for _ in range(num_clients)]
        for k in classes:
            idx = np.flatnonzero(labels == k)
            rng.shuffle(idx)
            props = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(props) * len(idx)).astype(np.int64)[:-1]
            for client, part in enumerate(np.split(idx, cuts)):
                shares[client].extend(part.tolist())
        if min(len(s) for s in shares) >= MIN_CLIENT_EXAMPLES:
            break
    out = []
    for s in shares:
        arr = np.asarray(s, dtype=np.int64)
        rng.shuffle(arr)
        out.append(arr)
    return out


def load_split(
    num_clients: int = NUM_CLIENTS, alpha: float = ALPHA, seed: int = SPLIT_SEED
) -> Split:
    """Holds out the test set, then splits the rest over clients (see module doc)."""
    x, y = load_digits_arrays()
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(y))
    n_test = int(round(TEST_FRACTION * len(y)))
    test, train = perm[:n_test], perm[n_test:]
    x_train, y_train = x[train], y[train]
    client_indices = _dirichlet_split(y_train, num_clients, alpha, rng)
    return Split(x_train, y_train, x[test], y[test], client_indices)


def client_data(split: Split, steps: int = LOCAL_STEPS, batch: int = BATCH) -> ClientData:
    """Each client's ``steps`` batches of ``batch`` rows, taken in order, cycling."""
    positions = np.arange(steps * batch)
    xs, ys, counts = [], [], []
    for idx in split.client_indices:
        rows = idx[positions % len(idx)]
        xs.append(split.x_train[rows].reshape(steps, batch, -1))
        ys.append(split.y_train[rows].reshape(steps, batch))
        counts.append(len(idx))
    return ClientData(
        np.stack(xs).astype(np.float32),
        np.stack(ys).astype(np.int32),
        np.asarray(counts, dtype=np.float32),
    )


def cohort(seed: int, round_index: int, num_clients: int = NUM_CLIENTS,
           size: int = COHORT) -> np.ndarray:
    """The clients (int64 ids) sampled for 0-based round ``round_index``."""
    return np.random.default_rng(seed + round_index).choice(num_clients, size, replace=False)


def cohort_schedule(seed: int, rounds: int) -> np.ndarray:
    """All cohorts of a run, [rounds, COHORT]."""
    return np.stack([cohort(seed, r) for r in range(rounds)])


def make_init_params(seed: int = INIT_SEED) -> Params:
    """Glorot-uniform weights (w1 drawn first, then w2) and zero biases, float32."""
    rng = np.random.default_rng(seed)
    params: Params = {}
    for w, b in (("w1", "b1"), ("w2", "b2")):
        fan_in, fan_out = PARAM_SHAPES[w]
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        params[w] = rng.uniform(-limit, limit, size=(fan_in, fan_out)).astype(np.float32)
        params[b] = np.zeros(PARAM_SHAPES[b], dtype=np.float32)
    return params


def save_init_params(path: str = INIT_PATH) -> None:
    """Writes ``make_init_params()`` to ``path`` (an .npz with keys w1, b1, w2, b2)."""
    np.savez(path, **make_init_params())


def load_init_params(path: str = INIT_PATH) -> Params:
    """The shared initial weights; written first if the file is missing."""
    if not os.path.exists(path):
        save_init_params(path)
    with np.load(path) as f:
        return {k: np.asarray(f[k], dtype=np.float32) for k in PARAM_NAMES}


def params_to_list(params: Params) -> List[np.ndarray]:
    """The parameters in the fixed order ``PARAM_NAMES``."""
    return [np.asarray(params[k]) for k in PARAM_NAMES]


def params_from_list(arrays: List[np.ndarray]) -> Params:
    """Inverse of ``params_to_list``."""
    return {k: np.asarray(a, dtype=np.float32) for k, a in zip(PARAM_NAMES, arrays)}


def forward(params: Params, x: np.ndarray) -> np.ndarray:
    """Logits of the MLP, float32 numpy."""
    h = np.maximum(x @ params["w1"] + params["b1"], 0.0)
    return h @ params["w2"] + params["b2"]


def softmax_xent(logits: np.ndarray, y: np.ndarray) -> float:
    """Mean softmax cross-entropy of integer labels."""
    z = logits - logits.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return float(-logp[np.arange(len(y)), y].mean())


def evaluate(params: Params, x: np.ndarray, y: np.ndarray) -> Tuple[float, float]:
    """(mean loss, accuracy) of ``params`` on ``(x, y)``."""
    logits = forward({k: np.asarray(v, dtype=np.float32) for k, v in params.items()}, x)
    return softmax_xent(logits, y), float((logits.argmax(axis=-1) == y).mean())


def check_program_inputs(seed: int = 0) -> Tuple[Params, np.ndarray, np.ndarray]:
    """Inputs of the fixed gradient-check program: the initial weights and, for each
    client of round 0's cohort, its first local batch (x [COHORT, BATCH, 64] float32,
    y [COHORT, BATCH] int32). The program is the unweighted mean over those clients of
    the loss of the broadcast weights on their batch; its gradient is w.r.t. the weights.
    """
    data = client_data(load_split())
    ids = cohort(seed, 0)
    return load_init_params(), data.x[ids, 0], data.y[ids, 0]


def param_bytes(params: Params) -> int:
    """Bytes of one copy of the model's tensors."""
    return int(sum(np.asarray(v).nbytes for v in params.values()))


if __name__ == "__main__":
    s = load_split()
    sizes = [len(i) for i in s.client_indices]
    print(
        f"train {len(s.y_train)} test {len(s.y_test)} clients {len(sizes)} "
        f"sizes min {min(sizes)} median {int(np.median(sizes))} max {max(sizes)}"
    )
    print("round 0 cohort", cohort(0, 0).tolist())
