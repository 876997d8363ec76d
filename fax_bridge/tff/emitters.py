"""How the exporter emits a batch of communication equations as TFF intrinsic calls.

A federated primitive's record (`primitive_facts`) names the intrinsic its equations
export to. When the record brings no emitter of its own, `INTRINSIC_EMITTERS`, keyed by
federated_language's `intrinsic_defs`, emits the batch: one call of that intrinsic on the
gathered operands (broadcast, sum, mean, weighted mean, the secure sums with their bound
as a literal), or one `federated_aggregate` per decode-sum equation. A primitive that is
not one call of its intrinsic has its emitter in `PRIMITIVE_EMITTERS` (the secure mean:
`federated_map` (quantize) -> `federated_secure_sum_bitwidth`, beside a `federated_sum`
of ones counting the clients whose codes were summed, -> `federated_apply` (dequantize)). Each emitter takes the running exporter (`tff/export._Exporter`),
gathers its operands with `gather`/`single` and keeps the result with `hold`.
"""

from __future__ import annotations

from typing import Callable

import federated_language
import jax
import jax.numpy as jnp
import numpy as np
from federated_language.compiler import building_block_factory as factory
from federated_language.compiler import building_blocks as bb
from federated_language.compiler import intrinsic_defs
from jax._src import core

from fax_bridge.language import primitives as P
from fax_bridge.language import secure as S
from fax_bridge.language.placements import Placement
from fax_bridge.language.primitive_facts import facts_of
from fax_bridge.tff import xla as tff_xla


def intrinsic_call(ex, eqns: list, build: Callable) -> None:
    """One call `build(operands)` on the gathered first operands of `eqns`, taken and
    given where their primitive's movement says."""
    movement = facts_of(eqns[0].primitive).movement
    expr, member = ex.gather([e.invars[0] for e in eqns], movement.takes, eqns[0])
    member = jax.tree_util.tree_map(lambda a: a, member)
    ex.hold(build(expr), movement.gives, member, [e.outvars[0] for e in eqns])


def weighted_mean(ex, eqns: list) -> None:
    """One `federated_weighted_mean` of equations sharing their weights (operand 1)."""
    w = eqns[0].invars[1]
    if len(w.aval.shape) != 1:
        ex.fail(eqns[0], (
            "a weighted mean under an outer vmap has one weight per client and "
            "batch element; TFF weights are one scalar per client. Export the "
            "program before vmapping it."))
    intrinsic_call(ex, eqns, lambda expr: factory.create_federated_mean(
        expr, ex.single(w, Placement.CLIENTS, eqns[0]).ref))


def decode_sum(ex, eqn) -> None:
    """`federated_aggregate` whose accumulate adds the decoded member.

    The members cross as they are; zero, accumulate, merge and report are Xla
    computations (zeros of the decoded type, acc + decode(member), a + b, identity).
    """
    closed = eqn.params["jaxpr"]
    expr, member = ex.gather(list(eqn.invars), Placement.CLIENTS, eqn)
    outs = list(eqn.outvars)
    acc_avals = tuple(P.member_aval(v.aval, P.SERVER) for v in outs)
    decode = core.jaxpr_as_fun(closed)

    def add(a, b):
        return tuple(x + y for x, y in zip(a, b))

    def accumulate(acc_and_member):
        acc, m = acc_and_member
        return add(acc, decode(*jax.tree_util.tree_leaves(m)))

    def zeros():
        return tuple(jnp.zeros(a.shape, a.dtype) for a in acc_avals)

    name = f"{eqn.params['name']}{ex.count}"
    parts = [bb.Call(bb.CompiledComputation(tff_xla.xla_computation(zeros, None),
                                            name=f"zero_{name}"))]
    for fn, avals, kind in ((accumulate, (acc_avals, member), "accumulate"),
                            (lambda ab: add(*ab), (acc_avals, acc_avals), "merge"),
                            (lambda a: tuple(a), acc_avals, "report")):
        parts.append(bb.CompiledComputation(tff_xla.xla_computation(fn, avals),
                                            name=f"{kind}_{name}"))
    call = factory.create_federated_aggregate(expr, *parts)
    ex.hold(call, Placement.SERVER, list(acc_avals), outs)


def _bound_call(uri: str, value, member_type, bound: np.generic):
    """`uri(<value, bound>)`, typed <{member}@CLIENTS, bound> -> member@SERVER, the bound
    a literal as in the protos TFF writes."""
    bound_type = federated_language.TensorType(bound.dtype)
    fn_type = federated_language.FunctionType(
        [federated_language.FederatedType(member_type, federated_language.CLIENTS),
         bound_type],
        federated_language.FederatedType(member_type, federated_language.SERVER))
    return bb.Call(bb.Intrinsic(uri, fn_type),
                   bb.Struct([value, bb.Literal(bound, bound_type)]))


