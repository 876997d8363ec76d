"""FedSGD on non-IID digits: the server steps on the gradient of the federated loss."""

import os

import jax
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
    state = alg.init(D.init_mlp(args.seed))
    step = jax.jit(alg.next)
    x_test, y_test = pop.test
    accs, losses = [], []
    for r in range(args.rounds):
        c = pop.cohort(sampler(r))
        state, m = step(state, c.data, c.mask)
        accs.append(float(D.accuracy(state.params, x_test, y_test)))
        losses.append(float(m["loss"]))
        if r % 10 == 9 or r == args.rounds - 1:
            print(f"round {r + 1:3d}  federated loss {losses[-1]:.4f}  test acc {accs[-1]:.4f}")
    D.plot(os.path.join(args.out, "fedsgd_digits.png"), "FedSGD (federated AD) on digits",
           {"FedSGD": accs}, losses={"FedSGD federated loss": losses})
    c = pop.cohort(sampler(0))
    print(D.parity_line(alg.next, (state, c.data, c.mask), alg.placements))
    print(f"final test accuracy {accs[-1]:.4f} after {args.rounds} rounds of {args.clients} "
          f"clients (seed {args.seed}) in {timer():.1f}s")


if __name__ == "__main__":
    main()
