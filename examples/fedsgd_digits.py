"""FedSGD on non-IID digits: the server steps on the gradient of the federated loss."""

import os

import optax

import _digits as D
from fax_bridge import data as fd
from fax_bridge.algorithms import fed_sgd


def main():
    args = D.parse_args(__doc__)
    timer = D.Timer()
    pop = D.Population(args.seed)
    sampler = fd.CohortSampler(pop.num_clients, args.clients, seed=args.seed)
    alg = fed_sgd(D.loss, clients=args.clients,
                  server_optimizer=optax.sgd(0.5, momentum=0.9))
    state, accs, losses = D.train(alg, pop, sampler, args.rounds, args.seed,
                                  progress="federated loss")
    D.plot(os.path.join(args.out, "fedsgd_digits.png"), "FedSGD (federated AD) on digits",
           {"FedSGD": accs}, losses={"FedSGD federated loss": losses})
    c = pop.cohort(sampler(0))
    print(D.parity_line(alg.next, (state, c.data, c.mask), alg.placements))
    print(f"final test accuracy {accs[-1]:.4f} after {args.rounds} rounds of {args.clients} "
          f"clients (seed {args.seed}) in {timer():.1f}s")


if __name__ == "__main__":
    main()
