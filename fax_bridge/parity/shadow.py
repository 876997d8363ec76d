"""How far two float evaluations of one program may differ, measured: a float64 shadow.

jit's XLA and the LiteRT interpreter evaluate the same program in float32 with other
kernels, sum orders and `exp`/`tanh` approximations; neither has the exact result's
bits. `measure(comp, args)` evaluates the traced program three ways, equation by
equation (the jaxpr is walked by `parity.shadow_eval`, so a float32 fixed in user code,
such as a scan's `jnp.zeros(..., jnp.float32)` carry, is widened like every other value):

  float32   the program as it is (every value in its own dtype): one float32 path
  truth     every float equation in float64 (x64 on this host's CPU): the reference
  samples   `SAMPLES` runs of the float64 shadow where each float equation's result is
            moved by a random rounding error of the size float32 allows there (below):
            the spread of these around the truth is how far float32 rounding, carried
            through the rest of the program by the program itself, moves each element

The float32 path runs in step with each float64 run, each float value a (float32,
float64) pair, and takes every decision for both: a comparison, an argmax, a float made
an integer, `floor`, `ceil`, `round` and `sign` are the float32 path's, so the `cond`
branch, `select_n` case, `while` trip count, gathered index and sort order of the truth
and of every sample are the float32 path's, in scans, loops and client maps alike. The
bound is then for the computation the program ran (deciding in float64, a threshold
that float32's rounding crosses put the truth on the other branch: a bound of that
branch's whole step, which let a wrong result pass).

A rounding is modelled by the equation's kind: ops that only move, pick or reinterpret
values add none (a bitcast; a bool or integer made a float the type holds exactly,
such as a comparison's result or a quantization code), nor do `add`, `sub` and `mul` (`ALIKE`: IEEE operations every implementation
rounds alike from the same operands); another elementwise op (a division, a narrowing
cast) moves its result by up to eps * |y|; `exp`, `log`, `tanh`, ... by
`ULPS_OF_FUNCTIONS` ulps; a sum of n terms (a dot, a convolution, a reduction, a window
sum, a scatter-add, an aggregation over clients) by up to
eps * sqrt(n) * (sqrt(sum terms^2) + |sum|), the size n random roundings of its partial
sums reach (a partial sum of k terms is about sqrt(k * mean square) plus k/n of the
sum). Each sample draws these errors uniformly, independently per element.

`Shadow.bounds()` turns it into a bound per element: `SAFETY` times the larger of the
samples' spread (scaled up by how much more the float32 path itself is off the truth at
most elements of that output, the `CALIBRATION` quantile, should the model understate
it) and the float32 path's own error there, plus one ulp of the value, and at least
`FLOOR_ULPS` ulps of the output's largest value (an element small by cancellation errs
as the terms it was computed from). A second float evaluation (LiteRT's, the fleet's
exact sums) is taken to err as the float32 path does, so the two may differ by twice
it. It is a measurement, not a guarantee: it follows the program's own cancellations
(LayerNorm's division, softmax, a recurrence that contracts, a max pool that picks one
of its inputs) where a worst-case analysis compounds every operation's derivative
without its sign. A second evaluation that decides otherwise than the float32 path (a
comparison at a tie, a value at a quantization step's edge) differs from it there by
that branch's or step's worth, beyond the bound: the check reports that element.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core

from fax_bridge.parity import shadow_compile, shadow_eval

SAMPLES = 4  # noisy shadow runs
SAFETY = 4.0  # the bound's factor over the measured error
FLOOR_ULPS = 2.0  # the least bound: ulps of the output's largest |value|
CALIBRATION = 0.9  # the quantile of |float32 - truth| / spread the spread is scaled by
is_float = shadow_eval.is_float
_is_key = shadow_eval.is_key


def loops(jaxpr) -> bool:
    """Whether `jaxpr` (a Jaxpr or ClosedJaxpr) runs a loop (scan, while), anywhere."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("scan", "while"):
            return True
        for value in eqn.params.values():
            inner = value if isinstance(value, (tuple, list)) else (value,)
            if any(isinstance(v, (core.Jaxpr, core.ClosedJaxpr)) and loops(v) for v in inner):
                return True
    return False


