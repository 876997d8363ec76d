"""How federated primitives lower: their plain-jax implementations, the evaluation of
nested federated equations through them, and the MLIR check that finds a broadcast
operand.

Each federated primitive is implemented by a jax function (`IMPLEMENTATIONS`) that its
lowering traces. The map lowering evaluates a per-member jaxpr with nested federated
equations run as those functions (`eval_implemented`), so the `vmap` around it reaches
their sharding constraints (`spmd_axis_name` composes nested placements). A map operand
that is a broadcast of one value (`broadcast_source`) is passed unbatched. Sums over a
placed axis are one dot over it off a mesh (`clients_sum`).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core
from jax._src import dispatch as _dispatch
from jax._src.lib.mlir import ir
from jax.interpreters import mlir
from jax.sharding import PartitionSpec

from fax_bridge.language import jax_compat as _compat

# The plain-jax implementation of each federated primitive (what its lowering traces).
IMPLEMENTATIONS: dict = {}


def register_impl_and_lowering(prim: core.Primitive, fn) -> None:
    """Implements `prim` by jitting its lowering, which is `fn` traced by jax."""
    prim.def_impl(partial(_dispatch.apply_primitive, prim))
    mlir.register_lowering(prim, mlir.lower_fun(fn, multiple_results=prim.multiple_results))
    IMPLEMENTATIONS[prim] = fn


@jax.custom_jvp
def derivative_of(value, proxy):
    """`value`, whose derivative is taken as `proxy`'s (same shape and dtype).

    Implementations are differentiated where their primitive's rule is not applied: a
    chunked round's derivative of a derivative differentiates the chunks' run of the
    first one, and a map's lowering the implementations of the equations nested in it.
    An implementation whose value goes through steps that have no derivative (integer
    codes) gives its value with `proxy`, a function of its inputs whose derivative is
    the rule's, so that it differentiates as the primitive does, to every order."""
    del proxy
    return value


@derivative_of.defjvp
def _derivative_of_jvp(primals, tangents):
    value, proxy = primals
    return derivative_of(value, proxy), tangents[1]


def refusing_derivatives(fn, refuse):
    """`fn` (an implementation), calling `refuse()` (which raises) when differentiated
    with a nonzero tangent: a primitive whose rule refuses refuses alike wherever its
    implementation is differentiated directly."""
    guarded = jax.custom_jvp(fn)
    guarded.defjvp(lambda primals, tangents: refuse())
    return guarded


def eval_implemented(jaxpr: _compat.ClosedJaxpr, *args):
    """Evaluates `jaxpr` with nested federated equations run as their plain-jax
    implementations, so transformations applied around it reach their constraints."""
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, core.Literal) else env[v]

    for v, c in zip(jaxpr.jaxpr.constvars, jaxpr.consts):
        env[v] = c
    for v, a in zip(jaxpr.jaxpr.invars, args):
        env[v] = a
    for eqn in jaxpr.jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        impl = IMPLEMENTATIONS.get(eqn.primitive)
        if impl is not None:
            outs = impl(*invals, **eqn.params)
        else:
            outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
        if not eqn.primitive.multiple_results:
            outs = [outs]
        for v, o in zip(eqn.outvars, outs):
            if not isinstance(v, core.DropVar):
                env[v] = o
    return [read(v) for v in jaxpr.jaxpr.outvars]


