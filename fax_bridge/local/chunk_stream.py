"""Cohorts whose data does not fit on the device: clients fed chunk by chunk from the host.

`stream_clients(program, argnum)` runs a program declared with `clients_per_step=k`
with its argument `argnum` not passed whole but *read* chunk by chunk: the caller gives a
function `fetch(ids)` returning the data of clients `ids` (a numpy pytree with a leading
axis of `len(ids)`, e.g. `store.cohort(ids).data` of a `fax_bridge.data.ClientStore`).
Only client work may read the streamed argument.

The round is the in-memory chunked round (`chunking.scan_chunks`) compiled once per
argument shapes, as `jax.jit(program)` is, with each chunk of the streamed argument read
by a host callback where the in-memory round slices its argument: while the device works
on chunk c, a thread reads chunk c + 1. The chunks, the program around them and so the
order of every sum are those of the in-memory round: on the same device the results are
the same bits (tested on this CPU). With k at least the cohort, the whole cohort is one
chunk (fetched at once).

Every answer of `fetch` is checked alike, the first one (clients [0], read once per call
for the data's structure) included: the same structure and per-client shapes and dtypes
every time, numeric arrays only, one row a client. Values the program closes over are read
when it is first traced for these shapes, as under `jax.jit`. Calls of one streamed
program run one at a time.

An answer of `fetch` is owned before the next fetch runs: a fetch may fill one
preallocated buffer per call (or return views of one) and every chunk still keeps its own
rows. An array that nothing but the answer refers to and that owns its memory (what
`data[ids]` or `store.cohort(ids).data` give) is taken as it is; any other is copied once.
"""

from __future__ import annotations

import concurrent.futures
import functools
import sys
import threading
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from fax_bridge import api
from fax_bridge.local import chunking
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


def _numeric(leaf) -> Optional[np.ndarray]:
    """`leaf` as a numpy array when it is one of numbers (bool, integer, float, complex)."""
    if not isinstance(leaf, (np.ndarray, np.generic, jax.Array, int, float, complex)):
        return None
    array = np.asarray(leaf)
    if not (jnp.issubdtype(array.dtype, jnp.number) or array.dtype == np.bool_):
        return None
    return array


