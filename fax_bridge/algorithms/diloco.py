"""DiLoCo and Streaming DiLoCo (Douillard et al., 2023; 2025).

DiLoCo: every worker (a CLIENTS member) runs H inner AdamW steps from the global model;
the outer gradient is the global model minus the worker's model; the server averages
the outer gradients and steps with Nesterov SGD (lr 0.7, momentum 0.9). Inner
optimizer states stay on the workers between rounds.

Streaming DiLoCo changes three things:

- the parameter leaves are split into P fragments, and fragment f is synchronised only
  every H inner steps, staggered so one fragment syncs every H / P steps (peak
  bandwidth drops by P);
- communication overlaps computation: the outer gradient of a fragment is taken, and
  workers keep training for `overlap` (tau) inner steps before the new global fragment
  arrives and is mixed in: `local = mixing * local + (1 - mixing) * global`;
- outer gradients are quantized to 4 bits (E3M0: a sign and a 3-bit exponent, no
  mantissa, relative to a per-tensor float32 scale) before they leave a worker; the
  average is accumulated in float32.

One program per fragment: `rounds[f](state, batches, mask)` runs H / P inner steps and
synchronises fragment f; round r uses `rounds[schedule(r)]`. Plain DiLoCo is the case
P = 1, tau = 0, no quantization, mixing 0.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fax_bridge as fx
from fax_bridge.algorithms import common as C

E3M0_LEVELS = 7          # non-zero magnitudes scale * 2**e, e in -6..0 (code 1..7)
E3M0_MIN_EXP = -(E3M0_LEVELS - 1)
E3M0_BITS = 4            # 1 sign bit + 3 exponent bits
SCALE_BYTES = 4          # one float32 scale per tensor
FLOAT32_BYTES = 4


# --------------------------------------------------------------------------- quantizer


def e3m0_encode(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """4-bit codes (uint8 in [0, 16)) and the float32 scale of `x`.

    Bit 3 is the sign; bits 0-2 the exponent code c: 0 is zero, c in 1..7 stands for
    `scale * 2**(c - 7)`. The scale is max |x|; magnitudes round to the nearest level.
    """
    x = jnp.asarray(x, jnp.float32)
    scale = jnp.max(jnp.abs(x)) if x.size else jnp.float32(0.0)
    safe = jnp.where(scale > 0, scale, 1.0)
    r = jnp.abs(x) / safe
    tiny = jnp.float32(2.0 ** (E3M0_MIN_EXP - 1))          # midpoint of 0 and the smallest level
    k = jnp.floor(jnp.log2(jnp.maximum(r, tiny)))
    mant = r / jnp.exp2(k)                                 # in [1, 2)
    e = jnp.clip(k + (mant >= 1.5), E3M0_MIN_EXP, 0)
    code = jnp.where((r >= tiny) & (scale > 0), e - E3M0_MIN_EXP + 1, 0).astype(jnp.uint8)
    sign = (x < 0).astype(jnp.uint8) << 3
    return code | sign, scale.astype(jnp.float32)


def e3m0_decode(codes: jax.Array, scale: jax.Array) -> jax.Array:
    """Inverse of `e3m0_encode` (up to the rounding it did)."""
    c = (codes & 7).astype(jnp.int32)
    mag = jnp.where(c > 0, jnp.exp2((c - 1 + E3M0_MIN_EXP).astype(jnp.float32)), 0.0)
    sign = jnp.where((codes & 8) > 0, -1.0, 1.0)
    return (sign * mag * scale).astype(jnp.float32)


def quantize_e3m0(x: jax.Array) -> jax.Array:
    """`x` rounded to the E3M0 grid (what the receiver decodes), same shape and dtype."""
    codes, scale = e3m0_encode(x)
    return e3m0_decode(codes, scale).astype(jnp.asarray(x).dtype)


def payload_bytes(leaves: Sequence[Any], quantized: bool) -> int:
    """Bytes to send these tensors once: float32, or 4-bit codes plus a scale per tensor."""
    total = 0
    for leaf in leaves:
        size = int(np.prod(np.shape(leaf)))
        total += (-(-size * E3M0_BITS // 8) + SCALE_BYTES) if quantized else size * FLOAT32_BYTES
    return total


# --------------------------------------------------------------------------- fragments


def split_fragments(params, num_fragments: int) -> tuple[tuple[int, ...], ...]:
    """Leaf indices of each fragment, balancing their element counts (largest first)."""
    leaves = jax.tree.leaves(params)
    if not 1 <= num_fragments <= len(leaves):
        raise ValueError(
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
    CLIENTS: every worker's model and inner optimizer state."""

    global_params: Any
    outer_states: tuple
    round: jax.Array
    worker_params: Any
    inner_states: Any


