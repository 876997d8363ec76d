"""Exact aggregates on the accelerator: the host's bits, computed where the addends are.

A round run on an accelerator (`on_device`) keeps the clients' results there (jax
arrays) and sums them there with 32-bit integers only: TPUs have no float64 and jax's
default has no int64. A sum-like aggregate in progress is a `DeviceSums`: for each dtype
of the value's tensors one running exact sum (`device_exact.Acc`) of all its tensors'
elements side by side in one flat buffer (`device_exact.flat_rows`), so that what adds
to it compiles as one program whatever the number of tensors, with a number of limbs
fixed by the dtype and the cohort (`device_exact.limbs_for`), so that it compiles once
whatever the data. Integer tensors keep their wrapped totals, as the host's do. A
weighted mean also keeps its weights' exact sum and their least (the host's refusals).

Addends arrive as rows: a batched client call's results (`DeviceColumn`, `partial_of`),
or a chunk of clients inside the program that computed them (`device_rounds`). Where an
element's addends spread wider than the window (`device_exact.WINDOW_SPREAD` bits) the
sum says so (`overflowed`, one flag read back) and the caller sums again with the dtype's
whole range (`full`). `finish` rounds each element once and divides a mean by its
clients or a weighted mean by its total weight (`device_floats`: integer operations, a
TPU flushing subnormals in its float arithmetic), in one compiled call; a float16 or
bfloat16 mean's sum is rounded to float32 and divided there, as the host does. Hence the
results have the bits of the host's `aggregation.finish` for the same addends, whatever
the backend's float arithmetic does. `on_device` says, in one place, whether a run takes
this path.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fax_bridge.errors import AggregationError, ArgumentError, WeightError
from fax_bridge.language.placements import weights_refusal
from fax_bridge.runtime import device_exact, exact
from fax_bridge.runtime.device_floats import astype, quotient

KINDS = ("sum", "mean", "weighted_mean")  # the aggregations finished on the device
ENV_VAR = "FAX_BRIDGE_ON_DEVICE"  # "1": rounds on the device path, "0": on the host


def on_device(requested: Optional[bool] = None) -> bool:
    """Whether a round keeps its values on jax's default device and sums there: as
    `requested` where given (True or False; anything else, a string like "0" among
    them, is refused), else as the environment variable `FAX_BRIDGE_ON_DEVICE` says
    ("1" or "0"), else whenever jax's default backend is not the CPU."""
    if isinstance(requested, (bool, np.bool_)):
        return bool(requested)
    if requested is not None:
        raise ArgumentError(f"on_device={requested!r}: expected True (sum rounds on the "
                            "device), False (on the host) or None (as FAX_BRIDGE_ON_DEVICE "
                            "or the default backend decides)")
    setting = os.environ.get(ENV_VAR, "").strip()
    if setting in ("1", "0"):
        return setting == "1"
    if setting:
        raise ArgumentError(f"{ENV_VAR}={setting!r}: expected 1 (sum rounds on the "
                            "device) or 0 (on the host), or leave it unset")
    return jax.default_backend() != "cpu"


def _float_dtypes() -> tuple:
    return (np.dtype(np.float32), np.dtype(np.float16), np.dtype(jnp.bfloat16))


def supports(dtype: np.dtype) -> bool:
    """Whether the device sums addends of `dtype` (floats of at most 4 bytes; the
    integers jax holds as they are)."""
    dtype = np.dtype(dtype)
    if dtype in _float_dtypes():
        return True
    return dtype.kind in "iu" and (dtype.itemsize <= 4 or bool(jax.config.jax_enable_x64))


