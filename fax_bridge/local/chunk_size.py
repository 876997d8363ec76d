"""How many clients a step: `clients_per_step="auto"` sized against the device's memory.

`fitting_chunk` compiles the program's round for the whole cohort first (one compile
where it fits), else at powers of two below it found by bisection, and keeps the largest
that fits: one whose compiled
arguments, results and temporaries (`memory_analysis()`) are within the budget, where a
compile the device refuses for memory (a TPU's `RESOURCE_EXHAUSTED ... exceeds available
HBM`, raised by `compile()` itself) does not fit. The budget is `memory_limit()` (the
allocator's limit on a TPU or GPU; half the host's memory on a CPU) unless a caller gives
`memory_bytes`.

What is sized is what runs: a program called under `jax.grad`, `jax.vjp` or `jax.jvp`
(its arguments being differentiated) is sized by its gradient (the forward and backward
passes of the round compiled together); otherwise by its forward round. A program that is
jitted first and differentiated afterwards (`jax.grad(jax.jit(program))`) is traced before
its derivative exists, so it is sized by its forward round: give it an integer
`clients_per_step` (e.g. from `Program.chunk_size(..., memory_bytes=...)`) to choose.

The search itself, `largest_fitting` (given what one size needs, a budget and names for
the log), is shared with the exported round's device path (`runtime.device_rounds`: None
or "auto" there sizes its compiled chunk step against its own budget).

Each size compiled and each choice (with the bytes of every size tried) is logged (logger
`fax_bridge.local.chunk_size`, level INFO), a program made with `progress=True` shows a
bar over the compiles, and the choice is cached per argument shapes;
`Program.chunk_size(*args, **kwargs)` returns it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax._src.interpreters import ad

from fax_bridge.errors import ArgumentError

LOG = logging.getLogger(__name__)


def memory_limit(host_fallback: bool = True) -> Optional[int]:
    """Bytes a round may take on the default device: its allocator's limit where it
    reports one (TPU, GPU); else (CPU) half the host's physical memory, or None when
    `host_fallback` is False."""
    stats = jax.devices()[0].memory_stats() or {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    if not host_fallback:
        return None
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def compiled_bytes(compiled) -> int:
    """Device bytes a compiled computation holds at once, by its `memory_analysis()`:
    arguments, results and temporaries, less the result bytes that reuse (alias) a
    donated argument's."""
    m = compiled.memory_analysis()
    if m is None:
        raise ValueError("this backend reports no memory_analysis() of a compiled "
                         "computation, so its memory cannot be sized before it runs")
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
               - m.alias_size_in_bytes)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is the device refusing a computation for memory: jax's runtime
    error with XLA's RESOURCE_EXHAUSTED status (a TPU refuses to compile a program whose
    temporaries exceed its HBM; an allocation can fail the same way)."""
    return isinstance(error, jax.errors.JaxRuntimeError) and \
        str(error).lstrip().startswith("RESOURCE_EXHAUSTED")


def is_differentiated(args: tuple, kwargs: dict) -> bool:
    """Whether any argument leaf is being differentiated (a JVP or linearize tracer)."""
    return any(isinstance(x, (ad.JVPTracer, ad.LinearizeTracer))
               for x in jax.tree_util.tree_leaves((args, kwargs)))


def _specs(tree):
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)


def _gradient(fn):
    """fn's gradient with respect to its float arguments, of the sum of its float
    results: the forward and backward passes a differentiated round compiles."""

    def grad(args, kwargs):
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        floats = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.inexact)]

        def loss(diff):
            full = list(leaves)
            for i, x in zip(floats, diff):
                full[i] = x
            a, kw = jax.tree_util.tree_unflatten(tree, full)
            outs = [o for o in jax.tree_util.tree_leaves(fn(*a, **kw))
                    if jnp.issubdtype(o.dtype, jnp.inexact)]
            return sum((jnp.sum(o.astype(jnp.float32)) for o in outs), jnp.float32(0))

        return jax.grad(loss)([leaves[i] for i in floats])

    return grad


def round_bytes(program, k: int, args: tuple, kwargs: dict, gradient: bool = False) -> int:
    """`compiled_bytes` of `program`'s compiled round at chunk size k (of its gradient
    with `gradient`). A compile the device refuses for memory raises its error
    (`is_out_of_memory`)."""
    at_k = program.with_clients_per_step(k)
    fn = _gradient(at_k) if gradient else (lambda a, kw: at_k(*a, **kw))
    return compiled_bytes(jax.jit(fn).lower(*_specs((args, kwargs))).compile())


def fitting_chunk(program, args: tuple, kwargs: dict,
                  memory_bytes: Optional[int] = None) -> int:
    """`clients_per_step="auto"`: the largest chunk size (the whole cohort, or a power of
    two below it) whose compiled round fits `memory_bytes` (default `memory_limit()`),
    found by bisection (memory grows with the chunk size); 1 when none fits. The round
    sized is the gradient when the arguments are being differentiated. Cached per
    argument shapes and budget; each choice is logged."""
    if memory_bytes is not None and (isinstance(memory_bytes, bool) or not isinstance(
            memory_bytes, int) or memory_bytes < 1):
        raise ArgumentError(f"memory_bytes must be a positive whole number of bytes, got "
                            f"{memory_bytes!r}; e.g. memory_bytes=8 << 30 for 8 GiB.")
    gradient = is_differentiated(args, kwargs)
    limit = memory_limit() if memory_bytes is None else memory_bytes
    key = (tuple((jnp.shape(x), str(jnp.result_type(x)))
                 for x in jax.tree_util.tree_leaves((args, kwargs))), gradient, limit)
    cache = program.__dict__.setdefault("_fitting", {})
    if key in cache:
        return cache[key]
    n = program.clients
    sizes = [1 << i for i in range(max(n - 1, 1).bit_length()) if (1 << i) < n] + [n]
    what = "gradient" if gradient else "forward round"
    bar = _bar(program, len(sizes).bit_length() + 1)
    try:
        best = largest_fitting(
            sizes, lambda k: round_bytes(program, k, args, kwargs, gradient), limit,
            f"clients_per_step='auto' for {_name(program)}", what,
            None if bar is None else (lambda: bar.update(1)))
    finally:
        if bar is not None:
            bar.close()
    cache[key] = best
    return best


def largest_fitting(sizes: Sequence[int], need: Callable[[int], Optional[int]],
                    limit: int, subject: str, what: str,
                    compiled: Optional[Callable[[], None]] = None) -> int:
    """The largest of `sizes` (ascending: powers of two, then the cohort) whose `need(k)`
    (the bytes of what runs at k clients a step, compiled to measure them) is within
    `limit`: the last size first (one compile where the whole cohort fits, as most do),
    then bisection below it (memory grows with the chunk); the smallest size when none
    fits, with a warning. A `need` of None, or one the device refuses to compile for
    memory (`is_out_of_memory`), does not fit; any other error is raised. Each size
    compiled and the choice (with the bytes of every size tried) are logged under
    `subject` (e.g. "clients_per_step='auto' for fedavg"), `what` naming what is
    compiled; `compiled` is called after each compile (a progress bar)."""
    n = sizes[-1]
    needs: dict[int, Optional[int]] = {}

    def fits(k: int) -> bool:
        LOG.info("%s: compiling the %s at %d of %d clients a step to measure its memory",
                 subject, what, k, n)
        start = time.perf_counter()
        try:
            needs[k] = need(k)
        except jax.errors.JaxRuntimeError as e:
            if not is_out_of_memory(e):
                raise
            needs[k] = None  # refused by the compiler: more than the device holds
        finally:
            if compiled is not None:
                compiled()
        ok = needs[k] is not None and needs[k] <= limit
        LOG.info("%s: %d clients a step need %s: %s (%.1f s)", subject, k, _bytes(needs[k]),
                 "fits" if ok else "does not fit", time.perf_counter() - start)
        return ok

    best = n if fits(n) else None
    lo, hi = 0, len(sizes) - 2  # the sizes below the cohort
    while best != n and lo <= hi:
        mid = (lo + hi) // 2
        if fits(sizes[mid]):
            best, lo = sizes[mid], mid + 1
        else:
            hi = mid - 1
    tried = ", ".join(f"{k}: {_bytes(v)}" for k, v in sorted(needs.items()))
    if best is None:
        best = sizes[0]
        LOG.warning("%s: no chunk size fits %d bytes (%d clients a step need %s); running "
                    "%d a step", subject, limit, best, _bytes(needs.get(best)), best)
    else:
        LOG.info("%s: %d of %d clients a step (%s: %s of %d bytes; the largest size tried "
                 "that fits, of %s)", subject, best, n, what, _bytes(needs[best]), limit,
                 tried)
    return best


def _bar(program, total: int):
    """A tqdm bar over the compiles of the sizes tried, for a program made with
    `progress=True` (the compiles of a large round take a while); else None."""
    if not getattr(program, "progress", False):
        return None
    from fax_bridge.system.progress import bar as tqdm

    return tqdm(total=total, unit="compile", leave=False,
                desc=f"sizing clients_per_step='auto' for {_name(program)}")


def _name(program) -> str:
    return getattr(program.fn, "__name__", repr(program.fn))


def _bytes(n: Optional[int]) -> str:
    return "more than the device holds" if n is None else f"{n} bytes"

