"""Cohorts in chunks: a program's client work run `clients_per_step` clients at a time.

`fb.program(clients=N, clients_per_step=k)` keeps what the program computes and changes
only how `jax.jit` runs it: the program is traced to a jaxpr, and each *phase* of client
work (the `federated_map_clients` calls, the per-client equations around them, and the
aggregations of their results, up to the first value the server needs) runs as one
`lax.scan` over chunks of k clients. The aggregations are accumulated as each chunk
finishes, so the round's temporaries are those of k clients whatever N is; the scan body
is under `jax.checkpoint`, so the backward pass of `jax.grad` runs in chunks too, its
memory as flat as the forward pass's. What is differentiated is the unchunked program,
by each federated primitive's own rule (`differentiable`), then run in chunks: a
chunked round has the unchunked round's derivatives, and refuses what it refuses. A
value a phase hands on (a CLIENTS-placed result, or one read by an equation that mixes
clients) is stacked chunk by chunk: it is as large as it is unchunked.

Chunk c of S = N // k holds clients c, c + S, c + 2S, ...: on a mesh whose `clients`
axis splits the cohort, each device keeps running its own clients, k / devices of them
a step (k must be a multiple of the axis size). When k does not divide N, the last
N mod k clients run as one smaller chunk after the scan. Equations outside the client
phases (the server step, anything between two trips) run as they are.

What may differ from the unchunked round: the order of summation. A sum over the
cohort becomes a sum of the chunks' sums, added in chunk order, so float aggregates may
differ from the unchunked round's in the last bits (integer and secure sums are exact
either way). With k >= N nothing is chunked and the bits are the unchunked round's.
`fb.trace`, `fb.export_tff` and `check_parity`'s export see the unchunked program: the
exported proto is the same for every k. Data that does not fit on the device can be fed
chunk by chunk from the host instead (`fax_bridge.local.chunk_stream.stream_clients`).
`clients_per_step="auto"` is resolved by `fax_bridge.local.chunk_size`; a program declared with
`progress=True` shows a tqdm bar of each trip's clients (`Progress`), under jit too.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import core
from jax._src.interpreters import ad
from jax.custom_derivatives import SymbolicZero

from fax_bridge.local import jit as _local
from fax_bridge.language import jax_compat as _compat
from fax_bridge.language import lowering as _lowering
from fax_bridge.language import primitives as P
# sizing (`clients_per_step="auto"`) lives in chunk_size; its names stay readable here
from fax_bridge.local.chunk_size import (  # noqa: F401
    compiled_bytes, fitting_chunk, memory_limit, round_bytes)
from fax_bridge.errors import ArgumentError
from fax_bridge.language.member_rules import member_params
from fax_bridge.language.placements import Placement

# --------------------------------------------------------------------------- values


@dataclasses.dataclass(frozen=True)
class Streamed:
    """Leaf `index` of an argument whose clients arrive chunk by chunk
    (`chunk_stream`): only client work may read it."""
    index: int


@dataclasses.dataclass(frozen=True)
class _Shared:
    """A broadcast not yet materialized: every member sees `value`."""
    value: Any
    params: dict


@dataclasses.dataclass(frozen=True)
class _Pending:
    """A CLIENTS value a phase computes chunk by chunk (slot `slot` of `phase`)."""
    phase: "_Phase"
    slot: int


@dataclasses.dataclass(frozen=True)
class _Aggregate:
    """A SERVER value a phase accumulates (result `index` of its aggregation `op`)."""
    phase: "_Phase"
    op: int
    index: int


# --------------------------------------------------------------------------- aggregations
# Each aggregation a phase may hold: (partials of one chunk, the finished result from
# the partials summed over the chunks). Partials add, so chunks combine in any grouping.


def _sum_partials(x, *, clients, axis, mesh, **_):
    return [_lowering.clients_sum(x, reduce=mesh is not None)]


def _sum_finish(totals, x_aval, **_):
    return [totals[0].astype(x_aval.dtype)]  # partials accumulate wide: rounded once


def _mean_finish(totals, x_aval, *, clients, **_):
    return [(totals[0] / clients).astype(x_aval.dtype)]


def _weighted_partials(x, w, *, clients, axis, mesh):
    reduce = mesh is not None
    return [_lowering.clients_sum(x, w, reduce=reduce), _lowering.clients_sum(w, reduce=reduce)]


def _weighted_finish(totals, x_aval, w_aval, **_):
    num, den = totals
    den = den.astype(num.dtype)
    return [(num / lax.expand_dims(den, tuple(range(den.ndim, num.ndim))))
            .astype(x_aval.dtype)]


def _decode_partials(*args, jaxpr, clients, name, axis, mesh):
    return _lowering.IMPLEMENTATIONS[P.federated_decode_sum_p](
        *args, jaxpr=jaxpr, clients=clients, name=name, axis=axis, mesh=mesh)


def as_is(totals, *avals, **params):
    """The finish of an aggregation whose partials are its result: the summed partials."""
    del avals, params
    return list(totals)


_AGGREGATIONS: dict[core.Primitive, tuple[Callable, Callable]] = {
    P.federated_sum_p: (_sum_partials, _sum_finish),
    P.federated_mean_p: (_sum_partials, _mean_finish),
    P.federated_weighted_mean_p: (_weighted_partials, _weighted_finish),
    P.federated_decode_sum_p: (_decode_partials, as_is),
}


def register_aggregation(prim: core.Primitive, partials: Callable, finish: Callable) -> None:
    """How chunks run aggregation `prim`: `partials(*chunk operands, **params)` gives a
    list of arrays that add across chunks, `finish(totals, *operand avals, **params)` the
    results from their sums (`params["clients"]` is the chunk's size, then the cohort's).
    A first derivative never differentiates them (it is the primitive's own JVP rule,
    run in chunks: `differentiable`), but a derivative of a derivative differentiates
    that chunked run, so finish(sum of partials) must differentiate as the primitive's
    rule: partials that are integer codes carry the derivative on a float partial
    beside them (`lowering.derivative_of`, as the secure mean does), or refuse it as the
    rule does. Modules defining aggregations register them beside the primitive."""
    _AGGREGATIONS[prim] = (partials, finish)


def _aggregation(prim: core.Primitive) -> Optional[tuple[Callable, Callable]]:
    return _AGGREGATIONS.get(prim)


# --------------------------------------------------------------------------- phases


@dataclasses.dataclass
class _Op:
    kind: str  # "map", "local" or "aggregate"
    eqn: core.JaxprEqn
    ins: list  # ("chunk", i) | ("shared", i) | ("slot", i)
    outs: list  # slots (map, local) or None (aggregate)
    params: Optional[dict] = None  # a local equation's member params


class _Phase:
    """Client work of one trip: ops run on every chunk, their aggregates accumulated."""

    def __init__(self, clients: int, axis: str, mesh):
        self.clients, self.axis, self.mesh = clients, axis, mesh
        self.ops: list[_Op] = []
        self.chunked: list = []  # N-leading arrays, sliced per chunk
        self.shared: list = []  # whole values every member sees
        self.slot_vars: list = []
        self.aggregate_vars: list = []  # the outvars of each aggregation
        self.result: Optional[tuple] = None  # (slot values, aggregate results) once run

    def operand(self, value, is_shared: bool) -> tuple:
        pool, kind = (self.shared, "shared") if is_shared else (self.chunked, "chunk")
        for i, v in enumerate(pool):
            if v is value:
                return (kind, i)
        pool.append(value)
        return (kind, len(pool) - 1)

    def new_slots(self, outvars) -> list[int]:
        first = len(self.slot_vars)
        self.slot_vars.extend(outvars)
        return list(range(first, len(self.slot_vars)))


def run_chunk(phase: _Phase, size: int, chunked: Sequence, shared: Sequence,
              keep: Sequence[int]):
    """Runs `phase`'s ops on one chunk of `size` clients: (each aggregation's partials,
    the kept slots)."""
    slots: dict[int, Any] = {}
    partials = []

    def value(ref):
        kind, i = ref
        if kind == "chunk":
            return _local.place_leading(chunked[i], phase.axis, phase.mesh)
        return shared[i] if kind == "shared" else slots[i]

    for op in phase.ops:
        args = [value(r) for r in op.ins]
        is_shared = tuple(r[0] == "shared" for r in op.ins)
        if op.kind == "map":
            outs = _lowering.IMPLEMENTATIONS[P.federated_map_p](
                *args, **dict(op.eqn.params, clients=size), shared=is_shared)
        elif op.kind == "local":
            outs = _member_apply(op, args, is_shared, size)
        else:
            partial_fn, _ = _aggregation(op.eqn.primitive)
            args = [jnp.broadcast_to(a, (size,) + jnp.shape(a)) if s else a
                    for a, s in zip(args, is_shared)]
            partials.append(partial_fn(*args, **dict(op.eqn.params, clients=size)))
            continue
        for slot, o in zip(op.outs, outs):
            slots[slot] = o
    return partials, [slots[s] for s in keep]


def _member_apply(op: _Op, args, is_shared, size: int):
    eqn = op.eqn
    if op.params.get("__identity__"):
        return [args[0]]
    prim = eqn.primitive

    def member(*a):
        out = prim.bind(*a, **prim.get_bind_params(op.params))
        return out if prim.multiple_results else [out]

    return jax.vmap(member, in_axes=[None if s else 0 for s in is_shared],
                    axis_size=size)(*args)


def _split(x, steps: int, k: int):
    """The first steps * k members as [k, steps, ...]: chunk c is column c, clients c,
    c + steps, c + 2 steps, ... (a reshape: no copy)."""
    return x[: steps * k].reshape((k, steps) + x.shape[1:])


def _column(x, c):
    return lax.dynamic_index_in_dim(x, c, axis=1, keepdims=False)


def unstrided(ys, steps: int, k: int):
    return jnp.swapaxes(ys, 0, 1).reshape((steps * k,) + ys.shape[2:])


def scan_chunks(phase: _Phase, k: int, keep: Sequence[int], read: Optional[Callable] = None,
                progress: bool = False) -> None:
    """Runs `phase` over the cohort in chunks of `k` (a `lax.scan`, then the tail): sets
    `phase.result`. The phase's `Streamed` operands come from `read(i, size, indices)`,
    chunk i's arrays of those streamed leaves (i = N // k for the tail); `progress`
    shows a tqdm bar of the clients done."""
    steps, tail = divmod(phase.clients, k)
    devices = 1 if phase.mesh is None else dict(
        zip(phase.mesh.axis_names, phase.mesh.axis_sizes)).get(phase.axis, 1)
    if k % devices:
        raise ArgumentError(
            f"clients_per_step={k} does not split over the mesh axis {phase.axis!r} of "
            f"{devices} devices; use a multiple of {devices} so each device runs its share "
            "of every chunk.")
    shared = list(phase.shared)
    streamed = [x.index for x in phase.chunked if isinstance(x, Streamed)]
    split = [None if isinstance(x, Streamed) else _split(x, steps, k) for x in phase.chunked]
    tick = Progress(phase.clients, k).tick if progress else None

    def fetched(i, size):
        return read(i, size, streamed) if streamed else []

    def chunk_at(c, split, shared, got):
        got = iter(got)
        return run_chunk(phase, k, [next(got) if x is None else _column(x, c) for x in split],
                         shared, keep)

    step = jax.checkpoint(chunk_at, prevent_cse=False)
    shapes, _ = jax.eval_shape(lambda c: step(c, split, shared, fetched(c, k)), 0)
    zeros = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)

    def body(totals, c):
        if tick:
            jax.debug.callback(tick, c)
        partials, kept = step(c, split, shared, fetched(c, k))
        return jax.tree_util.tree_map(jnp.add, totals, partials), kept

    totals, ys = lax.scan(body, zeros, jnp.arange(steps))
    kept = [unstrided(y, steps, k) for y in ys]
    if tail:
        if tick:
            jax.debug.callback(tick, steps)
        got = iter(fetched(steps, tail))
        rest = [next(got) if isinstance(x, Streamed) else x[steps * k:] for x in phase.chunked]
        partials, tail_kept = run_chunk(phase, tail, rest, shared, keep)
        totals = jax.tree_util.tree_map(jnp.add, totals, partials)
        kept = [jnp.concatenate([a, b]) for a, b in zip(kept, tail_kept)]
    finish(phase, totals, kept, keep)


class Progress:
    """A tqdm bar of a phase's clients, advanced by `tick(i)` as chunk i starts (in any
    order: a jitted round's callbacks are not ordered); a new bar each round."""

    def __init__(self, clients: int, k: int):
        self.clients, self.k = clients, k
        self.steps, self.tail = divmod(clients, k)
        self.bar, self.done = None, 0

    def tick(self, i) -> None:
        from fax_bridge.system.progress import bar as tqdm
        if self.bar is None:
            self.bar = tqdm(total=self.clients, unit="client", leave=False,
                            desc=f"clients, {self.k} a step")
        size = self.tail if int(i) >= self.steps else self.k
        self.bar.update(size)
        self.done += size
        if self.done >= self.clients:
            self.bar.close()
            self.bar, self.done = None, 0


