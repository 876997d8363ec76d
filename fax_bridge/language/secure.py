"""Secure aggregation: TFF's secure-sum intrinsics as primitives, and a float secure mean.

- `federated_secure_sum_bitwidth(x, bitwidth)`: the sum over clients of integer values,
  each in [0, 2**bitwidth - 1] (TFF's `federated_secure_sum_bitwidth`; the bitwidth bounds
  the inputs, the sum is not reduced).
- `federated_secure_sum(x, max_input)`: the same with each value in [0, max_input]
  (TFF's `federated_secure_sum`).

Both are typed as TFF types them, `<{V}@CLIENTS, B> -> V@SERVER`: the sum has the values'
own dtype and is not reduced. So a program is refused when it is traced (a
`SecureAggregationError` naming the bound, the clients, the dtype and the largest bound
that fits) unless clients * (2**bitwidth - 1), or clients * max_input, fits that dtype:
no in-range input can then wrap the sum (four int32 clients at bitwidth 31 would give
-4). The runtime and the fleet apply the same rule (`placements.secure_sum_refusal`) to
every proto they run, ours or written elsewhere, with the number of clients they hold.
- `federated_secure_modular_sum(x, modulus)`: the sum modulo `modulus` of values each
  client first reduces modulo `modulus` (TFF's MapReduce-backend intrinsic of that name,
  with its default `preapply_modulus`), built from the bitwidth sum.
- `federated_secure_mean(x, keys, value_range=(lo, hi), bits=b)`: the mean of float
  values through the secure path: each client clips to [lo, hi], maps to [0, 2**b - 1]
  and rounds stochastically (its own PRNG key, `keys` one per client), the integers go
  through `federated_secure_sum_bitwidth`, and the server divides the sum by the number
  of clients and maps it back.

Error bound of `federated_secure_mean` for values inside [lo, hi]: with step
s = (hi - lo) / (2**b - 1), each client's rounded value is within s of its value and
unbiased, so the result is within s of the exact mean (always) and its error has standard
deviation at most s / (2 * sqrt(clients)). Values outside [lo, hi] count as the nearest
end. The integer sum must fit int32: b + ceil(log2(clients)) <= 31.

Out-of-range integers are refused: eagerly and under `jit` with a `FaxBridgeError`
naming the bound, on the runtime and the fleet by its `AggregationError`.

Derivatives (the FAD paper's closure property): the secure mean's JVP is the plain mean
of the tangents where values were not clipped (rounding passes tangents straight
through), a linear `federated_mean`, so `jax.grad` of a loss of a secure mean with respect
to SERVER values transposes it to `federated_broadcast`: the gradient program uses only
federated primitives, and its forward pass still aggregates through the secure path.
Where the implementation itself is differentiated (a derivative of a chunked round's
derivative, a secure mean nested in a map), the codes carry that same derivative: the
mean of the unclipped values' (`lowering.derivative_of`).

Exported: the integer sums as TFF's intrinsics with the bound as a literal; the secure
mean as `federated_map` (clip, quantize) -> `federated_secure_sum_bitwidth`, beside a
`federated_sum` of ones counting the clients whose codes were summed, -> `federated_apply`
(dequantize by that count). So a fleet or Flower round over a cohort, or one that lost
a client, averages the clients that took part; under jit every client does and the
count is the program's. On a fleet each device returns the partial sums of its own
clients only.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from federated_language.compiler import intrinsic_defs
from jax._src import core
from jax._src.interpreters import ad

from fax_bridge.local import chunking
from fax_bridge import api as _api
from fax_bridge.language import lowering as _lowering
from fax_bridge.language import primitives as P
from fax_bridge.language import primitive_facts as _facts
from fax_bridge.errors import ArgumentError, PlacementError, SecureAggregationError
from fax_bridge.language.placements import secure_sum_refusal

SECURE_SUM_BITWIDTH = intrinsic_defs.FEDERATED_SECURE_SUM_BITWIDTH.uri
SECURE_SUM = intrinsic_defs.FEDERATED_SECURE_SUM.uri
MAX_BITWIDTH = 62


def _top(kind: str, bound: int) -> int:
    return 2 ** bound - 1 if kind == SECURE_SUM_BITWIDTH else bound


def _range_message(kind: str, bound: int, low, high) -> str:
    what = f"[0, 2**{bound} - 1] = [0, {_top(kind, bound)}]" if kind == SECURE_SUM_BITWIDTH \
        else f"[0, max_input] = [0, {bound}]"
    return (f"{kind}: a client value lies outside {what} (min {int(low)}, max {int(high)}); "
            "clip or quantize the values on the clients first, or declare a larger bound")


def _check_fits(kind: str, bound: int, clients: int, dtype) -> None:
    """SecureAggregationError unless `clients` values at the bound's top sum in `dtype`."""
    refusal = secure_sum_refusal(kind, "bitwidth" if kind == SECURE_SUM_BITWIDTH else
                                 "max_input", bound, _top(kind, bound), clients, dtype)
    if refusal:
        raise SecureAggregationError(refusal)