def _check(kind: str, dtypes: Sequence[np.dtype]) -> None:
    if kind not in KINDS:
        raise AggregationError(f"the device finishes {list(KINDS)}, not {kind!r}")
    for dtype in dtypes:
        if not supports(dtype):
            raise AggregationError(f"the device sums no tensors of dtype {dtype}; sum "
                                   "them on the host (on_device=False)")
        if kind != "sum" and np.dtype(dtype).kind in "iub":
            raise AggregationError(
                f"federated mean and weighted_mean need floating-point values, got "
                f"{dtype}; cast the clients' values to a float type first")


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a `DeviceSums` holds, fixed when it starts (its programs compile per
    layout): the kind, each tensor's (dtype, shape) depth first, the weight's dtype
    (weighted_mean), the most clients it may take (`capacity`) and whether its windows
    span each dtype's whole range (`full`)."""

    kind: str
    tensors: tuple
    weight: Optional[np.dtype]
    capacity: int
    full: bool = False

    @functools.cached_property
    def groups(self) -> dict:
        """dtype name -> the indices of its tensors (depth first)."""
        out: dict = {}
        for i, (dtype, _) in enumerate(self.tensors):
            out.setdefault(np.dtype(dtype).name, []).append(i)
        return out

    def widened(self) -> "Layout":
        return dataclasses.replace(self, full=True)

    def empty(self) -> dict:
        """The state of a sum of no clients (traceable)."""
        state: dict = {}
        for name, members in self.groups.items():
            dtype = self.tensors[members[0]][0]
            size = sum(math.prod(self.tensors[i][1]) for i in members)
            if np.dtype(dtype).kind in "iu":
                state[name] = jnp.zeros(size, dtype)
            else:
                state[name] = device_exact.empty(
                    size, device_exact.limbs_for(dtype, self.capacity, self.full))
        if self.weight is not None:
            state["weight sum"] = device_exact.empty(
                1, device_exact.limbs_for(self.weight, self.capacity, self.full))
            state["least weight"] = (jnp.int32(0x7F800000), jnp.zeros((), bool))
        return state

    def add(self, state: dict, leaves: Sequence[jax.Array], valid: jax.Array,
            weights: Optional[jax.Array] = None) -> dict:
        """`state` plus the rows of `leaves` (one array per tensor, [rows, *shape])
        marked `valid` (bool [rows]), each times its row of `weights` (weighted_mean).
        Traceable: the caller compiles it into its own program."""
        state = dict(state)
        for name, members in self.groups.items():
            rows = device_exact.flat_rows([leaves[i] for i in members])
            if rows.dtype.kind in "iu":
                keep = valid.reshape((-1, 1))
                state[name] = state[name] + jnp.sum(jnp.where(keep, rows, 0), axis=0,
                                                    dtype=rows.dtype)
                continue
            if weights is not None:
                rows = device_exact.weighted(rows, weights)
            state[name] = device_exact.add(state[name], rows, valid, self.capacity)
        if weights is not None:
            w = weights.reshape((weights.shape[0], 1))
            state["weight sum"] = device_exact.add(state["weight sum"], w, valid,
                                                   self.capacity)
            state["least weight"] = device_exact.least_weight(w, valid,
                                                              state["least weight"])
        return state

    def merged(self, a: dict, b: dict) -> dict:
        """The state of both sums' clients (traceable)."""
        out = {}
        for name, members in self.groups.items():
            dtype = self.tensors[members[0]][0]
            out[name] = (a[name] + b[name] if np.dtype(dtype).kind in "iu"
                         else device_exact.merged(a[name], b[name], dtype, self.capacity))
        if self.weight is not None:
            out["weight sum"] = device_exact.merged(a["weight sum"], b["weight sum"],
                                                    self.weight, self.capacity)
            (ka, na), (kb, nb) = a["least weight"], b["least weight"]
            out["least weight"] = (jnp.minimum(ka, kb), na | nb)
        return out


def overflow(state: dict) -> jax.Array:
    """Whether an element's addends spread past its window anywhere in `state`."""
    flags = [acc.overflow for acc in state.values() if isinstance(acc, device_exact.Acc)]
    return functools.reduce(jnp.logical_or, flags, jnp.zeros((), bool))


@dataclasses.dataclass
class DeviceSums:
    """A sum-like aggregate in progress on the device over `count` clients: `state`
    (arrays, see `Layout.empty`) laid out as `layout` says."""

    layout: Layout
    state: dict
    count: int

    @property
    def kind(self) -> str:
        return self.layout.kind

    def overflowed(self) -> bool:
        """Whether some element's sum did not fit its window (read back: one flag)."""
        return bool(jax.device_get(_overflow(self.state)))

    def joined(self, other: "DeviceSums") -> "DeviceSums":
        """The sums of both's clients (this one's first)."""
        if other.layout.tensors != self.layout.tensors or other.kind != self.kind:
            raise AggregationError(
                "partial sums disagree: "
                f"{[f'{d}{list(s)}' for d, s in self.layout.tensors]} vs "
                f"{[f'{d}{list(s)}' for d, s in other.layout.tensors]}")
        layout = dataclasses.replace(
            self.layout, capacity=self.layout.capacity + other.layout.capacity,
            full=self.layout.full or other.layout.full)
        for attempt in (layout, layout.widened()):  # whole ranges where windows overflow
            a, b = (x.state if x.layout == attempt else _regrown(x.layout, attempt, x.state)
                    for x in (self, other))
            out = DeviceSums(attempt, _merged(attempt, a, b), self.count + other.count)
            if attempt.full or not out.overflowed():
                return out
        raise AssertionError("unreachable: a sum over whole ranges fits")


