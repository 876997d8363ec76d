"""Federated evaluation: a model's loss and metrics over the clients' held-out data.

`federated_evaluation(loss, clients=N, metrics={...})` is a program
`evaluate(params, data, mask) -> {"loss": ..., name: ..., "examples": ...}`: the model
is broadcast, each client evaluates the loss and every metric on its real examples
(`mask`, as the rounds take it: padded examples count for nothing), and the server
takes each one's example-weighted mean over the cohort, so every real example counts
once whichever client holds it. A metric has the loss's form, `metric(params, batch)
-> scalar`, the mean over the batch's leading axis (`accuracy(logits)` makes the usual
one); it is evaluated one example at a time, as the rounds evaluate the loss. The
program is built from the federated primitives: it runs under jit, exports and runs on
a fleet like the rounds.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import jax
import jax.numpy as jnp

from fax_bridge import api as fx
from fax_bridge.algorithms import common as C
from fax_bridge.errors import ArgumentError


def accuracy(logits: Callable, inputs: str = "x", labels: str = "y") -> C.Loss:
    """The metric `(params, batch) -> share of the batch whose largest logit is its
    label`: `logits(params, batch[inputs])` of shape (batch, classes), integer labels
    `batch[labels]` of shape (batch,)."""
    if not callable(logits):
        raise ArgumentError(f"accuracy: logits must be a function logits(params, inputs), "
                            f"got {type(logits).__name__}.")

    def metric(params, batch):
        predicted = jnp.argmax(logits(params, batch[inputs]), axis=-1)
        return jnp.mean((predicted == batch[labels]).astype(jnp.float32))

    return metric


def federated_evaluation(loss: C.Loss, *, clients: int,
                         metrics: Optional[Mapping[str, C.Loss]] = None,
                         clients_per_step: C.ClientsPerStep = None,
                         progress: bool = False) -> fx.Program:
    """The program `(params, data, mask) -> {"loss", *metrics, "examples"}` (module
    docstring): each value the example-weighted mean over the cohort's real examples,
    `examples` their number. `data` and `mask` as the rounds take them (`mask.shape`
    leads every leaf of `data`: `(clients, size)` or `(clients, steps, batch)`).

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> from fax_bridge.algorithms import accuracy, federated_evaluation
      >>> def logits(w, x):
      ...     return x @ w
      >>> def loss(w, b):
      ...     return jnp.mean(jnp.sum((logits(w, b["x"]) - 1.0) ** 2, -1))
      >>> evaluate = federated_evaluation(loss, clients=2,
      ...                                 metrics={"accuracy": accuracy(logits)})
      >>> data = {"x": np.eye(2, dtype=np.float32)[None].repeat(2, 0),
      ...         "y": np.array([[0, 1], [1, 0]], np.int32)}
      >>> mask = np.array([[True, True], [True, False]])  # client 1 holds one example
      >>> got = evaluate(np.eye(2, dtype=np.float32), data, mask)
      >>> round(float(got["accuracy"]), 4), float(got["examples"])
      (0.6667, 3.0)
    """
    loss = C.check_loss(loss)
    metrics = dict(metrics or {})
    for name, fn in metrics.items():
        if name in ("loss", "examples") or not isinstance(name, str):
            raise ArgumentError(f"federated_evaluation: a metric may not be named {name!r} "
                                "('loss' and 'examples' are the evaluation's own); name it "
                                "otherwise.")
        C.check_loss(fn, f"metric {name!r}")
    n = C.check_clients(clients)

    def client_values(params, data, mask):
        values = {"loss": C.masked_loss(loss, params, data, mask)}
        for name, fn in metrics.items():
            values[name] = C.masked_loss(fn, params, data, mask)
        return values, C.example_count(mask)

    @fx.program(clients=n, clients_per_step=clients_per_step, progress=progress)
    def evaluate(params, data, mask):
        values, counts = fx.federated_map_clients(
            client_values, (fx.federated_broadcast(params), data, mask))
        means = jax.tree.map(lambda v: fx.federated_weighted_mean(v, counts), values)
        return dict(means, examples=fx.federated_sum(counts))

    return evaluate
