"""DiLoCo and Streaming DiLoCo on digits: accuracy, and the bytes a fleet carries per sync.

`--clients` workers each hold a non-IID shard of the training digits. Plain DiLoCo
syncs every parameter every H inner AdamW steps in float32. Streaming DiLoCo splits the
parameters into P fragments synced on a staggered schedule (one every H / P steps),
overlaps each sync with tau inner steps, and sends its outer gradients in float32 or as
packed 4-bit E3M0 codes. Every configuration runs the same number of inner steps:
`--rounds` outer steps of H inner steps.

Bytes are measured, not computed: after training, each fragment's sync (`syncs[f]`: the
workers' messages aggregated, the server's outer step, the broadcast every worker
decodes) is exported and run on a LocalFleet with one device process per worker, so
each worker's message travels as it is (a device of one client sends its own values).
`up` is the RoundReport's bytes_up (gRPC messages, devices to coordinator); `down` is
its bytes_down minus the bytes_down of a run that only places the same messages on the
workers (in a deployment they are computed there). A warm-up run loads the computations
first. Per outer step: `peak` is the largest single sync (up + down), `total` the sum
over the P fragments' syncs.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

import _digits as D
import fax_bridge as fb
from fax_bridge.system import cli_args
from fax_bridge import data as fd
from fax_bridge.algorithms import diloco, streaming_diloco
from fax_bridge.algorithms.diloco import SYNC_PLACEMENTS

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
    accs = []
    for r in range(rounds):
        data, mask = shards.batches(r * k, k)
        state, m = steps[alg.schedule(r)](state, data, mask)
        if (r + 1) * k % sync_every == 0:            # once per H inner steps
            accs.append(float(D.accuracy(state.global_params, *test)))
    return state, accs


def staging_only(workers: int):
    """A program that only places the workers' messages (and counts them)."""
    @fb.program(clients=workers)
    def stage(messages):
        return fb.federated_sum(fb.federated_map_clients(
            lambda m: jnp.int32(len(jax.tree.leaves(m)) > 0), messages))
    return stage


def measure_syncs(fleet, alg, state, workers: int) -> list:
    """Measured (up, down, payload_up, payload_down) of each fragment's sync."""
    out = []
    for f in range(len(alg.fragments)):
        args = alg.sync_args(state, f)
        proto = fb.export_tff(alg.syncs[f], *args, placements=SYNC_PLACEMENTS)
        stage = fb.export_tff(staging_only(workers), args[2], placements="clients")
        for prog, a in ((proto, args), (stage, (args[2],))):
            fleet.run(prog, *a)                              # loads the computations
        _, rep = fleet.run(proto, *args, report=True)
        _, base = fleet.run(stage, args[2], report=True)
        out.append((rep.bytes_up, rep.bytes_down - base.bytes_down,
                    rep.payload_up, rep.payload_down - base.payload_down))
    return out


def main():
    args = D.parse_args(__doc__, rounds=30, clients=4, extra=lambda p: (
        p.add_argument("--sync-every", type=cli_args.int_in(1, 10_000), default=16,
                       help="H inner steps"),
        p.add_argument("--fragments", type=cli_args.int_in(1, 64), nargs="+",
                       default=[1, 2, 4], help="the values of P to run"),
        p.add_argument("--overlap", type=cli_args.int_in(0, 10_000), default=2,
                       help="tau inner steps (Streaming DiLoCo)")))
    timer = D.Timer()
    digits = fd.load_federated_digits(num_clients=args.clients, alpha=0.5, seed=args.seed)
    shards = Shards(digits.clients, args.seed)
    test = (digits.test["x"], digits.test["y"])
    params = D.init_mlp(args.seed)
    inner = optax.adamw(3e-3, b1=0.9, b2=0.95, weight_decay=0.1)
    h, n = args.sync_every, args.clients
    runs = {"DiLoCo (fp32)": diloco(D.loss, params, clients=n, sync_every=h,
                                    inner_optimizer=inner)}
    for quant in (False, True):
        for p in args.fragments:
            runs[f"Streaming P={p} tau={args.overlap} {'4-bit' if quant else 'fp32'}"] = (
                streaming_diloco(D.loss, params, clients=n, sync_every=h, num_fragments=p,
                                 overlap=args.overlap, quantize=quant, inner_optimizer=inner))
    curves, states, rows = {}, {}, []
    with fb.LocalFleet(devices=n) as fleet:
        for name, alg in runs.items():
            states[name], curves[name] = run(alg, shards, args.rounds, h, params, test)
            syncs = measure_syncs(fleet, alg, states[name], n)
            per_sync = [u + d for u, d, _, _ in syncs]
            rows.append((name, curves[name][-1], max(per_sync), sum(per_sync),
                         sum(u for u, _, _, _ in syncs), sum(d for _, d, _, _ in syncs),
                         sum(pu + pd for _, _, pu, pd in syncs)))
            print(f"{name:28s} test acc {rows[-1][1]:.4f}  per outer step: peak "
                  f"{rows[-1][2]:>8,d} B  total {rows[-1][3]:>8,d} B (up {rows[-1][4]:,d}, "
                  f"down {rows[-1][5]:,d}; arrays {rows[-1][6]:,d} B)", flush=True)
    base = rows[0]
    print("\n| configuration | test accuracy | peak B / outer step | total B / outer step "
          "| total vs DiLoCo |")
    print("|---|---|---|---|---|")
    for name, acc, peak, total, *_ in rows:
        print(f"| {name} | {acc:.3f} | {peak:,d} | {total:,d} | {total / base[3]:.3f} |")
    D.plot(os.path.join(args.out, "diloco_digits.png"), "DiLoCo vs Streaming DiLoCo on digits",
           curves, ylabel="test accuracy (per H inner steps)")
    name = list(runs)[-1]
    alg = runs[name]
    data, mask = shards.batches(0, alg.inner_steps_per_round)
    print(D.parity_line(alg.rounds[0], (states[name], data, mask), alg.placements))
    print(f"{args.rounds} outer steps x H={h} inner steps, {n} workers (seed {args.seed}) "
          f"in {timer():.1f}s")


if __name__ == "__main__":
    main()
