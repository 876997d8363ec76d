"""Federated building blocks as JAX primitives, each with its rules registered beside it.

A placed array (CLIENTS, or any placement a program names) carries a leading axis of
size `clients`, the placement's number of members; a SERVER-placed array is a plain
array. Every primitive here works on single arrays (the public functions in
`fax_bridge.api` map them over pytrees) and has: abstract evaluation, an implementation,
an MLIR lowering, a JVP, a transpose and a batching rule. Transposes bind federated
primitives again (broadcast <-> sum), so the derivative of a federated program is a
federated program.

Every primitive carries `clients` (members), `axis` (the placement's name) and `mesh`
(the mesh to lay placed values out on, or None). Lowerings split the leading axis of
placed values over the mesh axis named `axis` and leave every other dimension as it is
(`local.place_leading`); abstract evaluation keeps the sharding of those dimensions in
the types, so meshes with Explicit axes type-check.

`federated_map_p` is higher order: it carries the per-member computation as a closed
jaxpr (`jaxpr`), applied to every member (`placement="clients"`, lowered as one `vmap`
whose mapped axis is the mesh axis `axis`, so sharding constraints and `shard_map`
inside the function see it as an SPMD axis) or once at the server (`placement="server"`).
Keeping the jaxpr in the equation is what lets the exporter turn it into a TFF
`federated_map` of an Xla computation, including after `jax.grad` (JVP, transpose,
partial evaluation and DCE all produce new `federated_map_p` equations with transformed
per-member jaxprs).

`federated_decode_sum_p` is an aggregation whose members (e.g. packed integer codes)
cross to the server as they are and are decoded there: the sum over clients of
`decode(member)`, `decode` a closed jaxpr, exported as TFF's `federated_aggregate`
(accumulate = add the decoded member). Codes are neither differentiated nor batched:
its JVP, transpose and batching rules (of batched operands) refuse, naming the fix.
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
from federated_language.compiler import intrinsic_defs
from jax import lax
from jax._src import core  # Primitive, ShapedArray, Tracer, new_jaxpr_eqn
from jax.interpreters import mlir
from jax.sharding import PartitionSpec

# Rule tables and jaxpr utilities for higher-order primitives live in jax's internal
# interpreter modules on jax 0.10 (the public `jax.interpreters.*` re-export only some).
from jax._src import dispatch as _dispatch
from jax._src import source_info_util as _source_info_util
from jax._src.interpreters import ad, batching
from jax._src.interpreters import partial_eval as pe

from fax_bridge.local import jit as _local
from fax_bridge.language import jax_compat as _compat
from fax_bridge.language import lowering as _lowering
from fax_bridge.language import primitive_facts as _facts
from fax_bridge.errors import ArgumentError, PlacementError
from fax_bridge.language.placements import aggregate_refusal, decode_sum_refusal

CLIENTS = "clients"
SERVER = "server"


# --------------------------------------------------------------------------- types


def _spec_of(aval) -> tuple:
    sharding = getattr(aval, "sharding", None)
    spec = tuple(getattr(sharding, "spec", ()) or ())
    return spec + (None,) * (len(aval.shape) - len(spec))


def _explicit_lead(aval, axis: str):
    """The leading entry of a placed value's type spec: `axis` on an Explicit mesh."""
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    return axis if _local.axis_is_explicit(mesh, axis) else None


def _placed(member, clients: int, axis: str, lead=None) -> core.ShapedArray:
    """The type of a placed value whose members have type `member`."""
    spec = PartitionSpec(lead, *_spec_of(member))
    return member.update(shape=(clients,) + tuple(member.shape),
                         sharding=member.sharding.update(spec=spec))


def _unplaced(aval) -> core.ShapedArray:
    """The type of one member of the placed value `aval` (its leading axis removed)."""
    spec = PartitionSpec(*_spec_of(aval)[1:])
    return aval.update(shape=tuple(aval.shape[1:]), sharding=aval.sharding.update(spec=spec))