@dataclasses.dataclass
class Shadow:
    """A program's outputs and the operands of its aggregations over clients, each as
    the float32 path gives it, its float64 truth and the samples' spread around it."""

    float32: list
    truth: list
    spread: list
    aggregands: list  # (kind, [float32, truth, spread] per operand) per aggregation

    def bounds(self) -> list[np.ndarray]:
        """Per output, elementwise, how far one float evaluation may be from the exact
        result (module docstring); zeros for integer and key outputs."""
        return [bound(*v) for v in zip(self.float32, self.truth, self.spread)]

    def aggregand_bounds(self) -> list[tuple]:
        """(kind, per-client bounds of each operand) per aggregation at the top level."""
        return [(kind, [bound(*v) for v in operands]) for kind, operands in self.aggregands]


def _spacing(x: np.ndarray, dtype) -> np.ndarray:
    """The ulp at |x| (float64 values) in `dtype`, as float64."""
    info = jnp.finfo(dtype)
    exponent = np.floor(np.log2(np.maximum(x, float(info.tiny))))
    return np.exp2(exponent) * float(info.eps)


def bound(float32, truth, spread) -> np.ndarray:
    """`SAFETY` x the larger of the spread (scaled up where the float32 path's own error
    exceeds it) and that error, plus one ulp of the value (at least `FLOOR_ULPS` ulps of
    the largest value); inf where not finite."""
    if _is_key(float32) or not is_float(np.asarray(float32).dtype):
        return np.zeros(np.shape(float32), np.float64)
    value = np.asarray(float32)
    f, t = value.astype(np.float64), np.asarray(truth, np.float64)
    s = np.asarray(spread, np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(f - t)
        finite = np.isfinite(err) & np.isfinite(s)
        drawn = finite & (s > 0)
        # how much more the float32 path is off than the samples, at most elements (a
        # quantile: an element where float32 and float64 took another branch or code is
        # bounded by its own error, not every element by it)
        ratio = float(np.quantile(err[drawn] / s[drawn], CALIBRATION)) if drawn.any() \
            else 1.0
        measured = np.maximum(s * max(ratio, 1.0), err)
        # an element small by cancellation errs as the terms it came from: at least
        # the ulps of the output's largest value
        top = np.max(np.abs(f), where=np.isfinite(f), initial=0.0)
        ulp = np.maximum(_spacing(np.abs(f), value.dtype),
                         FLOOR_ULPS * _spacing(np.asarray(top), value.dtype))
        out = SAFETY * measured + ulp
    return np.where(finite, out, np.inf)


_COMPILED: dict = {}  # the program's text and constants -> its jitted evaluations
def _host():
    """The CPU, where float64 runs on every machine (a TPU has none); the default
    device where jax was started without its CPU backend."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return None


def _constants(closed):
    """Every constant of `closed` and of the closed jaxprs in its equations' params."""
    yield from getattr(closed, "consts", ())
    for eqn in getattr(closed, "jaxpr", closed).eqns:
        for value in eqn.params.values():
            for v in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(v, (core.Jaxpr, core.ClosedJaxpr)):
                    yield from _constants(v)


def _compiled(closed) -> tuple:
    """({what a program returns: its jitted evaluation}, the aggregations' kinds) of the
    closed jaxpr `closed`, the same for a program traced again alike (`_program`)."""
    digest = hashlib.sha256(str(closed.jaxpr).encode())
    for c in _constants(closed):
        digest.update(repr(c).encode() if _is_key(c) else
                      np.asarray(c).tobytes() + str(np.shape(c)).encode())
    hit = _COMPILED.get(digest.hexdigest())
    if hit is not None:
        return hit
    made: tuple = ({}, [])
    if len(_COMPILED) >= 16:
        _COMPILED.clear()
    _COMPILED[digest.hexdigest()] = made
    return made


def _program(closed, keep: Optional[int]):
    """The jitted paired evaluation of `closed` (`shadow_eval`) from held argument
    leaves, a noise key and scale: (output leaves, aggregations' operands) held as pairs
    where `keep` is None; else its first `keep` output leaves held (a chained round's
    state) and the rest only in float64, no operands, so that XLA drops the float32
    work that feeds no decision."""
    programs, kinds = _compiled(closed)
    if keep not in programs:
        def run(state, key, scale):
            record: list = []
            mode = shadow_eval.Mode(key, scale, record)
            outs = shadow_eval.evaluate(closed.jaxpr, closed.consts, state, mode)
            kinds[:] = [k for k, _ in record]
            if keep is None:
                return outs, [vals for _, vals in record]
            return [o if i < keep else shadow_eval.wide(o) for i, o in enumerate(outs)], []

        programs[keep] = shadow_compile.Compiled(run, closed)
    return programs[keep], kinds


def measure(comp: Any, args: tuple, samples: int = SAMPLES, seed: int = 0,
            float32: Optional[Sequence] = None, rounds: int = 1,
            carry: int = 0) -> Shadow:
    """The traced program `comp` at `args` evaluated in float32 and float64 in step, and
    in `samples` noisy float64 runs, every decision the float32 path's (module
    docstring). `float32`: the program's output leaves as a float32 path gave them
    (jit's; after `rounds` rounds), which saves returning the shadow's own; the
    aggregations' operands are then not measured (`Shadow.aggregands` empty).

    `rounds` > 1 measures a chain of rounds: each evaluation feeds its own first `carry`
    output leaves (a round's new state) back as the first `carry` argument leaves of
    the next round, so the rounding of every round is carried through the rest, and the
    last round is measured (its aggregations' operands are those of the last round)."""
    flat = list(jax.tree_util.tree_leaves(args))
    if rounds < 1 or not 0 <= carry <= len(flat) or (rounds > 1 and carry == 0):
        raise ValueError(f"measure: rounds={rounds} with carry={carry} of {len(flat)} "
                         "argument leaves; chained rounds carry at least one leaf")
    program, kinds = _program(comp.jaxpr, None if float32 is None else carry)
    host = _host()
    if host is not None:  # arrays an accelerator holds, copied to the CPU
        flat = jax.device_put(flat, host)

    def chained(held, key, scale):
        """The last round's (outputs, aggregands); each round draws its own errors."""
        state = held
        for r in range(rounds):
            got = program(state, key if r == 0 else shadow_eval.mix(key, -r), scale)
            state = list(got[0][:carry]) + held[carry:]
        return got

    start = time.perf_counter()
    log = shadow_compile.LOG
    log.info("float64 shadow: measuring float rounding (%d float64 run(s) of %d round(s))",
             samples + 1, rounds)
    with jax.enable_x64(True), jax.default_device(host):
        held = [shadow_eval.pair(a) for a in flat]
        key = jnp.float64(seed)
        truth = jax.block_until_ready(chained(held, key, 0.0))
        runs = []
        for i in range(samples):
            runs.append(jax.block_until_ready(chained(held, shadow_eval.mix(key, i + 1),
                                                      1.0)))
            log.info("float64 shadow: sample %d of %d (%.1f s)", i + 1, samples,
                     time.perf_counter() - start)
        truth, runs = jax.device_get((truth, runs))
    narrow, truth, runs = [jax.tree.map(
        half, tree, is_leaf=lambda x: isinstance(x, shadow_eval.Pair))
        for half, tree in ((shadow_eval.narrow, truth), (shadow_eval.wide, truth),
                           (shadow_eval.wide, runs))]
    if float32 is not None:
        narrow = (list(float32), None)

    def spread(path: tuple, reference) -> np.ndarray:
        if _is_key(reference) or not is_float(np.asarray(reference).dtype):
            return np.zeros(np.shape(reference), np.float64)
        out = np.zeros(np.shape(reference), np.float64)
        for r in runs:
            sample = r
            for p in path:
                sample = sample[p]
            with np.errstate(invalid="ignore"):
                out = np.maximum(out, np.abs(np.asarray(sample, np.float64)
                                             - np.asarray(reference, np.float64)))
        return out

    outs = [(narrow[0][i], truth[0][i], spread((0, i), truth[0][i]))
            for i in range(len(narrow[0]))]
    aggregands = [] if narrow[1] is None else [
        (kind, [(narrow[1][a][o], truth[1][a][o], spread((1, a, o), truth[1][a][o]))
                for o in range(len(narrow[1][a]))])
        for a, kind in enumerate(kinds)]
    return Shadow([o[0] for o in outs], [o[1] for o in outs], [o[2] for o in outs],
                  aggregands)
