"""How the exporter emits a batch of communication equations as TFF intrinsic calls.

A federated primitive's record (`primitive_facts`) names the intrinsic its equations
export to. When the record brings no emitter of its own, `INTRINSIC_EMITTERS`, keyed by
federated_language's `intrinsic_defs`, emits the batch: one call of that intrinsic on the
gathered operands (broadcast, sum, mean, weighted mean), or one `federated_aggregate` per
decode-sum equation. Each emitter takes the running exporter (`tff/export._Exporter`),
gathers its operands with `gather`/`single` and keeps the result with `hold`.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from federated_language.compiler import building_block_factory as factory
from federated_language.compiler import building_blocks as bb
from federated_language.compiler import intrinsic_defs
from jax._src import core

from fax_bridge import primitives as P
from fax_bridge.placements import Placement
from fax_bridge.primitive_facts import facts_of
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


# Emits a batch of equations whose record names the intrinsic and no emitter of its own.
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
}
