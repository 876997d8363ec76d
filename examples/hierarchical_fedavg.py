"""Hierarchical FedAvg: groups of clients average their models, then the groups average.

    python examples/hierarchical_fedavg.py [--groups 4] [--workers 3] [--rounds 5]

Two nested placements: the outer program places one value per group (`clients`, the
placement TFF calls CLIENTS when exported), and each group runs an inner program over its
`workers` (the clients of that group): broadcast the group's model, a few local SGD
steps per worker, mean over the workers. The outer round then averages the groups. On a
mesh with `clients` and `workers` axes each placement is split over its own axis;
exported, the inner program is local work inside each group's Xla computation.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import fax_bridge as fb
from fax_bridge.system import cli_args

FEATURES = 4
EXAMPLES = 8
LOCAL_STEPS = 3
LR = 0.1
WORKERS = 3


def local_train(params, data):
    """A few SGD steps of least squares on one worker's data."""
    def loss(p):
        return jnp.mean((data["x"] @ p["w"] + p["b"] - data["y"]) ** 2)

    for _ in range(LOCAL_STEPS):
        params = jax.tree_util.tree_map(lambda a, g: a - LR * g, params, jax.grad(loss)(params))
    return params


def group_round(params, data):
    """One group: its workers train from the group's model; the group keeps their mean."""
    at_workers = fb.federated_broadcast(params)
    return fb.federated_mean(fb.federated_map_clients(local_train, (at_workers, data)))


def make_round(workers: int = WORKERS):
    """The hierarchical round for groups of `workers` clients (data: [groups, workers, ...])."""
    group = fb.program(placements={"workers": workers})(group_round)

    def hierarchical_round(params, data):
        at_groups = fb.federated_broadcast(params)
        return fb.federated_mean(fb.federated_map_clients(group, (at_groups, data)))

    return hierarchical_round


hierarchical_round = make_round()


def example_args(groups: int, workers: int = WORKERS):
    """Example arguments: a linear model at the server, [groups, workers, ...] data."""
    rng = np.random.default_rng(0)
    true_w = rng.normal(size=FEATURES).astype(np.float32)
    x = rng.normal(size=(groups, workers, EXAMPLES, FEATURES)).astype(np.float32)
    y = (x @ true_w + 0.5).astype(np.float32)
    params = {"w": np.zeros(FEATURES, np.float32), "b": np.float32(0.0)}
    return (params, {"x": x, "y": y}), ("server", "clients")


__exportable__ = ["hierarchical_round"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=cli_args.int_in(1, 10_000), default=4)
    parser.add_argument("--workers", type=cli_args.int_in(1, 10_000), default=WORKERS)
    parser.add_argument("--rounds", type=cli_args.int_in(1, 10_000), default=5)
    args = parser.parse_args()

    program = fb.program(clients=args.groups)(make_round(args.workers))
    (params, data), placements = example_args(args.groups, args.workers)
    print(fb.trace(program, params, data, placements=placements).signature())
    step = jax.jit(program)
    for r in range(args.rounds):
        params = step(params, data)
        loss = np.mean((np.asarray(data["x"]) @ np.asarray(params["w"]) + params["b"]
                        - data["y"]) ** 2)
        print(f"round {r}: mean squared error {loss:.4f}")

    from fax_bridge.runtime import run_computation

    proto = fb.export_tff(program, params, data, placements=placements)
    exported = run_computation(proto, params, data)
    local = step(params, data)
    err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
              for a, b in zip(jax.tree.leaves(exported), jax.tree.leaves(local)))
    print(f"exported ({proto.ByteSize()} bytes); runtime vs jit max difference {err:.2e}")


if __name__ == "__main__":
    main()