def _checked(got: Any, ids: np.ndarray, want=None) -> tuple:
    """(leaves as numpy arrays, treedef, per-client (shape, dtype) specs) of one answer of
    fetch(ids); `want` (treedef, specs) is what every answer must match."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(got)
    where = f"fetch(ids) for clients {[int(i) for i in ids[:4]]}{'...' if len(ids) > 4 else ''}"
    if not paths:
        raise ArgumentError(f"{where} gave no arrays ({type(got).__name__}); give a numpy "
                            "array, or a pytree of them, with one row a client.")
    if want is not None and treedef != want[0]:
        raise ArgumentError(f"{where} gave a {treedef}, but {want[0]} for client 0; give "
                            "every chunk one structure.")
    leaves, specs = [], []
    for j, (path, leaf) in enumerate(paths):
        name = f"fetch(ids){jax.tree_util.keystr(path)}"
        array = _numeric(leaf)
        if array is None:
            kind = getattr(np.asarray(leaf) if isinstance(leaf, (str, bytes, np.ndarray))
                           else leaf, "dtype", type(leaf).__name__)
            raise ArgumentError(f"{where}: {name} is {kind}, not an array of numbers; give "
                                "numeric arrays (bool, integer, float) only.")
        if array.ndim < 1 or array.shape[0] != len(ids):
            raise ArgumentError(f"{where}: {name} has shape {list(array.shape)}; its leading "
                                f"axis must have one row a client ({len(ids)}).")
        spec = (tuple(array.shape[1:]), jax.dtypes.canonicalize_dtype(array.dtype))
        if want is not None and spec != want[1][j]:
            shape, dtype = want[1][j]
            raise ArgumentError(
                f"{where}: {name} is {array.dtype}{list(array.shape)}; expected "
                f"{dtype}{[len(ids), *shape]} (one row a client, as for client 0).")
        leaves.append(array.astype(spec[1], copy=False))
        specs.append(spec)
    return leaves, treedef, tuple(specs)


def _references(items: list, j: int) -> int:
    """How many references `items[j]` has, counted the one way `_owned` compares."""
    return sys.getrefcount(items[j])


_ONLY_IN_A_LIST = _references([np.empty(1)], 0) if hasattr(sys, "getrefcount") else -1


def _owned(leaves: list) -> list:
    """`leaves` (one answer of fetch, checked) with every array the caller could still
    write to copied: all but those owning their memory that only `leaves` refers to. The
    next fetch may overwrite a buffer it returned before (one preallocated array filled per
    call), while the device still reads that chunk."""
    for j in range(len(leaves)):
        if not (leaves[j].flags.owndata and leaves[j].base is None
                and _references(leaves, j) == _ONLY_IN_A_LIST):
            leaves[j] = np.array(leaves[j], copy=True)
    return leaves


class _Reads:
    """One call's reads: chunk i's leaves, the next chunk read by a thread meanwhile."""

    def __init__(self, fetch: Callable, want: tuple, chunks: list):
        self.fetch, self.want, self.chunks = fetch, want, chunks
        self.pool = concurrent.futures.ThreadPoolExecutor(1)
        self.pending: dict[int, concurrent.futures.Future] = {}
        self.error: Optional[BaseException] = None

    def _read(self, i: int) -> list:
        ids = self.chunks[i]
        return _owned(_checked(self.fetch(ids), ids, self.want)[0])

    def leaves(self, i: int, indices) -> list:
        try:
            future = self.pending.pop(i, None)
            got = future.result() if future is not None else self._read(i)
            if i + 1 < len(self.chunks) and i + 1 not in self.pending:
                self.pending[i + 1] = self.pool.submit(self._read, i + 1)
            return [got[j] for j in indices]
        except BaseException as e:  # raised again, as it is, by the caller
            self.error = self.error or e
            raise

    def close(self) -> None:
        for future in self.pending.values():
            future.cancel()
        self.pool.shutdown(wait=True)


def _chunk_ids(clients: int, k: int) -> list[np.ndarray]:
    steps, tail = divmod(clients, k)
    ids = [c + steps * np.arange(k) for c in range(steps)]
    return ids + ([steps * k + np.arange(tail)] if tail else [])


class _StreamedRound:
    """A program with argument `argnum` streamed: compiled once per argument shapes."""

    def __init__(self, program: "api.Program", argnum: int):
        self.program, self.argnum = program, argnum
        self.k = min(program.clients_per_step, program.clients)
        self.lock = threading.Lock()
        self.reads: Optional[_Reads] = None
        self.compiled = jax.jit(self._round, static_argnums=(0, 1))

    def _read(self, specs: tuple, i, size: int, indices) -> list:
        """Chunk i's streamed leaves `indices` of `size` clients, from a host callback."""
        shapes = [jax.ShapeDtypeStruct((size,) + specs[j][0], specs[j][1]) for j in indices]
        return io_callback(lambda i: self.reads.leaves(int(i), indices), shapes, i,
                           ordered=True)  # chunk order: the next chunk is read ahead

    def _round(self, want: tuple, tree, *flat):
        others, kwargs = jax.tree_util.tree_unflatten(tree, flat)
        source_tree, specs = want
        abstract = list(others)
        abstract[self.argnum] = jax.tree_util.tree_unflatten(source_tree, [
            jax.ShapeDtypeStruct((self.program.clients,) + shape, dtype)
            for shape, dtype in specs])
        with api.placement_context(self.program):
            jaxpr, consts, leaves, out_tree = chunking.trace_flat(
                self.program.fn, tuple(abstract), kwargs)
            before = len(jax.tree_util.tree_leaves(tuple(abstract[:self.argnum])))
            values = [chunking.Streamed(i - before) if before <= i < before + len(specs)
                      else x for i, x in enumerate(leaves)]

            def execute(phase, k, keep):
                chunking.scan_chunks(phase, k, keep, functools.partial(self._read, specs),
                                     self.program.progress)

            outs = chunking.Interpreter(jaxpr, self.program.clients, self.program.placement,
                                        self.k, execute).run(consts, values)
        return jax.tree_util.tree_unflatten(out_tree(), outs)

    def __call__(self, args: tuple, kwargs: dict):
        fetch = args[self.argnum]
        first = np.arange(1)
        _, treedef, specs = _checked(fetch(first), first)
        others = list(args)
        others[self.argnum] = None
        flat, tree = jax.tree_util.tree_flatten((tuple(others), kwargs))
        with self.lock:
            self.reads = _Reads(fetch, (treedef, specs), _chunk_ids(self.program.clients,
                                                                    self.k))
            try:
                return jax.block_until_ready(self.compiled((treedef, specs), tree, *flat))
            except Exception:
                if self.reads.error is not None:  # fetch's own error, not the callback's
                    raise self.reads.error from None
                raise
            finally:
                self.reads.close()
                self.reads = None


def stream_clients(program: "api.Program", argnum: int) -> Callable[..., Any]:
    """`program` with its argument `argnum` read chunk by chunk through a fetch function.

    Args:
      program: a `fax_bridge.program(clients=N, clients_per_step=k)`.
      argnum: the position of the CLIENTS argument to stream.

    Returns:
      A function of the program's arguments in which argument `argnum` is `fetch(ids)`,
      a function giving clients `ids`' data (numpy arrays with a leading axis of
      `len(ids)`, the same structure and per-client shapes for every call); it returns
      the program's result. It compiles once per argument shapes.

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
        rounds = program.__dict__.setdefault("_streamed", {})  # lives as long as program
        if argnum not in rounds:
            rounds[argnum] = _StreamedRound(program, argnum)
        return rounds[argnum](args, kwargs)

    return run
