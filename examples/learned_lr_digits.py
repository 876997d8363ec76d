"""FedAvg with a server learning rate learned by federated hypergradients, on digits.

The 100 clients are split: 80 train, 20 are held out for validation. Each round the
hypergradient of the post-round loss is taken on a cohort of held-out clients, so the
learning rate is tuned on data the model never trains on.
"""

import os

import jax
import optax

import _digits as D
from fax_bridge import data as fd
from fax_bridge.algorithms import learned_server_lr

HELD_OUT = 20  # clients kept out of training, used only for the post-round loss


def main():
    args = D.parse_args(__doc__)
    timer = D.Timer()
    pop = D.Population(args.seed)
    train_clients = pop.num_clients - HELD_OUT
    sampler = fd.CohortSampler(train_clients, args.clients, seed=args.seed)
    val_sampler = fd.CohortSampler(HELD_OUT, args.clients, seed=args.seed + 1)
    alg = learned_server_lr(D.loss, optax.sgd(0.1), clients=args.clients, initial_lr=0.5,
                            meta_optimizer=optax.adam(0.05), local_epochs=5)
    state = alg.init(D.init_mlp(args.seed))
    step = jax.jit(alg.next)
    x_test, y_test = pop.test
    accs, losses, lrs = [], [], []
    for r in range(args.rounds):
        c = pop.cohort(sampler(r))
        v = pop.cohort(train_clients + val_sampler(r))   # held-out clients validate
        state, m = step(state, c.data, c.mask, v.data, v.mask)
        accs.append(float(D.accuracy(state.params, x_test, y_test)))
        losses.append(float(m["post_loss"]))
        lrs.append(float(m["lr"]))
        if r % 10 == 9 or r == args.rounds - 1:
            print(f"round {r + 1:3d}  held-out post-round loss {losses[-1]:.4f}  "
                  f"server lr {lrs[-1]:.3f}"
                  f"  test acc {accs[-1]:.4f}")
    D.plot(os.path.join(args.out, "learned_lr_digits.png"),
           "FedAvg with a learned server learning rate", {"test accuracy": accs},
           losses={"post-round loss": losses, "server lr": lrs})
    c, v = pop.cohort(sampler(0)), pop.cohort(train_clients + val_sampler(0))
    print(D.parity_line(alg.next, (state, c.data, c.mask, v.data, v.mask), alg.placements))
    print(f"final test accuracy {accs[-1]:.4f}, server lr {lrs[-1]:.3f}, after {args.rounds} "
          f"rounds of {args.clients} clients (seed {args.seed}) in {timer():.1f}s")


if __name__ == "__main__":
    main()