def finish(phase: _Phase, totals: list, kept: list, keep: Sequence[int]) -> None:
    """Sets `phase.result` from each aggregation's summed partials and the kept slots."""
    aggregates = [op for op in phase.ops if op.kind == "aggregate"]
    results = [_aggregation(op.eqn.primitive)[1](
        t, *[v.aval for v in op.eqn.invars], **op.eqn.params)
        for op, t in zip(aggregates, totals)]
    phase.result = (dict(zip(keep, kept)), results)


# --------------------------------------------------------------------------- interpreter


class Interpreter:
    """Evaluates a program's jaxpr with its client phases run in chunks of `k` by
    `execute(phase, k, kept slots)` (default: a `lax.scan` over the chunks)."""

    def __init__(self, jaxpr: core.Jaxpr, clients: int, axis: str, k: int,
                 execute: Optional[Callable] = None):
        self.jaxpr, self.clients, self.axis, self.k = jaxpr, clients, axis, k
        self.execute = execute or scan_chunks
        self.env: dict = {}
        self.phase: Optional[_Phase] = None
        self.consumers: dict = {}
        self.outvars = {v for v in jaxpr.outvars if not isinstance(v, core.Literal)}
        for i, eqn in enumerate(jaxpr.eqns):
            for v in eqn.invars:
                if not isinstance(v, core.Literal):
                    self.consumers.setdefault(v, set()).add(i)
        self.members: dict = {}  # phase -> eqn indices it holds

    # reading values ------------------------------------------------------------
    def raw(self, v):
        return v.val if isinstance(v, core.Literal) else self.env[v]

    def concrete(self, v):
        value = self.raw(v)
        if isinstance(value, Streamed):
            raise ArgumentError(
                "an argument whose clients arrive chunk by chunk is read outside client "
                "work; only federated_map_clients (and aggregations of its results) may "
                "read it: pass it whole, or move that use into the mapped function.")
        if isinstance(value, (_Pending, _Aggregate)):
            if value.phase.result is None:
                self.flush()
            value = self.raw(v)
        if isinstance(value, _Shared):
            value = P.federated_broadcast_p.bind(self.resolved(value.value), **value.params)
        return value

    def resolved(self, value):
        if isinstance(value, (_Pending, _Aggregate)):
            if value.phase.result is None:
                self.flush()
            slots, aggregates = value.phase.result
            return slots[value.slot] if isinstance(value, _Pending) else \
                aggregates[value.op][value.index]
        return value

    # phases ----------------------------------------------------------------------
    def is_members(self, value) -> bool:
        """A whole N-leading array the current trip may slice into chunks."""
        if isinstance(value, Streamed):
            return True
        return (not isinstance(value, (_Shared, _Pending, _Aggregate))
                and jnp.ndim(value) >= 1 and jnp.shape(value)[0] == self.clients)

    def open_phase(self, mesh) -> _Phase:
        if self.phase is None:
            self.phase = _Phase(self.clients, self.axis, mesh)
            self.members[self.phase] = set()
        return self.phase

    def flush(self) -> None:
        phase, self.phase = self.phase, None
        if phase is None:
            return
        held = self.members[phase]
        keep = [s for s, v in enumerate(phase.slot_vars)
                if v in self.outvars or self.consumers.get(v, set()) - held]
        self.execute(phase, self.k, keep)
        slots, results = phase.result
        for s in keep:
            self.env[phase.slot_vars[s]] = slots[s]
        for outvars, values in zip(phase.aggregate_vars, results):
            for v, value in zip(outvars, values):
                if not isinstance(v, core.DropVar):
                    self.env[v] = value

    def operands(self, eqn: core.JaxprEqn) -> Optional[list]:
        """How each operand of `eqn` enters a chunk: ("slot", i) of the open phase,
        ("chunk", array) sliced, ("shared", value) whole; None when it cannot."""
        found = []
        for v in eqn.invars:
            value = self.raw(v)
            if isinstance(value, _Pending):
                if value.phase is not self.phase:
                    return None
                found.append(("slot", value.slot))
            elif isinstance(value, _Aggregate):
                return None
            elif isinstance(value, _Shared):
                found.append(("shared", value.value))
            else:
                found.append(("chunk" if self.is_members(value) else "shared", value))
        return found

    def lazy_inputs(self, eqn) -> bool:
        return any(isinstance(self.raw(v), (_Pending, _Shared, Streamed)) for v in eqn.invars
                   if not isinstance(v, core.Literal))

    def try_join(self, i: int, eqn: core.JaxprEqn) -> bool:
        prim, params = eqn.primitive, eqn.params
        ours = params.get("axis") == self.axis and params.get("clients") == self.clients
        if prim is P.federated_broadcast_p and ours:
            self.env[eqn.outvars[0]] = _Shared(self.resolved(self.raw(eqn.invars[0])),
                                               dict(params))
            return True
        if prim is P.federated_map_p and ours and params["placement"] == P.CLIENTS:
            kind = "map"
        elif ours and _aggregation(prim) is not None and self.lazy_inputs(eqn):
            kind = "aggregate"
        elif not ours and "clients" not in params and self.lazy_inputs(eqn):
            kind = "local"
        else:
            return False
        if any(isinstance(self.raw(v), _Aggregate) and self.raw(v).phase is self.phase
               for v in eqn.invars if not isinstance(v, core.Literal)):
            self.flush()  # a second trip needs the first one's aggregates
        member = None
        if kind == "local":
            ins = [Placement.CLIENTS if self._placed(v) else Placement.UNPLACED
                   for v in eqn.invars]
            member = member_params(eqn, ins, self.clients)
            if member is None:
                return False
        found = self.operands(eqn)
        if found is None or (kind == "local"
                             and not any(k in ("slot", "chunk") for k, _ in found)):
            return False  # shared operands only: the broadcast is materialized
        phase = self.open_phase(params.get("mesh"))
        refs = [(k, v) if k == "slot" else phase.operand(v, k == "shared")
                for k, v in found]
        self.members[phase].add(i)
        if kind == "aggregate":
            index = len(phase.aggregate_vars)
            phase.aggregate_vars.append(list(eqn.outvars))
            phase.ops.append(_Op(kind, eqn, refs, None))
            for j, v in enumerate(eqn.outvars):
                self.env[v] = _Aggregate(phase, index, j)
        else:
            slots = phase.new_slots(eqn.outvars)
            phase.ops.append(_Op(kind, eqn, refs, slots, member))
            for v, s in zip(eqn.outvars, slots):
                self.env[v] = _Pending(phase, s)
        return True

    def _placed(self, v) -> bool:
        if isinstance(v, core.Literal):
            return False
        value = self.raw(v)
        return isinstance(value, (_Pending, _Shared)) or self.is_members(value)

    def run(self, consts, args):
        for v, c in zip(self.jaxpr.constvars, consts):
            self.env[v] = c
        for v, a in zip(self.jaxpr.invars, args):
            self.env[v] = a
        for i, eqn in enumerate(self.jaxpr.eqns):
            if self.try_join(i, eqn):
                continue
            invals = [self.concrete(v) for v in eqn.invars]
            outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
            if not eqn.primitive.multiple_results:
                outs = [outs]
            for v, o in zip(eqn.outvars, outs):
                if not isinstance(v, core.DropVar):
                    self.env[v] = o
        return [self.concrete(v) for v in self.jaxpr.outvars]


