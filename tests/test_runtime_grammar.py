"""The Computation grammar's one reader: cases, handler tables and free references."""

import pytest
from federated_language.proto import computation_pb2
from hypothesis import given, settings, strategies as st

from fax_bridge.errors import ComputationError
from fax_bridge.runtime import grammar

Computation = computation_pb2.Computation
_NAMES = ("a", "b", "c", "d")


def _typed(comp: Computation, dtype: int) -> Computation:
    """`comp` with a tensor type, so each reference carries a type to report."""
    comp.type.tensor.dtype = dtype
    return comp


def _protos():
    """Nested Lambda/Block/Reference/Call/Struct/Selection protos over a few names, so
    that names are bound, rebound, shadowed and left free in every position."""
    names = st.sampled_from(_NAMES)
    reference = st.builds(
        lambda n, t: _typed(grammar.make_reference(n), t), names, st.integers(1, 3))

    def extend(inner):
        def lambda_(param, result):
            out = Computation()
            lam = grammar.lambda_of(out)
            lam.parameter_name = param
            lam.result.CopyFrom(result)
            return out

        def block(locals_, result):
            out = Computation()
            for name, value in locals_:
                out.block.local.add(name=name, value=value)
            out.block.result.CopyFrom(result)
            return out

        def call(fn, arg):
            out = Computation()
            out.call.function.CopyFrom(fn)
            if arg is not None:
                out.call.argument.CopyFrom(arg)
            return out

        def struct(elements):
            out = Computation()
            out.struct.SetInParent()
            for e in elements:
                out.struct.element.add(value=e)
            return out

        return st.one_of(
            st.builds(lambda_, st.sampled_from(_NAMES + ("",)), inner),
            st.builds(block, st.lists(st.tuples(names, inner), max_size=3), inner),
            st.builds(call, inner, st.none() | inner),
            st.builds(struct, st.lists(inner, max_size=3)),
            st.builds(grammar.make_selection, inner, st.integers(0, 2)))

    return st.recursive(reference, extend, max_leaves=12)


def _free_occurrences(comp: Computation) -> list:
    """The reference definition: (name, dtype) of each free reference, depth first,
    by recursion on the grammar's rules."""
    kind = comp.WhichOneof("computation")
    if kind == "reference":
        return [(comp.reference.name, comp.type.tensor.dtype)]
    if kind == "lambda":
        lam = getattr(comp, "lambda")
        return [o for o in _free_occurrences(lam.result)
                if not lam.parameter_name or o[0] != lam.parameter_name]
    if kind == "block":
        return _block_free(list(comp.block.local), comp.block.result)
    if kind == "call":
        out = _free_occurrences(comp.call.function)
        if comp.call.HasField("argument"):
            out += _free_occurrences(comp.call.argument)
        return out
    if kind == "struct":
        return [o for e in comp.struct.element for o in _free_occurrences(e.value)]
    if kind == "selection":
        return _free_occurrences(comp.selection.source)
    return []


def _block_free(locals_: list, result: Computation) -> list:
    if not locals_:
        return _free_occurrences(result)
    first, rest = locals_[0], locals_[1:]
    return _free_occurrences(first.value) + [
        o for o in _block_free(rest, result) if o[0] != first.name]


@settings(max_examples=150, deadline=None, database=None)
@given(_protos())
def test_free_references_match_the_grammar_rules(comp):
    expected: dict = {}
    for name, dtype in _free_occurrences(comp):
        expected.setdefault(name, []).append(dtype)
    got = grammar.free_references(comp)
    assert {n: [t.tensor.dtype for t in types] for n, types in got.items()} == expected


def test_free_references_of_a_block_see_earlier_locals_only():
    """`b = a; a = 1; result a`: the first `a` is free, the result's is bound."""
    comp = Computation()
    comp.block.local.add(name="b", value=grammar.make_reference("a"))
    comp.block.local.add(name="a", value=grammar.make_reference("c"))
    comp.block.result.CopyFrom(grammar.make_reference("a"))
    assert sorted(grammar.free_references(comp)) == ["a", "c"]


def test_free_references_walk_nesting_deeper_than_python_recursion():
    comp = grammar.make_reference("x")
    for _ in range(1500):
        comp = grammar.make_selection(comp, 0)
    assert list(grammar.free_references(comp)) == ["x"]


def test_handler_tables_refuse_a_name_that_is_not_a_case():
    with pytest.raises(ComputationError, match="not cases of Computation"):
        grammar.handlers({"refrence": lambda c: c})
    assert set(grammar.handlers({"reference": len})) <= set(grammar.CASES)


def test_case_names_what_is_missing():
    with pytest.raises(ComputationError, match="no computation case"):
        grammar.case(Computation())
