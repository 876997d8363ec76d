"""Tracing a federated program to a placement-annotated jaxpr (`FederatedComputation`).

`trace(fn, *args, placements=...)` runs `jax.make_jaxpr`, inlines nested calls (jit,
custom_jvp/vjp, checkpoint) so every federated operation sits at the top level or in a
control-flow body, and infers the placement of every value:

- inputs are SERVER or CLIENTS as the user declares;
- federated primitives move values between placements;
- other equations take the placement of their operands. An equation on CLIENTS values is
  *per-client* when it acts on each client's slice independently (elementwise math,
  reductions over non-client axes...); one that mixes clients (e.g. `x[0]`, a sum over
  the clients axis) still runs locally but is recorded as a `Violation`, which export
  reports. Combining a SERVER value with a CLIENTS value is a `PlacementError`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import jax
from jax._src import core
from jax._src import source_info_util

from fax_bridge.errors import PlacementError, ProgramError
from fax_bridge.errors import is_machinery  # noqa: F401 (tracing.is_machinery)
from fax_bridge.local.execution import unchunked
from fax_bridge.language import jax_compat as _compat
from fax_bridge.language.member_rules import member_params
from fax_bridge.language.placements import Placement, broadcast_placements
from fax_bridge.language.primitive_facts import Movement, facts_of

# Call-like primitives whose body is inlined: name -> parameter holding the body.
_INLINED_CALLS = {
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "checkpoint": "jaxpr",
    "remat": "jaxpr",
    "custom_lin": None,
}

def eqn_location(eqn: core.JaxprEqn) -> str:
    """`file:line (function)` of the innermost frame of the program's own code (the
    user's, or `fax_bridge.algorithms`) that produced `eqn`."""
    for frame in source_info_util.user_frames(eqn.source_info.traceback):
        if is_machinery(frame.file_name):
            continue
        return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"
    return "<unknown location>"


def type_string(aval, placement: Placement) -> str:
    """`f32[3]@SERVER`, `{f32[3]}@CLIENTS` (member type), or `f32[3]` when unplaced."""
    if placement is Placement.CLIENTS:
        member = core.ShapedArray(aval.shape[1:], aval.dtype)
        return "{" + member.str_short(short_dtypes=True) + "}@CLIENTS"
    s = aval.str_short(short_dtypes=True)
    return s + "@SERVER" if placement is Placement.SERVER else s


class PlacementNestingError(PlacementError):
    """Several placements side by side at a program's top level instead of nested."""


@dataclasses.dataclass(frozen=True)
class Violation:
    """An equation that mixes clients outside the federated primitives (not exportable)."""

    eqn: core.JaxprEqn
    reason: str
    location: str

    def __str__(self) -> str:
        return f"{self.eqn.primitive.name} at {self.location}: {self.reason}"


# --------------------------------------------------------------------------- inlining


def _eval_inlined(jaxpr: core.Jaxpr, consts, *args):
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, core.Literal) else env[v]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = c
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack):
            body_param = _INLINED_CALLS.get(eqn.primitive.name, "missing")
            if body_param not in ("missing", None) and body_param in eqn.params:
                body = eqn.params[body_param]
                if isinstance(body, _compat.ClosedJaxpr):
                    outs = _eval_inlined(body.jaxpr, body.consts, *invals)
                else:
                    outs = _eval_inlined(body, (), *invals)
            else:
                bind_params = eqn.primitive.get_bind_params(eqn.params)
                outs = eqn.primitive.bind(*invals, **bind_params)
                if not eqn.primitive.multiple_results:
                    outs = [outs]
        for v, o in zip(eqn.outvars, outs):
            if not isinstance(v, core.DropVar):
                env[v] = o
    return [read(v) for v in jaxpr.outvars]


def inline_calls(closed: _compat.ClosedJaxpr) -> _compat.ClosedJaxpr:
    """The same computation with nested jit/custom-derivative/checkpoint calls inlined
    and unused equations removed."""
    fn = lambda *args: _eval_inlined(closed.jaxpr, closed.consts, *args)
    inlined = jax.make_jaxpr(fn)(*closed.in_avals)
    return _compat.dce_closed(inlined, [True] * len(inlined.jaxpr.outvars),
                              instantiate=True)[0]


# --------------------------------------------------------------------------- placements


