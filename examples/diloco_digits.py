"""DiLoCo and Streaming DiLoCo on digits: accuracy and bytes exchanged.

`--clients` workers each hold a non-IID shard of the training digits. Plain DiLoCo
syncs every parameter every H inner AdamW steps in float32. Streaming DiLoCo splits the
parameters into P fragments synced on a staggered schedule (one every H / P steps),
overlaps each sync with tau inner steps and sends 4-bit E3M0 outer gradients. Both run
the same number of inner steps: `--rounds` outer rounds of H steps.
"""

import os

import jax
import numpy as np
import optax

import _digits as D
from fax_bridge import cli_args
from fax_bridge import data as fd
from fax_bridge.algorithms import diloco, streaming_diloco

BATCH = 16


class Shards:
    """Per-worker minibatches, drawn with a seeded generator per (round, worker)."""

    def __init__(self, clients, seed):
        self.clients, self.seed = clients, seed

    def batches(self, step0: int, steps: int):
        xs, ys = [], []
        for w, c in enumerate(self.clients):
            rng = np.random.default_rng([self.seed, w, step0])
            idx = rng.integers(0, len(c["y"]), size=(steps, BATCH))
            xs.append(c["x"][idx])
            ys.append(c["y"][idx])
        mask = np.ones((len(self.clients), steps, BATCH), bool)
        return {"x": np.stack(xs), "y": np.stack(ys)}, mask


def run(alg, shards, outer_rounds, sync_every, params, test):
    state = alg.init(params)
    steps = [jax.jit(r) for r in alg.rounds]
    k = alg.inner_steps_per_round
    rounds = outer_rounds * sync_every // k
    accs, losses = [], []
    for r in range(rounds):
        data, mask = shards.batches(r * k, k)
        state, m = steps[alg.schedule(r)](state, data, mask)
        if (r + 1) * k % sync_every == 0:            # once per H inner steps
            accs.append(float(D.accuracy(state.global_params, *test)))
            losses.append(float(m["loss"]))
    return state, accs, losses, alg.communication(rounds)


def main():
    args = D.parse_args(__doc__, rounds=30, clients=4, extra=lambda p: (
        p.add_argument("--sync-every", type=cli_args.int_in(1, 10_000), default=16,
                       help="H inner steps"),
        p.add_argument("--fragments", type=cli_args.int_in(1, 64), default=2, help="P"),
        p.add_argument("--overlap", type=cli_args.int_in(0, 10_000), default=2,
                       help="tau inner steps")))
    timer = D.Timer()
    digits = fd.load_federated_digits(num_clients=args.clients, alpha=0.5, seed=args.seed)
    shards = Shards(digits.clients, args.seed)
    test = (digits.test["x"], digits.test["y"])
    params = D.init_mlp(args.seed)
    inner = optax.adamw(3e-3, b1=0.9, b2=0.95, weight_decay=0.1)
    h = args.sync_every
    runs = {
        "DiLoCo": diloco(D.loss, params, clients=args.clients, sync_every=h,
                         inner_optimizer=inner),
        f"Streaming DiLoCo (P={args.fragments}, tau={args.overlap}, 4-bit)": streaming_diloco(
            D.loss, params, clients=args.clients, sync_every=h, num_fragments=args.fragments,
            overlap=args.overlap, quantize=True, inner_optimizer=inner),
    }
    curves, losses, comm, states = {}, {}, {}, {}
    for name, alg in runs.items():
        states[name], curves[name], losses[name], comm[name] = run(
            alg, shards, args.rounds, h, params, test)
        print(f"{name:40s} test acc {curves[name][-1]:.4f}  total {comm[name]['total_bytes']:>10,d} B"
              f"  peak/sync {comm[name]['peak_bytes']:>8,d} B")
    plain, stream = comm["DiLoCo"], comm[list(runs)[1]]
    print(f"streaming / plain bytes: total {stream['total_bytes'] / plain['total_bytes']:.4f}, "
          f"peak {stream['peak_bytes'] / plain['peak_bytes']:.4f}")
    D.plot(os.path.join(args.out, "diloco_digits.png"), "DiLoCo vs Streaming DiLoCo on digits",
           curves, ylabel="test accuracy (per H inner steps)", losses=losses)
    name = list(runs)[1]
    alg = runs[name]
    data, mask = shards.batches(0, alg.inner_steps_per_round)
    print(D.parity_line(alg.rounds[0], (states[name], data, mask), alg.placements))
    print(f"{args.rounds} outer rounds x H={h} inner steps, {args.clients} workers "
          f"(seed {args.seed}) in {timer():.1f}s")


if __name__ == "__main__":
    main()