# Modules that define more federated primitives (fax_bridge.language.secure) register through it.
register_impl_and_lowering = _register_impl_and_lowering = _lowering.register_impl_and_lowering


def _zero_like(x):
    return ad.Zero(core.typeof(x).to_tangent_aval())


def _move_batch_axis_after_clients(x, bdim):
    """Puts an outer vmap axis right after the clients axis (axis 1) of a CLIENTS value."""
    if bdim is None:
        return x
    return jnp.moveaxis(x, bdim, 1)


def _move_batch_axis_first(x, bdim):
    if bdim is None:
        return x
    return jnp.moveaxis(x, bdim, 0)


# --------------------------------------------------------------------------- broadcast

federated_broadcast_p = core.Primitive("federated_broadcast")


def _broadcast_impl(x, *, clients, axis, mesh):
    return _local.place_leading(lax.broadcast(x, (clients,)), axis, mesh)


def _broadcast_abstract_eval(x, *, clients, axis, mesh):
    del mesh
    return _placed(x, clients, axis, _explicit_lead(x, axis))


def _broadcast_transpose(ct, x, **params):
    del x
    return [federated_sum_p.bind(ct, **params)]


def _broadcast_batch(axis_data, args, dims, **params):
    del axis_data
    (x,), (d,) = args, dims
    out = federated_broadcast_p.bind(_move_batch_axis_first(x, d), **params)
    return out, (None if d is None else 1)


federated_broadcast_p.def_abstract_eval(_broadcast_abstract_eval)
_lowering.register_impl_and_lowering(federated_broadcast_p, _broadcast_impl)
ad.deflinear2(federated_broadcast_p, lambda ct, x, **p: _broadcast_transpose(ct, x, **p))
batching.fancy_primitive_batchers[federated_broadcast_p] = _broadcast_batch
_facts.register(_facts.PrimitiveFacts(
    federated_broadcast_p, _facts.Movement.BROADCAST, intrinsic_defs.FEDERATED_BROADCAST,
    batching=_facts.Batching.KIND))


# --------------------------------------------------------------------------- sum / mean

federated_sum_p = core.Primitive("federated_sum")
federated_mean_p = core.Primitive("federated_mean")


def _check_clients_axis(name, x, clients):
    if not x.shape or x.shape[0] != clients:
        raise PlacementError(
            f"{name} needs a CLIENTS value with a leading axis of size {clients}, got "
            f"shape {tuple(x.shape)}."
        )


def _aggregate_abstract_eval(x, *, clients, axis, mesh, name):
    del axis, mesh
    _check_clients_axis(name, x, clients)
    refusal = aggregate_refusal(name, x.dtype)
    if refusal:
        raise PlacementError(refusal)
    return _unplaced(x)


def _sum_impl(x, *, clients, axis, mesh):
    del clients, axis
    return _lowering.clients_sum(x, reduce=mesh is not None).astype(x.dtype)


def _mean_impl(x, *, clients, axis, mesh):
    del axis
    return (_lowering.clients_sum(x, reduce=mesh is not None) / clients).astype(x.dtype)


def _sum_transpose(ct, x, **params):
    del x
    return [federated_broadcast_p.bind(ct, **params)]


def _mean_transpose(ct, x, **params):
    del x
    return [federated_broadcast_p.bind(ct / jnp.asarray(params["clients"], ct.dtype),
                                       **params)]


def _aggregate_batch(prim, axis_data, args, dims, **params):
    del axis_data
    (x,), (d,) = args, dims
    out = prim.bind(_move_batch_axis_after_clients(x, d), **params)
    return out, (None if d is None else 0)