def accumulator(dtype):
    """The dtype a sum over clients of `dtype` values accumulates in: float32 for a float
    narrower than it (float16, bfloat16, the float8s: a float16 sum of 2,049 ones is
    already off, and of 65,520 overflows), else `dtype` itself."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
        return jnp.dtype(jnp.float32)
    return dtype


BLOCK_FROM = 256  # narrow floats of more clients are summed in blocks of about sqrt(n)


def _sharded(x) -> bool:
    spec = tuple(core.typeof(x).sharding.spec)
    return any(d is not None for d in spec)


def _blocked_sum(x, weights):
    """`clients_sum` of the float32 `x` (a narrow float widened) in two levels: blocks of
    about sqrt(n) clients, then the blocks' sums. A float32 sum of n terms errs by up to
    about n float32 roundings, which from 2**12 terms passes half a float16 ulp (a mean
    of 65,520 float16 copies of 0.1 came out one ulp off); in two levels it errs by about
    2 sqrt(n), so a mean of identical float16 values is that value up to millions of
    clients."""
    n = x.shape[0]
    block = int(np.ceil(np.sqrt(n)))
    blocks = -(-n // block)
    pad = blocks * block - n
    x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    x = x.reshape((blocks, block) + x.shape[1:])
    if weights is None:
        sums = jax.vmap(clients_sum)(x)
    else:
        w = jnp.pad(weights, [(0, pad)] + [(0, 0)] * (weights.ndim - 1))
        w = w.reshape((blocks, block) + w.shape[1:])
        sums = jax.vmap(clients_sum)(x, w)
    return clients_sum(sums)


def clients_sum(x, weights=None, *, reduce: bool = False):
    """The sum over the leading (clients) axis of `x`, each member scaled by its weight
    when `weights` (shape a prefix of `x.shape`) is given, in `accumulator(x.dtype)`:
    the caller rounds it to its result's dtype once, after any division.

    Floating-point sums are a dot product contracting the leading axis with a vector of
    ones or of the weights (batched over any further weight dimensions): XLA's CPU
    backend compiles a reduction over a leading axis into a fusion that is 10-500x slower
    than a dot on large members, and the dot is what hand-written `jnp.tensordot(w, x, 1)`
    compiles to. The dot adds members in another order than the reduction did, so float
    results may differ from a reduction's in the last bits.

    Integer sums stay reductions (exact, and fast there), and so does every sum with
    `reduce=True`, which federated operations placed over a mesh pass: there XLA fuses
    the reduction with the computation of its operand, which a dot does not, so each
    device's memory stays what it was (a dot would hold every local client's value).
    """
    narrow = accumulator(x.dtype) != x.dtype
    x = x.astype(accumulator(x.dtype))
    if narrow and not reduce and x.shape[0] > BLOCK_FROM and not _sharded(x):
        return _blocked_sum(x, weights)
    if reduce or not jnp.issubdtype(x.dtype, jnp.floating):
        if weights is not None:
            x = lax.expand_dims(weights, tuple(range(weights.ndim, x.ndim))).astype(x.dtype) * x
        return jnp.sum(x, axis=0, dtype=x.dtype)
    w = jnp.ones(x.shape[:1], x.dtype) if weights is None else weights.astype(x.dtype)
    batch = tuple(range(1, w.ndim))
    out_sharding = None
    aval = core.typeof(x)
    spec = tuple(aval.sharding.spec) + (None,) * (x.ndim - len(aval.sharding.spec))
    if any(d is not None for d in spec):  # sharded over Explicit mesh axes: the weights
        # take the value's layout, and the result keeps the sharding of the other dims
        out_sharding = aval.sharding.update(spec=PartitionSpec(*spec[1:]))
        w = jax.sharding.reshard(w, PartitionSpec(*spec[:w.ndim]))
    return lax.dot_general(w, x, (((0,), (0,)), (batch, batch)),
                           precision=lax.Precision.HIGHEST, preferred_element_type=x.dtype,
                           out_sharding=out_sharding)


_LAYOUT_OPS = ("sdy.sharding_constraint", "stablehlo.custom_call")


def broadcast_source(value, clients: int):
    """The member value that `value` (an MLIR value with a leading axis of `clients`)
    broadcasts, looking through layout constraints; None when it is not a broadcast."""
    for _ in range(16):
        owner = value.owner
        if not isinstance(owner, (ir.Operation, ir.OpView)):
            return None  # a block argument
        op = owner.operation if isinstance(owner, ir.OpView) else owner
        if op.name in _LAYOUT_OPS:
            if op.name == "stablehlo.custom_call" and "Sharding" not in str(
                    op.attributes["call_target_name"]):
                return None
            value = op.operands[0]
            continue
        if op.name != "stablehlo.broadcast_in_dim":
            return None
        source = op.operands[0]
        src = ir.RankedTensorType(source.type)
        out = ir.RankedTensorType(value.type)
        dims = list(ir.DenseI64ArrayAttr(op.attributes["broadcast_dimensions"]))
        if (dims == list(range(1, src.rank + 1)) and out.rank == src.rank + 1
                and out.shape[0] == clients and list(out.shape[1:]) == list(src.shape)):
            return source
        return None
    return None