def _check_range(kind: str, bound: int, low, high) -> None:
    if int(low) < 0 or int(high) > _top(kind, bound):
        raise SecureAggregationError(_range_message(kind, bound, low, high))


# --------------------------------------------------------------------------- integer sums

secure_sum_bitwidth_p = core.Primitive(SECURE_SUM_BITWIDTH)
secure_sum_p = core.Primitive(SECURE_SUM)
_KIND = {secure_sum_bitwidth_p: SECURE_SUM_BITWIDTH, secure_sum_p: SECURE_SUM}


def _int_sum_abstract_eval(x, *, clients, axis, mesh, bound, kind):
    del axis, mesh
    if not x.shape or x.shape[0] != clients:
        raise PlacementError(f"{kind} needs a CLIENTS value with a leading axis of size "
                             f"{clients}, got shape {tuple(x.shape)}.")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ArgumentError(f"{kind} sums integers, got {x.dtype}.")
    _check_fits(kind, bound, clients, x.dtype)
    return P._unplaced(x)


def _int_sum_impl(x, *, clients, axis, mesh, bound, kind):
    del clients, axis, mesh
    # Checked where the values are: concretely here, and by a callback under jit (a
    # value of no elements has none to check, and no minimum to take).
    if x.size:
        jax.debug.callback(partial(_check_range, kind, bound), jnp.min(x), jnp.max(x))
    return jnp.sum(x, axis=0, dtype=x.dtype)


def _int_sum_batch(prim, axis_data, args, dims, **params):
    del axis_data
    (x,), (d,) = args, dims
    return prim.bind(P._move_batch_axis_after_clients(x, d), **params), (
        None if d is None else 0)


for _prim in (secure_sum_bitwidth_p, secure_sum_p):
    _kind = _KIND[_prim]
    _prim.def_effectful_abstract_eval(
        lambda x, _k=_kind, **p: (_int_sum_abstract_eval(x, kind=_k, **p),
                                  {jax._src.debugging.debug_effect}))
    P.register_impl_and_lowering(_prim, partial(_int_sum_impl, kind=_kind))
    # in chunks: each chunk's integer sum, wrapping in the dtype as the whole sum does
    chunking.register_aggregation(
        _prim, lambda x, _k=_kind, **p: [_int_sum_impl(x, kind=_k, **p)], chunking.as_is)
    ad.defjvp_zero(_prim)  # integer inputs carry no tangent
    jax._src.interpreters.batching.fancy_primitive_batchers[_prim] = partial(
        _int_sum_batch, _prim)