def _join(a: Placement, b: Placement, where: str) -> Placement:
    if a is b or b is Placement.UNPLACED:
        return a
    if a is Placement.UNPLACED:
        return b
    raise PlacementError(f"{where}: a value is SERVER on one path and CLIENTS on another.")


S, C, U = Placement.SERVER, Placement.CLIENTS, Placement.UNPLACED


class _Analysis:
    def __init__(self, clients: int):
        self.clients = clients
        self.placements: dict = {}
        self.violations: list[Violation] = []
        self.per_client: dict[int, dict] = {}

    def run(self, jaxpr: core.Jaxpr, in_placements: Sequence[Placement]) -> list[Placement]:
        env = self.placements
        for v in jaxpr.constvars:
            env[v] = Placement.UNPLACED
        for v, p in zip(jaxpr.invars, in_placements):
            env[v] = p
        for eqn in jaxpr.eqns:
            ins = [Placement.UNPLACED if isinstance(v, core.Literal) else env[v]
                   for v in eqn.invars]
            outs = self.eqn(eqn, ins)
            for v, p in zip(eqn.outvars, outs):
                env[v] = p
        return [Placement.UNPLACED if isinstance(v, core.Literal) else env[v]
                for v in jaxpr.outvars]

    def _need(self, eqn, ins, allowed, what, hint):
        for i, p in enumerate(ins):
            if p not in allowed:
                raise PlacementError(
                    f"{eqn.primitive.name} at {eqn_location(eqn)}: operand {i} "
                    f"({type_string(eqn.invars[i].aval, p)}) is {p}, but {what}. {hint}")

    def _violation(self, eqn, reason):
        self.violations.append(Violation(eqn, reason, eqn_location(eqn)))

    def eqn(self, eqn: core.JaxprEqn, ins: list[Placement]) -> list[Placement]:
        """The placements of `eqn`'s results: the rule of a federated primitive's movement
        (its record in `primitive_facts`), of control flow, else the placement its
        operands share."""
        facts = facts_of(eqn.primitive)
        if facts is not None:
            return _MOVEMENT_RULES[facts.movement](self, eqn, ins)
        rule = _CONTROL_FLOW_RULES.get(eqn.primitive.name)
        if rule is not None:
            return rule(self, eqn, ins)
        return self._local(eqn, ins)

    def _broadcast(self, eqn, ins):
        self._need(eqn, ins, (S, U), "federated_broadcast sends a SERVER value",
                   "A CLIENTS value is already at the clients; to send a value computed "
                   "from client data, aggregate it first (federated_mean/sum). If the "
                   "broadcast comes from a value closed over by a federated_map_clients "
                   "function, pass that value explicitly in the map's argument instead.")
        return [C]

    def _aggregate(self, eqn, ins):
        self._need(eqn, ins, (C, U), f"{eqn.primitive.name} aggregates a CLIENTS value",
                   "A SERVER value needs no aggregation; send it to the clients with "
                   "federated_broadcast if that was the intent.")
        return [S] * len(eqn.outvars)

    def _map(self, eqn, ins):
        n_out = len(eqn.outvars)
        if eqn.params["placement"] == Placement.CLIENTS.value:
            self._need(eqn, ins, (C, U),
                       "federated_map_clients applies its function to CLIENTS values",
                       "Send SERVER values to the clients with federated_broadcast first.")
            return [C] * n_out
        self._need(eqn, ins, (S, U),
                   "federated_map_server applies its function to SERVER values",
                   "Aggregate CLIENTS values (federated_mean/sum) before using them at "
                   "the server.")
        return [S] * n_out

    def _local(self, eqn, ins):
        """An equation outside the federated primitives: SERVER, CLIENTS (per-client when
        it has a member form) or a `PlacementError` when it mixes the two."""
        prim = eqn.primitive
        n_out = len(eqn.outvars)
        placed = {p for p in ins if p is not U}
        if not placed:
            return [U] * n_out
        if placed == {S}:
            return [S] * n_out
        if placed == {C}:
            params = member_params(eqn, ins, self.clients)
            if params is not None:
                self.per_client[id(eqn)] = params
                return [C] * n_out
            self._violation(eqn, "it combines the values of several clients outside the "
                                 "federated primitives")
            return [C if (o.aval.shape and o.aval.shape[0] == self.clients) else S
                    for o in eqn.outvars]
        server_ops = [i for i, p in enumerate(ins) if p is S]
        client_ops = [i for i, p in enumerate(ins) if p is C]
        raise PlacementError(
            f"{prim.name} at {eqn_location(eqn)} combines SERVER operand(s) {server_ops} "
            f"({', '.join(type_string(eqn.invars[i].aval, S) for i in server_ops)}) with "
            f"CLIENTS operand(s) {client_ops} "
            f"({', '.join(type_string(eqn.invars[i].aval, C) for i in client_ops)}). A "
            "SERVER value used at the clients must be sent with federated_broadcast; a "
            "CLIENTS value used at the server must be aggregated (federated_mean/sum).")

    def _body(self, closed, ins):
        return self.run(closed.jaxpr, ins)

    def _scan(self, eqn, ins):
        p = eqn.params
        nc, nk = _compat.scan_counts(p)
        consts, carry, xs = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
        x_members = []
        for i, px in enumerate(xs):
            if px is Placement.CLIENTS:
                self._violation(eqn, "lax.scan iterates over the clients axis of a CLIENTS "
                                     "value")
                x_members.append(Placement.SERVER)
            else:
                x_members.append(px)
        for _ in range(len(carry) + 2):
            outs = self._body(p["jaxpr"], list(consts) + list(carry) + x_members)
            new_carry = [_join(a, b, f"lax.scan at {eqn_location(eqn)}")
                         for a, b in zip(carry, outs[:nk])]
            if new_carry == list(carry):
                break
            carry = new_carry
        ys = []
        for o in outs[nk:]:
            if o is Placement.CLIENTS:
                self._violation(eqn, "lax.scan stacks CLIENTS values across iterations")
                ys.append(Placement.SERVER)
            else:
                ys.append(o)
        return list(carry) + ys

    def _while(self, eqn, ins):
        p = eqn.params
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, carry = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
        for _ in range(len(carry) + 2):
            outs = self._body(p["body_jaxpr"], list(bconsts) + list(carry))
            new_carry = [_join(a, b, f"lax.while_loop at {eqn_location(eqn)}")
                         for a, b in zip(carry, outs)]
            if new_carry == list(carry):
                break
            carry = new_carry
        (pred,) = self._body(p["cond_jaxpr"], list(cconsts) + list(carry))
        if pred is Placement.CLIENTS:
            self._violation(eqn, "the loop condition depends on client data")
        return list(carry)

    def _cond(self, eqn, ins):
        index, ops = ins[0], ins[1:]
        if index is Placement.CLIENTS:
            self._violation(eqn, "the branch taken depends on client data")
        outs = None
        for branch in eqn.params["branches"]:
            b = self._body(branch, ops)
            outs = b if outs is None else [
                _join(x, y, f"lax.cond at {eqn_location(eqn)}") for x, y in zip(outs, b)]
        return outs


