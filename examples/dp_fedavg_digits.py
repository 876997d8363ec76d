"""DP-FedAvg on non-IID digits: Poisson cohorts, adaptive clipping, accuracy against epsilon.

Each round every one of the 100 clients joins with probability q = clients / 100
(Poisson sampling, `PoissonSampler`); the program has a few more client slots than the
expected cohort, and unused slots are empty clients. Updates are clipped to an adaptive
L2 norm (Andrew et al. 2021 defaults) and the server adds Gaussian noise to their sum
(`dp_fed_avg`). For each noise multiplier the guarantee after every 10 rounds is
reported by RDP and PLD (`dp-accounting`).
"""

import math
import os

import numpy as np
import optax

import _digits as D
from fax_bridge.system import cli_args
from fax_bridge import data as fd
from fax_bridge import privacy
from fax_bridge.algorithms import dp_fed_avg

DELTA = 1e-3      # below 1 / population
NOISE = (0.0, 0.5, 1.0, 1.5, 1.9)   # the default clipped-count noise fits any z


class PoissonCohorts(D.Population):
    """The digits population whose cohorts fill `slots` client slots (padding: no data)."""

    def __init__(self, seed: int, slots: int):
        super().__init__(seed)
        self.slots = slots

    def cohort(self, ids) -> fd.PaddedClients:
        clients = [self.digits.clients[int(i)] for i in ids]
        empty = {k: v[:0] for k, v in self.digits.clients[0].items()}
        clients += [empty] * (self.slots - len(clients))
        return fd.to_batches(fd.pad_clients(clients, size=self.size), D.BATCH)


def main():
    args = D.parse_args(__doc__, clients=20, extra=lambda p: p.add_argument(
        "--noise", type=cli_args.float_at_least(0.0), nargs="+", default=list(NOISE),
        help=f"noise multipliers to compare (default {' '.join(map(str, NOISE))})"))
    timer = D.Timer()
    population = 100
    rate = args.clients / population
    slots = min(population, int(math.ceil(args.clients + 4 * math.sqrt(args.clients))))
    pop = PoissonCohorts(args.seed, slots)
    sampler = fd.PoissonSampler(population, rate, capacity=slots, seed=args.seed)
    sampling = privacy.Sampling.poisson(rate)
    curves, rows, last = {}, [], None
    for z in args.noise:
        alg = dp_fed_avg(D.loss, optax.sgd(0.1), clients=slots, noise_multiplier=z,
                         clients_per_round=float(args.clients), local_epochs=5)
        state, accs, _ = D.train(alg, pop, sampler, args.rounds, args.seed)
        ledger = privacy.PrivacyLedger(z, sampling, DELTA)
        for r in range(10, args.rounds + 1, 10):
            report = ledger.step(r - ledger.rounds)
            print(f"z={z:<4} round {r:3d}  test acc {accs[r - 1]:.4f}  {report.summary()}")
        report = ledger.step(args.rounds - ledger.rounds) if ledger.rounds < args.rounds \
            else ledger.report()
        label = f"z={z:g}, eps={report.epsilon_pld:.2f}" if z > 0 else "z=0 (clip only)"
        curves[label] = accs
        rows.append((z, report, accs[-1], float(state.dp.clip)))
        last = (alg, state)
    print(f"\nnoise z | RDP eps | PLD eps (delta={DELTA:g}) | final clip | test accuracy")
    for z, rep, acc, clip in rows:
        print(f"{z:7.2f} | {rep.epsilon_rdp:7.2f} | {rep.epsilon_pld:7.2f} | {clip:10.3f} | "
              f"{acc:.4f}")
    _plot(os.path.join(args.out, "dp_fedavg_digits.png"), curves, rows)
    alg, state = last
    c = pop.cohort(sampler(0))
    print(D.parity_line(alg.next, (state, c.data, c.mask), alg.placements))
    print(f"{args.rounds} rounds, Poisson q={rate:g} over {population} clients ({slots} "
          f"slots), seed {args.seed}, in {timer():.1f}s")


def _plot(path, curves, rows):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, ys in curves.items():
        axes[0].plot(np.arange(1, len(ys) + 1), ys, label=name)
    axes[0].set_xlabel("round")
    axes[0].set_ylabel("test accuracy")
    axes[0].grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    noisy = [(rep.epsilon_pld, acc, z) for z, rep, acc, _ in rows if z > 0]
    if noisy:
        eps, acc, zs = zip(*sorted(noisy))
        axes[1].plot(eps, acc, "o-")
        for e, a, z in noisy:
            axes[1].annotate(f"z={z:g}", (e, a), textcoords="offset points", xytext=(4, 4),
                             fontsize=8)
    for z, rep, acc, _ in rows:
        if z == 0:
            axes[1].axhline(acc, color="gray", ls="--", label="no noise (clip only)")
            axes[1].legend(fontsize=8)
    axes[1].set_xscale("log")
    if noisy:
        axes[1].set_xticks(eps, [f"{e:.1f}" for e in eps])
        axes[1].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[1].set_xlabel(f"epsilon (PLD, delta={DELTA:g}) after all rounds")
    axes[1].set_ylabel("final test accuracy")
    axes[1].grid(alpha=0.3)
    fig.suptitle("DP-FedAvg on digits (Poisson cohorts, adaptive clipping)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
