"""FedFish (Fisher-weighted aggregation) next to FedAvg on non-IID digits."""

import os

import optax

import _digits as D
from fax_bridge import data as fd
from fax_bridge.algorithms import fed_avg, fed_fish


def main():
    args = D.parse_args(__doc__)
    timer = D.Timer()
    pop = D.Population(args.seed)
    sampler = fd.CohortSampler(pop.num_clients, args.clients, seed=args.seed)
    curves, losses = {}, {}
    algs = {"FedFish": fed_fish(D.loss, optax.sgd(0.1), clients=args.clients, local_epochs=5),
            "FedAvg": fed_avg(D.loss, optax.sgd(0.1), clients=args.clients, local_epochs=5)}
    for name, alg in algs.items():
        state, accs, ls = D.train(alg, pop, sampler, args.rounds, args.seed)
        curves[name], losses[name] = accs, ls
        print(f"{name:8s} final test accuracy {accs[-1]:.4f} (best {max(accs):.4f})")
        if name == "FedFish":
            fish_state = state
    D.plot(os.path.join(args.out, "fedfish_digits.png"), "FedFish vs FedAvg on digits",
           curves, losses=losses)
    c = pop.cohort(sampler(0))
    print(D.parity_line(algs["FedFish"].next, (fish_state, c.data, c.mask),
                        algs["FedFish"].placements))
    print(f"{args.rounds} rounds of {args.clients} clients (seed {args.seed}) in {timer():.1f}s")


if __name__ == "__main__":
    main()
