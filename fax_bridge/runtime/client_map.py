"""Runs one local computation over many clients, as one XLA call where it can.

`map_clients` is the one place fax_bridge maps a local computation (see `local_eval`)
over clients: a device's `Map` and `Round`, the in-process backend's map and a round
split's client part all call it, so they all give the same bits. `map_clients_stacked`
is its batched run with the results left stacked over clients (`Stacked`), for callers
that aggregate them (a round split's client part) and so never need them per client;
`batch` hands the batched loop, uncompiled, to a caller that compiles it into a program
of its own (`device_rounds`: each chunk's results summed in the same program).

Batched: when the computation has a parameter and the clients' members (and the shared
part, if any) are tensors, or Structs of tensors, of one layout (the same names, shapes
and dtypes for every client), the members are stacked along a leading clients axis,
padded up to a power-of-two bucket (at least 2) with copies of the first client, and
the whole computation runs as ONE jitted call over the bucket's rows: by default XLA's
loop over the first `count` rows, each part called as its module (`call_traced`). With
`FAX_BRIDGE_VMAP_CLIENTS=1`, where every `Xla` part inside it reads as lax operations
(`HloExecutable.lax_program`, `hlo_lax`), the rows run as `jax.vmap` of the computation
over the member rows instead (shared leaves unmapped; padding rows computed too, their
results never read), and where one does not, a warning on logger `fax_bridge.runtime`
says, once per computation and reason, which op kept it from vmap and where it comes
from (`_Batched.vmapped` records which ran). The loop is the default because it was the
faster of the two wherever measured (docs/accelerators.md: on a TPU v5e a 35.7M-parameter
round took 0.330 s looped, 0.405 s vmapped, and vmapped chunks hold every row's
activations at once; on a CPU the two were level), and it keeps each part's own bits.
A cohort runs as one call per CPU of this process (`part_size`), at once on the worker
threads (`threads`), each call over its share of the clients and never over
`MAX_ROWS`. The executable is compiled once per (computation, layout, bucket): cohorts
that shrink by dropouts reuse it. It writes its results over arrays it is given
(donated): the results of an earlier call that its caller read once and dropped,
kept for the next call in `buffers` (kind `SPARES`), else new zeros, so that a round
does not fault in and zero fresh memory for every call's results.

Bits: integer results are exact on every path. Looped (the default), matmuls, sums and
elementwise arithmetic give the parts' own executables' bits and a transcendental fused
into a reduction may land an ulp apart, and a client's result has the same bits
whatever cohort, bucket and call it runs in and wherever it sits there (tested: alone,
reversed, in a larger bucket), which is what makes the host path and the device path
(buckets of different sizes) agree bit for bit. Vmapped, XLA fuses the parts'
operations with each other and batches a bucket's rows as one operation, so a client's
float result is within a few ulps of its parts' own executables and may move by an ulp
with the bucket (`tests/test_runtime_client_map.py`: `VMAP_ULPS` of the leaf's scale):
there the host and device paths agree within parity's bounds, not bit for bit.

Per client: otherwise (no parameter, members of different layouts, generic intrinsics on
client values, 64-bit types while jax runs with 32-bit ones, anything the trace refuses)
each client is one call of `compile_local(fn)`, which also gives the clear errors of a
computation that cannot run. The choice is automatic, and remembered per layout. A
computation whose batched call cannot be built (its trace or XLA's compilation fails)
is named in an `UnbatchedWarning` with the reason, once per computation and reason.

Caps: a `Guard` checks time and room around the work: one client at a time, `tick` runs
before each client and `room` after each with the bytes produced so far; batched, `tick`
runs before the calls and after each, and `room` before the first, with the results'
size x clients.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import threading
import warnings
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from federated_language.common_libs import structure
from federated_language.proto import computation_pb2

from fax_bridge.errors import ComputationError, UnbatchedWarning
from fax_bridge.runtime import (buffers, client_layouts, grammar, hlo, hlo_lax, local_eval,
                                threads, xla_function)
from fax_bridge.runtime.backend import ClientRows, LocalValue, as_numpy
from fax_bridge.system import env_settings

LOG = logging.getLogger("fax_bridge.runtime")
NO_SHARED = client_layouts.NO_SHARED  # `shared` when the computation takes the member alone
MAX_ROWS = 1024  # the largest bucket: larger cohorts run as several calls of it
MAX_PAD_BYTES = 64 << 20  # `least_rows` widens a bucket while its padding stays under this


@dataclasses.dataclass(frozen=True)
class Guard:
    """The caller's caps around the clients' work (see the module docstring)."""

    tick: Callable[[], None]
    room: Callable[[int], None]
    size: Callable[[LocalValue], int]


@dataclasses.dataclass(frozen=True)
class _Batched:
    traced: Callable       # traceable: (shared leaves, stacked member leaves, count,
    #                        outputs to write over) -> stacked results
    lowered: Any           # `traced` lowered for this layout and bucket
    result_tree: Any       # the layout of one client's result
    result_specs: tuple    # (shape, dtype) of each result leaf, per client
    rows: int              # the bucket
    vmapped: bool          # rows run as jax.vmap (else as a loop, one after the other)

    @functools.cached_property
    def run(self) -> Callable:
        """`traced` compiled, its outputs donated (on first use: a caller that compiles
        `traced` into its own program never compiles it alone)."""
        return self.lowered.compile()

    @functools.cached_property
    def example(self) -> LocalValue:
        """One client's result of zeros (read-only views), for sizing results."""
        return client_layouts.build(self.result_tree, iter(np.broadcast_to(np.zeros((), dtype), shape)
                                             for shape, dtype in self.result_specs))

    @functools.cached_property
    def output_bytes(self) -> int:
        """The bytes of one call's stacked results."""
        return self.rows * sum(math.prod(shape) * dtype.itemsize
                               for shape, dtype in self.result_specs)

    def outputs(self, reuse: bool) -> tuple:
        """Arrays for a call to write its results over (it takes them donated): with
        `reuse`, an earlier call's results when one is spare (`spare`), else zeros."""
        spare = buffers.take(buffers.SPARES, self) if reuse else None
        if spare is not None:
            return spare
        return tuple(jnp.zeros((self.rows, *shape), dtype) for shape, dtype in self.result_specs)

    def spare(self, outputs: tuple) -> None:
        """Keeps a call's results, read and dropped by its caller, so that a later call
        of this executable writes its results over them instead of over a new buffer:
        allocating and zeroing a fresh one (the page faults of a new mapping) cost about
        20 ms per 40 MB row of a bucket, as much as a client's work at 10M parameters.
        jax writes over a donated array only when no view of it is alive, else it
        allocates anew, so a caller still reading earlier results keeps them intact.
        Kept in `buffers` under the process's one cap: the results of the most recently
        used executable only (a round reuses one), one set per worker thread."""
        buffers.give(buffers.SPARES, self, outputs, self.output_bytes,
                     per_key=threads.workers(), latest_key_only=True)


