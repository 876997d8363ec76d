"""A round's client part on the accelerator, a chunk of clients at a time.

Where a round runs on the device (`device_sums.on_device`) and every aggregation of its
client part is one the device finishes (`device_sums.KINDS` of tensors it sums), the
clients run `clients_per_step` at a time, each chunk in ONE compiled program (the chunk
step): the batched client call (`client_map.batch`) and the chunk's results added into
the aggregations' running exact sums (`device_sums.Layout.add`), which the step takes
donated and gives back. No client's result outlives its chunk, so the device holds the
model, one chunk's work and the sums whatever the cohort. The sums are integers, so the
result has the same bits whatever the chunks (the host's: `device_sums`). The step
compiles once per chunk size and layout (ahead of time: what is sized is what runs); the
last chunk's missing clients are padding rows, never computed nor summed.

How many clients a chunk (`chunk_size`): a whole number as given; None or "auto" sizes
the chunk by what its compiled step holds (`memory_analysis()`: arguments, results and
temporaries, `local.chunk_size.compiled_bytes`) against `step_budget()` (1 GiB unless
`FAX_BRIDGE_STEP_BYTES` says, at most the device's memory), with the jit path's search
(`local.chunk_size.largest_fitting`: the cohort where it fits, else the largest power of
two below it that does), logged there and kept per round layout. Beyond the budget the
chunk stops growing with the cohort, so the round's memory is flat in it.

Where an element's addends spread wider than the sums' window (`device_exact`, flagged
in the program and read back once at the end) the chunks run again with the dtypes'
whole ranges. That variant (its step, its empty sums and its finishing programs) is
compiled beside the first round of a layout, on a thread while the round runs, so that
no later round compiles when its data change scale. `progress` shows a tqdm bar of the
clients as chunks finish.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import math
import threading
from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from fax_bridge.errors import ArgumentError
from fax_bridge.local import chunk_size as sizing
from fax_bridge.runtime import aggregation, client_map, device_exact, device_sums
from fax_bridge.system import env_settings

LOG = logging.getLogger(__name__)
BUDGET_VARIABLE = "FAX_BRIDGE_STEP_BYTES"  # the budget of None / "auto" (`step_budget`)
# Where a backend reports no memory_analysis(): a chunk step's temporaries as a multiple
# of its results (measured: 6.7x at 64 and at 128 rows of a 1M-parameter FedAvg round's
# step, CPU, jax 0.10.2; 2x at 16 rows)
TEMP_PER_RESULT = 7
WHAT = "exported round's chunk step"

_lock = threading.Lock()
_steps: dict = {}   # (batch's traced call, layouts, spans, rows, specs) -> _Step
_chosen: dict = {}  # (the round's layout, the option, the budget) -> clients a chunk
_twins: dict = {}   # the same key as _steps -> the whole-range twin being compiled
_last: dict = {}    # "step": the _Step run last
_pool: list = []    # the one thread that compiles whole-range twins


@dataclasses.dataclass(frozen=True)
class _Step:
    """A compiled chunk step (`run(states, shared leaves, member leaves, count)`, the
    states donated) and the sums of no clients it starts from (`empty()`)."""

    run: Any
    empty: Any


def step_budget() -> int:
    """The bytes a chunk step may hold when `clients_per_step` is None or "auto":
    `FAX_BRIDGE_STEP_BYTES` (1 GiB unless set), at most `local.chunk_size.memory_limit()`
    (the device allocator's limit; half the host's memory on a CPU)."""
    return min(env_settings.whole_number(BUDGET_VARIABLE), sizing.memory_limit())


def chunk_size(requested: Union[int, str, None], count: int,
               need: Optional[Callable[[int], int]] = None,
               budget: Optional[int] = None) -> int:
    """Clients a chunk of a cohort of `count`: `requested` (an int >= 1), at most the
    cohort and `client_map.MAX_ROWS`; for None or "auto", the largest size (the cohort,
    or a power of two from 2 below it; a chunk step holds at least 2 rows) whose step
    holds at most `budget` bytes (default `step_budget()`) by `need(k)` (the compiled
    step's bytes at k clients), found and logged by `local.chunk_size.largest_fitting`;
    the smallest when none fits."""
    top = max(1, min(count, client_map.MAX_ROWS))
    if requested is None or requested == "auto":
        if top == 1:
            return 1
        if need is None:
            raise TypeError("chunk_size(None or 'auto', ...) needs need(k), the bytes of "
                            "the chunk step at k clients")
        sizes = [1 << i for i in range(1, top.bit_length()) if (1 << i) < top] + [top]
        return sizing.largest_fitting(
            sizes, need, step_budget() if budget is None else budget,
            f"clients_per_step={requested!r} for the exported round", WHAT)
    if isinstance(requested, (int, np.integer)) and not isinstance(requested, bool) \
            and requested >= 1:
        return min(int(requested), top)
    raise ArgumentError(f"clients_per_step={requested!r}: expected a whole number of "
                        "clients >= 1, \"auto\" or None")


def client_partials(fn: Any, key: str, sent: Any, members: Sequence, specs: list,
                    clients_per_step: Union[int, str, None] = None,
                    progress: bool = False) -> Optional[list]:
    """The client part `fn` over the clients' `members` with the broadcast values `sent`,
    its aggregations (`specs`, as `round_split.client_partials` takes them) summed on
    the device chunk by chunk: one `aggregation.Partial` per spec; None where some
    aggregation is not one the device finishes or the clients cannot run batched (the
    caller then runs them as before)."""
    if not members or any(kind not in device_sums.KINDS for kind, *_ in specs):
        return None
    # at least 2 rows, as every batched call has (`client_map.bucket`: a client's bits
    # must not depend on its chunk); a chunk of 1 leaves the second row padding
    probe = client_map.batch(fn, members, sent, 2, key=key)
    if probe is None:
        return None
    aggregations = _aggregations(probe, specs)
    if aggregations is None:
        return None
    layouts = tuple(layout for layout, _ in aggregations)
    spans = tuple(span for _, span in aggregations)
    shapes = _Shapes.of(probe)

    def batch_of(k: int) -> Optional[client_map.Batch]:
        return probe if max(2, k) == 2 else client_map.batch(fn, members, sent, max(2, k),
                                                             key=key)

    k = _chosen_size(clients_per_step, probe, batch_of, layouts, spans, shapes)
    batch = batch_of(k)
    if batch is None:
        return None
    step_key = (batch.traced, layouts, spans, batch.rows, shapes.key)
    step = _compiled(step_key, lambda: _compile(batch, layouts, spans, shapes))
    twin = _twin(step_key, batch, layouts, spans, shapes)
    states = _run(step, batch, k, progress)
    if bool(jax.device_get(_any_overflow(states))):
        LOG.info("the exported round's sums: some element's clients spread past the sums' "
                 "window (at least %d bits); summing its %d clients again over the dtypes' "
                 "whole ranges", device_exact.WINDOW_SPREAD, batch.count)
        layouts = tuple(layout.widened() for layout in layouts)
        states = None  # freed before the whole-range sums start: never both at once
        states = _run(twin.result(), batch, k, progress)
    else:
        _settle(step_key, twin)  # compiled with the first round, not in a later one
    return [aggregation.device_sums_partial(device_sums.DeviceSums(layout, state,
                                                                   batch.count))
            for layout, state in zip(layouts, states)]


def _aggregations(batch: client_map.Batch, specs: list) -> Optional[list]:
    """Per spec: (its `device_sums.Layout`, (the span of result leaves it sums, the
    index of its weight leaf or None)); None where the device does not sum one."""
    out = []
    for kind, vi, wi, *_ in specs:
        start, stop = batch.leaves_of(vi)
        tensors = tuple((np.dtype(d), tuple(s)) for s, d in batch.result_specs[start:stop])
        weight = None
        if wi is not None:
            w_start, w_stop = batch.leaves_of(wi)
            shape, weight = batch.result_specs[w_start]
            if w_stop - w_start != 1 or int(np.prod(shape)) != 1:
                return None
        dtypes = [d for d, _ in tensors] + ([] if weight is None else [weight])
        if not all(device_sums.supports(d) for d in dtypes) or (
                kind != "sum" and any(np.dtype(d).kind in "iub" for d in dtypes)):
            return None
        layout = device_sums.Layout(kind, tensors, None if weight is None
                                    else np.dtype(weight), batch.count)
        out.append((layout, (start, stop, None if wi is None else w_start)))
    return out


@jax.jit
def _any_overflow(states: tuple) -> jax.Array:
    flags = [device_sums.overflow(state) for state in states]
    return functools.reduce(jnp.logical_or, flags, jnp.zeros((), bool))


@dataclasses.dataclass(frozen=True)
class _Shapes:
    """The chunk step's inputs besides the sums: the shared leaves' and one client's
    member leaves' (shape, dtype)."""

    shared: tuple
    member: tuple

    @staticmethod
    def of(probe: client_map.Batch) -> "_Shapes":
        """Read off a batch (its first member padded to its rows: no cohort stacked)."""
        def spec(x, lead: int = 0):
            return tuple(np.shape(x)[lead:]), np.dtype(getattr(x, "dtype", None)
                                                       or np.asarray(x).dtype)
        return _Shapes(tuple(spec(x) for x in probe.shared_leaves),
                       tuple(spec(x, 1) for x in probe.members(0, 1)))

    @property
    def key(self) -> tuple:
        return self.shared, self.member

    def specs(self, rows: int) -> tuple:
        return ([jax.ShapeDtypeStruct(s, d) for s, d in self.shared],
                [jax.ShapeDtypeStruct((rows, *s), d) for s, d in self.member])

    def argument_bytes(self, rows: int) -> int:
        return sum(math.prod(s) * d.itemsize for s, d in self.shared) + rows * sum(
            math.prod(s) * d.itemsize for s, d in self.member)


def _chosen_size(requested: Union[int, str, None], probe: client_map.Batch,
                 batch_of: Callable, layouts: tuple, spans: tuple, shapes: _Shapes) -> int:
    """`chunk_size` for this round, its steps compiled to measure them where the option
    is None or "auto" (the chosen step kept for the run; the choice kept per round
    layout and budget)."""
    if not (requested is None or requested == "auto"):
        return chunk_size(requested, probe.count)
    budget = step_budget()
    key = (probe.traced, layouts, spans, shapes.key, requested, budget)
    with _lock:
        if key in _chosen:
            return _chosen[key]
    made: dict = {}

    def need(k: int) -> Optional[int]:
        batch = batch_of(k)
        if batch is None:  # not batched at k rows: no step to size (the caller falls back)
            return None
        with _lock:  # a step this process compiled before (another option, say)
            step = _steps.get((batch.traced, layouts, spans, batch.rows, shapes.key))
        made[k] = (batch, step or _compile(batch, layouts, spans, shapes))
        return _step_bytes(made[k][1], batch, shapes)

    k = chunk_size(requested, probe.count, need, budget)
    if k in made:
        batch, step = made[k]
        _compiled((batch.traced, layouts, spans, batch.rows, shapes.key), lambda: step)
    with _lock:
        _chosen[key] = k
    return k


def _step_bytes(step: _Step, batch: client_map.Batch, shapes: _Shapes) -> int:
    """What the compiled step holds at once (`local.chunk_size.compiled_bytes`); where
    the backend reports no `memory_analysis()`, its arguments and results and
    `TEMP_PER_RESULT` times the results in temporaries (the sums, donated, counted
    once)."""
    try:
        return sizing.compiled_bytes(step.run)
    except ValueError:
        sums = sum(math.prod(leaf.shape) * leaf.dtype.itemsize
                   for leaf in jax.tree.leaves(step.empty.out_info))
        results = batch.rows * sum(math.prod(s) * np.dtype(d).itemsize
                                   for s, d in batch.result_specs)
        LOG.info("this backend reports no memory_analysis() of the %s: estimated from its "
                 "arguments and %d times its results (%d bytes) in temporaries", WHAT,
                 TEMP_PER_RESULT, results)
        return sums + shapes.argument_bytes(batch.rows) + (1 + TEMP_PER_RESULT) * results


def _run(step: _Step, batch: client_map.Batch, k: int, progress: bool) -> list:
    """The running sums after every chunk of `k` clients of the cohort."""
    states = step.empty()
    _last["step"] = step
    bar = None
    if progress:
        from fax_bridge.system.progress import bar as tqdm
        bar = tqdm(total=batch.count, unit="client", leave=False,
                   desc=f"clients, {k} a step")
    try:
        for start in range(0, batch.count, k):
            size = min(k, batch.count - start)
            states = step.run(states, batch.shared_leaves, batch.members(start, start + size),
                              np.int32(size))
            if bar is not None:
                jax.block_until_ready(states)  # the bar follows the device, not dispatch
                bar.update(size)
    finally:
        if bar is not None:
            bar.close()
    return states


def step_memory() -> Any:
    """The `memory_analysis()` of the chunk step this process ran last, or None before
    any."""
    return _last["step"].run.memory_analysis() if "step" in _last else None


def _compiled(key: tuple, make: Callable[[], _Step]) -> _Step:
    """The step kept under `key`, made (compiled) the first time."""
    with _lock:
        if key in _steps:
            return _steps[key]
    step = make()
    with _lock:
        return _steps.setdefault(key, step)


def _compile(batch: client_map.Batch, layouts: tuple, spans: tuple,
             shapes: _Shapes) -> _Step:
    """The chunk step of `batch`'s rows for sums of `layouts`, compiled ahead of time."""
    rows, specs, traced = batch.rows, batch.result_specs, batch.traced

    def step(states, shared_leaves, member_leaves, count):
        outputs = tuple(jnp.zeros((rows, *shape), dtype) for shape, dtype in specs)
        results = traced(shared_leaves, member_leaves, count, outputs)
        valid = jnp.arange(rows) < count
        return [layout.add(state, results[start:stop], valid,
                           None if w is None else results[w])
                for layout, (start, stop, w), state in zip(layouts, spans, states)]

    shared, members = shapes.specs(rows)
    empty = _empty(layouts)
    run = jax.jit(step, donate_argnums=0).lower(
        empty.out_info, shared, members, jax.ShapeDtypeStruct((), np.int32)).compile()
    return _Step(run, empty)


@functools.lru_cache(maxsize=64)
def _empty(layouts: tuple) -> Any:
    """The sums of no clients of `layouts`, compiled (one program whatever the rows)."""
    return jax.jit(lambda: [layout.empty() for layout in layouts]).lower().compile()


def _twin(key: tuple, batch: client_map.Batch, layouts: tuple, spans: tuple,
          shapes: _Shapes) -> concurrent.futures.Future:
    """The step of the same chunks over the dtypes' whole ranges, with the programs that
    finish its sums (`device_sums.compile_finish`): compiled on a thread beside the first
    round of a layout (kept: later rounds find it done)."""
    with _lock:
        if key in _twins:
            return _twins[key]
        wide = tuple(layout.widened() for layout in layouts)

        def make() -> _Step:
            step = _compiled(key[:1] + (wide,) + key[2:],
                             lambda: _compile(batch, wide, spans, shapes))
            for layout in wide:
                device_sums.compile_finish(layout)
            return step

        if not _pool:
            _pool.append(concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="fax-bridge-whole-range-sums"))
        _twins[key] = _pool[0].submit(make)
        return _twins[key]


def _settle(key: tuple, twin: concurrent.futures.Future) -> None:
    """Waits for the whole-range twin compiled beside this round; a twin that failed to
    compile (the device refusing it for memory, say) is dropped, logged, and compiled
    again by the round that needs it, which then raises its error."""
    error = twin.exception()
    if error is not None:
        with _lock:
            _twins.pop(key, None)
        LOG.warning("the %s over the dtypes' whole ranges did not compile (%s); a round "
                    "whose values spread past the sums' window will compile it again",
                    WHAT, error)