# The placement rule of each way a federated primitive moves values (its record says
# which), and of control flow, keyed by primitive name.
_MOVEMENT_RULES = {
    Movement.BROADCAST: _Analysis._broadcast,
    Movement.AGGREGATE: _Analysis._aggregate,
    Movement.MAP: _Analysis._map,
}
_CONTROL_FLOW_RULES = {"scan": _Analysis._scan, "while": _Analysis._while,
                       "cond": _Analysis._cond}


# --------------------------------------------------------------------------- computation


def placements_in(jaxpr: core.Jaxpr) -> set[tuple[str, int]]:
    """(placement name, members) of the federated operations of `jaxpr`, outside the
    per-member functions of maps (where nested programs' operations are local work)."""
    found = set()
    for eqn in jaxpr.eqns:
        facts = facts_of(eqn.primitive)
        if facts is not None:
            found.add((eqn.params["axis"], eqn.params["clients"]))
            if facts.movement is Movement.MAP:
                continue
        for sub in core.jaxprs_in_params(eqn.params):
            found |= placements_in(sub)
    return found


def _clients_from_jaxpr(jaxpr: core.Jaxpr) -> set[int]:
    return {n for _, n in placements_in(jaxpr)}


@dataclasses.dataclass
class FederatedComputation:
    """A traced federated program: closed jaxpr plus the placement of every value."""

    jaxpr: _compat.ClosedJaxpr
    clients: int
    in_tree: Any
    out_tree: Any
    in_paths: list[str]
    out_paths: list[str]
    in_placements: list[Placement]
    out_placements: list[Placement]
    placements: dict
    violations: list[Violation]
    per_client_params: dict
    name: str = "program"
    axis: str = Placement.CLIENTS.value  # the placement's name (TFF CLIENTS when exported)

    # Read once: the jaxpr builds a new list of its avals on every read, so a caller that
    # indexes them leaf by leaf would do work quadratic in the leaves.
    @functools.cached_property
    def in_avals(self) -> tuple:
        return tuple(self.jaxpr.in_avals)

    @functools.cached_property
    def out_avals(self) -> tuple:
        return tuple(self.jaxpr.out_avals)

    def placement_of(self, var) -> Placement:
        """The placement inferred for a jaxpr variable (or Literal: UNPLACED)."""
        if isinstance(var, core.Literal):
            return Placement.UNPLACED
        return self.placements[var]

    def signature(self) -> str:
        """`(x: f32[3]@SERVER, y: {f32[3]}@CLIENTS) -> f32[]@SERVER`."""
        ins = ", ".join(f"{path}: {type_string(a, p)}" for path, a, p in zip(
            self.in_paths, self.in_avals, self.in_placements))
        outs = ", ".join(type_string(a, p) for a, p in zip(self.out_avals, self.out_placements))
        if len(self.out_avals) != 1:
            outs = f"({outs})"
        return f"({ins}) -> {outs}"

    def __call__(self, *args):
        flat = jax.tree_util.tree_leaves(args)
        outs = core.jaxpr_as_fun(self.jaxpr)(*flat)
        return jax.tree_util.tree_unflatten(self.out_tree, outs)

    def __str__(self) -> str:
        names: dict = {}

        def name(v):
            if isinstance(v, core.Literal):
                return str(v.val)
            if v not in names:
                names[v] = _var_name(len(names))
            return names[v]

        def typed(v):
            return f"{name(v)}:{type_string(v.aval, self.placement_of(v))}"

        j = self.jaxpr.jaxpr
        lines = [f"federated computation {self.name} (clients={self.clients})",
                 f"  {self.signature()}",
                 "  { lambda " + " ".join(typed(v) for v in j.constvars) + "; "
                 + " ".join(typed(v) for v in j.invars) + ". let"]
        for eqn in j.eqns:
            outs = " ".join(typed(v) for v in eqn.outvars)
            extra = ""
            facts = facts_of(eqn.primitive)
            if facts is not None and facts.movement is Movement.MAP:
                extra = f"[{eqn.params['placement']}, fn={eqn.params['name']}]"
            lines.append(f"      {outs} = {eqn.primitive.name}{extra} "
                         + " ".join(name(v) for v in eqn.invars))
        lines.append("    in (" + ", ".join(name(v) for v in j.outvars) + ") }")
        if self.violations:
            lines.append("  not exportable:")
            lines.extend(f"    {v}" for v in self.violations)
        return "\n".join(lines)


