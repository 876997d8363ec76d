"""FedAdam, FedYogi and FedAdagrad on non-IID digits (Reddi et al. defaults).

FedAdagrad is Algorithm 2 of the paper; FedAdam and FedYogi run twice, with optax's
bias-corrected Adam / Yogi (the default) and with `paper_exact=True` (Algorithm 2).
"""

import os

import optax

import _digits as D
from fax_bridge.system import cli_args
from fax_bridge import data as fd
from fax_bridge.algorithms import fed_adagrad, fed_adam, fed_yogi


def main():
    args = D.parse_args(__doc__, extra=lambda p: p.add_argument(
        "--server-lr", type=cli_args.float_at_least(0.0), default=0.01))
    timer = D.Timer()
    pop = D.Population(args.seed)
    sampler = fd.CohortSampler(pop.num_clients, args.clients, seed=args.seed)
    curves, losses, last = {}, {}, None
    variants = [("FedAdam", fed_adam, {}), ("FedAdam (paper)", fed_adam, {"paper_exact": True}),
                ("FedYogi", fed_yogi, {}), ("FedYogi (paper)", fed_yogi, {"paper_exact": True}),
                ("FedAdagrad", fed_adagrad, {})]
    for name, make, kw in variants:
        alg = make(D.loss, optax.sgd(0.1), clients=args.clients, server_lr=args.server_lr,
                   local_epochs=5, **kw)
        state, accs, ls = D.train(alg, pop, sampler, args.rounds, args.seed)
        curves[name], losses[name] = accs, ls
        print(f"{name:16s} final test accuracy {accs[-1]:.4f} (best {max(accs):.4f})")
        last = (alg, state)
    D.plot(os.path.join(args.out, "fedopt_digits.png"), "FedOpt server optimizers on digits",
           curves, losses=losses)
    alg, state = last
    c = pop.cohort(sampler(0))
    print(D.parity_line(alg.next, (state, c.data, c.mask), alg.placements))
    print(f"{args.rounds} rounds of {args.clients} clients (seed {args.seed}), server lr "
          f"{args.server_lr}, in {timer():.1f}s")


if __name__ == "__main__":
    main()
