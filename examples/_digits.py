"""Shared pieces of the digits examples: a small MLP, cohorts, evaluation, plots, parity."""

from __future__ import annotations

import argparse
import os
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import fax_bridge as fb
from fax_bridge.system import cli_args
from fax_bridge import data as fd

BATCH = 8


POPULATION = 100  # digits clients (Population); no round can sample more


def parse_args(description: str, rounds: int = 50, clients: int = 10,
               extra: Callable[[argparse.ArgumentParser], None] | None = None,
               argv: Optional[Sequence[str]] = None):
    """The examples' flags, each checked as it is read (argparse names a bad one)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--rounds", type=cli_args.int_in(1, 100_000), default=rounds,
                   help=f"federated rounds (1..100000, default {rounds})")
    p.add_argument("--clients", type=cli_args.int_in(1, POPULATION), default=clients,
                   help=f"clients per round (1..{POPULATION}, the digits population; "
                        f"default {clients})")
    p.add_argument("--seed", type=cli_args.int_in(0, 2**32 - 1), default=0)
    p.add_argument("--out", default="docs/img", help="folder for the PNG plot")
    if extra is not None:
        extra(p)
    return p.parse_args(argv)


def init_mlp(seed: int, sizes: Sequence[int] = (64, 64, 10)) -> dict:
    """He-initialised MLP parameters {'w0','b0','w1','b1',...}."""
    key = jax.random.PRNGKey(seed)
    params = {}
    for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:])):
        key, sub = jax.random.split(key)
        params[f"w{i}"] = jax.random.normal(sub, (m, n)) * jnp.sqrt(2.0 / m)
        params[f"b{i}"] = jnp.zeros(n)
    return params


def logits_fn(params: dict, x: jax.Array) -> jax.Array:
    layers = len(params) // 2
    h = x
    for i in range(layers):
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        if i < layers - 1:
            h = jax.nn.relu(h)
    return h


def loss(params: dict, batch: dict) -> jax.Array:
    """Mean softmax cross-entropy of the MLP on `batch` = {'x', 'y'}."""
    logp = jax.nn.log_softmax(logits_fn(params, batch["x"]))
    return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=1))


@jax.jit
def accuracy(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean(jnp.argmax(logits_fn(params, x), -1) == y)


@jax.jit
def test_loss(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    return loss(params, {"x": x, "y": y})


class Population:
    """The digits clients, every one padded to the same number of batches."""

    def __init__(self, seed: int, num_clients: int = POPULATION, alpha: float = 0.5):
        self.digits = fd.load_federated_digits(num_clients=num_clients, alpha=alpha, seed=seed)
        self.size = int(-(-self.digits.sizes.max() // BATCH) * BATCH)
        self.num_clients = num_clients

    def cohort(self, ids) -> fd.PaddedClients:
        clients = [self.digits.clients[int(i)] for i in ids]
        return fd.to_batches(fd.pad_clients(clients, size=self.size), BATCH)

    @property
    def test(self):
        return jnp.asarray(self.digits.test["x"]), jnp.asarray(self.digits.test["y"])


def train(alg, pop: Population, sampler, rounds: int, seed: int,
          progress: Optional[str] = None):
    """Runs `rounds` rounds of `alg` (`init`/`next` over (state, data, mask)) on seeded
    cohorts; returns (final state, test accuracy per round, round loss per round).

    With `progress`, prints the round's loss under that label every 10 rounds.
    """
    state = alg.init(init_mlp(seed))
    step = jax.jit(alg.next)
    x_test, y_test = pop.test
    accs, losses = [], []
    for r in range(rounds):
        c = pop.cohort(sampler(r))
        state, m = step(state, c.data, c.mask)
        accs.append(float(accuracy(state.params, x_test, y_test)))
        losses.append(float(m["loss"]))
        if progress and (r % 10 == 9 or r == rounds - 1):
            print(f"round {r + 1:3d}  {progress} {losses[-1]:.4f}  test acc {accs[-1]:.4f}")
    return state, accs, losses


def parity_line(program, args: tuple, placements, devices: int = 2) -> str:
    """Exports `program` at `args`, runs the proto on a LocalFleet and compares with jit."""
    try:
        with fb.LocalFleet(devices=devices) as fleet:
            report = fb.check_parity(program, *args, placements=placements, fleet=fleet)
    except Exception as e:  # the example still reports its training results
        return f"parity: fleet run FAILED ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
    worst = max(leaf.max_abs for leaf in report.leaves)
    return (f"parity: {'OK' if report.ok else 'MISMATCH'} on a LocalFleet of {report.devices} "
            f"devices, {len(report.leaves)} leaves, max |local - fleet| = {worst:.2e}")


def plot(path: str, title: str, curves: dict, ylabel: str = "test accuracy",
         losses: dict | None = None) -> None:
    """Saves accuracy (and optionally loss) curves per round to `path`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 2 if losses else 1
    fig, axes = plt.subplots(1, cols, figsize=(5 * cols, 3.6))
    axes = np.atleast_1d(axes)
    for name, ys in curves.items():
        axes[0].plot(np.arange(1, len(ys) + 1), ys, label=name)
    axes[0].set_xlabel("round")
    axes[0].set_ylabel(ylabel)
    axes[0].grid(alpha=0.3)
    axes[0].legend()
    if losses:
        for name, ys in losses.items():
            axes[1].plot(np.arange(1, len(ys) + 1), ys, label=name)
        axes[1].set_xlabel("round")
        axes[1].set_ylabel("loss")
        axes[1].set_yscale("log")
        axes[1].grid(alpha=0.3)
        axes[1].legend()
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


class Timer:
    def __init__(self):
        self.start = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.start
