"""A round's client part on the accelerator, a chunk of clients at a time.

Where a round runs on the device (`device_sums.on_device`) and every aggregation of its
client part is one the device finishes (`device_sums.KINDS` of tensors it sums), the
clients run `clients_per_step` at a time, each chunk in ONE compiled program: the batched
client call (`client_map.batch`, XLA's loop over the chunk's clients) and the chunk's
results added into the aggregations' running exact sums (`device_sums.Layout.add`),
which the program takes donated and gives back. No client's result outlives its chunk,
so the device holds the model, one chunk's work and the sums whatever the cohort. The
sums are integers, so the result has the same bits whatever the chunks (the host's:
`device_sums`). The program compiles once per chunk size and layout; the last chunk's
missing clients are padding rows, never computed nor summed.

Where an element's addends spread wider than the sums' window (`device_exact`, flagged
in the program and read back once at the end) the chunks run again with the dtypes'
whole ranges. `progress` shows a tqdm bar of the clients as chunks finish.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from federated_language.common_libs import structure

from fax_bridge.errors import ArgumentError
from fax_bridge.runtime import aggregation, client_map, device_sums

AUTO_BYTES = 1 << 30  # "auto": clients a chunk while their results fit in this many bytes

_lock = threading.Lock()
_steps: dict = {}  # (the batched body, layouts, spans, rows) -> the compiled chunk step
_last: dict = {}  # "step": (the chunk step run last, its arguments' shapes)


def chunk_size(requested: Union[int, str, None], count: int, client_bytes: int) -> int:
    """Clients a chunk: `requested` (an int >= 1), or for None or "auto" as many as
    hold `AUTO_BYTES` of results at `client_bytes` each; at most the cohort and
    `client_map.MAX_ROWS`."""
    if requested is None or requested == "auto":
        k = AUTO_BYTES // max(1, client_bytes)
    elif isinstance(requested, (int, np.integer)) and not isinstance(requested, bool) \
            and requested >= 1:
        k = int(requested)
    else:
        raise ArgumentError(f"clients_per_step={requested!r}: expected a whole number of "
                            "clients >= 1, \"auto\" or None")
    return max(1, min(k, count, client_map.MAX_ROWS))


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
    client_bytes = _bytes(sent) + _bytes(members[0])  # a result about the model's size
    k = chunk_size(clients_per_step, len(members), client_bytes)
    # at least 2 rows, as every batched call has (`client_map.bucket`: a client's bits
    # must not depend on its chunk); a chunk of 1 leaves the second row padding
    batch = client_map.batch(fn, members, sent, max(2, k), key=key)
    if batch is None:
        return None
    aggregations = _aggregations(batch, specs)
    if aggregations is None:
        return None
    for full in (False, True):
        layouts = tuple(layout.widened() if full else layout for layout, _ in aggregations)
        states = _run(batch, k, layouts, tuple(span for _, span in aggregations),
                      progress)
        if full or not bool(jax.device_get(_any_overflow(states))):
            return [aggregation.device_sums_partial(
                device_sums.DeviceSums(layout, state, batch.count))
                    for layout, state in zip(layouts, states)]
    raise AssertionError("unreachable: sums over whole ranges fit")


def _bytes(value: Any) -> int:
    """The bytes of a local value's tensors (none read back from the device)."""
    if isinstance(value, structure.Struct):
        return sum(_bytes(member) for _, member in structure.iter_elements(value))
    return int(value.nbytes if isinstance(value, jax.Array) else np.asarray(value).nbytes)


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


def _run(batch: client_map.Batch, k: int, layouts: tuple, spans: tuple,
         progress: bool) -> list:
    """The running sums after every chunk of `k` clients of the cohort."""
    step, empty = _compiled(batch, layouts, spans)
    states = empty()
    bar = None
    if progress:
        from fax_bridge.system.progress import bar as tqdm
        bar = tqdm(total=batch.count, unit="client", leave=False,
                   desc=f"clients, {k} a step")
    try:
        for start in range(0, batch.count, k):
            size = min(k, batch.count - start)
            members = batch.members(start, start + size)
            if start == 0:
                _last["step"] = (step, jax.tree.map(_spec, (states, batch.shared_leaves,
                                                            members)))
            states = step(states, batch.shared_leaves, members, np.int32(size))
            if bar is not None:
                jax.block_until_ready(states)  # the bar follows the device, not dispatch
                bar.update(size)
    finally:
        if bar is not None:
            bar.close()
    return states


def _spec(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype if not hasattr(x, "dtype")
                                else x.dtype)


def step_memory() -> Any:
    """The `memory_analysis()` of the chunk step this process ran last (compiled again
    from its arguments' shapes, or found in jax's cache), or None before any."""
    if "step" not in _last:
        return None
    step, (states, shared, members) = _last["step"]
    return step.lower(states, shared, members,
                      jax.ShapeDtypeStruct((), np.int32)).compile().memory_analysis()


def _compiled(batch: client_map.Batch, layouts: tuple, spans: tuple) -> tuple:
    """(the chunk step, jitted with its sums donated; the sums of no clients)."""
    key = (batch.traced, layouts, spans, batch.rows)
    with _lock:
        if key in _steps:
            return _steps[key]
    rows, specs, traced = batch.rows, batch.result_specs, batch.traced

    def step(states, shared_leaves, member_leaves, count):
        outputs = tuple(jnp.zeros((rows, *shape), dtype) for shape, dtype in specs)
        results = traced(shared_leaves, member_leaves, count, outputs)
        valid = jnp.arange(rows) < count
        return [layout.add(state, results[start:stop], valid,
                           None if w is None else results[w])
                for layout, (start, stop, w), state in zip(layouts, spans, states)]

    compiled = (jax.jit(step, donate_argnums=0),
                jax.jit(lambda: [layout.empty() for layout in layouts]))
    with _lock:
        return _steps.setdefault(key, compiled)