STATE_PLACEMENTS = DiLoCoState("server", "server", "server", "clients", "clients")


class StreamingDiLoCo(NamedTuple):
    """`init(params)` (a program); `rounds[f]` syncs fragment f; `schedule(r)` = f of round r.

    `inner_steps_per_round` = H / P: the `steps` axis of a round's batches.
    `bytes_per_round[f]`: bytes all workers exchange to sync fragment f (each worker
    sends its outer gradient and receives the averaged one, as in an all-reduce).
    """

    init: Callable
    rounds: tuple
    schedule: Callable[[int], int]
    fragments: tuple
    inner_steps_per_round: int
    bytes_per_round: tuple
    placements: tuple

    def next(self, state: DiLoCoState, batches, mask, round_index: int):
        """Runs round `round_index` (picks the fragment it syncs)."""
        return self.rounds[self.schedule(round_index)](state, batches, mask)

    def communication(self, num_rounds: int) -> dict:
        """Total and peak (one sync) bytes exchanged over `num_rounds` rounds."""
        per = [self.bytes_per_round[self.schedule(r)] for r in range(num_rounds)]
        return {"total_bytes": int(sum(per)), "peak_bytes": int(max(per, default=0))}


def _default_inner() -> optax.GradientTransformation:
    return optax.adamw(1e-3, b1=0.9, b2=0.95, weight_decay=0.1)