for _prim, _impl, _transpose in (
    (federated_sum_p, _sum_impl, _sum_transpose),
    (federated_mean_p, _mean_impl, _mean_transpose),
):
    _prim.def_abstract_eval(partial(_aggregate_abstract_eval, name=_prim.name))
    _lowering.register_impl_and_lowering(_prim, _impl)
    ad.deflinear2(_prim, lambda ct, x, _t=_transpose, **p: _t(ct, x, **p))
    batching.fancy_primitive_batchers[_prim] = partial(_aggregate_batch, _prim)
for _prim, _intrinsic in ((federated_sum_p, intrinsic_defs.FEDERATED_SUM),
                          (federated_mean_p, intrinsic_defs.FEDERATED_MEAN)):
    _facts.register(_facts.PrimitiveFacts(_prim, _facts.Movement.AGGREGATE, _intrinsic,
                                          _facts.Batching.KIND))


# --------------------------------------------------------------------------- weighted mean

federated_weighted_mean_p = core.Primitive("federated_weighted_mean")


def _expand_weights(w, x):
    """Gives per-client weights of shape w.shape the rank of x (trailing unit axes)."""
    return lax.expand_dims(w, tuple(range(w.ndim, x.ndim)))


def _weighted_mean_impl(x, w, *, clients, axis, mesh):
    del clients, axis
    num = _lowering.clients_sum(x, w, reduce=mesh is not None)
    total = _lowering.clients_sum(w, reduce=mesh is not None).astype(num.dtype)
    return (num / lax.expand_dims(total, tuple(range(total.ndim, num.ndim)))).astype(x.dtype)


def _weighted_mean_abstract_eval(x, w, *, clients, axis, mesh):
    del axis, mesh
    _check_clients_axis("federated_weighted_mean", x, clients)
    if tuple(w.shape) != tuple(x.shape[: len(w.shape)]) or not w.shape:
        raise PlacementError(
            "federated_weighted_mean needs weights of shape (clients,) (one weight per "
            f"client); got weights of shape {tuple(w.shape)} for a value of shape "
            f"{tuple(x.shape)}."
        )
    refusal = aggregate_refusal("federated_weighted_mean", x.dtype)
    if refusal:
        raise PlacementError(refusal)
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise ArgumentError(
            "federated_weighted_mean needs floating-point weights; got "
            f"{w.dtype} weights (cast them with .astype(jnp.float32))."
        )
    return _unplaced(x)


def _member_scaled(c, w, total):
    """Per client: the cotangent share w_i / sum(w) of the weighted mean."""
    return [c * _expand_weights(w, c).astype(c.dtype) / _expand_weights(total, c).astype(c.dtype)]


def _member_deviation(tw, x, m):
    """Per client: tw_i * (x_i - m), the weight tangent's contribution."""
    return [_expand_weights(tw, x).astype(x.dtype) * (x - m)]


def _weighted_mean_jvp(primals, tangents, **params):
    x, w = primals
    tx, tw = tangents
    out = federated_weighted_mean_p.bind(x, w, **params)
    parts = []
    if type(tx) is not ad.Zero:
        parts.append(federated_weighted_mean_p.bind(tx, w, **params))
    if type(tw) is not ad.Zero:
        total = federated_sum_p.bind(w, **params)
        m_c = federated_broadcast_p.bind(out, **params)
        (dev,) = map_bind(_member_deviation, [tw, x, m_c], CLIENTS, **params)
        dm = federated_sum_p.bind(dev, **params)
        parts.append(dm / _expand_weights(total, dm).astype(dm.dtype))
    if not parts:
        return out, _zero_like(out)
    tangent = parts[0]
    for p in parts[1:]:
        tangent = tangent + p
    return out, tangent


def _weighted_mean_transpose(ct, x, w, **params):
    if ad.is_undefined_primal(w):
        raise ValueError("federated_weighted_mean is not linear in its weights.")
    if type(ct) is ad.Zero:
        return [ad.Zero(x.aval.to_tangent_aval()), None]
    total = federated_sum_p.bind(w, **params)
    ct_c = federated_broadcast_p.bind(ct, **params)
    total_c = federated_broadcast_p.bind(total, **params)
    (ct_x,) = map_bind(_member_scaled, [ct_c, w, total_c], CLIENTS, **params)
    return [ct_x, None]


