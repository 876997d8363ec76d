"""Tests of fax_bridge.runtime.hlo_check: HloModuleProto structure checked before XLA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fax_bridge.errors import ComputationError, HloModuleError
from fax_bridge.runtime import hlo_check
from fax_bridge.v1 import hlo_module_pb2 as H

X = np.ones((3, 4), np.float32)


def _hlo(fn, *specs) -> bytes:
    return jax.jit(fn, keep_unused=True).lower(*specs).compiler_ir(
        "hlo").as_serialized_hlo_module_proto()


MODULES = {
    "tuple result": _hlo(lambda a, b: (a + b, (a * b, a)), X, X),
    "while": _hlo(lambda a: jax.lax.fori_loop(0, 3, lambda i, v: v * 2, a), X),
    "cond": _hlo(lambda a, p: jax.lax.cond(p, jnp.sin, jnp.cos, a), X, True),
    "sort and gather": _hlo(lambda a, i: jnp.sort(a, axis=0)[i], X, np.array([0, 2])),
    "grad": _hlo(jax.grad(lambda a: jnp.tanh(a @ a.T).sum()), X),
    "no parameters": _hlo(lambda: jnp.arange(3)),
    # elementwise ops each jax version writes as an XLA opcode of its own (jax 0.12:
    # cosh, sinh, exp2, log2, and fma in the normal sampler's polynomial)
    "elementwise": _hlo(lambda a, i: (
        jnp.cosh(a), jnp.sinh(a), jnp.exp2(a), jnp.log2(a), jax.lax.clz(i),
        jax.lax.population_count(i), jax.scipy.special.erfinv(a * 0.5),
        jax.random.normal(jax.random.key(0), a.shape), jnp.cbrt(a), jnp.tan(a)),
        X, np.arange(3, dtype=np.int32)),
}


def _parsed(name: str) -> H.Module:
    return H.Module.FromString(MODULES[name])


def _entry(module: H.Module) -> H.Computation:
    return next(c for c in module.computations if c.id == module.entry_computation_id)


def _root(comp: H.Computation) -> H.Instruction:
    return next(i for i in comp.instructions if i.id == comp.root_id)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_jax_exports_pass(name):
    assert hlo_check.check_module(MODULES[name]).computations


def test_bytes_that_are_no_module_are_refused_as_such():
    with pytest.raises(HloModuleError, match="not a serialized xla.HloModuleProto"):
        hlo_check.check_module(b"\xff\xff\xff")
    assert issubclass(HloModuleError, ComputationError)


def _refused(module: H.Module, match: str) -> None:
    with pytest.raises(HloModuleError, match=match) as info:
        hlo_check.check_module(module.SerializeToString())
    assert "refused before XLA read it" in str(info.value)
    assert "HloModuleProto `jit_" in str(info.value)  # names the module


def test_a_tuple_shape_longer_than_its_operands_is_refused():
    # Unchecked, XLA's import dies on these: SIGSEGV for the root's shape, a CHECK
    # failure (SIGABRT) for the host program shape.
    module = _parsed("tuple result")
    _root(_entry(module)).shape.tuple_shapes.add(element_type=11, dimensions=[3, 4])
    _refused(module, "tuple of 3 operands whose shape lists 4 elements")
    module = _parsed("tuple result")
    module.host_program_shape.result.tuple_shapes.add(element_type=11, dimensions=[3, 4])
    _refused(module, "host program shape's result is")


def _shapes(module: H.Module) -> list:
    out = []

    def add(shape):
        out.append(shape)
        for t in shape.tuple_shapes:
            add(t)

    for c in module.computations:
        for p in c.program_shape.parameters:
            add(p)
        add(c.program_shape.result)
        for i in c.instructions:
            add(i.shape)
    return out


_module_names = st.sampled_from(sorted(MODULES))


@settings(max_examples=40, deadline=None)
@given(_module_names, st.data())
def test_malformed_shapes_are_refused(name, data):
    module = _parsed(name)
    shapes = _shapes(module)
    shape = data.draw(st.sampled_from(shapes))
    fault = data.draw(st.sampled_from(["type", "negative", "array tuple", "dynamic"]))
    if fault == "type":
        shape.element_type = data.draw(st.sampled_from([0, 26, 27, 99, -3]))
        _refused(module, "which XLA does not define")
    elif fault == "negative":
        if shape.element_type == hlo_check.TUPLE:
            shape.element_type = 11
        shape.dimensions.append(data.draw(st.integers(-(1 << 62), -1)))
        _refused(module, "negative dimension|tuple elements")
    elif fault == "array tuple":
        shape.element_type = 11 if shape.element_type == hlo_check.TUPLE else 13
        shape.tuple_shapes.add(element_type=11) if shape.element_type == 11 else None
        shape.dimensions.append(2)
        _refused(module, "tuple elements|tuple with dimensions|a tuple with")
    else:
        if shape.element_type == hlo_check.TUPLE:
            return
        shape.is_dynamic_dimension.extend([False] * (len(shape.dimensions) + 1))
        _refused(module, "dynamic-dimension flags")


@settings(max_examples=30, deadline=None)
@given(_module_names, st.data())
def test_layouts_that_are_no_permutation_of_the_dimensions_are_refused(name, data):
    module = _parsed(name)
    arrays = [s for s in _shapes(module) if s.dimensions]
    shape = data.draw(st.sampled_from(arrays))
    rank = len(shape.dimensions)
    order = data.draw(st.lists(st.integers(-2, rank + 1), min_size=1, max_size=rank + 2)
                      .filter(lambda o: sorted(o) != list(range(rank))))
    shape.layout.ClearField("minor_to_major")
    shape.layout.minor_to_major.extend(order)
    _refused(module, "is not a permutation")
    del shape.layout.minor_to_major[:]
    shape.layout.tiles.add(dimensions=[8])
    _refused(module, "tiles")


@settings(max_examples=40, deadline=None)
@given(_module_names, st.data())
def test_dangling_ids_are_refused(name, data):
    module = _parsed(name)
    comp = data.draw(st.sampled_from(list(module.computations)))
    ids = {i.id for i in comp.instructions}
    fault = data.draw(st.sampled_from(["operand", "root", "entry", "called", "order"]))
    stranger = data.draw(st.integers(-5, 1 << 40).filter(lambda i: i not in ids))
    if fault == "operand":
        ins = data.draw(st.sampled_from(list(comp.instructions)))
        ins.operand_ids.append(stranger)
        _refused(module, "no earlier instruction of its computation")
    elif fault == "root":
        comp.root_id = stranger
        _refused(module, "names root id")
    elif fault == "entry":
        module.entry_computation_id = data.draw(st.integers(-5, 1 << 40).filter(
            lambda i: i not in {c.id for c in module.computations}))
        _refused(module, "entry computation id")
    elif fault == "called":
        ins = data.draw(st.sampled_from(list(comp.instructions)))
        ins.called_computation_ids.append(comp.id)  # itself, or a later computation
        _refused(module, "calls computations")
    else:
        users = [i for i in comp.instructions if i.operand_ids]
        if not users:
            return
        user = data.draw(st.sampled_from(users))
        user.operand_ids[0] = user.id  # an operand defined no earlier than its user
        _refused(module, "no earlier instruction")


def test_parameter_numbers_must_be_0_to_n_minus_1_and_match_the_signature():
    module = _parsed("tuple result")
    params = [i for i in _entry(module).instructions if i.opcode == "parameter"]
    params[1].parameter_number = 0
    _refused(module, "is parameter 0 a second time")
    params[1].parameter_number = 2
    _refused(module, r"numbers its parameters \[0, 2\]")
    module = _parsed("tuple result")
    _entry(module).program_shape.parameters.add(element_type=11, dimensions=[3, 4])
    _refused(module, "program shape names 2 parameters but has 3")
    _entry(module).program_shape.parameter_names.append("p2")
    _refused(module, "program shape has 3 parameters, its instructions 2")
    module = _parsed("tuple result")
    module.host_program_shape.parameters[0].dimensions[0] = 5
    _refused(module, r"host program shape's parameter 0 is f32\[5, 4\]")


def test_opcodes_operand_counts_and_tuple_indices_are_checked():
    module = _parsed("tuple result")
    add = next(i for i in _entry(module).instructions if i.opcode == "add")
    add.opcode = "add-with-carry"
    _refused(module, "opcode `add-with-carry`, which XLA does not define")
    add.opcode = "add"
    del add.operand_ids[1]
    _refused(module, "is a `add` with 1 operands, not 2")
    module = _parsed("while")
    gte = next(i for c in module.computations for i in c.instructions
               if i.opcode == "get-tuple-element")
    gte.tuple_index = 7
    _refused(module, "takes element 7 of a tuple of")