@functools.partial(jax.jit, static_argnums=(0,))
def _merged(layout: Layout, a: dict, b: dict) -> dict:
    return layout.merged(a, b)


@jax.jit
def _overflow(state: dict) -> jax.Array:
    return overflow(state)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _regrown(old: Layout, new: Layout, state: dict) -> dict:
    """`state` (of `old`) held with `new`'s limbs: its digits moved into a wider stack
    (the same values, bases and flags)."""
    out = dict(state)
    for name, members in new.groups.items():
        acc = state[name]
        if not isinstance(acc, device_exact.Acc):
            continue
        limbs = device_exact.limbs_for(new.tensors[members[0]][0], new.capacity, new.full)
        out[name] = _widened(acc, limbs)
    if new.weight is not None:
        out["weight sum"] = _widened(state["weight sum"], device_exact.limbs_for(
            new.weight, new.capacity, new.full))
    return out


def _widened(acc: device_exact.Acc, limbs: int) -> device_exact.Acc:
    """The same sum over `limbs` (at least as many) limbs: zero limbs above, its top
    limb's sign carried up into them."""
    extra = limbs - acc.limbs.shape[0]
    if extra <= 0:
        return acc
    zeros = jnp.zeros((extra,) + acc.limbs.shape[1:], jnp.int32)
    limbs = device_exact.carried(jnp.concatenate([acc.limbs, zeros]))
    return acc._replace(limbs=jnp.stack(limbs))


# -- addends held as rows -------------------------------------------------------------------


@dataclasses.dataclass
class DeviceColumn:
    """One tensor's addends on the device: `parts[i]` ([rows, *shape]) holds
    `counts[i]` addends in its first rows (the rest is padding, never read)."""

    parts: list
    counts: list

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.parts[0].dtype)

    @property
    def shape(self) -> tuple:
        return tuple(self.parts[0].shape[1:])

    @property
    def count(self) -> int:
        return sum(self.counts)


def partial_of(kind: str, columns: Sequence[DeviceColumn],
               weights: Optional[DeviceColumn] = None) -> DeviceSums:
    """The `DeviceSums` of `kind` over the columns' addends (they share their parts'
    rows: the results of the same batched calls), `weights` those clients' weights
    (weighted_mean). Summed again over the dtypes' whole ranges where an element's
    addends spread past the window (one flag read back)."""
    _check(kind, [c.dtype for c in columns])
    count = columns[0].count if columns else 0
    rows = sum(x.shape[0] for x in columns[0].parts) if columns else 1  # padding too:
    layout = Layout(kind, tuple((c.dtype, c.shape) for c in columns),  # one compile
                    None if weights is None else weights.dtype, rows)  # per shapes
    parts = [tuple(c.parts[i] for c in columns) for i in range(len(columns[0].parts))] \
        if columns else []
    by = [None] * len(parts) if weights is None else list(weights.parts)
    counts = list(columns[0].counts) if columns else []
    sums = DeviceSums(layout, _summed(layout, parts, counts, by), count)
    if sums.overflowed():
        layout = layout.widened()
        sums = DeviceSums(layout, _summed(layout, parts, counts, by), count)
    return sums


def _summed(layout: Layout, parts: list, counts: list, weights: list) -> dict:
    return _summed_jit(layout, tuple(parts), tuple(jnp.int32(c) for c in counts),
                       tuple(weights))


@functools.partial(jax.jit, static_argnums=(0,))
def _summed_jit(layout: Layout, parts: tuple, counts: tuple, weights: tuple) -> dict:
    state = layout.empty()
    for leaves, count, w in zip(parts, counts, weights):
        valid = jnp.arange(leaves[0].shape[0]) < count
        state = layout.add(state, leaves, valid, w)
    return state


def exact_sum(column: DeviceColumn) -> jax.Array:
    """The sum of the column's addends, rounded once to their dtype (`ExactSum`'s bits)."""
    return exact_sums([column])[0]


def exact_sums(columns: Sequence[DeviceColumn]) -> list:
    """`exact_sum` of each column (sharing their parts' rows), in one compiled call."""
    return finish(partial_of("sum", columns))


# -- finishing an aggregation ---------------------------------------------------------------


def finish(sums: DeviceSums) -> list:
    """The aggregate's tensors (jax arrays, depth first), as `aggregation.finish`
    computes them on the host: exact sums rounded once, a mean divided by the clients,
    a weighted mean's products rounded to the value's dtype before they are summed."""
    flats, least, total = _finished(sums.layout, sums.state, np.int32(sums.count))
    out = _split(sums.layout, flats)
    if sums.kind == "weighted_mean":
        least, total = jax.device_get((least, total))
        refusal = weights_refusal(float(least), False)  # each client's, as the host checks
        if refusal:
            raise WeightError(refusal)
        refusal = weights_refusal(float(total), not bool(total))
        if refusal:
            raise WeightError(refusal)
    return out