def trace_flat(fn: Callable, args: tuple, kwargs: dict, lift_consts: bool = False):
    """`fn(*args, **kwargs)` as a jaxpr of the flat argument leaves: (jaxpr, consts,
    flat leaves, a function giving the output treedef once traced). With `lift_consts`
    the values it closes over are the jaxpr's leading inputs instead (the consts
    returned are then those values and the jaxpr has no consts of its own)."""
    flat, in_tree = jax.tree_util.tree_flatten((args, kwargs))
    store = {}

    def flat_fn(*leaves):
        a, kw = jax.tree_util.tree_unflatten(in_tree, leaves)
        out = fn(*a, **kw)
        out_leaves, store["tree"] = jax.tree_util.tree_flatten(out)
        return out_leaves

    avals = [core.typeof(x) if not isinstance(x, jax.ShapeDtypeStruct)
             else core.ShapedArray(x.shape, x.dtype) for x in flat]
    closed, lifted = _compat.trace_lifting(flat_fn, avals, "chunked program",
                                           lambda c: lift_consts)
    if lift_consts:
        return closed, lifted, flat, lambda: store["tree"]
    return closed.jaxpr, closed.consts, flat, lambda: store["tree"]


def run(fn: Callable, clients: int, axis: str, k: int, args: tuple, kwargs: dict,
        progress: bool = False):
    """Runs `fn(*args, **kwargs)` (a program's body, inside its placement context) with
    its client phases in chunks of `k` clients (a tqdm bar of each with `progress`)."""
    closed, consts, flat, out_tree = trace_flat(fn, args, kwargs, lift_consts=True)
    outs = differentiable(closed, clients, axis, k, progress)(*consts, *flat)
    return jax.tree_util.tree_unflatten(out_tree(), outs)


