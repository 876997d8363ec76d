"""How federated primitives lower: their plain-jax implementations, the evaluation of
nested federated equations through them, and the MLIR check that finds a broadcast
operand.

Each federated primitive is implemented by a jax function (`IMPLEMENTATIONS`) that its
lowering traces. The map lowering evaluates a per-member jaxpr with nested federated
equations run as those functions (`eval_implemented`), so the `vmap` around it reaches
their sharding constraints (`spmd_axis_name` composes nested placements). A map operand
that is a broadcast of one value (`broadcast_source`) is passed unbatched.
"""

from __future__ import annotations

from functools import partial

from jax._src import core
from jax._src import dispatch as _dispatch
from jax._src.lib.mlir import ir
from jax.interpreters import mlir

# The plain-jax implementation of each federated primitive (what its lowering traces).
IMPLEMENTATIONS: dict = {}


def register_impl_and_lowering(prim: core.Primitive, fn) -> None:
    """Implements `prim` by jitting its lowering, which is `fn` traced by jax."""
    prim.def_impl(partial(_dispatch.apply_primitive, prim))
    mlir.register_lowering(prim, mlir.lower_fun(fn, multiple_results=prim.multiple_results))
    IMPLEMENTATIONS[prim] = fn


def eval_implemented(jaxpr: core.ClosedJaxpr, *args):
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
