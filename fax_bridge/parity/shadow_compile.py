"""How the float64 shadow's programs are compiled (`parity.shadow`): quickly where small.

A small program compiles with less optimization: a quarter less compile time, and its
unoptimized code runs in milliseconds. A large one is optimized: unoptimized, XLA's CPU
code runs a convolution's float64 round 20-100x slower than its compile saves (a CNN
round of 4 clients: 571 s against 23 s, compile included). Each compile is logged
(logger `fax_bridge.parity`, INFO), as long work shows its progress.
"""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core

QUICK = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
QUICK_WORK = 2e7  # the most flops (every loop at its full length) compiled quickly
LOG = logging.getLogger("fax_bridge.parity")


def loop_factor(jaxpr) -> float:
    """How many times the longest path through `jaxpr`'s loops runs a loop body: the
    product of nested scans' lengths (the largest among siblings), inf for a while
    loop (its trip count is not known before it runs)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    most = 1.0
    for eqn in jaxpr.eqns:
        inner = 1.0
        for value in eqn.params.values():
            for v in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(v, (core.Jaxpr, core.ClosedJaxpr)):
                    inner = max(inner, loop_factor(v))
        if eqn.primitive.name == "scan":
            inner *= float(eqn.params["length"])
        elif eqn.primitive.name == "while":
            inner = float("inf")
        most = max(most, inner)
    return most


def options_of(lowered, jaxpr) -> dict:
    """The compile options of one shadow program: `QUICK` where its work, XLA's flop
    count with every loop at its full length, is at most `QUICK_WORK`."""
    try:
        flops = float(lowered.cost_analysis().get("flops", float("inf")))
    except Exception:  # noqa: BLE001 - no estimate: optimize
        flops = float("inf")
    return dict(QUICK) if flops * loop_factor(jaxpr) <= QUICK_WORK else {}


class Compiled:
    """A jitted evaluation compiled on its first call, with `options_of` for what it
    is given then (later calls with other shapes compile again)."""

    def __init__(self, fn, jaxpr):
        self.jitted, self.jaxpr, self.programs, self.chosen = jax.jit(fn), jaxpr, {}, {}

    def __call__(self, *args):
        shapes = jax.tree_util.tree_map(lambda a: (np.shape(a), str(jnp.result_type(a))),
                                        args)
        key = repr(shapes)
        program = self.programs.get(key)
        if program is None:
            lowered = self.jitted.lower(*args)
            options = options_of(lowered, self.jaxpr)
            start = time.perf_counter()
            program = lowered.compile(compiler_options=options or None)
            LOG.info("float64 shadow: compiled a program in %.1f s (%s)",
                     time.perf_counter() - start,
                     "small: less optimized" if options else "optimized")
            self.programs[key], self.chosen[key] = program, options
        return program(*args)