def differentiable(closed: _compat.ClosedJaxpr, clients: int, axis: str, k: int,
                   progress: bool = False) -> Callable:
    """`closed` run in chunks of `k` clients, differentiated by its primitives' own rules.

    Differentiating the chunked evaluation itself would differentiate how each
    aggregation is split into chunks (a secure mean's integer codes, a decode-sum's
    decoder) rather than the aggregation: the JVP is instead that of the unchunked
    jaxpr (each federated primitive's own JVP rule, so what it refuses is refused
    alike), itself run in chunks outside any `custom_jvp`: `jax.linearize` and
    `jax.grad` split that run, chunk scan by chunk scan, into the values known from the
    primals (the primal outputs among them) and the linear rest they transpose. (From
    jax 0.12 partial evaluation no longer looks inside a `custom_jvp` whose inputs are
    unknown: one around the JVP's run would leave its primal outputs unknown.)

    A derivative of the derivative differentiates that run of the JVP directly: its
    chunk scans, the maps' implementations and the aggregations' partials, each of
    which differentiates as its primitive's rule does (`register_aggregation`,
    `lowering.derivative_of`), so every order equals the unchunked program's.
    """
    execute = functools.partial(scan_chunks, progress=progress)

    @jax.custom_jvp
    def call(*values):
        return Interpreter(closed.jaxpr, clients, axis, k, execute).run(closed.consts, values)

    def jvp(primals, tangents):
        nonzeros = [type(t) is not SymbolicZero for t in tangents]
        jvp_closed, out_nonzeros = ad.jvp_jaxpr(closed, nonzeros, instantiate=False)
        outs = Interpreter(jvp_closed.jaxpr, clients, axis, k, execute).run(
            jvp_closed.consts, [*primals, *[t for t, nz in zip(tangents, nonzeros) if nz]])
        primals_out, nz_tangents = outs[:len(out_nonzeros)], iter(outs[len(out_nonzeros):])
        return primals_out, [next(nz_tangents) if nz else SymbolicZero(a.to_tangent_aval())
                             for nz, a in zip(out_nonzeros, closed.out_avals)]

    call.defjvp(jvp, symbolic_zeros=True)
    return call
