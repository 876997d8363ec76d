"""What differs between the jax versions fax_bridge runs on (0.10.2 to 0.12.x), in one place.

jax 0.11 merged `ClosedJaxpr` into `Jaxpr` (consts are values attached to a jaxpr's
leading inputs; `jax._src.core.ClosedJaxpr` is gone in 0.12), made `scan`'s
`num_consts`/`num_carry` parameters `FlatTree`s (`ft_in`, `ft_out`), changed what its
internal `transpose_jaxpr` returns and, in 0.12, the signature of DCE rules and the
fields of `jax.export.Exported`. Every module that touches one of these goes through
here, so a new jax version is one module's work:

- `ClosedJaxpr`: `jax.extend.core.ClosedJaxpr` (public in every version);
- `trace_lifting`: a function traced to a closed jaxpr, the values it closes over that
  an enclosing trace owns lifted out as leading inputs;
- `dce_closed`: dead-code elimination of a closed jaxpr, its unused consts dropped;
- `transpose_closed`: the transposition of a closed jaxpr, through the public
  `jax.linear_transpose`;
- `scan_counts`: a scan equation's (consts, carries) counts;
- `register_dce`: a DCE rule written as `(used_outputs, eqn)`, registered with the
  signature the installed jax calls;
- `exported`: a `jax.export.Exported` built from the fields the installed jax has;
- `lower_embedded`: a jitted function lowered to a module of its own, the arrays it
  closes over constants of the module (jax 0.12 makes those over 1 KiB parameters).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.extend import core as _xcore
from jax._src import linear_util as _lu
from jax._src.interpreters import mlir as _mlir
from jax._src.interpreters import partial_eval as _pe

ClosedJaxpr = _xcore.ClosedJaxpr
Jaxpr = _xcore.Jaxpr


def trace_lifting(fn: Callable, avals: Sequence, debug_name: str,
                  lift: Callable[[Any], bool]) -> tuple[ClosedJaxpr, list]:
    """`fn` (flat arrays -> a list of arrays) traced at `avals` to a closed jaxpr:
    (closed jaxpr, lifted). The values it closes over for which `lift` is true (tracers
    of an enclosing trace) become the jaxpr's leading inputs, in the order `lifted`
    lists them; the others stay its consts."""
    import jax.api_util as api_util

    dbg = api_util.debug_info(debug_name, fn, tuple(avals), {})
    jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(_lu.wrap_init(fn, debug_info=dbg), avals)
    # 0.10 keeps the consts' variables apart (constvars); from 0.11 they lead the
    # inputs, attached to the jaxpr or not: either way they lead the two lists together.
    every = [*jaxpr.constvars, *jaxpr.invars]
    const_vars, in_vars = every[:len(consts)], every[len(consts):]
    lifted_at = [lift(c) for c in consts]
    kept = [v for v, up in zip(const_vars, lifted_at) if not up]
    raised = [v for v, up in zip(const_vars, lifted_at) if up]
    open_jaxpr = jaxpr.replace(constvars=kept, invars=raised + in_vars)
    closed = ClosedJaxpr(open_jaxpr, [c for c, up in zip(consts, lifted_at) if not up])
    return closed, [c for c, up in zip(consts, lifted_at) if up]


def dce_closed(closed: ClosedJaxpr, used_outputs: Sequence[bool],
               instantiate: bool | Sequence[bool] = False) -> tuple[ClosedJaxpr, list[bool]]:
    """(the closed jaxpr computing only `used_outputs`, the inputs it still uses); the
    consts it no longer reads are dropped, `instantiate` inputs are kept all the same."""
    new, used_consts, used_inputs = _pe.dce_jaxpr_consts(closed.jaxpr, list(used_outputs),
                                                         instantiate)
    return ClosedJaxpr(new, [c for c, u in zip(closed.consts, used_consts) if u]), used_inputs


def transpose_closed(closed: ClosedJaxpr, in_linear: Sequence[bool],
                     out_zeros: Sequence[bool]) -> tuple[ClosedJaxpr, list[bool]]:
    """The transposition of `closed` in its `in_linear` inputs: (transposed, in_zeros).

    The transposed jaxpr takes the non-linear inputs, then the cotangents of the outputs
    that are not `out_zeros` (an integer output's, of dtype float0, is taken and not
    read), and returns the cotangents of the linear inputs that are not `in_zeros`:
    those of float inputs that some output with a float cotangent reads."""
    in_avals, out_avals = closed.in_avals, closed.out_avals
    inexact = lambda a: jnp.issubdtype(a.dtype, jnp.inexact)
    given = [not z for z in out_zeros]
    read = [g and inexact(a) for g, a in zip(given, out_avals)]
    _, reads = dce_closed(closed, read)
    live = [lin and r and inexact(a) for lin, r, a in zip(in_linear, reads, in_avals)]
    nonlinear = [a for a, lin in zip(in_avals, in_linear) if not lin]
    cts = [a.to_tangent_aval() for a, g in zip(out_avals, given) if g]
    live_avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a, lv in zip(in_avals, live) if lv]
    run = _xcore.jaxpr_as_fun(closed)

    def transposed(*args):
        fixed, ct = args[:len(nonlinear)], iter(args[len(nonlinear):])
        ct = [next(ct) for g in given if g]
        ct = [c for c, r in zip(ct, [r for g, r in zip(given, read) if g]) if r]

        def forward(*lin):
            lin_it, fixed_it = iter(lin), iter(fixed)
            ins = [next(lin_it) if lv else next(fixed_it) if not l_
                   else jnp.zeros(a.shape, a.dtype)
                   for a, l_, lv in zip(in_avals, in_linear, live)]
            return [o for o, r in zip(run(*ins), read) if r]

        return list(jax.linear_transpose(forward, *live_avals)(ct)) if live_avals else []

    t_closed = jax.make_jaxpr(transposed)(*nonlinear, *cts)
    return ClosedJaxpr(t_closed.jaxpr, t_closed.consts), [
        not lv for lin, lv in zip(in_linear, live) if lin]


def scan_counts(params: dict) -> tuple[int, int]:
    """(consts, carries) of a `scan` equation: its first operands, in that order, before
    the scanned ones (`num_consts`/`num_carry` to 0.10, the packed `ft_in` after)."""
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


# From 0.12 dce_jaxpr takes `live_inputs` (the Ref inputs read after it) and DCE rules
# take them too, between the used outputs and the equation.
_DCE_TAKES_LIVE_INPUTS = "live_inputs" in inspect.signature(_pe.dce_jaxpr).parameters


def register_dce(primitive, rule: Callable) -> None:
    """Registers `rule(used_outputs, eqn) -> (used_inputs, new eqn or None)` as
    `primitive`'s DCE rule, called as the installed jax calls such rules."""
    if _DCE_TAKES_LIVE_INPUTS:
        _pe.dce_rules[primitive] = lambda used_outputs, live_inputs, eqn: rule(
            used_outputs, eqn)
    else:
        _pe.dce_rules[primitive] = rule


