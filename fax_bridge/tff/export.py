"""Export of a traced federated program as a TFF building-block `Computation` proto.

The placement-annotated jaxpr of `fax_bridge.trace` is cut into *stages* and
*communication* (planned by `stages.plan`, a pure function; this module emits the plan):

- every equation is given a depth, the number of federated communications (broadcast,
  sum, mean, weighted mean) on its longest input path;
- the local equations of one placement and one depth form one stage, lowered to one
  `Xla` computation (consecutive work at a placement is fused, not one computation per
  equation) and applied with `federated_map` (CLIENTS, per-client HLO without the clients
  axis) or `federated_apply` (SERVER), their inputs zipped with `federated_zip_at_*`;
- each communication becomes its intrinsic (named by its primitive's record in
  `primitive_facts`, emitted by the record's emitter or by `emitters`); constants are
  folded into the HLO, or placed with `federated_value_at_*` / `federated_eval_at_*`
  where they are used directly by an intrinsic.

The result is `Lambda(arg -> Block(locals, result))`, type-checked by federated_language's
building blocks as it is built. Pytrees become TFF structs: dict keys name elements,
tuples and lists are unnamed; an argument (or result) whose leaves share one placement is
one federated value of a struct, e.g. `{<x=float32[5,3],y=int32[5]>}@CLIENTS`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import federated_language
import jax
import numpy as np
from federated_language.compiler import building_block_factory as factory
from federated_language.compiler import building_blocks as bb
from federated_language.proto import computation_pb2
from google.protobuf.message import DecodeError
from jax._src import core

from fax_bridge.language import primitives as P
from fax_bridge.language import tracing
from fax_bridge.errors import ExportError
from fax_bridge.language.member_rules import ELEMENTWISE
from fax_bridge.language.placements import Placement
from fax_bridge.language.primitive_facts import Movement, facts_of
from fax_bridge.runtime import result_structure
from fax_bridge.tff.arguments import argument_names, client_data  # noqa: F401 - served here too
from fax_bridge.tff import emitters, stages
from fax_bridge.tff import types as tff_types
from fax_bridge.tff import xla as tff_xla
from fax_bridge.tff.exportable import check_exportable

S, C, U = Placement.SERVER, Placement.CLIENTS, Placement.UNPLACED

# Per-client equations whose UNPLACED operands of full shape are per-client data (one
# row per client); for the others (dot_general's right operand, pad values, scalars)
# an UNPLACED operand is the same for every client.
_ROW_OPERANDS = ELEMENTWISE | {"concatenate"}

# Up to this many leaves are selected out of their federated structs one by one (each
# selection repeats its struct's type, so this bounds the bytes at this many times the
# struct's); more are gathered by one Xla part (`_Exporter.arrange`), whose bytes grow
# with the struct and the leaves, never their product. Small programs keep their
# selections and need no Xla part more.
SELECT_AT_MOST = 8


@dataclasses.dataclass
class _Group:
    """A federated value held in a Block local: its member is a pytree of tensors."""

    ref: bb.ComputationBuildingBlock
    placement: Placement
    member_avals: Any  # pytree of ShapedArray (member shapes, no clients axis)
    leaf_vars: list  # jaxpr vars, in the member's flatten (= TFF depth-first) order

    @property
    def is_single(self) -> bool:
        return len(self.leaf_vars) == 1 and not jax.tree_util.tree_structure(
            self.member_avals).children()


def _member(aval, placement: Placement):
    return P.member_aval(aval, P.CLIENTS if placement is C else P.SERVER)


def _fed_type(member_type, placement: Placement) -> federated_language.FederatedType:
    return tff_types.federated(member_type, placement.value)


def _host(value):
    """A folded constant as numpy; a typed PRNG key stays jax (it never crosses)."""
    return value if tff_types.is_typed_key(value) else np.asarray(value)


class _Exporter:
    def __init__(self, comp: tracing.FederatedComputation, arg_names: Sequence[Optional[str]],
                 round_form: bool = False):
        self.comp = comp
        self.round_form = round_form
        self.arg_names = list(arg_names)
        self.locals: list[tuple[str, bb.ComputationBuildingBlock]] = []
        self.where: dict = {}  # var -> (group, index path inside the member)
        self.singles: dict = {}  # var -> group whose member is that var alone
        self.consts: dict = {}  # UNPLACED var -> concrete value
        self.all_equal_consts: set = set()  # CLIENTS vars holding a broadcast constant
        self.count = 0

    # ----------------------------------------------------------------- helpers

    def _local(self, value: bb.ComputationBuildingBlock, prefix: str) -> bb.Reference:
        name = f"{prefix}{self.count}"
        self.count += 1
        self.locals.append((name, value))
        return bb.Reference(name, value.type_signature)

    def _placement(self, v) -> Placement:
        return self.comp.placement_of(v)

    def fail(self, eqn, message: str):
        raise ExportError(f"{eqn.primitive.name} at {tracing.eqn_location(eqn)}: {message}")

    def _register(self, group: _Group) -> _Group:
        leaves = tff_types.leaves_with_paths(tff_types.pytree_type(group.member_avals)) \
            if not group.is_single else None
        if group.is_single:
            self.where.setdefault(group.leaf_vars[0], (group, ()))
            self.singles.setdefault(group.leaf_vars[0], group)
        else:
            for var, leaf in zip(group.leaf_vars, leaves):
                self.where.setdefault(var, (group, tuple(leaf.index_path)))
        return group

    # ----------------------------------------------------------------- constants

    def fold_constants(self) -> None:
        j = self.comp.jaxpr
        for v, c in zip(j.jaxpr.constvars, j.consts):
            self.consts[v] = _host(c)
        for eqn in j.jaxpr.eqns:
            if all(self._placement(v) is U for v in eqn.outvars) and not any(
                    self._placement(v) is not U for v in eqn.invars):
                vals = [v.val if isinstance(v, core.Literal) else self.consts[v]
                        for v in eqn.invars]
                outs = eqn.primitive.bind(*vals, **eqn.primitive.get_bind_params(eqn.params))
                if not eqn.primitive.multiple_results:
                    outs = [outs]
                for v, o in zip(eqn.outvars, outs):
                    self.consts[v] = _host(o)
            elif _moves(eqn, Movement.BROADCAST) and self._is_const(eqn.invars[0]):
                # A constant sent to every client is a constant there too: folded into
                # the per-client HLO, or placed with federated_value_at_clients.
                (x,), (out,) = eqn.invars, eqn.outvars
                value = np.asarray(x.val) if isinstance(x, core.Literal) else self.consts[x]
                self.consts[out] = np.broadcast_to(value, (self.comp.clients,) + value.shape)
                self.all_equal_consts.add(out)

    def _const_row(self, eqn, v):
        value = self.consts[v]
        if value.ndim == 0 or value.shape[0] != self.comp.clients:
            return value
        if not np.all(value == value[:1]):
            self.fail(eqn, (
                "a constant with one different row per client is used as client data; "
                "pass it as a CLIENTS argument of the program instead."))
        return value[0]

    def _const_fn(self, value) -> bb.ComputationBuildingBlock:
        proto = tff_xla.xla_computation(lambda: jax.numpy.asarray(value), None)
        return bb.CompiledComputation(proto, name=f"const{self.count}")

    # ----------------------------------------------------------------- parameter

    def parameter(self):
        comp = self.comp
        leaves = list(range(len(comp.in_avals)))
        tree = jax.tree_util.tree_unflatten(comp.in_tree, leaves)  # tuple of args
        if not tree:
            return None, None
        if self.round_form:
            return self._round_parameter(tree)
        if len(tree) == 1:
            ptype = self._arg_type(tree[0])
            ref = bb.Reference("arg", ptype)
            self._bind_arg(tree[0], ref)
            return "arg", ptype
        names = [n if n and n not in ("arg",) else None for n in self.arg_names]
        if len(set(n for n in names if n)) != len([n for n in names if n]):
            names = [None] * len(tree)
        elements = [(names[i] if i < len(names) else None, self._arg_type(sub))
                    for i, sub in enumerate(tree)]
        ptype = federated_language.StructType(elements)
        ref = bb.Reference("arg", ptype)
        for i, sub in enumerate(tree):
            self._bind_arg(sub, bb.Selection(ref, index=i))
        return "arg", ptype

    def _round_parameter(self, tree):
        """`<server_state@SERVER, client_data@CLIENTS>`: the SERVER arguments zipped into
        one server value, the CLIENTS arguments into one client value."""
        groups: dict = {S: [], C: []}
        names: dict = {S: [], C: []}
        for i, sub in enumerate(tree):
            placements = self._leaf_placements(sub)
            if len(placements) != 1 or placements & {U}:
                raise ExportError(
                    f"argument {i} ({self.arg_names[i] if i < len(self.arg_names) else '?'})"
                    f" mixes placements {sorted(p.value for p in placements)}; a round in "
                    "the forms' shape takes SERVER state and CLIENTS data only. Keep client "
                    "state at the server (e.g. one entry per client slot) or split it into "
                    "its own argument.")
            placement = placements.pop()
            groups[placement].append(sub)
            names[placement].append(self.arg_names[i] if i < len(self.arg_names) else None)
        parts = []
        for placement, subs in ((S, groups[S]), (C, groups[C])):
            if not subs:
                raise ExportError(
                    f"a round in the forms' shape needs a {placement.value.upper()} argument "
                    "(server state first, then client data); the program has none.")
            member = subs[0] if len(subs) == 1 else tuple(subs)
            if placement is C and len(subs) > 1:  # named after the arguments (`data/x`)
                member = client_data(subs, names[C])
            parts.append((placement, member))
        ptype = federated_language.StructType(
            [(None, _fed_type(tff_types.pytree_type(self._member_avals(m)), p))
             for p, m in parts])
        ref = bb.Reference("arg", ptype)
        invars = self.comp.jaxpr.jaxpr.invars
        for i, (placement, member) in enumerate(parts):
            self._register(_Group(self._local(bb.Selection(ref, index=i), "_arg"), placement,
                                  self._member_avals(member),
                                  [invars[j] for j in jax.tree_util.tree_leaves(member)]))
        return "arg", ptype

    def _leaf_placements(self, subtree) -> set:
        return {self.comp.in_placements[i] for i in jax.tree_util.tree_leaves(subtree)}

    def _member_avals(self, subtree):
        return jax.tree_util.tree_map(
            lambda i: _member(self.comp.in_avals[i], self.comp.in_placements[i]), subtree)

    def _arg_type(self, subtree):
        placements = self._leaf_placements(subtree)
        if not jax.tree_util.tree_leaves(subtree):
            return federated_language.StructType([])
        if len(placements) == 1:
            return _fed_type(tff_types.pytree_type(self._member_avals(subtree)),
                             placements.pop())
        return federated_language.StructType(
            [(name, self._arg_type(child))
             for name, child in tff_types.named_children(subtree)])

    def _bind_arg(self, subtree, expr) -> None:
        placements = self._leaf_placements(subtree)
        if not jax.tree_util.tree_leaves(subtree):
            return
        if len(placements) == 1:
            ref = self._local(expr, "_arg") if not isinstance(expr, bb.Reference) else expr
            invars = self.comp.jaxpr.jaxpr.invars
            self._register(_Group(ref, placements.pop(), self._member_avals(subtree),
                                  [invars[i] for i in jax.tree_util.tree_leaves(subtree)]))
            return
        for i, (_, child) in enumerate(tff_types.named_children(subtree)):
            self._bind_arg(child, bb.Selection(expr, index=i))

    # ----------------------------------------------------------------- values

    def single(self, v, placement: Placement, eqn) -> _Group:
        """A group whose member is exactly `v` (selecting it out of a struct if needed)."""
        if not isinstance(v, core.Literal) and v in self.singles:
            return self.singles[v]
        if isinstance(v, core.Literal) or v in self.consts:
            value = np.asarray(v.val) if isinstance(v, core.Literal) else self.consts[v]
            if placement is C and v in self.all_equal_consts:
                row = value[0]
                call = factory.create_federated_value(bb.Call(self._const_fn(row)),
                                                      federated_language.CLIENTS)
                aval = core.ShapedArray(np.shape(row), row.dtype)
            elif placement is C:
                row = self._const_row(eqn, v) if not isinstance(v, core.Literal) else value
                call = factory.create_federated_eval(self._const_fn(row),
                                                     federated_language.CLIENTS)
                aval = core.ShapedArray(np.shape(row), np.asarray(row).dtype)
            else:
                call = factory.create_federated_eval(self._const_fn(value),
                                                     federated_language.SERVER)
                aval = core.ShapedArray(np.shape(value), value.dtype)
            group = _Group(self._local(call, "_c"), placement, aval, [v])
            return self._register(group) if not isinstance(v, core.Literal) else group
        group, path = self.where[v]
        expr = group.ref
        for index in path:
            expr = factory.create_federated_getitem_call(expr, index)
        single = _Group(self._local(expr, "_s"), group.placement,
                        _member(v.aval, group.placement), [v])
        self.singles[v] = single
        return single

    # ----------------------------------------------------------------- communication

    def _is_const(self, v) -> bool:
        return isinstance(v, core.Literal) or v in self.consts

    def gather(self, vs: list, placement: Placement, eqn):
        """One federated value holding `vs`: (expression, member avals pytree).

        Uses a group as it is when it holds exactly `vs`, else zips the single values.
        """
        if not self._is_const(vs[0]) and vs[0] in self.where:
            group, _ = self.where[vs[0]]
            if list(group.leaf_vars) == list(vs):
                return group.ref, group.member_avals
        if len(vs) == 1:
            g = self.single(vs[0], placement, eqn)
            return g.ref, g.member_avals
        if len(vs) <= SELECT_AT_MOST:
            singles = [self.single(v, placement, eqn) for v in vs]
            return (factory.create_federated_zip(bb.Struct([g.ref for g in singles])),
                    tuple(g.member_avals for g in singles))
        return self.arrange(vs, jax.tree_util.tree_structure(tuple(vs)), placement, eqn)

    def arrange(self, vs: list, treedef, placement: Placement, eqn):
        """One federated value whose member is `treedef` holding `vs`: (expression, member
        avals pytree), in bytes and time linear in the groups `vs` come from (used for
        more than `SELECT_AT_MOST` leaves).

        A group holding exactly `vs` in that structure is used as it is; several leaves
        are picked out of their groups by one Xla computation (mapped or applied). Every
        node of a proto carries its type, so selecting the leaves one by one would repeat
        the type of their whole group once per leaf: quadratic in the number of leaves.
        """
        groups: list[_Group] = []
        index: dict = {}  # id(group) -> its place in groups
        positions: list[dict] = []  # per group: leaf var -> its index in the member
        flat_avals: list[list] = []
        picks = []  # per leaf of vs: (group index, leaf index)
        for v in vs:
            if self._is_const(v) or v in self.singles or v not in self.where:
                group = self.single(v, placement, eqn)
            else:
                group = self.where[v][0]
            gi = index.get(id(group))
            if gi is None:
                index[id(group)] = gi = len(groups)
                groups.append(group)
                positions.append({})
                for li, var in enumerate(group.leaf_vars):
                    if not isinstance(var, core.Literal):
                        positions[-1].setdefault(var, li)
                flat_avals.append(jax.tree_util.tree_leaves(group.member_avals))
            picks.append((gi, 0 if isinstance(v, core.Literal) else positions[gi][v]))
        avals = [flat_avals[gi][li] for gi, li in picks]
        member = jax.tree_util.tree_unflatten(treedef, avals)
        if len(groups) == 1 and list(groups[0].leaf_vars) == list(vs) and \
                tff_types.pytree_type(groups[0].member_avals) == tff_types.pytree_type(member):
            return groups[0].ref, groups[0].member_avals
        if treedef.num_leaves == 1 and treedef.num_nodes == 1:
            return self.single(vs[0], placement, eqn).ref, member

        def pick(value):
            flat = [jax.tree_util.tree_leaves(x)
                    for x in ((value,) if len(groups) == 1 else value)]
            return jax.tree_util.tree_unflatten(treedef, [flat[gi][li] for gi, li in picks])

        arg_avals = groups[0].member_avals if len(groups) == 1 else tuple(
            g.member_avals for g in groups)
        compiled = bb.CompiledComputation(tff_xla.xla_computation(pick, arg_avals),
                                          name=f"arrange{self.count}")
        arg = groups[0].ref if len(groups) == 1 else factory.create_federated_zip(
            bb.Struct([g.ref for g in groups]))
        call = (factory.create_federated_map(compiled, arg) if placement is C
                else factory.create_federated_apply(compiled, arg))
        return self._local(call, "_a"), member

    def communicate(self, eqns: list) -> None:
        """Equations of one kind (and weights) at one depth, emitted by `emitters.emit`."""
        emitters.emit(self, eqns)

    def hold(self, value: bb.ComputationBuildingBlock, placement: Placement, member_avals,
             leaf_vars: list) -> None:
        """Holds a communication's result `value` in a Block local: the federated value
        of `leaf_vars`, whose members are `member_avals`."""
        self._register(_Group(self._local(value, "_f"), placement, member_avals, leaf_vars))

    # ----------------------------------------------------------------- stages

    def stage(self, placement: Placement, eqns: list, needed_later: set) -> None:
        produced = {v for e in eqns for v in e.outvars}
        inputs: list = []
        for e in eqns:
            for v in e.invars:
                if isinstance(v, core.Literal) or v in produced or v in self.consts:
                    continue
                if v not in inputs:
                    inputs.append(v)
        outputs = [v for e in eqns for v in e.outvars
                   if v in needed_later and not isinstance(v, core.DropVar)]
        if not outputs:
            return
        groups: list[_Group] = []
        for v in inputs:
            group, _ = self.where[v]
            if all(group is not g for g in groups):
                groups.append(group)

        def run(member_arg):
            env: dict = {}
            values = (member_arg,) if len(groups) == 1 else member_arg
            for group, value in zip(groups, values):
                for var, leaf in zip(group.leaf_vars, jax.tree_util.tree_leaves(value)):
                    env.setdefault(var, leaf)
            for e in eqns:
                self._eval_local(e, placement, env)
            return [env[v] for v in outputs] if len(outputs) > 1 else env[outputs[0]]

        if groups:
            arg_avals = groups[0].member_avals if len(groups) == 1 else tuple(
                g.member_avals for g in groups)
            fn = tff_xla.xla_computation(run, arg_avals)
            if len(groups) == 1:
                arg = groups[0].ref
            else:
                arg = factory.create_federated_zip(bb.Struct([g.ref for g in groups]))
            compiled = bb.CompiledComputation(fn, name=f"stage{self.count}")
            call = (factory.create_federated_map(compiled, arg) if placement is C
                    else factory.create_federated_apply(compiled, arg))
        else:
            fn = tff_xla.xla_computation(lambda: run(()), None)
            compiled = bb.CompiledComputation(fn, name=f"stage{self.count}")
            call = factory.create_federated_eval(
                compiled, federated_language.CLIENTS if placement is C
                else federated_language.SERVER)
        member = [_member(v.aval, placement) for v in outputs]
        self._register(_Group(self._local(call, "_l"), placement,
                              member if len(member) > 1 else member[0], outputs))

    def _eval_local(self, e, placement: Placement, env: dict) -> None:
        per_client = placement is C
        params = self.comp.per_client_params.get(id(e)) if per_client else None

        def read(v, row: bool):
            if isinstance(v, core.Literal):
                return v.val
            if v in env:
                return env[v]
            return self._const_row(e, v) if row else self.consts[v]

        if _moves(e, Movement.MAP):
            inner = e.params["jaxpr"]
            vals = [read(v, per_client) for v in e.invars]
            outs = core.eval_jaxpr(inner.jaxpr, inner.consts, *vals)
        elif per_client:
            if params is None:
                self.fail(e, "this operation on CLIENTS values has no per-client form.")
            row = e.primitive.name in _ROW_OPERANDS
            vals = [read(v, row and self._full_shape(v, e)) for v in e.invars]
            if params.get("__identity__"):
                outs = vals[:1]
            else:
                outs = e.primitive.bind(*vals, **e.primitive.get_bind_params(params))
                outs = outs if e.primitive.multiple_results else [outs]
        else:
            vals = [read(v, False) for v in e.invars]
            outs = e.primitive.bind(*vals, **e.primitive.get_bind_params(e.params))
            outs = outs if e.primitive.multiple_results else [outs]
        for v, o in zip(e.outvars, outs):
            env[v] = o

    @staticmethod
    def _full_shape(v, e) -> bool:
        return bool(v.aval.shape) and tuple(v.aval.shape) == tuple(e.outvars[0].aval.shape)

    # ----------------------------------------------------------------- driver

    def body(self) -> None:
        """Emits the steps `stages.plan` chose, in order."""
        steps = stages.plan(self.comp.jaxpr.jaxpr, self._placement, self.consts)
        for step in steps:
            if isinstance(step, stages.Communicate):
                self.communicate(step.eqns)
            else:
                self.stage(step.placement, step.eqns, step.needed)

    def result(self) -> bb.ComputationBuildingBlock:
        comp = self.comp
        outvars = list(comp.jaxpr.jaxpr.outvars)
        tree = jax.tree_util.tree_unflatten(comp.out_tree, list(range(len(outvars))))

        def placements_of(sub):
            return {comp.out_placements[i] for i in jax.tree_util.tree_leaves(sub)}

        def build(sub):
            ps = placements_of(sub)
            if isinstance(sub, int):
                return self.single(outvars[sub], comp.out_placements[sub], None).ref
            children = tff_types.named_children(sub)
            leaves = jax.tree_util.tree_leaves(sub)
            if len(ps) == 1 and children and len(leaves) > SELECT_AT_MOST:
                return self.arrange([outvars[i] for i in leaves],
                                    jax.tree_util.tree_structure(sub), ps.pop(), None)[0]
            if len(ps) == 1 and children:
                struct = bb.Struct([(name, build(child)) for name, child in children])
                return factory.create_federated_zip(struct)
            return bb.Struct([(name, build(child)) for name, child in children])

        if self.round_form:
            children = tff_types.named_children(tree) if not isinstance(tree, int) else []
            if len(children) != 2 or any(placements_of(c) != {S} for _, c in children):
                raise ExportError(
                    "a round in the forms' shape returns (new_state, output), two values "
                    f"placed at SERVER; this program returns {comp.signature().split(' -> ')[1]}."
                    " Return a pair, and keep any CLIENTS result at the server (aggregate it) "
                    "or drop it.")
            return bb.Struct([(None, build(child)) for _, child in children])
        return build(tree)


def _moves(eqn, movement: Movement) -> bool:
    facts = facts_of(eqn.primitive)
    return facts is not None and facts.movement is movement


def export_computation(comp: tracing.FederatedComputation,
                       arg_names: Optional[Sequence[Optional[str]]] = None,
                       round_form: bool = False) -> computation_pb2.Computation:
    """Builds the TFF proto of a traced program (see the module docstring).

    With `round_form`, the proto has the type TFF's production forms want:
    `(<server_state@SERVER, client_data@CLIENTS> -> <new_state@SERVER, output@SERVER>)`,
    the SERVER arguments zipped into one value, the CLIENTS arguments into another, and
    the program's `(new_state, output)` result returned as two separate SERVER values.
    """
    n_args = len(jax.tree_util.tree_unflatten(comp.in_tree, list(range(len(comp.in_avals)))))
    try:
        exporter = _Exporter(comp, arg_names or [None] * n_args, round_form)
        check_exportable(comp, exporter.arg_names)
        exporter.fold_constants()
        param_name, param_type = exporter.parameter()
        exporter.body()
        result = exporter.result()
        block = bb.Block(exporter.locals, result) if exporter.locals else result
        proto = bb.Lambda(param_name, param_type, block).to_proto()
    except (DecodeError, RecursionError) as e:  # protobuf's depth limit, anywhere
        raise tff_types.too_deep_error(
            jax.tree_util.tree_unflatten(comp.in_tree, list(comp.in_avals)), e) from None
    # Runs of this proto give results the program's output structure, as jit does.
    result_structure.keep_structure(proto, comp.out_tree)
    return proto


def export_tff(fn: Callable, *args, placements: Any = None, clients: Optional[int] = None,
               round_form: bool = False) -> computation_pb2.Computation:
    """Exports `fn(*args)` as a `federated_language` `Computation` proto.

    `placements` is a pytree prefix of "server"/"clients" per positional argument
    (default: all SERVER), or the program's own placement name in place of "clients"
    (`placements=("workers",)` for `program(placements={"workers": 2})`). The program's
    placement (any name) becomes TFF CLIENTS; nested programs (another placement inside
    a `federated_map_clients` function) are local work in the per-client Xla
    computations. Raises `fax_bridge.ExportError` for what
    TFF cannot express, naming the equation, the user's source line and the fix.

    Args:
      fn: the program.
      *args: example arguments (their shapes and dtypes become the proto's types).
      placements: a pytree prefix of placements per argument.
      clients: the number of clients, for a plain function.
      round_form: see `export_computation`.

    Returns:
      The `federated_language` `Computation` proto (local parts as `Xla` HLO modules).

    Example:
      >>> import jax.numpy as jnp, fax_bridge as fb
      >>> @fb.program(clients=3)
      ... def total(x):
      ...     return fb.federated_sum(x)
      >>> proto = fb.export_tff(total, jnp.zeros(3), placements="clients")
      >>> proto.WhichOneof("computation")
      'lambda'
    """
    names = argument_names(fn, len(args))
    try:
        comp = tracing.trace(fn, *args, placements=placements, clients=clients)
    except tracing.PlacementNestingError as e:
        raise ExportError(
            f"cannot export: {e} TFF has one CLIENTS placement, which is the outermost "
            "placement of the program; inner placements can only be local work inside a "
            "per-client function.") from e
    return export_computation(comp, names, round_form)

