"""Per-client forms of jax primitives, one rule per primitive in a table.

An equation on CLIENTS values is *per-client* when it acts on each client's slice alone;
its member form is the same primitive with the leading clients axis removed from every
CLIENTS operand and from the results. `MEMBER_RULES` maps a primitive's name to a rule
`(params, avals, in_placements, out_avals, clients) -> member params or None` (None: the
equation mixes clients), as jax keys its own rules by primitive. `member_params` applies
the checks every rule shares and looks the rule up.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from jax._src import core

from fax_bridge.language.placements import Placement

MemberRule = Callable[[dict, list, Sequence[Placement], list, int], Optional[dict]]
MEMBER_RULES: dict[str, MemberRule] = {}

ELEMENTWISE = frozenset("""
add sub mul div rem pow max min neg sign floor ceil round is_finite exp exp2 log log1p
expm1 tanh logistic sin cos tan asin acos atan sinh cosh asinh acosh atanh atan2 sqrt rsqrt
cbrt integer_pow square abs erf erfc erf_inv lgamma digamma not and or xor eq ne lt le gt ge
select_n clamp convert_element_type add_any nextafter copy copy_p real imag conj
stop_gradient reduce_precision shift_left shift_right_logical shift_right_arithmetic
population_count sharding_constraint
""".split())

_REDUCTIONS = frozenset(
    "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax argmin".split())
_CUMULATIVE = frozenset("cumsum cumprod cummax cummin cumlogsumexp".split())

C, U = Placement.CLIENTS, Placement.UNPLACED


def _rule(*names: str):
    def register(fn: MemberRule) -> MemberRule:
        for name in names:
            MEMBER_RULES[name] = fn
        return fn
    return register


def _shifted(axes) -> tuple:
    return tuple(int(a) - 1 for a in axes)


def _out_sharding_cleared(params: dict) -> dict:
    return {"out_sharding": None} if "out_sharding" in params else {}


def member_params(eqn: core.JaxprEqn, in_placements: Sequence[Placement],
                  clients: int) -> Optional[dict]:
    """Params of the per-client (member) version of `eqn`, or None if it mixes clients.

    Called for equations with at least one CLIENTS operand and no SERVER operand.
    """
    avals = [v.aval for v in eqn.invars]
    outs = [v.aval for v in eqn.outvars]
    if not outs or any(not o.shape or o.shape[0] != clients for o in outs):
        return None
    for a, p in zip(avals, in_placements):
        if p is C and (not a.shape or a.shape[0] != clients):
            return None
    rule = MEMBER_RULES.get(eqn.primitive.name)
    return None if rule is None else rule(dict(eqn.params), avals, in_placements, outs,
                                          clients)


@_rule(*ELEMENTWISE)
def _elementwise(params, avals, ins, outs, clients):
    for a, p in zip(avals, ins):
        if p is C and tuple(a.shape) != tuple(outs[0].shape):
            return None
        if p is U and a.shape and tuple(a.shape) != tuple(outs[0].shape):
            return None
    return params


def _constraint(params, avals, ins, outs, clients):
    """A layout constraint: one client's slice has no layout to constrain."""
    if _elementwise(params, avals, ins, outs, clients) is None:
        return None
    return {"__identity__": True}


MEMBER_RULES["sharding_constraint"] = _constraint
MEMBER_RULES["reshard"] = _constraint


@_rule("broadcast_in_dim")
def _broadcast_in_dim(params, avals, ins, outs, clients):
    bd = tuple(params["broadcast_dimensions"])
    if not bd or bd[0] != 0:
        return None
    return dict(params, shape=tuple(params["shape"][1:]),
                broadcast_dimensions=_shifted(bd[1:]), sharding=None)


@_rule("reshape")
def _reshape(params, avals, ins, outs, clients):
    if params.get("dimensions") is not None or params["new_sizes"][0] != clients:
        return None
    return dict(params, new_sizes=tuple(params["new_sizes"][1:]), sharding=None)


@_rule("transpose")
def _transpose(params, avals, ins, outs, clients):
    perm = tuple(params["permutation"])
    return None if perm[0] != 0 else dict(params, permutation=_shifted(perm[1:]))


@_rule(*_REDUCTIONS)
def _reduction(params, avals, ins, outs, clients):
    axes = tuple(params["axes"])
    if 0 in axes:
        return None
    return dict(params, axes=_shifted(axes), **_out_sharding_cleared(params))


@_rule("squeeze", "rev")
def _dimensions(params, avals, ins, outs, clients):
    dims = tuple(params["dimensions"])
    return None if 0 in dims else dict(params, dimensions=_shifted(dims))


@_rule("concatenate")
def _concatenate(params, avals, ins, outs, clients):
    if params["dimension"] == 0 or any(
            p is not C and (not a.shape or a.shape[0] != clients) for a, p in zip(avals, ins)):
        return None
    return dict(params, dimension=params["dimension"] - 1)


@_rule("split", *_CUMULATIVE)
def _axis(params, avals, ins, outs, clients):
    return None if params["axis"] == 0 else dict(params, axis=params["axis"] - 1)


@_rule("slice")
def _slice(params, avals, ins, outs, clients):
    strides = params.get("strides")
    if params["start_indices"][0] != 0 or params["limit_indices"][0] != clients or (
            strides is not None and strides[0] != 1):
        return None
    return dict(params, start_indices=tuple(params["start_indices"][1:]),
                limit_indices=tuple(params["limit_indices"][1:]),
                strides=None if strides is None else tuple(strides[1:]))


@_rule("pad")
def _pad(params, avals, ins, outs, clients):
    cfg = tuple(params["padding_config"])
    if tuple(cfg[0]) != (0, 0, 0) or ins[1] is C:
        return None
    return dict(params, padding_config=cfg[1:])


@_rule("sort")
def _sort(params, avals, ins, outs, clients):
    return None if params["dimension"] == 0 else dict(params, dimension=params["dimension"] - 1)


@_rule("dot_general")
def _dot_general(params, avals, ins, outs, clients):
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    lp, rp = ins
    if lp is C and rp is C:
        if not lb or lb[0] != 0 or rb[0] != 0:
            return None
        dn = ((_shifted(lc), _shifted(rc)), (_shifted(lb[1:]), _shifted(rb[1:])))
    elif lp is C and rp is U:
        if lb or 0 in lc:
            return None
        dn = ((_shifted(lc), tuple(rc)), ((), ()))
    else:
        return None
    return dict(params, dimension_numbers=dn, **_out_sharding_cleared(params))
