"""The federated_language `Computation` grammar, read in one place.

Every module that walks a computation proto takes from here: which case a computation
holds (`which`, the one reader of the proto's oneof; `case`, which refuses none and
TensorFlow; a table of handlers by case checked against the proto's own list,
`handlers`), the computations directly inside one (`children`) and every one inside,
depth first (`walk`), the names it uses
without binding them (`free_references`), the parts of an intrinsic call
(`intrinsic_call`), what a value only selects from another (`selected_path`: through
locals, selections and member-wise selection lambdas) or zips together
(`zipped_elements`), and the small pieces a rewriter builds (`make_reference`,
`make_selection`).
"""

from __future__ import annotations

from typing import Callable, Iterator, Mapping, Optional

from federated_language.proto import computation_pb2

from fax_bridge.errors import ComputationError

Computation = computation_pb2.Computation

# The cases of the `computation` oneof, as the proto declares them.
CASES = tuple(field.name for field in
              Computation.DESCRIPTOR.oneofs_by_name["computation"].fields)
LAMBDA = "lambda"  # a python keyword, so the proto field is read with getattr


def which(comp: Computation) -> Optional[str]:
    """Which case of the Computation proto `comp` holds (None when none is set)."""
    return comp.WhichOneof("computation")


def case(comp: Computation) -> str:
    """Which case of the Computation proto `comp` holds; ComputationError when none or
    TensorFlow (no walker here runs TensorFlow parts)."""
    kind = which(comp)
    if kind is None:
        raise ComputationError(
            "a computation proto has no computation case set (malformed proto)")
    if kind == "tensorflow":
        raise ComputationError(
            "TensorFlow local computations are not supported; export local parts as Xla "
            "computations")
    return kind


def handlers(table: Mapping[str, Callable]) -> dict[str, Callable]:
    """`table` (case name -> handler) as a dict, once every key is checked to be a case
    of the proto: a misspelt case fails when the table is built, not when a proto of that
    case first arrives."""
    unknown = sorted(set(table) - set(CASES))
    if unknown:
        raise ComputationError(
            f"handlers for {unknown}, which are not cases of Computation ({', '.join(CASES)})")
    return dict(table)


def lambda_of(comp: Computation) -> computation_pb2.Lambda:
    """The Lambda message of a `lambda` computation."""
    return getattr(comp, LAMBDA)


def children(comp: Computation) -> list[Computation]:
    """The computations directly inside `comp`, in evaluation order: a call's function
    then its argument, a struct's elements, a selection's source, a lambda's result, a
    block's locals then its result; none for references, intrinsics, literals, Xla."""
    kind = which(comp)
    if kind == "call":
        call = comp.call
        return [call.function, call.argument] if call.HasField("argument") else [call.function]
    if kind == "struct":
        return [e.value for e in comp.struct.element]
    if kind == "selection":
        return [comp.selection.source]
    if kind == LAMBDA:
        return [lambda_of(comp).result]
    if kind == "block":
        return [local.value for local in comp.block.local] + [comp.block.result]
    return []


def walk(comp: Computation) -> Iterator[Computation]:
    """`comp` and every computation inside it, depth first, each before its children
    (in `children` order). Walked with an explicit stack, so nesting costs no recursion."""
    stack = [comp]
    while stack:
        c = stack.pop()
        yield c
        stack.extend(reversed(children(c)))


def free_references(comp: Computation) -> dict[str, list]:
    """The names `comp` references without binding them itself, each with the Type
    proto of every such reference (in depth-first order).

    A Lambda binds its parameter in its result; a Block binds each local in the locals
    after it and in its result. Walked with an explicit stack, so nesting depth costs no
    Python recursion.
    """
    free: dict[str, list] = {}
    stack: list[tuple[Computation, frozenset]] = [(comp, frozenset())]
    while stack:
        c, bound = stack.pop()
        kind = which(c)
        if kind == "reference":
            if c.reference.name not in bound:
                free.setdefault(c.reference.name, []).append(c.type)
        elif kind == LAMBDA:
            lam = lambda_of(c)
            stack.append((lam.result,
                          bound | {lam.parameter_name} if lam.parameter_name else bound))
        elif kind == "block":
            scoped = []
            for local in c.block.local:
                scoped.append((local.value, bound))
                bound = bound | {local.name}
            scoped.append((c.block.result, bound))
            stack.extend(reversed(scoped))
        else:
            stack.extend((child, bound) for child in reversed(children(c)))
    return free