def _bound(op: str, name: str, value, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not (
            low <= int(value) <= high):
        raise SecureAggregationError(
            f"{op}: {name} must be a Python int in [{low}, {high}], got {value!r}; it is "
            "part of the protocol, fixed when the program is written.")
    return int(value)


def _int_sum(prim, op: str, x, bound: int):
    params = _api._params(op)
    paths, arrays, treedef = _api._leaves_with_paths(x, op, "value")
    _api._check_clients_leaves(op, "value", paths, arrays, params["clients"], params["axis"])
    for path, a in zip(paths, arrays):
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise PlacementError(
                f"{op}: value{jax.tree_util.keystr(path)} has dtype {a.dtype}; secure sums "
                f"add integers (at {_api.user_location()}). Quantize floats first, or use "
                "federated_secure_mean.")
    kind = _KIND[prim]
    for a in arrays:
        _check_fits(kind, bound, params["clients"], a.dtype)  # before any value is read
    for a in arrays:
        if not isinstance(a, core.Tracer) and a.size:  # concrete: refuse before binding
            _check_range(kind, bound, jnp.min(a), jnp.max(a))
    return jax.tree_util.tree_unflatten(
        treedef, [prim.bind(a, bound=bound, **params) for a in arrays])


def federated_secure_sum_bitwidth(x, bitwidth: int):
    """CLIENTS -> SERVER: the sum of integer values, each in [0, 2**bitwidth - 1].

    Args:
      x: a CLIENTS value of integer leaves.
      bitwidth: each client's values fit in this many bits.

    Returns:
      The SERVER value: the exact sum. A value out of range, or a bound whose clients'
      sum could wrap the dtype, is a `SecureAggregationError`.

    Example:
      >>> import jax.numpy as jnp, fax_bridge as fb
      >>> @fb.program(clients=3)
      ... def total(x):
      ...     return fb.federated_secure_sum_bitwidth(x, 4)
      >>> print(total(jnp.array([1, 2, 15], jnp.int32)))
      18
    """
    op = SECURE_SUM_BITWIDTH
    return _int_sum(secure_sum_bitwidth_p, op, x, _bound(op, "bitwidth", bitwidth, 0,
                                                         MAX_BITWIDTH))


def federated_secure_sum(x, max_input: int):
    """CLIENTS -> SERVER: the sum of integer values, each in [0, max_input].

    Args:
      x: a CLIENTS value of integer leaves.
      max_input: the largest value a client may send.

    Returns:
      The SERVER value: the exact sum (out-of-range values are refused).

    Example:
      >>> import jax.numpy as jnp, fax_bridge as fb
      >>> @fb.program(clients=3)
      ... def total(x):
      ...     return fb.federated_secure_sum(x, 10)
      >>> print(total(jnp.array([1, 2, 10], jnp.int32)))
      13
    """
    op = SECURE_SUM
    return _int_sum(secure_sum_p, op, x, _bound(op, "max_input", max_input, 0, 2 ** 62))


def federated_secure_modular_sum(x, modulus: int):
    """CLIENTS -> SERVER: the sum of integer values modulo `modulus`.

    As TFF's `federated_secure_modular_sum` with its default `preapply_modulus`, each
    client first reduces its values modulo `modulus` (floor modulo, so negatives land in
    range too). federated_language has no such intrinsic, so this is the composition
    `federated_map` (reduce) -> `federated_secure_sum_bitwidth` (bitwidth of modulus - 1)
    -> `federated_apply` (modulo), which the runtime and the fleet execute with partial
    sums on the devices. The codes' sum must fit the dtype: clients * (2**b - 1), b the
    bit length of modulus - 1, must fit the values' dtype (checked when traced).

    Args:
      x: a CLIENTS value of integer leaves.
      modulus: the modulus, in [1, 2**31].

    Returns:
      The SERVER value: the sum of the clients' values, modulo `modulus`.

    Example:
      >>> import jax.numpy as jnp, fax_bridge as fb
      >>> @fb.program(clients=3)
      ... def total(x):
      ...     return fb.federated_secure_modular_sum(x, 5)
      >>> print(total(jnp.array([4, 4, -1], jnp.int32)))  # (4 + 4 + 4) mod 5
      2
    """
    op = "federated_secure_modular_sum"
    params = _api._params(op)
    n = params["clients"]
    modulus = _bound(op, "modulus", modulus, 1, 2 ** 31)
    bits = max(1, (modulus - 1).bit_length())
    paths, arrays, treedef = _api._leaves_with_paths(x, op, "value")
    _api._check_clients_leaves(op, "value", paths, arrays, n, params["axis"])
    for path, a in zip(paths, arrays):
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise PlacementError(f"{op}: value{jax.tree_util.keystr(path)} has dtype "
                                 f"{a.dtype}; modular sums add integers.")
        # the reduced values go through the bitwidth sum: its rule, named by the modulus
        refusal = secure_sum_refusal(op, "modulus", modulus, 2 ** bits - 1, n, a.dtype)
        if refusal:
            raise SecureAggregationError(refusal)
    reduced = _api.federated_map_clients(
        lambda *v: tuple(jnp.mod(a, jnp.asarray(modulus, a.dtype)) for a in v), tuple(arrays))
    totals = federated_secure_sum_bitwidth(tuple(reduced), bits)
    out = _api.federated_map_server(
        lambda *t: tuple(jnp.mod(a, jnp.asarray(modulus, a.dtype)) for a in t), tuple(totals))
    return jax.tree_util.tree_unflatten(treedef, list(out))


# --------------------------------------------------------------------------- secure mean

secure_mean_p = core.Primitive("federated_secure_mean")


def quantize(x, key, lo: float, hi: float, bits: int):
    """One client's values as int32 codes in [0, 2**bits - 1], rounded stochastically."""
    top = 2 ** bits - 1
    scale = jnp.float32(top / (hi - lo))
    y = (jnp.clip(x.astype(jnp.float32), lo, hi) - jnp.float32(lo)) * scale
    u = jax.random.uniform(jax.random.wrap_key_data(key), y.shape, jnp.float32)
    return jnp.clip(jnp.floor(y + u), 0, top).astype(jnp.int32)


def dequantize(total, clients, lo: float, hi: float, bits: int, dtype):
    """The mean of `clients` clients' values from the sum of their codes (`clients` an
    int, or an integer scalar counted where the codes were summed)."""
    scale = jnp.float32((2 ** bits - 1) / (hi - lo))
    # Behind a barrier: a count known when tracing would be folded into the constant
    # divisor, which XLA turns into a product with its rounded reciprocal for scalars,
    # one rounding more than the division the export runs with a counted divisor.
    count = jax.lax.optimization_barrier(jnp.asarray(clients).astype(jnp.float32))
    return (jnp.float32(lo) + total.astype(jnp.float32) / (scale * count)).astype(dtype)


def _secure_mean_abstract_eval(x, keys, *, clients, axis, mesh, lo, hi, bits):
    del axis, mesh, lo, hi, bits
    if not x.shape or x.shape[0] != clients or keys.shape != (clients, 2):
        raise PlacementError(f"federated_secure_mean needs values and keys with a leading axis "
                             f"of {clients}, got {tuple(x.shape)} and {tuple(keys.shape)}.")
    return P._unplaced(x)


def _unclipped(x, lo: float, hi: float):
    """The values inside [lo, hi], zero elsewhere: the secure mean's derivative is the
    mean of theirs (the JVP rule's `inside`)."""
    return jnp.where((x >= lo) & (x <= hi), x, jnp.zeros_like(x))


def _unclipped_mean(total, clients, dtype):
    return (total / clients).astype(dtype)


def _secure_mean_impl(x, keys, *, clients, axis, mesh, lo, hi, bits):
    del axis
    codes = jax.vmap(lambda v, k: quantize(v, k, lo, hi, bits))(x, keys)
    mean = dequantize(jnp.sum(codes, axis=0, dtype=jnp.int32), clients, lo, hi, bits, x.dtype)
    # the codes have no derivative: differentiated directly, the implementation takes
    # its rule's (XLA drops the proxy's sum where nothing differentiates it)
    proxy = _lowering.clients_sum(_unclipped(x, lo, hi), reduce=mesh is not None)
    return _lowering.derivative_of(mean, _unclipped_mean(proxy, clients, x.dtype))


def _secure_mean_jvp(primals, tangents, **params):
    x, keys = primals
    t, _ = tangents
    out = secure_mean_p.bind(x, keys, **params)
    if type(t) is ad.Zero:
        return out, ad.Zero.from_primal_value(out)
    inside = (x >= params["lo"]) & (x <= params["hi"])
    agg = {k: params[k] for k in ("clients", "axis", "mesh")}
    (t_in,) = P.map_bind(lambda ti, m: [jnp.where(m, ti, jnp.zeros_like(ti))], [t, inside],
                         P.CLIENTS, name="unclipped", **agg)
    return out, P.federated_mean_p.bind(t_in, **agg)


def _secure_mean_batch(axis_data, args, dims, **params):
    """An outer vmap's axis joins each client's member (one key rounds all of it)."""
    del axis_data
    (x, keys), (dx, dk) = args, dims
    if dk is not None:
        raise SecureAggregationError(
            "federated_secure_mean under vmap needs the same keys for every batch element "
            "(vmap with in_axes=None for the keys); batch the values only.")
    if dx is None:
        return secure_mean_p.bind(x, keys, **params), None
    return secure_mean_p.bind(P._move_batch_axis_after_clients(x, dx), keys, **params), 0


def _secure_mean_partials(x, keys, *, lo, hi, bits, mesh, **params):
    """One chunk's sum of codes (codes add exactly across chunks), and of its unclipped
    values, whose mean carries the derivative (`_secure_mean_impl`)."""
    del params
    codes = jax.vmap(lambda v, k: quantize(v, k, lo, hi, bits))(x, keys)
    return [jnp.sum(codes, axis=0, dtype=jnp.int32),
            _lowering.clients_sum(_unclipped(x, lo, hi), reduce=mesh is not None)]


def _secure_mean_finish(totals, x_aval, keys_aval, *, clients, lo, hi, bits, **params):
    del keys_aval, params
    return [_lowering.derivative_of(dequantize(totals[0], clients, lo, hi, bits, x_aval.dtype),
                                    _unclipped_mean(totals[1], clients, x_aval.dtype))]


secure_mean_p.def_abstract_eval(_secure_mean_abstract_eval)
chunking.register_aggregation(secure_mean_p, _secure_mean_partials, _secure_mean_finish)
jax._src.interpreters.batching.fancy_primitive_batchers[secure_mean_p] = _secure_mean_batch
P.register_impl_and_lowering(secure_mean_p, _secure_mean_impl)
ad.primitive_jvps[secure_mean_p] = _secure_mean_jvp


def federated_secure_mean(x, keys, *, value_range: tuple, bits: int = 16):
    """CLIENTS -> SERVER: the mean of float values through `federated_secure_sum_bitwidth`.

    `keys` is a CLIENTS uint32 array of shape (clients, 2) (one raw PRNG key per client,
    `jax.random.key_data`) driving the stochastic rounding; `value_range` (lo, hi) the
    clipping range; `bits` the bitwidth of each client's codes. See the module docstring
    for the error bound.

    Args:
      x: a CLIENTS value of float leaves.
      keys: the clients' raw PRNG keys, uint32 of shape (clients, 2).
      value_range: (lo, hi): values are clipped to it before they are quantized.
      bits: bits per client's code.

    Returns:
      The SERVER value: the mean, within one quantization step of the exact one.

    Example:
      >>> import jax, jax.numpy as jnp, fax_bridge as fb
      >>> @fb.program(clients=2)
      ... def mean(x, keys):
      ...     return fb.federated_secure_mean(x, keys, value_range=(0.0, 1.0), bits=8)
      >>> keys = jax.random.key_data(jax.random.split(jax.random.PRNGKey(0), 2))
      >>> print(mean(jnp.array([0.25, 0.75]), keys))
      0.5
    """
    op = "federated_secure_mean"
    params = _api._params(op)
    n = params["clients"]
    lo, hi = (float(v) for v in value_range)
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise SecureAggregationError(f"{op}: value_range must be finite (lo, hi) with lo < hi, "
                                     f"got {value_range!r}.")
    bits = _bound(op, "bits", bits, 1, 31 - math.ceil(math.log2(max(n, 2))))
    paths, arrays, treedef = _api._leaves_with_paths(x, op, "value")
    _api._check_clients_leaves(op, "value", paths, arrays, n, params["axis"])
    keys = jnp.asarray(keys)
    if keys.shape != (n, 2) or keys.dtype != jnp.uint32:
        raise PlacementError(f"{op}: keys must be a CLIENTS uint32 array of shape ({n}, 2), "
                             f"got {keys.dtype}{list(keys.shape)} (at {_api.user_location()}).")
    out = []
    for i, (path, a) in enumerate(zip(paths, arrays)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise PlacementError(f"{op}: value{jax.tree_util.keystr(path)} has dtype "
                                 f"{a.dtype}; the secure mean averages floats.")
        (k,) = P.map_bind(lambda kk, _i=i: [jax.random.key_data(jax.random.fold_in(
            jax.random.wrap_key_data(kk), _i))], [keys], P.CLIENTS, name="leaf_key", **params)
        out.append(secure_mean_p.bind(a, k, lo=lo, hi=hi, bits=bits, **params))
    return jax.tree_util.tree_unflatten(treedef, out)


# --------------------------------------------------------------------------- records

_BITWIDTH = intrinsic_defs.FEDERATED_SECURE_SUM_BITWIDTH
for _prim, _intrinsic in (
    (secure_sum_bitwidth_p, _BITWIDTH),
    (secure_sum_p, intrinsic_defs.FEDERATED_SECURE_SUM),
    # exported as map (quantize) -> secure_sum_bitwidth -> apply (dequantize)
    (secure_mean_p, _BITWIDTH),
):
    _facts.register(_facts.PrimitiveFacts(_prim, _facts.Movement.AGGREGATE, _intrinsic,
                                          _facts.Batching.ALONE))