_lock = threading.Lock()
_batched: dict[tuple, Optional[_Batched]] = {}  # None: this layout runs per client


def bucket(count: int) -> int:
    """The padded number of rows for `count` clients: the next power of two, at least 2
    (XLA simplifies the row slicing of a one-row loop, which can change a result's last
    bit, and a client's bits must not depend on its cohort). Padding rows compute
    nothing, and a call that writes over an earlier call's results (`_Batched.spare`)
    does not touch their share of the output either."""
    return max(2, 1 << max(0, count - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Stacked:
    """The clients' results of a batched run, each result leaf stacked over clients.

    `parts` holds the results of each call of the run in client order (`counts[i]`
    clients in part i): part i's leaf j is leaf j of one client's result (depth first)
    with those clients on a leading axis. `columns` joins them: leaf j of every
    client's result, stacked. The arrays are the caller's own (fresh copies) unless
    the run was asked not to keep them. A caller that aggregates may take the parts one
    by one (`element_parts`) and merge, which spares the copy that joining them costs.
    """

    tree: Any       # the layout of one client's result
    parts: list     # per call, the result leaves over its clients
    counts: list    # per call, how many clients

    @property
    def count(self) -> int:
        return sum(self.counts)

    @functools.cached_property
    def columns(self) -> list:
        """Each result leaf over every client, `[count, *shape]` (the parts joined)."""
        if len(self.parts) == 1:
            return self.parts[0]
        return [np.concatenate(leaf) for leaf in zip(*self.parts)]

    def rows(self) -> Sequence:
        """The clients' results kept stacked (a `ClientRows`: client i's made when asked
        for), or `members()` when the result has no tensors."""
        if not self.columns:
            return self.members()
        return ClientRows(client_layouts.build(self.tree, iter(self.columns)))

    def members(self) -> list:
        """One result per client, as `map_clients` returns them."""
        rows = zip(*self.columns) if self.columns else ([] for _ in range(self.count))
        return [client_layouts.build(self.tree, iter(row)) for row in rows]

    def element(self, index: int) -> list[np.ndarray]:
        """The columns of element `index` of the (struct) result, as a Selection picks
        it on each client."""
        start, stop = self._leaves_of(index)
        return self.columns[start:stop]

    def element_parts(self, index: int) -> list[list[np.ndarray]]:
        """`element(index)` of each part, in client order (nothing joined)."""
        start, stop = self._leaves_of(index)
        return [part[start:stop] for part in self.parts]

    def _leaves_of(self, index: int) -> tuple[int, int]:
        """The span of result leaves that element `index` of the (struct) result holds."""
        if self.tree[0] != "struct":
            raise ComputationError(
                f"Selection of element {index} from a value that is not a struct (tensor)")
        trees = self.tree[2]
        if not 0 <= index < len(trees):
            raise ComputationError(
                f"Selection index {index} is out of range for a struct of {len(trees)} "
                "elements")
        start = sum(_leaf_count(t) for t in trees[:index])
        return start, start + _leaf_count(trees[index])


def _leaf_count(tree: Any) -> int:
    return sum(_leaf_count(t) for t in tree[2]) if tree[0] == "struct" else 1


def map_clients(fn: computation_pb2.Computation, members: Sequence[LocalValue],
                shared: Any = NO_SHARED, *, key: Optional[str] = None,
                no_argument: bool = False, guard: Optional[Guard] = None) -> list:
    """`fn` on each client's member (on `<shared, member>` when `shared` is given), one
    numpy result per client in client order; `no_argument`: `fn()` once per client.

    `key` names `fn`'s content (its hash, when the caller has one). Raises what running
    `fn` on a client raises (`ComputationError` for computations that cannot run).
    """
    if not members:
        return []
    if not no_argument:
        stacked = map_clients_stacked(fn, members, shared, key=key, guard=guard)
        if stacked is not None:
            return stacked.members()
    compiled = local_eval.compile_local(fn)
    results, produced = [], 0
    for member in members:
        if guard is not None:
            guard.tick()
        if no_argument:
            result = as_numpy(compiled())
        elif shared is NO_SHARED:
            result = as_numpy(compiled(member))
        else:
            result = as_numpy(compiled(structure.Struct([(None, shared), (None, member)])))
        if guard is not None:
            produced += guard.size(result)
            guard.room(produced)  # before the next client's compute
        results.append(result)
    return results


def map_clients_stacked(fn: computation_pb2.Computation, members: Sequence[LocalValue],
                        shared: Any = NO_SHARED, *, key: Optional[str] = None,
                        guard: Optional[Guard] = None, keep: bool = True,
                        least_rows: int = 0, on_device: bool = False) -> Optional[Stacked]:
    """`map_clients` for callers that take the results as columns (an aggregation):
    the batched run's results, never split per client; None when there are no clients
    or they run one at a time (then `map_clients` gives their results). `keep=False`:
    the caller reads the results once and drops them, so they may stay read-only views
    of XLA's output (no copy of what may be gigabytes). `least_rows`: run in the bucket
    a cohort of this many clients would take (its `part_size`), so that a caller whose
    cohorts vary in size compiles once, for the largest; the padding rows cost no work and a
    client's bits do not depend on its bucket, but their inputs are stacked, so the
    bucket is widened only while they take under `MAX_PAD_BYTES`. `on_device`: the
    results stay jax arrays on the device, each call's whole bucket of rows (its first
    `counts[i]` rows are its clients'), and a cohort runs as one call per `MAX_ROWS`
    clients (the accelerator, not the CPUs, does the work)."""
    if not members:
        return None
    batch = client_layouts.layouts(members, shared)
    if batch is None:
        return None
    shared_tree, member_tree, shared_leaves, source = batch
    part = min(len(members), MAX_ROWS) if on_device else part_size(len(members))
    rows = bucket(part)
    wider = bucket(part_size(least_rows))
    if wider > rows and (wider - part) * source.row_bytes() <= MAX_PAD_BYTES:
        rows = wider
    plan = _plan(fn, key, shared_tree, member_tree, rows, source.fixed)
    if plan is None or _refused(plan):
        return None
    return _run_batched(plan, part, rows, shared_leaves + source.fixed_leaves(), source,
                        guard, keep, on_device)


def part_size(count: int) -> int:
    """How many clients one batched call runs: a cohort is split into as many parts
    as this process has CPUs (`threads.workers`), run at once, each at most `MAX_ROWS`.
    A loop over clients runs one client after the other, on one core (a client's
    work is too small for XLA to spread it): parts put the other cores to work."""
    return max(1, min(-(-count // threads.workers()), MAX_ROWS))


def _plan(fn, key, shared_tree, member_tree, rows: int,
          fixed: Optional[tuple] = None) -> Optional[_Batched]:
    """The batched executable for this layout and bucket (and `fixed` member leaves),
    compiled on first use; None when this computation or layout runs per client."""
    cache_key = (key or local_eval.content_hash(fn), shared_tree, member_tree, rows, fixed,
                 vmap_clients())
    with _lock:
        if cache_key in _batched:
            return _batched[cache_key]
    try:
        compiled = local_eval.compile_local(fn)
        plan = None
        if vmap_clients():
            reason = _unreadable(fn)
            if reason is None:
                try:
                    plan = _compile(compiled, shared_tree, member_tree, rows, fixed, True)
                except Exception as e:  # noqa: BLE001 - the loop runs it, and says why
                    reason = f"its vmapped trace failed with {type(e).__name__}: {e}"
            if reason is not None:
                _looped(cache_key[0], reason)
        if plan is None:
            plan = _compile(compiled, shared_tree, member_tree, rows, fixed, False)
    except Exception as e:  # what the trace refuses runs per client, which names the problem
        _unbatched(cache_key[0], "its batched trace", e)
        plan = None
    with _lock:
        return _batched.setdefault(cache_key, plan)


def _refused(plan: _Batched) -> bool:
    """Whether XLA refuses to compile the batched executable (those clients then run one
    at a time, which names the problem); remembered as a refused trace is."""
    try:
        plan.run
    except Exception as e:  # noqa: BLE001 - as a refused trace, it runs per client
        with _lock:
            keys = [k for k, p in _batched.items() if p is plan]
            _batched.update(dict.fromkeys(keys))
        _unbatched(keys[0][0] if keys else "?", "XLA's compilation of its batched call", e)
        return True
    return False


def vmap_clients() -> bool:
    """Whether batched rows run as `jax.vmap` where the parts read as lax operations
    (`FAX_BRIDGE_VMAP_CLIENTS=1`; the module docstring says why the loop is the default)."""
    return env_settings.whole_number("FAX_BRIDGE_VMAP_CLIENTS") > 0


def _unreadable(fn: computation_pb2.Computation) -> Optional[str]:
    """Why the clients of `fn` cannot run vmapped: the first Xla part that does not read
    as lax operations (`HloExecutable.lax_program`), and what in it; None when all do."""
    for part in grammar.walk(fn):
        if grammar.which(part) == "xla":
            try:
                xla_function.executable(part.xla.hlo_module.value).lax_program()
            except hlo_lax.Unreadable as e:
                return f"an Xla part does not read as lax operations: {e}"
    return None


def _looped(key: str, reason: str) -> None:
    """Says, once per computation and reason, that its clients run as a loop over rows."""
    with _lock:
        if (key, reason) in _warned:
            return
        _warned.add((key, reason))
    LOG.warning("the clients of computation %s run as a loop over rows, one client after "
                "the other, not vmapped: %s", key[:12], reason[:1000])


_warned: set = set()  # (computation, reason) already warned of


def _unbatched(key: str, stage: str, error: Exception) -> None:
    """Warns, once per computation and reason, that its clients run one call each."""
    reason = f"{type(error).__name__}: {error}"[:1000]
    with _lock:
        if (key, reason) in _warned:
            return
        _warned.add((key, reason))
    warnings.warn(f"the clients of computation {key[:12]} run one call per client, not as "
                  f"one batched call: {stage} failed with {reason}", UnbatchedWarning,
                  stacklevel=4)


def _compile(compiled, shared_tree, member_tree, rows: int, fixed: Optional[tuple],
             vmapped: bool) -> _Batched:
    """The batched executable: (shared leaves, then the `fixed` member leaves; the other
    member leaves stacked over `rows`; count; the arrays to write the results over,
    donated) -> the results stacked over `rows`. `vmapped`: the rows run as `jax.vmap`
    over the member leaves (every Xla part read as lax operations); else as a loop."""
    found: dict = {}
    num_fixed = sum(fixed) if fixed else 0

    def one(shared_leaves, row) -> tuple:
        """One client's result leaves."""
        cut = len(shared_leaves) - num_fixed
        shared = (NO_SHARED if shared_tree is None
                  else client_layouts.build(shared_tree, iter(shared_leaves[:cut])))
        if fixed:
            given, stacked = iter(shared_leaves[cut:]), iter(row)
            row = [next(given) if f else next(stacked) for f in fixed]
        member = client_layouts.build(member_tree, iter(row))
        arg = member if shared is NO_SHARED else structure.Struct(
            [(None, shared), (None, member)])
        out: list = []
        found["tree"] = client_layouts.result_layout(compiled(arg), out)
        return tuple(out)

    def batched(shared_leaves, member_leaves, count, outputs):
        if vmapped:  # every row, padding too; the results take the outputs' buffers
            with hlo.reading_as_lax():
                return tuple(jax.vmap(one, in_axes=(None, 0))(shared_leaves, member_leaves))
        # The loop runs `count` rows: the padding rows give the bucket's shapes, not work,
        # and their share of `outputs` is left as it came.
        def step(i, outs):
            row = [jax.lax.dynamic_index_in_dim(m, i, keepdims=False) for m in member_leaves]
            return tuple(jax.lax.dynamic_update_index_in_dim(o, r, i, 0)
                         for o, r in zip(outs, one(shared_leaves, row)))

        return jax.lax.fori_loop(0, count, step, tuple(outputs))

    def avals(tree, stacked: bool) -> list:
        if tree is None:
            return []
        if tree[0] == "struct":
            return [a for t in tree[2] for a in avals(t, stacked)]
        shape = (rows, *tree[1]) if stacked else tree[1]
        return [jax.ShapeDtypeStruct(shape, np.dtype(tree[2]))]

    shared_in, member_in = avals(shared_tree, False), avals(member_tree, True)
    if fixed:
        shared_in += [a for a, f in zip(avals(member_tree, False), fixed) if f]
        member_in = [a for a, f in zip(member_in, fixed) if not f]
    results = jax.eval_shape(one, shared_in,
                             [jax.ShapeDtypeStruct(m.shape[1:], m.dtype) for m in member_in])
    outputs_in = tuple(jax.ShapeDtypeStruct((rows, *a.shape), a.dtype) for a in results)
    lowered = jax.jit(batched, donate_argnums=3, keep_unused=True).lower(
        shared_in, member_in, jax.ShapeDtypeStruct((), np.int32), outputs_in)
    specs = tuple((tuple(a.shape), np.dtype(a.dtype)) for a in results)
    return _Batched(batched, lowered, found["tree"], specs, rows, vmapped)


@dataclasses.dataclass(frozen=True)
class Batch:
    """A cohort ready to run `rows` clients at a time inside a caller's own program:
    `traced(shared_leaves, members(start, stop), count, outputs)` (traceable) gives
    the stacked result leaves of clients [start, stop) (padded to `rows`; `outputs`:
    zeros of `result_specs` stacked over `rows`); `leaves_of(index)` the span of
    result leaves element `index` of a struct result holds."""

    traced: Callable
    shared_leaves: list
    result_tree: Any
    result_specs: tuple
    rows: int
    count: int
    _source: Any

    def members(self, start: int, stop: int) -> list:
        """The stacked member leaves of clients [start, stop), padded to `rows`."""
        return self._source.chunk(start, stop, self.rows)

    def leaves_of(self, index: int) -> tuple[int, int]:
        return Stacked(self.result_tree, [], [])._leaves_of(index)


def batch(fn: computation_pb2.Computation, members: Sequence[LocalValue], shared: Any,
          rows: int, *, key: Optional[str] = None) -> Optional[Batch]:
    """`fn` over `members` (with `shared`) as a `Batch` of `rows` clients a call, or
    None where the clients cannot run batched (see the module docstring)."""
    if not members:
        return None
    found = client_layouts.layouts(members, shared)
    if found is None:
        return None
    shared_tree, member_tree, shared_leaves, source = found
    plan = _plan(fn, key, shared_tree, member_tree, rows, source.fixed)
    if plan is None:
        return None
    return Batch(plan.traced, shared_leaves + source.fixed_leaves(), plan.result_tree,
                 plan.result_specs, rows, source.count, source)


def _run_batched(plan: _Batched, part: int, rows: int, shared_leaves: list,
                 source: client_layouts.Source, guard: Optional[Guard], keep: bool = True,
                 on_device: bool = False) -> Stacked:
    """Runs the clients `part` at a time, each call padded to `rows`, the calls at once
    on the worker threads (`part_size`); `on_device`: one after the other, their
    results left on the device, padding rows and all."""
    count = source.count
    if guard is not None:
        guard.tick()
        guard.room(guard.size(plan.example) * count)

    def call(start: int) -> tuple[list, tuple]:
        size = min(part, count - start)
        chunk = source.chunk(start, start + size, rows)
        try:
            if on_device:
                return list(plan.run(shared_leaves, chunk, np.int32(size),
                                     plan.outputs(False))), ()
            # Results read once and dropped (not `keep`) are written over by a later call.
            outs = plan.run(shared_leaves, chunk, np.int32(size), plan.outputs(not keep))
            # Copied when kept and padded: no XLA buffer's padding rows stay alive behind
            # the clients' results. Without padding the view holds nothing more, and a
            # copy would cost as much as the clients' work (3.2 GB at 8 x 100M floats).
            return [np.array(np.asarray(o)[:size]) if keep and size < rows
                    else np.asarray(o)[:size] for o in outs], outs
        except Exception as e:
            raise ComputationError(f"XLA execution failed: {e}") from e

    chunks, outputs = [], []
    for done, outs in (threads.pool().map(call, range(0, count, part))
                       if part < count and not on_device
                       else map(call, range(0, count, part))):  # in client order
        chunks.append(done)
        outputs.append(outs)
        if guard is not None:
            guard.tick()
    if not keep and not on_device:  # spare once every call is done (none writes over
        #                             another's); results on the device are the caller's
        for outs in outputs:
            plan.spare(outs)
    counts = [min(part, count - start) for start in range(0, count, part)]
    return Stacked(plan.result_tree, chunks, counts)
