"""FedAvg on non-IID digits: 100 clients, a seeded cohort each round, a small MLP."""

import os

import optax

import _digits as D
from fax_bridge import data as fd
from fax_bridge.algorithms import fed_avg


def main():
    args = D.parse_args(__doc__)
    timer = D.Timer()
    pop = D.Population(args.seed)
    sampler = fd.CohortSampler(pop.num_clients, args.clients, seed=args.seed)
    alg = fed_avg(D.loss, optax.sgd(0.1), clients=args.clients, local_epochs=5)
    state, accs, losses = D.train(alg, pop, sampler, args.rounds, args.seed,
                                  progress="train loss")
    D.plot(os.path.join(args.out, "fedavg_digits.png"), "FedAvg on digits",
           {"FedAvg": accs}, losses={"FedAvg train": losses})
    c = pop.cohort(sampler(0))
    print(D.parity_line(alg.next, (state, c.data, c.mask), alg.placements))
    print(f"final test accuracy {accs[-1]:.4f} after {args.rounds} rounds of {args.clients} "
          f"clients (seed {args.seed}) in {timer():.1f}s")


if __name__ == "__main__":
    main()
