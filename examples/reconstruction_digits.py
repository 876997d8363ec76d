"""Federated Reconstruction on non-IID digits: a shared MLP body, a local output bias.

The output-layer bias (the client's label prior) is local: reconstructed on each client
from its own data every round and never sent. Held-out evaluation splits the test set
into 20 unseen clients; each reconstructs its bias on half of its examples and is
scored on the other half.
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


def split_halves(padded: fd.PaddedClients, steps_recon: int):
    """First `steps_recon` batches reconstruct, the rest train/evaluate."""
    first = {k: v[:, :steps_recon] for k, v in padded.data.items()}
    rest = {k: v[:, steps_recon:] for k, v in padded.data.items()}
    return first, padded.mask[:, :steps_recon], rest, padded.mask[:, steps_recon:]


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
    halves = []
    for c in test_clients:
        idx = np.random.default_rng(args.seed).permutation(len(c["y"]))
        halves.append(({k: v[idx[::2]] for k, v in c.items()},
                       {k: v[idx[1::2]] for k, v in c.items()}))
    size = -(-max(len(h[0]["y"]) for h in halves) // D.BATCH) * D.BATCH
    rec = fd.to_batches(fd.pad_clients([h[0] for h in halves], size=size), D.BATCH)
    ev = fd.pad_clients([h[1] for h in halves], size=size)

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
    recon_steps = pop.size // D.BATCH // 2
    accs, losses = [], []
    for r in range(args.rounds):
        c = pop.cohort(sampler(r))
        rb, rm, tb, tm = split_halves(c, recon_steps)
        state, m = step(state, rb, rm, tb, tm)
        accs.append(float(held_out_accuracy(state.params)))
        losses.append(float(m["loss"]))
        if r % 10 == 9 or r == args.rounds - 1:
            print(f"round {r + 1:3d}  train loss {losses[-1]:.4f}  held-out acc {accs[-1]:.4f}")
    D.plot(os.path.join(args.out, "reconstruction_digits.png"),
           "Federated Reconstruction on digits (local output bias)",
           {"held-out clients (reconstructed)": accs}, losses={"train": losses})
    c = pop.cohort(sampler(0))
    print(D.parity_line(alg.next, (state,) + split_halves(c, recon_steps), alg.placements))
    print(f"final held-out accuracy {accs[-1]:.4f} after {args.rounds} rounds of {args.clients} "
          f"clients (seed {args.seed}) in {timer():.1f}s")


if __name__ == "__main__":
    main()