def _weighted_mean_batch(axis_data, args, dims, **params):
    x, w = args
    dx, dw = dims
    if dx is None and dw is None:
        return federated_weighted_mean_p.bind(x, w, **params), None
    size = axis_data.size
    x = _move_batch_axis_after_clients(x, dx)
    w = _move_batch_axis_after_clients(w, dw)
    if dx is None:
        x = jnp.broadcast_to(x[:, None], (x.shape[0], size) + x.shape[1:])
    if dw is None:
        w = jnp.broadcast_to(w[:, None], (w.shape[0], size) + w.shape[1:])
    return federated_weighted_mean_p.bind(x, w, **params), 0


federated_weighted_mean_p.def_abstract_eval(_weighted_mean_abstract_eval)
_lowering.register_impl_and_lowering(federated_weighted_mean_p, _weighted_mean_impl)
ad.primitive_jvps[federated_weighted_mean_p] = _weighted_mean_jvp
ad.primitive_transposes[federated_weighted_mean_p] = _weighted_mean_transpose
batching.fancy_primitive_batchers[federated_weighted_mean_p] = _weighted_mean_batch
_facts.register(_facts.PrimitiveFacts(  # batched by weights: one TFF weight operand
    federated_weighted_mean_p, _facts.Movement.AGGREGATE,
    intrinsic_defs.FEDERATED_WEIGHTED_MEAN, _facts.Batching.WEIGHTS))


# --------------------------------------------------------------------------- map


federated_map_p = core.Primitive("federated_map")
federated_map_p.multiple_results = True


def outer_aval(aval, placement: str, clients: int, axis: str = CLIENTS) -> core.ShapedArray:
    """The aval a member value has as a federated value at `placement`."""
    if placement == CLIENTS:
        return _placed(aval, clients, axis, _explicit_lead(aval, axis))
    return aval


def member_aval(aval, placement: str) -> core.ShapedArray:
    """The aval of one member (one client's slice) of a federated value."""
    if placement == CLIENTS:
        return _unplaced(aval)
    return aval


def trace_member_fn(fn, member_avals: Sequence[core.ShapedArray], debug_name: str):
    """Traces a flat per-member function to a closed jaxpr.

    Returns (closed_jaxpr, captured): values the function closed over that are tracers of
    an enclosing trace are lifted out as `captured` (the jaxpr takes them first), concrete
    constants stay inside the closed jaxpr.
    """
    return _compat.trace_lifting(fn, member_avals, debug_name,
                                 lambda c: isinstance(c, core.Tracer))


def map_bind(fn, args: Sequence, placement: str, clients: int, name: str | None = None,
             axis: str = CLIENTS, mesh=None):
    """Binds `federated_map_p` for `fn`, a function from flat member arrays to a list of them."""
    avals = [member_aval(core.typeof(a), placement) for a in args]
    closed, captured = trace_member_fn(fn, avals, name or getattr(fn, "__name__", "fn"))
    if captured:
        if placement == CLIENTS:
            captured = [federated_broadcast_p.bind(c, clients=clients, axis=axis, mesh=mesh)
                        for c in captured]
        args = list(captured) + list(args)
    return federated_map_p.bind(
        *args, jaxpr=closed, placement=placement, clients=clients,
        name=name or getattr(fn, "__name__", "fn"), axis=axis, mesh=mesh)


def _map_abstract_eval(*avals, jaxpr, placement, clients, name, axis, mesh):
    del name, mesh
    for i, (a, m) in enumerate(zip(avals, jaxpr.in_avals)):
        expect = outer_aval(m, placement, clients, axis)
        if tuple(a.shape) != tuple(expect.shape) or a.dtype != expect.dtype:
            raise PlacementError(
                f"federated_map at {placement.upper()}: operand {i} has type "
                f"{a.str_short()}, expected {expect.str_short()}."
            )
    return [outer_aval(a, placement, clients, axis) for a in jaxpr.out_avals]