def _var_name(i: int) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    s = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        s = letters[r] + s
    return s


def trace(fn: Callable, *args, placements: Any = None,
          clients: Optional[int] = None) -> FederatedComputation:
    """Traces `fn(*args)` to a `FederatedComputation`.

    `placements` is a pytree prefix of "server" / "clients" per positional argument
    (default: every argument at the server); the program's own placement name (e.g.
    "workers") may stand for "clients": it is the program's outermost placement, TFF's
    CLIENTS. `clients` is taken from `fn` when it is a `fax_bridge.program`, else from
    the federated operations in the program.

    Args:
      fn: the program.
      *args: example arguments; CLIENTS ones carry a leading clients axis.
      placements: a pytree prefix of placements per argument.
      clients: the number of clients, for a plain function.

    Returns:
      The `FederatedComputation`: the closed jaxpr and the placement of every value. A
      SERVER value combined with a CLIENTS one is a `PlacementError` naming the line.

    Example:
      >>> import jax.numpy as jnp, fax_bridge as fb
      >>> @fb.program(clients=3)
      ... def total(x):
      ...     return fb.federated_sum(x)
      >>> print(fb.trace(total, jnp.zeros(3), placements="clients"))
      federated computation total (clients=3)
        (arg0: {f32[]}@CLIENTS) -> f32[]@SERVER
        { lambda ; a:{f32[]}@CLIENTS. let
            b:f32[]@SERVER = federated_sum a
          in (b) }
    """
    leaves_with_paths, in_tree = jax.tree_util.tree_flatten_with_path(args)
    in_paths = [_arg_path(path) for path, _ in leaves_with_paths]
    own = getattr(fn, "placement", None)  # a program's own name for its placement
    try:
        flat_placements = broadcast_placements(placements, args, own)
    except ProgramError:
        if own is not None:
            raise
        flat_placements = None  # a plain function: its placement is known once traced
    declared = clients if clients is not None else getattr(fn, "clients", None)
    if declared is not None and flat_placements is not None:
        _check_clients_arguments(in_paths, [_shape_of(leaf) for _, leaf in leaves_with_paths],
                                 flat_placements, declared)
    with unchunked():  # chunk sizes are an execution choice: every one exports alike
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    out_leaves, out_tree = jax.tree_util.tree_flatten_with_path(out_shape)
    closed = inline_calls(closed)

    n = clients if clients is not None else getattr(fn, "clients", None)
    found = placements_in(closed.jaxpr)
    names = {name for name, _ in found}
    if len(names) > 1:
        raise PlacementNestingError(
            f"the program places values at several placements {sorted(names)} at its top "
            "level. Nest them instead: call the program over the inner placement inside "
            "federated_map_clients of the outer one.")
    axis = names.pop() if names else getattr(fn, "placement", Placement.CLIENTS.value)
    if flat_placements is None:
        flat_placements = broadcast_placements(placements, args, axis)
    counts = {k for _, k in found}
    if n is None:
        if len(counts) > 1:
            raise PlacementError(f"the program mixes numbers of clients {sorted(counts)}.")
        if not counts:
            raise PlacementError(
                "cannot tell the number of clients: the program uses no federated operation "
                "and trace() was given no clients=N.")
        n = counts.pop()
    elif counts - {n}:
        raise PlacementError(
            f"trace(clients={n}) but the program's federated operations use "
            f"{sorted(counts - {n})} clients.")

    _check_clients_arguments(in_paths, closed.in_avals, flat_placements, n)

    analysis = _Analysis(n)
    out_placements = analysis.run(closed.jaxpr, flat_placements)
    out_placements = [Placement.SERVER if p is Placement.UNPLACED else p
                      for p in out_placements]
    return FederatedComputation(
        jaxpr=closed, clients=n, in_tree=in_tree, out_tree=out_tree, in_paths=in_paths,
        out_paths=[_arg_path(path, prefix="out") for path, _ in out_leaves],
        in_placements=flat_placements, out_placements=out_placements,
        placements=analysis.placements, violations=analysis.violations,
        per_client_params=analysis.per_client,
        name=getattr(fn, "__name__", "program"), axis=axis)


