"""Quick start: one FedAvg round written once, run locally, exported to TFF, and checked.

    python examples/quickstart.py [--clients 8] [--devices 4]

The round broadcasts a linear model to the clients, runs a few local SGD steps on each
client's data, and averages the updates weighted by the clients' example counts.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import fax_bridge as fb
from fax_bridge.system import cli_args

FEATURES = 4
EXAMPLES = 16
LOCAL_STEPS = 5
LR = 0.1


def local_train(params, data):
    """A few SGD steps of least squares on one client's data."""
    def loss(p):
        pred = data["x"] @ p["w"] + p["b"]
        return jnp.mean((pred - data["y"]) ** 2)

    def step(p, _):
        g = jax.grad(loss)(p)
        return jax.tree_util.tree_map(lambda a, b: a - LR * b, p, g), None

    trained, _ = jax.lax.scan(step, params, None, length=LOCAL_STEPS)
    delta = jax.tree_util.tree_map(lambda a, b: a - b, trained, params)
    return delta, jnp.float32(data["y"].shape[0]), loss(trained)


def fedavg_round(params, data):
    """Broadcast, local training, weighted mean of deltas, server update."""
    at_clients = fb.federated_broadcast(params)
    delta, weight, loss = fb.federated_map_clients(local_train, (at_clients, data))
    mean_delta = fb.federated_weighted_mean(delta, weight)
    new_params = fb.federated_map_server(
        lambda p, d: jax.tree_util.tree_map(jnp.add, p, d), (params, mean_delta))
    return new_params, fb.federated_mean(loss)


def example_args(clients: int):
    """Example arguments for `fax-bridge export examples/quickstart.py:fedavg_round`."""
    rng = np.random.default_rng(0)
    true_w = rng.normal(size=FEATURES).astype(np.float32)
    x = rng.normal(size=(clients, EXAMPLES, FEATURES)).astype(np.float32)
    y = (x @ true_w + 0.5 + 0.01 * rng.normal(size=(clients, EXAMPLES))).astype(np.float32)
    params = {"w": np.zeros(FEATURES, np.float32), "b": np.float32(0.0)}
    return (params, {"x": x, "y": y}), ("server", "clients")


__exportable__ = ["fedavg_round"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=cli_args.int_in(1, 100_000), default=8)
    parser.add_argument("--devices", type=cli_args.int_in(1, 64), default=4)
    parser.add_argument("--rounds", type=cli_args.int_in(1, 100_000), default=5)
    args = parser.parse_args()

    program = fb.program(clients=args.clients)(fedavg_round)
    (params, data), placements = example_args(args.clients)

    print(fb.trace(program, params, data, placements=placements).signature())
    step = jax.jit(program)
    for r in range(args.rounds):
        params, loss = step(params, data)
        print(f"round {r}: mean client loss {float(loss):.4f}")

    proto = fb.export_tff(program, params, data, placements=placements)
    from federated_language.compiler import building_blocks
    print("TFF type:", building_blocks.ComputationBuildingBlock.from_proto(proto).type_signature)

    report = fb.check_parity(program, params, data, placements=placements,
                             devices=args.devices)
    print(report.table())
    if not report.ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