def streaming_diloco(loss: C.Loss, params_example, *, clients: int, sync_every: int,
                     num_fragments: int = 1, overlap: int = 0, quantize: bool = True,
                     mixing: float = 0.5,
                     inner_optimizer: Optional[optax.GradientTransformation] = None,
                     outer_lr: float = 0.7, outer_momentum: float = 0.9,
                     fragments: Optional[Sequence[Sequence[int]]] = None) -> StreamingDiLoCo:
    """Streaming DiLoCo over `clients` workers.

    `params_example` fixes the parameter structure (fragments are sets of leaves).
    `sync_every` is H; it must be a multiple of `num_fragments`; `overlap` (tau) is at
    most H / P. Batches of a round: leaves `(clients, H / P, batch, ...)`.
    Metrics: `loss` (mean inner training loss of the round).
    """
    loss = C.check_loss(loss)
    n = C.check_clients(clients)
    inner = C.check_optimizer(_default_inner() if inner_optimizer is None else inner_optimizer,
                              "inner_optimizer")
    outer = optax.sgd(outer_lr, momentum=outer_momentum, nesterov=True)
    leaves_example, treedef = jax.tree.flatten(params_example)
    if fragments is None:
        fragments = split_fragments(params_example, num_fragments)
    else:
        fragments = tuple(tuple(int(i) for i in f) for f in fragments)
        flat = sorted(i for f in fragments for i in f)
        if flat != list(range(len(leaves_example))):
            raise ValueError(
                f"fragments must partition the {len(leaves_example)} parameter leaves; got "
                f"{fragments}.")
    p = len(fragments)
    if sync_every < 1 or sync_every % p:
        raise ValueError(
            f"sync_every (H={sync_every}) must be a positive multiple of the number of "
            f"fragments ({p}) so fragments sync every H / P steps.")
    k = sync_every // p
    if not 0 <= overlap <= k:
        raise ValueError(f"overlap (tau={overlap}) must be between 0 and H / P = {k}.")
    if not 0.0 <= mixing <= 1.0:
        raise ValueError(f"mixing must be in [0, 1], got {mixing}.")

    def frag_leaves(tree, f):
        leaves = treedef.flatten_up_to(tree)
        return [leaves[i] for i in fragments[f]]

    def replace_leaves(tree, f, new):
        leaves = list(treedef.flatten_up_to(tree))
        for i, v in zip(fragments[f], new):
            leaves[i] = v
        return treedef.unflatten(leaves)

    @fx.program(clients=n)
    def init(params) -> DiLoCoState:
        params = jax.tree.map(jnp.asarray, params)
        outer_states = tuple(outer.init(frag_leaves(params, f)) for f in range(p))
        return DiLoCoState(params, outer_states, jnp.zeros((), jnp.int32),
                           fx.federated_broadcast(params),
                           fx.federated_broadcast(inner.init(params)))

    def make_round(f: int):
        def worker_phase(wp, st, batches, mask, global_frag):
            sl = lambda lo, hi: jax.tree.map(lambda a: a[lo:hi], batches)  # noqa: E731
            wp, st, l1 = C.local_train(loss, inner, wp, st, sl(0, k - overlap),
                                       mask[: k - overlap])
            outer_grad = [g - w for g, w in zip(global_frag, frag_leaves(wp, f))]
            if quantize:
                outer_grad = [quantize_e3m0(g) for g in outer_grad]
            if overlap:
                wp, st, l2 = C.local_train(loss, inner, wp, st, sl(k - overlap, k),
                                           mask[k - overlap:])
                c1 = C.example_count(mask[: k - overlap])
                c2 = C.example_count(mask[k - overlap:])
                l1 = (l1 * c1 + l2 * c2) / jnp.maximum(c1 + c2, 1.0)
            return wp, st, outer_grad, l1

        def server_phase(global_frag, outer_state, mean_grad):
            updates, outer_state = outer.update(mean_grad, outer_state, global_frag)
            return optax.apply_updates(global_frag, updates), outer_state

        def merge(wp, new_frag):
            mixed = [mixing * w + (1.0 - mixing) * g
                     for w, g in zip(frag_leaves(wp, f), new_frag)]
            return replace_leaves(wp, f, mixed)

        @fx.program(clients=n)
        def round_fn(state: DiLoCoState, batches, mask):
            global_frag = frag_leaves(state.global_params, f)
            wp, st, outer_grad, losses = fx.federated_map_clients(
                worker_phase, (state.worker_params, state.inner_states, batches, mask,
                               fx.federated_broadcast(global_frag)))
            mean_grad = fx.federated_mean(outer_grad)
            new_frag, outer_state = fx.federated_map_server(
                server_phase, (global_frag, state.outer_states[f], mean_grad))
            wp = fx.federated_map_clients(merge, (wp, fx.federated_broadcast(new_frag)))
            outer_states = tuple(outer_state if j == f else s
                                 for j, s in enumerate(state.outer_states))
            global_params = fx.federated_map_server(
                lambda g, nf: replace_leaves(g, f, nf), (state.global_params, new_frag))
            new_state = DiLoCoState(global_params, outer_states, state.round + 1, wp, st)
            return new_state, {"loss": fx.federated_mean(losses)}

        round_fn.__name__ = f"streaming_diloco_round_fragment{f}"
        return round_fn

    rounds = tuple(make_round(f) for f in range(p))
    bytes_per_round = tuple(
        2 * n * payload_bytes([leaves_example[i] for i in frag], quantize) for frag in fragments)
    return StreamingDiLoCo(init, rounds, lambda r: int(r) % p, fragments, k,
                           bytes_per_round, (STATE_PLACEMENTS, "clients", "clients"))


def diloco(loss: C.Loss, params_example, *, clients: int, sync_every: int,
           inner_optimizer: Optional[optax.GradientTransformation] = None,
           outer_lr: float = 0.7, outer_momentum: float = 0.9) -> StreamingDiLoCo:
    """Plain DiLoCo: all parameters synced every H inner steps, full precision, no overlap."""
    return streaming_diloco(loss, params_example, clients=clients, sync_every=sync_every,
                            num_fragments=1, overlap=0, quantize=False, mixing=0.0,
                            inner_optimizer=inner_optimizer, outer_lr=outer_lr,
                            outer_momentum=outer_momentum)
