"""FedAvg with learned client weights: a fixed cohort where some clients have noisy labels.

Ten cross-silo clients hold digits; the training labels of three of them are shuffled.
Every client keeps a clean validation split; the aggregation weights are learned from
the gradient of the post-round validation loss (federated AD through
`federated_weighted_mean`), next to plain FedAvg on the same data.
"""

import os

import jax
import numpy as np
import optax

import _digits as D
from fax_bridge import data as fd
from fax_bridge.algorithms import fed_avg, learned_client_weights

NOISY = (0, 1, 2)


def split(pop_clients, seed):
    rng = np.random.default_rng(seed)
    train, val = [], []
    for i, c in enumerate(pop_clients):
        idx = rng.permutation(len(c["y"]))
        cut = int(0.8 * len(idx))
        t = {k: v[idx[:cut]] for k, v in c.items()}
        if i in NOISY:
            t["y"] = rng.integers(0, 10, len(t["y"])).astype(np.int32)   # random labels
        train.append(t)
        val.append({k: v[idx[cut:]] for k, v in c.items()})
    return train, val


def stack(clients):
    size = -(-max(len(c["y"]) for c in clients) // D.BATCH) * D.BATCH
    return fd.to_batches(fd.pad_clients(clients, size=size), D.BATCH)


def main():
    args = D.parse_args(__doc__, rounds=40)
    timer = D.Timer()
    digits = fd.load_federated_digits(num_clients=args.clients, alpha=1.0, seed=args.seed)
    train, val = split(digits.clients, args.seed)
    tr, va = stack(train), stack(val)
    x_test, y_test = digits.test["x"], digits.test["y"]
    learned = learned_client_weights(D.loss, optax.sgd(0.05), clients=args.clients,
                                     meta_optimizer=optax.adam(0.1))
    plain = fed_avg(D.loss, optax.sgd(0.05), clients=args.clients)
    s_l = learned.init(D.init_mlp(args.seed))
    s_p = plain.init(D.init_mlp(args.seed))
    step_l, step_p = jax.jit(learned.next), jax.jit(plain.next)
    acc_l, acc_p, noisy_share = [], [], []
    for r in range(args.rounds):
        s_l, m = step_l(s_l, tr.data, tr.mask, va.data, va.mask)
        s_p, _ = step_p(s_p, tr.data, tr.mask)
        acc_l.append(float(D.accuracy(s_l.params, x_test, y_test)))
        acc_p.append(float(D.accuracy(s_p.params, x_test, y_test)))
        noisy_share.append(float(np.asarray(m["weights"])[list(NOISY)].sum()))
    D.plot(os.path.join(args.out, "learned_weights_digits.png"),
           "Learned client weights (3 of 10 clients with random labels)",
           {"learned weights": acc_l, "FedAvg": acc_p},
           losses={"weight share of noisy clients": noisy_share})
    print(D.parity_line(learned.next, (s_l, tr.data, tr.mask, va.data, va.mask),
                        learned.placements))
    share0 = tr.counts[list(NOISY)].sum() / tr.counts.sum()
    print(f"weight share of the noisy clients: {share0:.3f} (by example count) -> "
          f"{noisy_share[-1]:.3f} (learned)")
    print(f"final test accuracy: learned weights {acc_l[-1]:.4f}, FedAvg {acc_p[-1]:.4f}, after "
          f"{args.rounds} rounds of {args.clients} clients (seed {args.seed}) in {timer():.1f}s")


if __name__ == "__main__":
    main()
