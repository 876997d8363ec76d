"""DiLoCo and Streaming DiLoCo (Douillard et al., 2023; 2025).

DiLoCo: every worker (a CLIENTS member) runs H inner AdamW steps from the global model;
the outer gradient is the global model minus the worker's model; the outer gradients
are averaged and the global model steps with Nesterov SGD (lr 0.7, momentum 0.9). Inner
optimizer states stay on the workers between rounds.

Streaming DiLoCo changes three things:

- the parameter leaves are split into P fragments, and fragment f is synchronised only
  every H inner steps, staggered so one fragment syncs every H / P steps (peak
  bandwidth drops by P);
- communication overlaps computation: the outer gradient of a fragment is taken, and
  workers keep training for `overlap` (tau) inner steps before the new global fragment
  arrives and is mixed in: `local = mixing * local + (1 - mixing) * global`. `mixing`
  (alpha) defaults to 0, the default of torchft's `fragment_update_alpha` and of
  MaxText's `communication_overlapping_alpha`: the workers adopt the global fragment;
- outer gradients travel as 4-bit E3M0 codes (`fax_bridge.algorithms.e3m0`).

The communication of a sync is what a quantized all-reduce moves, as in torchft: each
worker sends its fragment's outer gradient as packed codes (two per byte) and one
float32 scale per tensor; the server decodes every worker's codes and averages them
in float32 (`federated_decode_sum`, exported as TFF `federated_aggregate`: the codes
are what cross from CLIENTS to SERVER); the average is re-quantized to packed codes,
and those codes are what is broadcast. Server and workers apply the same decoded
average: every worker keeps its own copy of the global model and of the outer
optimizer state (torchft's replicas each run the outer step) and steps them itself, so
the only float32 values a round sends are the scales and the scalar loss metric. The
exported round also carries the workers' state, because this runtime keeps no client
state between programs; `syncs[f]` is the sync alone. With `quantize=False` the same
round moves the float32 outer gradients (`federated_mean`) and the float32 average.

One program per fragment: `rounds[f](state, batches, mask)` runs H / P inner steps and
synchronises fragment f; round r uses `rounds[schedule(r)]`. `syncs[f]` is the
communication of that round alone (aggregate, server step, broadcast) as a program of
its own, to measure on a fleet. Plain DiLoCo is P = 1, tau = 0, float32, mixing 0.

Simplifications against the paper: fragments are sets of whole parameter leaves
balanced by size (the paper uses strided groups of transformer layers), the sync
schedule is one fragment per H / P steps in fragment order, and workers are the
members of a fixed cohort (no worker joins or leaves).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fax_bridge import api as fx
from fax_bridge.algorithms import common as C
from fax_bridge.algorithms import e3m0
from fax_bridge.errors import HyperparameterError

FLOAT32_BYTES = 4

# The quantizer's public names, kept here for callers of this module.
e3m0_encode = e3m0.encode
e3m0_decode = e3m0.decode
quantize_e3m0 = e3m0.quantize


def payload_bytes(leaves: Sequence[Any], quantized: bool) -> int:
    """Array bytes of one worker's outer gradient for these tensors: float32, or packed
    4-bit codes plus a float32 scale per tensor (what `rounds[f]` sends each way)."""
    return sum(e3m0.packed_bytes(np.shape(leaf)) if quantized
               else int(np.prod(np.shape(leaf))) * FLOAT32_BYTES for leaf in leaves)


# --------------------------------------------------------------------------- fragments


def split_fragments(params, num_fragments: int) -> tuple[tuple[int, ...], ...]:
    """Leaf indices of each fragment, balancing their element counts (largest first)."""
    leaves = jax.tree.leaves(params)
    if isinstance(num_fragments, bool) or not isinstance(num_fragments, int) or not (
            1 <= num_fragments <= len(leaves)):
        raise HyperparameterError(
            f"num_fragments must be between 1 and the number of parameter leaves "
            f"({len(leaves)}), got {num_fragments}.")
    sizes = [int(np.prod(np.shape(l))) for l in leaves]
    loads = [0] * num_fragments
    groups: list[list[int]] = [[] for _ in range(num_fragments)]
    for i in sorted(range(len(leaves)), key=lambda i: (-sizes[i], i)):
        f = min(range(num_fragments), key=lambda f: (loads[f], f))
        groups[f].append(i)
        loads[f] += sizes[i]
    return tuple(tuple(sorted(g)) for g in groups)


# --------------------------------------------------------------------------- algorithm


class DiLoCoState(NamedTuple):
    """SERVER: global model, one outer optimizer state per fragment, rounds.
    CLIENTS: every worker's model, inner optimizer state, its copy of the global model
    and of the outer optimizer states (workers apply the outer step themselves)."""

    global_params: Any
    outer_states: tuple
    round: jax.Array
    worker_params: Any
    inner_states: Any
    worker_global: Any
    worker_outer_states: tuple


STATE_PLACEMENTS = DiLoCoState("server", "server", "server", "clients", "clients", "clients",
                               "clients")
SYNC_PLACEMENTS = ("server", "server", "clients")


class StreamingDiLoCo(NamedTuple):
    """`init(params)` (a program); `rounds[f]` syncs fragment f; `schedule(r)` = f of round r.

    `inner_steps_per_round` = H / P: the `steps` axis of a round's batches.
    `syncs[f](global_fragment, outer_state, payload)`: the communication of `rounds[f]`
    alone (the workers' payloads at CLIENTS, aggregated, the server's outer step, the
    broadcast, which every worker decodes); returns `(new_fragment, outer_state, acks)`,
    `acks` the number of workers whose decoded update is finite. `sync_args(state, f)`
    gives its arguments at `state` (the workers' messages from their current models).
    `payload_bytes[f]`: array bytes one worker sends for fragment f (and receives).
    """

    init: Callable
    rounds: tuple
    schedule: Callable[[int], int]
    fragments: tuple
    inner_steps_per_round: int
    payload_bytes: tuple
    placements: tuple
    syncs: tuple
    sync_args: Callable

    def next(self, state: DiLoCoState, batches, mask, round_index: int):
        """Runs round `round_index` (picks the fragment it syncs)."""
        return self.rounds[self.schedule(round_index)](state, batches, mask)


def _default_inner() -> optax.GradientTransformation:
    return optax.adamw(1e-3, b1=0.9, b2=0.95, weight_decay=0.1)


def streaming_diloco(loss: C.Loss, params_example, *, clients: int, sync_every: int,
                     num_fragments: int = 1, overlap: int = 0, quantize: bool = True,
                     mixing: float = 0.0,
                     inner_optimizer: Optional[optax.GradientTransformation] = None,
                     outer_lr: float = 0.7, outer_momentum: float = 0.9,
                     fragments: Optional[Sequence[Sequence[int]]] = None,
                     clients_per_step: C.ClientsPerStep = None,
                     progress: bool = False) -> StreamingDiLoCo:
    """Streaming DiLoCo over `clients` workers.

    `params_example` fixes the parameter structure (fragments are sets of leaves).
    `sync_every` is H; it must be a multiple of `num_fragments`; `overlap` (tau) is at
    most H / P. `mixing` is alpha (0: adopt the global fragment). Batches of a round:
    leaves `(clients, H / P, batch, ...)`. Metrics: `loss` (mean inner training loss).
    """
    loss = C.check_loss(loss)
    n = C.check_clients(clients)
    inner = C.check_optimizer(_default_inner() if inner_optimizer is None else inner_optimizer,
                              "inner_optimizer")
    leaves_example, treedef = jax.tree.flatten(params_example)
    shapes = [tuple(np.shape(leaf)) for leaf in leaves_example]
    if fragments is None:
        fragments = split_fragments(params_example, num_fragments)
    else:
        fragments = tuple(tuple(int(i) for i in f) for f in fragments)
        flat = sorted(i for f in fragments for i in f)
        if flat != list(range(len(leaves_example))):
            raise HyperparameterError(
                f"fragments must partition the {len(leaves_example)} parameter leaves; got "
                f"{fragments}.")
    p = len(fragments)
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or (
            sync_every < 1 or sync_every % p):
        raise HyperparameterError(
            f"sync_every (H={sync_every}) must be a positive multiple of the number of "
            f"fragments ({p}) so fragments sync every H / P steps.")
    k = sync_every // p
    if isinstance(overlap, bool) or not isinstance(overlap, int) or not 0 <= overlap <= k:
        raise HyperparameterError(
            f"overlap (tau={overlap!r}) must be an int between 0 and H / P = {k}.")
    mixing = C.check_real(mixing, "mixing (alpha)", 0.0, 1.0)
    C.check_real(outer_lr, "outer_lr", 0.0, low_open=True)
    C.check_real(outer_momentum, "outer_momentum", 0.0, 1.0, high_open=True)
    outer = optax.sgd(outer_lr, momentum=outer_momentum, nesterov=True)

    def frag_leaves(tree, f):
        leaves = treedef.flatten_up_to(tree)
        return [leaves[i] for i in fragments[f]]

    def replace_leaves(tree, f, new):
        leaves = list(treedef.flatten_up_to(tree))
        for i, v in zip(fragments[f], new):
            leaves[i] = v
        return treedef.unflatten(leaves)

    def encode(f, grads):
        """A worker's (or the server's) message for fragment f."""
        if not quantize:
            return list(grads)
        packed = [e3m0.encode_packed(g) for g in grads]
        return {"codes": [c for c, _ in packed], "scales": [sc for _, sc in packed]}

    def decode(f, message):
        if not quantize:
            return list(message)
        return [e3m0.decode_packed(c, sc, shapes[i])
                for i, c, sc in zip(fragments[f], message["codes"], message["scales"])]

    def outer_step(frag, outer_state, mean_grad):
        updates, outer_state = outer.update(mean_grad, outer_state, frag)
        return optax.apply_updates(frag, updates), outer_state

    def communicate(f, global_frag, outer_state, payload):
        """Aggregate (from the codes), server outer step, broadcast of the re-encoded mean."""
        if quantize:
            total = fx.federated_decode_sum(
                lambda m: (decode(f, m), jnp.float32(1.0)), payload)
            mean_grad = fx.federated_map_server(
                lambda t, c: [g / c for g in t], total)
        else:
            mean_grad = fx.federated_mean(payload)

        def server(frag, o_state, mean):
            down = encode(f, mean)
            new_frag, o_state = outer_step(frag, o_state, decode(f, down))
            return new_frag, o_state, down

        new_frag, outer_state, down = fx.federated_map_server(
            server, (global_frag, outer_state, mean_grad))
        return new_frag, outer_state, fx.federated_broadcast(down)

    @fx.program(clients=n, clients_per_step=clients_per_step, progress=progress)
    def init(params) -> DiLoCoState:
        params = jax.tree.map(jnp.asarray, params)
        outer_states = tuple(outer.init(frag_leaves(params, f)) for f in range(p))
        return DiLoCoState(params, outer_states, jnp.zeros((), jnp.int32),
                           fx.federated_broadcast(params),
                           fx.federated_broadcast(inner.init(params)),
                           fx.federated_broadcast(params),
                           fx.federated_broadcast(outer_states))

    def make_round(f: int):
        def worker_phase(wp, st, wg, batches, mask):
            sl = lambda lo, hi: jax.tree.map(lambda a: a[lo:hi], batches)  # noqa: E731
            wp, st, l1 = C.local_train(loss, inner, wp, st, sl(0, k - overlap),
                                       mask[: k - overlap])
            message = encode(f, [g - w for g, w in zip(frag_leaves(wg, f),
                                                        frag_leaves(wp, f))])
            if overlap:
                wp, st, l2 = C.local_train(loss, inner, wp, st, sl(k - overlap, k),
                                           mask[k - overlap:])
                c1 = C.example_count(mask[: k - overlap])
                c2 = C.example_count(mask[k - overlap:])
                l1 = (l1 * c1 + l2 * c2) / jnp.maximum(c1 + c2, 1.0)
            return wp, st, message, l1

        def worker_merge(wp, wg, w_outer, down):
            new_frag, w_outer = outer_step(frag_leaves(wg, f), w_outer, decode(f, down))
            mixed = [mixing * w + (1.0 - mixing) * g
                     for w, g in zip(frag_leaves(wp, f), new_frag)]
            return replace_leaves(wp, f, mixed), replace_leaves(wg, f, new_frag), w_outer

        @fx.program(clients=n, clients_per_step=clients_per_step, progress=progress)
        def round_fn(state: DiLoCoState, batches, mask):
            wp, st, payload, losses = fx.federated_map_clients(
                worker_phase, (state.worker_params, state.inner_states, state.worker_global,
                               batches, mask))
            new_frag, outer_state, down = communicate(
                f, frag_leaves(state.global_params, f), state.outer_states[f], payload)
            wp, wg, w_outer = fx.federated_map_clients(
                worker_merge, (wp, state.worker_global, state.worker_outer_states[f], down))
            outer_states = tuple(outer_state if j == f else s
                                 for j, s in enumerate(state.outer_states))
            w_outers = tuple(w_outer if j == f else s
                             for j, s in enumerate(state.worker_outer_states))
            global_params = fx.federated_map_server(
                lambda g, nf: replace_leaves(g, f, nf), (state.global_params, new_frag))
            new_state = DiLoCoState(global_params, outer_states, state.round + 1, wp, st, wg,
                                    w_outers)
            return new_state, {"loss": fx.federated_mean(losses)}

        @fx.program(clients=n, clients_per_step=clients_per_step, progress=progress)
        def sync_fn(global_frag, outer_state, payload):
            new_frag, outer_state, down = communicate(f, global_frag, outer_state, payload)

            def received(message):       # a worker decodes the broadcast and acknowledges
                ok = [jnp.all(jnp.isfinite(g)) for g in decode(f, message)]
                return jnp.all(jnp.stack(ok)).astype(jnp.int32)

            acks = fx.federated_sum(fx.federated_map_clients(received, down))
            return new_frag, outer_state, acks

        round_fn.__name__ = f"streaming_diloco_round_fragment{f}"
        sync_fn.__name__ = f"streaming_diloco_sync_fragment{f}"
        return round_fn, sync_fn

    made = [make_round(f) for f in range(p)]

    def sync_args(state: DiLoCoState, f: int):
        """`syncs[f]`'s arguments: the global fragment and its outer state (SERVER), the
        workers' messages from their current models (CLIENTS)."""
        grads = [g - w for g, w in zip(frag_leaves(state.worker_global, f),
                                       frag_leaves(state.worker_params, f))]
        messages = jax.vmap(lambda *gs: encode(f, list(gs)))(*grads)
        return frag_leaves(state.global_params, f), state.outer_states[f], messages

    sizes = tuple(payload_bytes([leaves_example[i] for i in frag], quantize)
                  for frag in fragments)
    return StreamingDiLoCo(init, tuple(r for r, _ in made), lambda r: int(r) % p, fragments,
                           k, sizes, (STATE_PLACEMENTS, "clients", "clients"),
                           tuple(s for _, s in made), sync_args)


def diloco(loss: C.Loss, params_example, *, clients: int, sync_every: int,
           inner_optimizer: Optional[optax.GradientTransformation] = None,
           outer_lr: float = 0.7, outer_momentum: float = 0.9,
           clients_per_step: C.ClientsPerStep = None, progress: bool = False) -> StreamingDiLoCo:
    """Plain DiLoCo: all parameters synced every H inner steps, float32, no overlap."""
    return streaming_diloco(loss, params_example, clients=clients, sync_every=sync_every,
                            num_fragments=1, overlap=0, quantize=False, mixing=0.0,
                            inner_optimizer=inner_optimizer, outer_lr=outer_lr,
                            outer_momentum=outer_momentum,
                            clients_per_step=clients_per_step, progress=progress)
