"""`portable_fma`: a float32 `stablehlo.fma` rewritten into float64 ops gives XLA's
fused multiply-add bit for bit, and a module holding one serializes for StableHLO 0.9.0."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fax_bridge.runtime import hlo, portable_fma

_TEXT = """func.func @main(%a: tensor<4xTYPE>, %b: tensor<4xTYPE>, %c: tensor<4xTYPE>)
    -> tensor<4xTYPE> {
  %0 = stablehlo.fma %a, %b, %c : tensor<4xTYPE>
  return %0 : tensor<4xTYPE>
}"""
_PAIRS: dict = {}


def _pair(element: str):
    """(XLA's fma, the rewritten module), each compiled once."""
    if element not in _PAIRS:
        from jax._src.interpreters import mlir
        from jax._src.lib.mlir import ir

        with mlir.make_ir_context(), ir.Location.unknown():
            module = ir.Module.parse(_TEXT.replace("TYPE", element))
            original = mlir.module_to_bytecode(module)
            assert portable_fma.fma_as_float64(module, ir) == 1
            assert "stablehlo.fma" not in str(module)
            rewritten = mlir.module_to_bytecode(module)
        _PAIRS[element] = tuple(hlo.HloExecutable(b"", stablehlo=m)
                                for m in (original, rewritten))
    return _PAIRS[element]


floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
# products just off a float32 midpoint of the sum: where rounding twice (to float64,
# then to float32) would go wrong
near_one = st.integers(-64, 64).map(lambda k: np.float32(1 + k * 2.0 ** -23))


@settings(max_examples=80, deadline=None)
@given(st.lists(floats, min_size=4, max_size=4), st.lists(floats, min_size=4, max_size=4),
       st.lists(floats, min_size=4, max_size=4), st.lists(near_one, min_size=8, max_size=8),
       st.integers(-30, 2))
def test_a_rewritten_fma_gives_xla_s_bits(a, b, c, ones, scale):
    a, b, c = (np.array(x, np.float32) for x in (a, b, c))
    # half of the lanes: a near-one product scaled, added to -1 or 1
    a[2:] = np.array(ones[:2], np.float32) * np.float32(2.0 ** scale)
    b[2:], c[2:] = ones[2:4], np.array([1, -1], np.float32)
    args = [a, b, c]
    fused, rewritten = _pair("f32")
    (want,), (got,) = fused(args), rewritten(args)
    assert got.dtype == want.dtype
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), (args, got, want)


def test_a_module_with_fma_serializes_for_the_portable_target():
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    with mlir.make_ir_context(), ir.Location.unknown():
        module = mlir.module_to_bytecode(ir.Module.parse(_TEXT.replace("TYPE", "f32")))
    assert hlo.stablehlo_artifact(module, hlo.PORTABLE_TARGET)


@pytest.mark.parametrize("element", ["f64", "f16"])
def test_other_fmas_are_left_as_they_are(element):
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    with mlir.make_ir_context(), ir.Location.unknown():
        module = ir.Module.parse(_TEXT.replace("TYPE", element))
        assert portable_fma.fma_as_float64(module, ir) == 0



def test_a_sum_just_off_a_float32_midpoint_is_rounded_once():
    # 2^-24 (1 + 2^-23)(1 - 2^-23) + (1 + 2^-23) = 1 + 3 * 2^-24 - 2^-70: just under the
    # midpoint of 1 + 2^-23 and 1 + 2^-22, which float64 rounds onto (then to the even
    # 1 + 2^-22): the fused result is 1 + 2^-23, with either sign
    up, down = np.float32(1 + 2.0 ** -23), np.float32(1 - 2.0 ** -23)
    a = np.array([up, -up, up, up], np.float32) * np.float32(2.0 ** -12)
    b = np.array([down, down, -down, down], np.float32) * np.float32(2.0 ** -12)
    c = np.array([up, -up, -up, up], np.float32)
    fused, rewritten = _pair("f32")
    (want,), (got,) = fused([a, b, c]), rewritten([a, b, c])
    assert want[0] == up and want[1] == -up  # XLA's fma, rounded once
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
