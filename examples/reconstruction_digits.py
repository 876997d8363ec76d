"""Federated Reconstruction on non-IID digits: a shared MLP body, a local output bias.

The output-layer bias (the client's label prior) is local: reconstructed on each client
from its own data every round and never sent. Every client's own examples are split
into interleaved halves: the even-numbered ones reconstruct the local bias (support),
the odd-numbered ones train the global model (query), so every client with two or more
examples contributes to the global update. Held-out evaluation splits the test set into
20 unseen clients, split the same way: reconstruct on one half, score on the other.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

import _digits as D
from fax_bridge import data as fd
from fax_bridge.algorithms import fed_reconstruction


def loss(global_params, local_params, batch):
    return D.loss({**global_params, **local_params}, batch)


def interleaved_halves(clients, seed=None):
    """Each client's examples split into (support, query): even and odd positions.

    With `seed`, the examples are shuffled first (one seeded permutation per client).
    """
    support, query = [], []
    for c in clients:
        idx = np.arange(len(c["y"]))
        if seed is not None:
            idx = np.random.default_rng(seed).permutation(idx)
        support.append({k: v[idx[0::2]] for k, v in c.items()})
        query.append({k: v[idx[1::2]] for k, v in c.items()})
    return support, query


def half_size(clients) -> int:
    """Padded size (a multiple of the batch) of the larger half of the largest client."""
    largest = max(len(c["y"]) for c in clients)
    return -(-(-(-largest // 2)) // D.BATCH) * D.BATCH


def cohort_halves(pop: D.Population, ids, size: int):
    """(support batches, support mask, query batches, query mask) of a cohort."""
    support, query = interleaved_halves([pop.digits.clients[int(i)] for i in ids])
    s = fd.to_batches(fd.pad_clients(support, size=size), D.BATCH)
    q = fd.to_batches(fd.pad_clients(query, size=size), D.BATCH)
    return s.data, s.mask, q.data, q.mask


def main():
    args = D.parse_args(__doc__)
    timer = D.Timer()
    pop = D.Population(args.seed)
    sampler = fd.CohortSampler(pop.num_clients, args.clients, seed=args.seed)
    params = D.init_mlp(args.seed)
    global0 = {k: v for k, v in params.items() if k != "b1"}
    alg = fed_reconstruction(loss, {"b1": jnp.zeros(10)}, clients=args.clients,
                             client_optimizer=optax.sgd(0.1),
                             reconstruction_optimizer=optax.sgd(0.5),
                             reconstruction_epochs=3, local_epochs=5)
    test_clients = fd.partition_dirichlet(pop.digits.test, "y", 20, alpha=0.5, seed=args.seed,
                                          min_size=4)
    test_support, test_query = interleaved_halves(test_clients, seed=args.seed)
    size = half_size(test_clients)
    rec = fd.to_batches(fd.pad_clients(test_support, size=size), D.BATCH)
    ev = fd.pad_clients(test_query, size=size)

    @jax.jit
    def held_out_accuracy(g):
        def one(rb, rm, ex, ey, em):
            lp = alg.reconstruct(g, rb, rm)
            hit = jnp.argmax(D.logits_fn({**g, **lp}, ex), -1) == ey
            return jnp.sum(hit * em), jnp.sum(em)
        hits, n = jax.vmap(one)(rec.data, rec.mask, ev.data["x"], ev.data["y"], ev.mask)
        return jnp.sum(hits) / jnp.sum(n)

    state = alg.init(global0)
    step = jax.jit(alg.next)
    train_size = half_size(pop.digits.clients)
    accs, losses = [], []
    for r in range(args.rounds):
        state, m = step(state, *cohort_halves(pop, sampler(r), train_size))
        accs.append(float(held_out_accuracy(state.params)))
        losses.append(float(m["loss"]))
        if r % 10 == 9 or r == args.rounds - 1:
            print(f"round {r + 1:3d}  train loss {losses[-1]:.4f}  held-out acc {accs[-1]:.4f}")
    D.plot(os.path.join(args.out, "reconstruction_digits.png"),
           "Federated Reconstruction on digits (local output bias)",
           {"held-out clients (reconstructed)": accs}, losses={"train": losses})
    print(D.parity_line(alg.next, (state,) + cohort_halves(pop, sampler(0), train_size),
                        alg.placements))
    print(f"final held-out accuracy {accs[-1]:.4f} after {args.rounds} rounds of {args.clients} "
          f"clients (seed {args.seed}) in {timer():.1f}s")


if __name__ == "__main__":
    main()