def compile_finish(layout: Layout) -> None:
    """Compiles what `finish` runs for sums of `layout` held on the default device (its
    rounding and division, and the cut into tensors), so that finishing them compiles
    nothing then: a round compiles its whole-range sums beside its first
    (`device_rounds`), not when a later round's values first need them."""
    where = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def placed(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where),
                            tree)

    state, count = placed(jax.eval_shape(layout.empty)), jax.ShapeDtypeStruct((), np.int32)
    _finished.lower(layout, state, count).compile()
    flats = placed(jax.eval_shape(functools.partial(_finished, layout), state, count)[0])
    for name, members in layout.groups.items():  # `_split`'s cuts, one per tensor shape
        flat = flats[name]
        if flat.size < 2 ** 31:
            for shape in {tuple(layout.tensors[i][1]) for i in members}:
                _cut.lower(flat, jax.ShapeDtypeStruct((), np.int32),
                           math.prod(shape), shape).compile()


def _split(layout: Layout, flats: dict) -> list:
    """The tensors (depth first) of each dtype's flat results, each cut by `_cut`: one
    small program per tensor shape, called once per tensor. Inside the program that
    computes them, XLA moves the cuts up through the element-wise computation and
    compiles (and runs) it once per tensor; in one program of their own, XLA's CPU
    backend still compiles a kernel per tensor (83 s for 1,000 tensors of 4 floats, on
    a loaded 2-core machine), so the compile would grow with the model's leaves."""
    out: list = [None] * len(layout.tensors)
    for name, members in layout.groups.items():
        flat, start = flats[name], 0
        for i in members:
            shape = tuple(layout.tensors[i][1])
            size = math.prod(shape)
            out[i] = (flat[start:start + size].reshape(shape) if flat.size >= 2 ** 31
                      else _cut(flat, np.int32(start), size, shape))
            start += size
    return out


@functools.partial(jax.jit, static_argnums=(2, 3))
def _cut(flat: jax.Array, start: jax.Array, size: int, shape: tuple) -> jax.Array:
    """`flat[start:start + size]` as a tensor of `shape` (`start` traced: one program
    per shape, whatever the offset)."""
    return jax.lax.dynamic_slice(flat, (start,), (size,)).reshape(shape)


@functools.partial(jax.jit, static_argnums=(0,))
def _finished(layout: Layout, state: dict, count: jax.Array) -> tuple:
    """(each dtype's flat results, the least weight, the total weight): the sums
    rounded, divided."""
    out: dict = {}
    least = total = jnp.float32(0)
    by = None
    if layout.kind == "mean":
        by = count
    if layout.weight is not None:
        least = device_exact.weight_of_key(*state["least weight"])
        total = device_exact.result(state["weight sum"], layout.weight,
                                    _wide(layout.weight)).reshape(())
        by = total
    for name, members in layout.groups.items():
        dtype = np.dtype(layout.tensors[members[0]][0])
        acc = state[name]
        if dtype.kind in "iu":
            flat = acc
        elif by is None:
            flat = device_exact.result(acc, dtype)
        else:  # a float16/bfloat16 sum rounded to float32, divided there, then to dtype
            flat = device_exact.result(acc, dtype, _wide(dtype))
            flat = astype(_divide(flat, astype(by, flat.dtype) if layout.weight is not None
                                  else by.astype(flat.dtype)), dtype)
        out[name] = flat
    return out, astype(least, np.float32), astype(total, np.float32)


def _wide(dtype: np.dtype) -> np.dtype:
    """What a mean of `dtype` values is divided in: float32 for float16 and bfloat16
    (`exact.WIDE`, as the host divides), else `dtype`."""
    dtype = np.dtype(dtype)
    return exact.WIDE if dtype.itemsize < exact.WIDE.itemsize else dtype


def _divide(total: jax.Array, by: jax.Array) -> jax.Array:
    """total / by in total's dtype, as numpy divides on the host: the float32 quotient,
    rounded to the dtype (`device_floats`: the bits whatever the backend's float
    arithmetic does)."""
    quotient_ = quotient(astype(total, np.float32),
                         jnp.broadcast_to(astype(by, np.float32), total.shape))
    return astype(quotient_, total.dtype)


divide = jax.jit(_divide)  # total / by, as numpy divides (tests compare it with numpy)