def _map_impl(*args, jaxpr, placement, clients, name, axis, mesh, shared=()):
    """Applies `jaxpr` to every member: one vmap. Operands flagged in `shared` are one
    member-shaped value that every member sees (a broadcast, see `_map_lowering`)."""
    del name
    fn = partial(_lowering.eval_implemented, jaxpr)
    if placement != CLIENTS:
        return fn(*args)
    shared = shared or (False,) * len(args)
    in_axes = [None if s else 0 for s in shared]
    if mesh is None or axis not in mesh.axis_names:
        return jax.vmap(fn, in_axes=in_axes, axis_size=clients)(*args)
    args = [a if s else _local.place_leading(a, axis, mesh) for a, s in zip(args, shared)]
    spmd = None if _local.axis_is_explicit(mesh, axis) else axis
    outs = jax.vmap(fn, in_axes=in_axes, axis_size=clients, spmd_axis_name=spmd)(*args)
    return [_local.place_leading(o, axis, mesh) for o in outs]


_map_lower_batched = mlir.lower_fun(_map_impl, multiple_results=True)


def _map_lowering(ctx, *args, **params):
    """Lowers a map; an operand that is a broadcast of one value (as after
    `federated_broadcast`) enters the per-member function unbatched, as `vmap` with
    `in_axes=None` would take it, so the broadcast copy is never materialized."""
    if params["placement"] != CLIENTS:
        return _map_lower_batched(ctx, *args, **params)
    sources = [_lowering.broadcast_source(a, params["clients"]) for a in args]
    if all(s is None for s in sources):
        return _map_lower_batched(ctx, *args, **params)
    shared = tuple(s is not None for s in sources)
    avals = [_unplaced(a) if s else a for a, s in zip(ctx.avals_in, shared)]
    return _map_lower_batched(ctx.replace(avals_in=avals),
                              *[s if s is not None else a for a, s in zip(args, sources)],
                              shared=shared, **params)


def _map_jvp(primals, tangents, *, jaxpr, name, **params):
    nonzeros = [type(t) is not ad.Zero for t in tangents]
    jvp_jaxpr, out_nz = ad.jvp_jaxpr(jaxpr, nonzeros, instantiate=False)
    nz_tangents = [t for t in tangents if type(t) is not ad.Zero]
    outs = federated_map_p.bind(*primals, *nz_tangents, jaxpr=jvp_jaxpr,
                                name=f"jvp({name})", **params)
    n_out = len(jaxpr.out_avals)
    out_primals, out_nz_tangents = outs[:n_out], iter(outs[n_out:])
    out_tangents = [next(out_nz_tangents) if nz else _zero_like(p)
                    for p, nz in zip(out_primals, out_nz)]
    return out_primals, out_tangents


def _map_transpose(cts, *args, jaxpr, name, **params):
    in_linear = [ad.is_undefined_primal(x) for x in args]
    out_zeros = [type(ct) is ad.Zero for ct in cts]
    zero_result = [ad.Zero(x.aval.to_tangent_aval()) if lin else None
                   for x, lin in zip(args, in_linear)]
    if all(out_zeros):
        return zero_result
    t_jaxpr, in_zeros = _compat.transpose_closed(jaxpr, in_linear, out_zeros)
    nonlinear = [x for x, lin in zip(args, in_linear) if not lin]
    nz_cts = [ct for ct in cts if type(ct) is not ad.Zero]
    outs = iter(federated_map_p.bind(*nonlinear, *nz_cts, jaxpr=t_jaxpr,
                                     name=f"transpose({name})", **params))
    lin_zeros = iter(in_zeros)
    result = []
    for x, lin, zr in zip(args, in_linear, zero_result):
        if not lin:
            result.append(None)
        elif next(lin_zeros):
            result.append(zr)
        else:
            result.append(next(outs))
    return result