def intrinsic_call(comp: Computation) -> Optional[tuple[str, Optional[Computation]]]:
    """(uri, argument or None) of a call of an intrinsic; None for anything else."""
    if which(comp) != "call":
        return None
    fn = comp.call.function
    if which(fn) != "intrinsic":
        return None
    return fn.intrinsic.uri, (comp.call.argument if comp.call.HasField("argument") else None)


def reference_name(comp: Optional[Computation]) -> Optional[str]:
    """The name a Reference computation refers to; None for anything else."""
    if comp is not None and which(comp) == "reference":
        return comp.reference.name
    return None


def struct_elements(comp: Optional[Computation], count: int) -> Optional[list]:
    """The element values of a Struct computation of exactly `count` elements; None for
    anything else."""
    if comp is None or which(comp) != "struct" or \
            len(comp.struct.element) != count:
        return None
    return [e.value for e in comp.struct.element]


def make_reference(name: str) -> Computation:
    """A Reference computation to `name`."""
    out = Computation()
    out.reference.name = name
    return out


def make_selection(source: Computation, index: int) -> Computation:
    """A Selection of element `index` from `source`."""
    out = Computation()
    out.selection.source.CopyFrom(source)
    out.selection.index = index
    return out


# Intrinsics that apply a function to a placed value, member by member: a selection
# lambda applied through one of them selects from every member alike.
MEMBERWISE_APPLY = frozenset(("federated_apply", "federated_map", "federated_map_all_equal"))
ZIPS = frozenset(("federated_zip_at_server", "federated_zip_at_clients"))


def selection_lambda(fn: Computation) -> Optional[list[int]]:
    """The indices `[i, j, ...]` of a Lambda `(x -> x[i][j]...)` (its result only selects
    from its parameter); None for any other computation."""
    if which(fn) != LAMBDA:
        return None
    lam = lambda_of(fn)
    body, indices = lam.result, []
    while which(body) == "selection":
        indices.append(body.selection.index)
        body = body.selection.source
    if not lam.parameter_name or reference_name(body) != lam.parameter_name:
        return None
    return indices[::-1]


def selected_path(comp: Computation, scope: Mapping[str, Computation],
                  root: str) -> Optional[list[int]]:
    """The indices by which `comp` selects a part of the value named `root`, unchanged:
    through references to the locals in `scope` ({name: value}), selections, and
    member-wise applications of selection lambdas (`MEMBERWISE_APPLY`); `[]` for `root`
    itself, None where `comp` computes anything else."""
    suffix: list[int] = []
    for _ in range(10_000):  # a chain of locals; a cycle is a malformed proto
        kind = which(comp)
        if kind == "reference":
            name = comp.reference.name
            if name == root:
                return suffix
            if name not in scope:
                return None
            comp = scope[name]
        elif kind == "selection":
            suffix.insert(0, comp.selection.index)
            comp = comp.selection.source
        else:
            call = intrinsic_call(comp)
            pair = struct_elements(call[1], 2) if call and call[0] in MEMBERWISE_APPLY \
                else None
            picked = selection_lambda(pair[0]) if pair else None
            if picked is None:
                return None
            suffix[:0] = picked
            comp = pair[1]
    return None


def zipped_elements(comp: Computation, scope: Mapping[str, Computation]
                    ) -> Optional[list[tuple[Optional[str], Computation]]]:
    """The (name, value) elements a federated zip (`ZIPS`) of a struct puts together,
    following references to the locals in `scope`; None for anything else."""
    while which(comp) == "reference" and comp.reference.name in scope:
        comp = scope[comp.reference.name]
    call = intrinsic_call(comp)
    if call is None or call[0] not in ZIPS or call[1] is None:
        return None
    arg = call[1]
    while which(arg) == "reference" and arg.reference.name in scope:
        arg = scope[arg.reference.name]
    if which(arg) != "struct":
        return None
    return [(e.name or None, e.value) for e in arg.struct.element]
