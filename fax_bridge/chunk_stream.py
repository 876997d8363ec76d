"""Cohorts whose data does not fit on the device: clients fed chunk by chunk from the host.

`stream_clients(program, argnum)` runs a program declared with `clients_per_step=k`
with its argument `argnum` not passed whole but *read* chunk by chunk: the caller gives a
function `fetch(ids)` returning the data of clients `ids` (a numpy pytree with a leading
axis of `len(ids)`, e.g. `store.cohort(ids).data` of a `fax_bridge.data.ClientStore`).
Each client phase then runs as a loop on the host: one compiled step per chunk
(`chunking.run_chunk`), the aggregates summed as the steps finish, and while the device
works on chunk c a thread reads chunk c + 1 and copies it to the device. Only client work
may read the streamed argument.

Chunks are those of `fax_bridge.chunking` (chunk c holds clients c, c + N // k, ...; the
last N mod k clients after them), so a streamed round sums in the same order as the
same program run with its data in memory. Equations outside the client phases run as
jax runs them eagerly (one dispatch each): keep the server step small, or jit it.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from fax_bridge import api
from fax_bridge import chunking
from fax_bridge.errors import ArgumentError


def _check_argnum(program, argnum: int, args: tuple) -> None:
    if not isinstance(program, api.Program) or not isinstance(program.clients_per_step, int):
        raise ArgumentError(
            "stream_clients needs a fax_bridge.program with an integer clients_per_step, "
            "e.g. @fax_bridge.program(clients=1024, clients_per_step=4).")
    if not 0 <= argnum < len(args) or not callable(args[argnum]):
        raise ArgumentError(
            f"stream_clients(argnum={argnum}): argument {argnum} must be a function "
            "fetch(ids) giving those clients' data; got "
            f"{type(args[argnum]).__name__ if 0 <= argnum < len(args) else 'no argument'}.")


class _Source:
    """The streamed argument: its treedef, per-client leaf specs and `fetch`."""

    def __init__(self, fetch: Callable, clients: int):
        self.fetch, self.clients = fetch, clients
        first = fetch(np.arange(1))
        leaves, self.treedef = jax.tree_util.tree_flatten(first)
        self.specs = [(tuple(np.shape(x))[1:], np.asarray(x).dtype) for x in leaves]

    def abstract(self):
        return jax.tree_util.tree_unflatten(self.treedef, [
            jax.ShapeDtypeStruct((self.clients,) + shape, dtype) for shape, dtype in self.specs])

    def read(self, ids: np.ndarray) -> list:
        got = self.fetch(ids)
        leaves, treedef = jax.tree_util.tree_flatten(got)
        if treedef != self.treedef:
            raise ArgumentError(f"fetch(ids) gave a {treedef} for clients {ids[:4]}..., but "
                                f"{self.treedef} for client 0; give every chunk one structure.")
        for leaf, (shape, dtype) in zip(leaves, self.specs):
            want = (len(ids),) + shape
            if tuple(np.shape(leaf)) != want or np.asarray(leaf).dtype != dtype:
                raise ArgumentError(
                    f"fetch(ids) gave a leaf {np.asarray(leaf).dtype}{list(np.shape(leaf))} "
                    f"for {len(ids)} clients; expected {dtype}{list(want)} (one row a "
                    "client, as for client 0).")
        return jax.device_put(leaves)


def _chunk_ids(clients: int, k: int) -> list[np.ndarray]:
    steps, tail = divmod(clients, k)
    ids = [c + steps * np.arange(k) for c in range(steps)]
    return ids + ([steps * k + np.arange(tail)] if tail else [])


def _executor(source: _Source):
    """Runs a phase as a host loop over chunks, the next chunk read while one computes."""

    def execute(phase, k: int, keep) -> None:
        steps = phase.clients // k
        shared = list(phase.shared)
        steps_of: dict[int, Callable] = {}

        def compiled(size: int) -> Callable:
            if size not in steps_of:
                steps_of[size] = jax.jit(lambda chunk, shared: chunking.run_chunk(
                    phase, size, chunk, shared, keep))
            return steps_of[size]

        def inputs(ids: np.ndarray) -> list:
            streamed = None
            out = []
            for x in phase.chunked:
                if isinstance(x, chunking.Streamed):
                    streamed = source.read(ids) if streamed is None else streamed
                    out.append(streamed[x.index])
                else:
                    out.append(jnp.take(x, jnp.asarray(ids), axis=0))
            return out

        chunks = _chunk_ids(phase.clients, k)
        totals, kept = None, []
        with concurrent.futures.ThreadPoolExecutor(1) as reader:
            pending = reader.submit(inputs, chunks[0])
            for i, ids in enumerate(chunks):
                chunk = pending.result()
                if i + 1 < len(chunks):
                    pending = reader.submit(inputs, chunks[i + 1])
                partials, kept_here = compiled(len(ids))(chunk, shared)
                totals = partials if totals is None else jax.tree_util.tree_map(
                    jnp.add, totals, partials)
                kept.append(kept_here)
        slots = []
        for j in range(len(keep)):
            main = chunking.unstrided(jnp.stack([c[j] for c in kept[:steps]]), steps, k)
            slots.append(main if len(kept) == steps else jnp.concatenate([main, kept[-1][j]]))
        chunking.finish(phase, totals, slots, keep)

    return execute


def stream_clients(program: "api.Program", argnum: int) -> Callable[..., Any]:
    """`program` with its argument `argnum` read chunk by chunk through a fetch function.

    Args:
      program: a `fax_bridge.program(clients=N, clients_per_step=k)`.
      argnum: the position of the CLIENTS argument to stream.

    Returns:
      A function of the program's arguments in which argument `argnum` is `fetch(ids)`,
      a function giving clients `ids`' data (numpy arrays with a leading axis of
      `len(ids)`, the same structure and per-client shapes for every call); it returns
      the program's result.

    Example:
      >>> import numpy as np, jax.numpy as jnp, fax_bridge as fb
      >>> @fb.program(clients=6, clients_per_step=4)
      ... def total(w, x):
      ...     wx = fb.federated_map_clients(lambda w, x: w * x,
      ...                                   (fb.federated_broadcast(w), x))
      ...     return fb.federated_sum(wx)
      >>> data = np.arange(6.0, dtype=np.float32)
      >>> print(fb.stream_clients(total, 1)(jnp.float32(2.0), lambda ids: data[ids]))
      30.0
    """

    def run(*args, **kwargs):
        _check_argnum(program, argnum, args)
        source = _Source(args[argnum], program.clients)
        abstract = list(args)
        abstract[argnum] = source.abstract()
        with api.placement_context(program):
            jaxpr, consts, flat, out_tree = chunking.trace_flat(program.fn, tuple(abstract),
                                                                kwargs)
            leaves_before = len(jax.tree_util.tree_leaves(tuple(args[:argnum])))
            count = len(source.specs)
            values = [chunking.Streamed(i - leaves_before)
                      if leaves_before <= i < leaves_before + count else x
                      for i, x in enumerate(flat)]
            interpreter = chunking.Interpreter(jaxpr, program.clients, program.placement,
                                               program.clients_per_step, _executor(source))
            outs = interpreter.run(consts, values)
        return jax.tree_util.tree_unflatten(out_tree(), outs)

    return run