def _map_partial_eval(trace, *tracers, jaxpr, name, **params):
    unknowns = [not t.pval.is_known() for t in tracers]
    if not any(unknowns):
        known = [t.pval.get_known() for t in tracers]
        return [trace.new_const(v) for v in federated_map_p.bind(
            *known, jaxpr=jaxpr, name=name, **params)]
    jaxpr_known, jaxpr_unknown, out_unknowns, res_avals = pe.partial_eval_jaxpr_nounits(
        jaxpr, unknowns, instantiate=False)
    known_vals = [t.pval.get_known() for t, uk in zip(tracers, unknowns) if not uk]
    known_outs = federated_map_p.bind(*known_vals, jaxpr=jaxpr_known,
                                      name=f"known({name})", **params)
    n_res = len(res_avals)
    known_out_vals = known_outs[: len(known_outs) - n_res]
    residuals = known_outs[len(known_outs) - n_res:]
    res_tracers = [trace.new_instantiated_const(r) for r in residuals]
    unknown_tracers = [trace.instantiate_const(t) for t, uk in zip(tracers, unknowns) if uk]
    out_tracers = [
        pe.JaxprTracer(trace, pe.PartialVal.unknown(
            outer_aval(a, params["placement"], params["clients"], params["axis"])), None)
        for a in jaxpr_unknown.out_avals
    ]
    new_params = dict(params, jaxpr=jaxpr_unknown, name=f"staged({name})")
    recipe = pe.new_eqn_recipe(
        trace, res_tracers + unknown_tracers, out_tracers, federated_map_p, new_params,
        core.no_effects, _source_info_util.current())
    for t in out_tracers:
        t.recipe = recipe
    known_iter, unknown_iter = iter(known_out_vals), iter(out_tracers)
    return [next(unknown_iter) if uk else trace.new_const(next(known_iter))
            for uk in out_unknowns]


def _map_dce(used_outputs, eqn):
    if not any(used_outputs):
        return [False] * len(eqn.invars), None
    new_closed, used_inputs = _compat.dce_closed(eqn.params["jaxpr"], used_outputs)
    new_params = dict(eqn.params, jaxpr=new_closed)
    new_eqn = core.new_jaxpr_eqn(
        [v for v, u in zip(eqn.invars, used_inputs) if u],
        [v for v, u in zip(eqn.outvars, used_outputs) if u],
        federated_map_p, new_params, core.no_effects, eqn.source_info, eqn.ctx)
    return used_inputs, new_eqn


def _map_batch(axis_data, args, dims, *, jaxpr, **params):
    in_batched = [d is not None for d in dims]
    if not any(in_batched):
        outs = federated_map_p.bind(*args, jaxpr=jaxpr, **params)
        return outs, [None] * len(outs)
    if params["placement"] == CLIENTS:
        args = [_move_batch_axis_after_clients(x, d) for x, d in zip(args, dims)]
        out_dim = 1
    else:
        args = [_move_batch_axis_first(x, d) for x, d in zip(args, dims)]
        out_dim = 0
    batched, out_batched = batching.batch_jaxpr(jaxpr, axis_data, in_batched, False)
    outs = federated_map_p.bind(*args, jaxpr=batched, **params)
    return outs, [out_dim if b else None for b in out_batched]


federated_map_p.def_abstract_eval(_map_abstract_eval)
federated_map_p.def_impl(partial(_dispatch.apply_primitive, federated_map_p))
mlir.register_lowering(federated_map_p, _map_lowering, cacheable=False)  # sees its operands
_lowering.IMPLEMENTATIONS[federated_map_p] = _map_impl
ad.primitive_jvps[federated_map_p] = _map_jvp
ad.primitive_transposes[federated_map_p] = _map_transpose
pe.custom_partial_eval_rules[federated_map_p] = _map_partial_eval
_compat.register_dce(federated_map_p, _map_dce)
batching.fancy_primitive_batchers[federated_map_p] = _map_batch
_facts.register(_facts.PrimitiveFacts(federated_map_p, _facts.Movement.MAP, None))