def exported(**fields: Any) -> jax.export.Exported:
    """A `jax.export.Exported` of `fields`, given by their names in some jax version:
    those the installed version lacks are left out, and a field it requires that is not
    given is an error naming it (a newer jax: this function needs the field's value)."""
    known = dataclasses.fields(jax.export.Exported)
    missing = [f.name for f in known if f.name not in fields
               and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise TypeError(f"jax {jax.__version__}'s jax.export.Exported requires "
                        f"{missing}, which fax_bridge does not give; "
                        "fax_bridge.language.jax_compat.exported needs them")
    return jax.export.Exported(**{f.name: fields[f.name] for f in known if f.name in fields})


def lower_embedded(jitted: Callable, *args: Any) -> Any:
    """`jitted.lower(*args)` with every array the function closes over a constant of
    the module, its parameters the function's own: a module that stands alone (an Xla
    computation's HLO, the StableHLO a converter reads), as `jax.export` lowers. From
    jax 0.12 (`jax_use_simplified_jaxpr_constants`) a plain `lower` makes each array
    over `jax_embedded_constants_max_bytes` (1 KiB) one more parameter, given by jax
    when it runs the executable itself; 0.10 and 0.11 embed them all."""
    return jitted.trace(*args).lower(
        _private_parameters=_mlir.LoweringParameters(hoist_constants_as_args=False))
