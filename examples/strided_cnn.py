"""A CNN a new user writes first, under FedAdam: for parity, LiteRT and chunked cohorts.

    fax-bridge parity examples/strided_cnn.py:fed_adam --clients 16 --devices 2
    fax-bridge litert examples/strided_cnn.py:fed_adam --clients 3 -o out/litert

Two 3x3 convolutions of stride 2 with "SAME" padding (28x28x1 -> 14x14x16 -> 7x7x32),
a dense layer of 1568x64 and one of 64x10: 105,866 parameters. Each client holds 20 to
60 examples (labels skewed on every other client), padded to a common size and split
into batches of 20 with a mask of the real examples (`fax_bridge.data.to_batches`);
the round is `fax_bridge.algorithms.fed_adam` with client SGD at 0.05.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fax_bridge import algorithms as A
from fax_bridge.data import pad_clients, to_batches

BATCH = 20
_DIMENSIONS = ("NHWC", "HWIO", "NHWC")


def init(seed: int = 0) -> dict:
    """The model's parameters (105,866)."""
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    return {"c1": jax.random.normal(k[0], (3, 3, 1, 16)) * 0.3, "b1": jnp.zeros(16),
            "c2": jax.random.normal(k[1], (3, 3, 16, 32)) * 0.1, "b2": jnp.zeros(32),
            "d1": jax.random.normal(k[2], (1568, 64)) / 40.0, "e1": jnp.zeros(64),
            "d2": jax.random.normal(k[3], (64, 10)) / 8.0, "e2": jnp.zeros(10)}


def logits(params: dict, x: jax.Array) -> jax.Array:
    """Class scores of images `x` (batch, 28, 28, 1)."""
    h = jax.lax.conv_general_dilated(x, params["c1"], (2, 2), "SAME",
                                     dimension_numbers=_DIMENSIONS)
    h = jax.nn.relu(h + params["b1"])
    h = jax.lax.conv_general_dilated(h, params["c2"], (2, 2), "SAME",
                                     dimension_numbers=_DIMENSIONS)
    h = jax.nn.relu(h + params["b2"]).reshape(h.shape[0], -1)
    h = jax.nn.relu(h @ params["d1"] + params["e1"])
    return h @ params["d2"] + params["e2"]


def loss(params: dict, batch: dict) -> jax.Array:
    """Cross-entropy of a batch."""
    logp = jax.nn.log_softmax(logits(params, batch["x"]))
    return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], 1))


def client_data(clients: int, seed: int = 0) -> tuple:
    """(batches, mask) of `clients` non-IID clients of 20-60 examples each."""
    rng = np.random.default_rng(seed)
    population = []
    for c in range(clients):
        n = int(rng.integers(20, 61))
        labels = rng.integers(0, 10, n) if c % 2 else rng.integers(0, 3, n)
        x = rng.normal(size=(n, 28, 28, 1)).astype(np.float32)
        population.append({"x": x + labels[:, None, None, None].astype(np.float32) * 0.1,
                           "y": labels.astype(np.int32)})
    batches = to_batches(pad_clients(population), BATCH)
    return batches.data, batches.mask


def make(clients: int, **options) -> A.FederatedAlgorithm:
    """FedAdam over cohorts of `clients` (`options`: fed_adam's, e.g. server_lr)."""
    return A.fed_adam(loss, optax.sgd(0.05), clients=clients, **options)


def example_args(clients: int) -> tuple:
    """((state, batches, mask), placements) of a round of `clients` clients."""
    alg = make(clients)
    batches, mask = client_data(clients)
    return (alg.init(init()), batches, mask), alg.placements


def export_targets(clients: int) -> dict:
    """name -> (program, args, placements): the round at `clients` clients, as
    `fax-bridge` commands name it."""
    alg = make(clients)
    batches, mask = client_data(clients)
    return {"fed_adam": (alg.next, (alg.init(init()), batches, mask), alg.placements)}