# --------------------------------------------------------------------------- decode-sum

federated_decode_sum_p = core.Primitive("federated_decode_sum")
federated_decode_sum_p.multiple_results = True


def decode_sum_bind(fn, args: Sequence, clients: int, name: str | None = None,
                    axis: str = CLIENTS, mesh=None):
    """Binds `federated_decode_sum_p`: `fn` maps flat member arrays to a list of arrays."""
    name = name or getattr(fn, "__name__", "decode")
    avals = [member_aval(core.typeof(a), CLIENTS) for a in args]
    closed, captured = trace_member_fn(fn, avals, name)
    if captured:
        raise ArgumentError(
            f"federated_decode_sum: the decode function {name} closes over traced values; "
            "a decoder runs at the server on each member alone, so it may use only its "
            "member and constants. Put per-client parameters (e.g. scales) in the member.")
    return federated_decode_sum_p.bind(*args, jaxpr=closed, clients=clients, name=name,
                                       axis=axis, mesh=mesh)


def _decode_sum_abstract_eval(*avals, jaxpr, clients, name, axis, mesh):
    del mesh
    for i, (a, m) in enumerate(zip(avals, jaxpr.in_avals)):
        expect = outer_aval(m, CLIENTS, clients, axis)
        if tuple(a.shape) != tuple(expect.shape) or a.dtype != expect.dtype:
            raise PlacementError(
                f"federated_decode_sum ({name}): operand {i} has type {a.str_short()}, "
                f"expected {expect.str_short()}.")
    return [a.update(weak_type=False) for a in jaxpr.out_avals]


def _decode_sum_impl(*args, jaxpr, clients, name, axis, mesh):
    def decoded_sum(*args):
        args = [_local.place_leading(a, axis, mesh) for a in args]
        decoded = jax.vmap(partial(_lowering.eval_implemented, jaxpr),
                           axis_size=clients)(*args)
        return [_lowering.clients_sum(d, reduce=mesh is not None).astype(d.dtype)
                for d in decoded]

    # differentiated directly (a chunk of a differentiated round, nested in a map): as
    # the rule, refused
    return _lowering.refusing_derivatives(
        decoded_sum, lambda: _decode_sum_refuse("jvp", name))(*args)


def _decode_sum_refuse(rule: str, name: str):
    raise ArgumentError(decode_sum_refusal(rule, name))


def _decode_sum_batch(axis_data, args, dims, **params):
    """Operands the vmap does not batch (it maps other arguments) pass; others refuse."""
    if any(d is not None for d in dims):
        _decode_sum_refuse("batch", params["name"])
    outs = federated_decode_sum_p.bind(*args, **params)
    return outs, [None] * len(outs)


federated_decode_sum_p.def_abstract_eval(_decode_sum_abstract_eval)
_lowering.register_impl_and_lowering(federated_decode_sum_p, _decode_sum_impl)
ad.primitive_jvps[federated_decode_sum_p] = lambda _, __, name, **p: _decode_sum_refuse(
    "jvp", name)
ad.primitive_transposes[federated_decode_sum_p] = \
    lambda _, *__, name, **p: _decode_sum_refuse("transpose", name)
batching.fancy_primitive_batchers[federated_decode_sum_p] = _decode_sum_batch
# Exported as federated_aggregate, whose own functions the runtime runs (no kind).
_facts.register(_facts.PrimitiveFacts(
    federated_decode_sum_p, _facts.Movement.AGGREGATE, intrinsic_defs.FEDERATED_AGGREGATE,
    batching=_facts.Batching.KIND))