def check_placements(fn: Callable, args: tuple, placements: Any) -> None:
    """Raises the `PlacementError` that `trace` raises for `fn(*args)` (e.g. a SERVER
    value combined with a CLIENTS one); programs without federated operations pass."""
    try:
        trace(fn, *args, placements=placements)
    except PlacementError as e:
        if "cannot tell the number of clients" in str(e):
            return
        raise


def _shape_of(leaf):
    return core.ShapedArray(tuple(getattr(leaf, "shape", ())), getattr(leaf, "dtype", None)
                            or jax.numpy.result_type(leaf))


def _check_clients_arguments(paths, avals, placements, n: int) -> None:
    for path, aval, p in zip(paths, avals, placements):
        if p is Placement.CLIENTS and (not aval.shape or aval.shape[0] != n):
            raise PlacementError(
                f"argument {path} is placed at CLIENTS but has shape {tuple(aval.shape)}; a "
                f"CLIENTS value needs a leading axis of size {n} (one slice per client). "
                "Stack the clients' values along axis 0, or mark the argument 'server'.")


def _arg_path(path, prefix: str = "arg") -> str:
    """`arg0`, `arg1['w']`... for a key path starting with the positional index."""
    if not path:
        return prefix
    first, rest = path[0], path[1:]
    head = f"{prefix}{first.idx}" if isinstance(first, jax.tree_util.SequenceKey) else \
        prefix + jax.tree_util.keystr((first,))
    return head + jax.tree_util.keystr(tuple(rest))