def secure_int_sum(ex, eqns: list) -> None:
    """One secure sum (bitwidth or max_input) of one equation, its bound a literal of the
    dtype TFF types it with (int32 for a bitwidth, the values' dtype for max_input)."""
    (eqn,) = eqns  # batched alone
    x = eqn.invars[0]
    expr, member = ex.gather([x], Placement.CLIENTS, eqn)
    dtype = np.dtype(np.int32) if eqn.primitive is S.secure_sum_bitwidth_p else np.dtype(
        x.aval.dtype)
    call = _bound_call(facts_of(eqn.primitive).intrinsic.uri, expr,
                       expr.type_signature.member, dtype.type(eqn.params["bound"]))
    ex.hold(call, Placement.SERVER, member, [eqn.outvars[0]])


def secure_mean(ex, eqns: list) -> None:
    """map (quantize) -> secure_sum_bitwidth, beside a sum of ones -> apply (dequantize)."""
    (eqn,) = eqns  # batched alone
    p = eqn.params
    lo, hi, bits = p["lo"], p["hi"], p["bits"]
    x, keys = eqn.invars
    expr, member = ex.gather([x, keys], Placement.CLIENTS, eqn)
    dtype = x.aval.dtype
    name = f"secure_mean{ex.count}"
    quant = bb.CompiledComputation(tff_xla.xla_computation(
        lambda xk: S.quantize(xk[0], xk[1], lo, hi, bits), member), name=f"quantize_{name}")
    codes = factory.create_federated_map(quant, expr)
    code_type = codes.type_signature.member
    total = _bound_call(intrinsic_defs.FEDERATED_SECURE_SUM_BITWIDTH.uri, codes, code_type,
                        np.int32(bits))
    # The divisor is counted with the codes (a plain sum of ones: how many clients took
    # part is no secret from the server), not the program's client count: with a cohort,
    # or a client lost, the mean is over the clients whose codes were summed.
    one = bb.CompiledComputation(tff_xla.xla_computation(
        lambda xk: jnp.ones((), jnp.int32), member), name=f"one_{name}")
    count = factory.create_federated_sum(factory.create_federated_map(one, expr))
    code_aval = core.ShapedArray(member[0].shape, np.int32)
    count_aval = core.ShapedArray((), np.int32)
    deq = bb.CompiledComputation(tff_xla.xla_computation(
        lambda tc: S.dequantize(tc[0], tc[1], lo, hi, bits, dtype), (code_aval, count_aval)),
        name=f"dequantize_{name}")
    mean = factory.create_federated_apply(
        deq, factory.create_federated_zip(bb.Struct([total, count])))
    ex.hold(mean, Placement.SERVER, member[0], [eqn.outvars[0]])


# Emits a batch of equations by the intrinsic their record names.
INTRINSIC_EMITTERS: dict = {
    intrinsic_defs.FEDERATED_BROADCAST:
        lambda ex, eqns: intrinsic_call(ex, eqns, factory.create_federated_broadcast),
    intrinsic_defs.FEDERATED_SUM:
        lambda ex, eqns: intrinsic_call(ex, eqns, factory.create_federated_sum),
    intrinsic_defs.FEDERATED_MEAN: lambda ex, eqns: intrinsic_call(
        ex, eqns, lambda expr: factory.create_federated_mean(expr, None)),
    intrinsic_defs.FEDERATED_WEIGHTED_MEAN: weighted_mean,
    intrinsic_defs.FEDERATED_AGGREGATE:  # one aggregate per equation, by its decoder
        lambda ex, eqns: [decode_sum(ex, e) for e in eqns],
    intrinsic_defs.FEDERATED_SECURE_SUM_BITWIDTH: secure_int_sum,
    intrinsic_defs.FEDERATED_SECURE_SUM: secure_int_sum,
}

# Emits a batch of a primitive that is not one call of its record's intrinsic.
PRIMITIVE_EMITTERS: dict = {S.secure_mean_p: secure_mean}


def emit(ex, eqns: list) -> None:
    """Emits equations of one kind (and weights) at one depth."""
    prim = eqns[0].primitive
    (PRIMITIVE_EMITTERS.get(prim) or INTRINSIC_EMITTERS[facts_of(prim).intrinsic])(ex, eqns)
