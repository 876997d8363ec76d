"""What LiteRT refuses is what its table says: `lax.top_k` runs where its indices are
used (LiteRT's TOPK_V2) and is refused where only its values are (the converter makes
them a sort), naming the user's line and the rewrite that runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fax_bridge as fb
from fax_bridge.in_process import run_computation
from fax_bridge.litert import convert, refusals
from fax_bridge.rounds import round_split


def _round(client):
    @fb.program(clients=2)
    def one_round(w, x):
        return fb.federated_mean(fb.federated_map_clients(
            client, (fb.federated_broadcast(w), x)))

    return one_round


ARGS = (np.float32(1.5), np.random.default_rng(0).normal(size=(2, 3, 5)).astype(np.float32))


def test_top_k_values_alone_are_refused_naming_the_line_and_the_rewrite(empty_litert_cache):
    client = lambda p, x: jax.lax.top_k(x * p, 2)[0]  # noqa: E731 - its line is named
    proto = fb.export_tff(_round(client), *ARGS, placements=("server", "clients"))
    with pytest.raises(refusals.ConversionRefused) as caught:
        convert.convert_round(round_split.split_of(proto), use_cache=False)
    text = str(caught.value)
    assert "stablehlo.sort" in caught.value.ops and "lax.top_k when only its values" in text
    assert f"(at {__file__}:{client.__code__.co_firstlineno} (" in text, text
    assert "jnp.take_along_axis(x, lax.top_k(x, k)[1], axis=-1)" in text


def test_the_rewrite_the_refusal_names_runs_in_litert_as_jit_does(empty_litert_cache):
    def client(p, x):
        y = x * p
        return jnp.take_along_axis(y, jax.lax.top_k(y, 2)[1], axis=-1)

    program = _round(client)
    proto = fb.export_tff(program, *ARGS, placements=("server", "clients"))
    got = run_computation(proto, *ARGS, client_runtime="litert")
    assert "TOPK_V2" in convert.convert_round(round_split.split_of(proto)).operators
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(program)(*ARGS)),
                               rtol=0, atol=1e-6)


# the interpreter's message for the gradient of a stride-2 "SAME" convolution inside a
# scan, before the converter's TRANSPOSE_CONV was given a padding it computes right
_KERNEL_FAILED = ("tflite/kernels/transpose_conv.cc:315 computed_input_height != "
                  "SizeOfDimension(input, 1) (6 != 7)Node number 79 (TRANSPOSE_CONV) failed "
                  "to prepare.Node number 1 (WHILE) failed to prepare.Node number 0 (WHILE) "
                  "failed to prepare.")


def test_no_litert_builtin_is_called_missing_and_a_failed_kernel_is_named_alone():
    from ai_edge_litert import schema_py_generated as schema

    for name in (k for k in vars(schema.BuiltinOperator) if not k.startswith("_")):
        for spelling in (name, "tfl." + name.lower()):
            text = refusals.describe(spelling)
            assert "no LiteRT builtin" not in text and "does not write as" not in text, text
            assert refusals.builtin(spelling) == name
    assert refusals.failed_node(_KERNEL_FAILED) == ["TRANSPOSE_CONV"]  # not the loops
    text = str(refusals.refuse("the LiteRT interpreter refuses",
                               refusals.failed_node(_KERNEL_FAILED), _KERNEL_FAILED))
    assert "TRANSPOSE_CONV, a LiteRT builtin" in text and "WHILE" not in text.split("\n")[0]
    assert "gradient of a strided convolution" in text and "feature_group_count=1" in text
    # an op the converter leaves is named as the StableHLO op it comes from
    assert refusals.refuse("x", ["mhlo.convolution", "tfl.conv_2d"]).ops == \
        ["stablehlo.convolution"]


DN = ("NHWC", "HWIO", "NHWC")
CONV_ARGS = (np.random.default_rng(1).normal(size=(3, 3, 1, 4)).astype(np.float32) * 0.3,
             np.random.default_rng(2).normal(size=(2, 2, 6, 6, 4)).astype(np.float32))


def _conv_round(conv):
    def client(k, x):
        return k - 0.1 * jax.grad(lambda k: jnp.mean(jnp.tanh(conv(x, k))))(k)

    return _round(client)


def test_a_depthwise_kernel_gradient_is_refused_at_the_users_line_with_a_rewrite(
        empty_litert_cache):
    depthwise = lambda x, k: jax.lax.conv_general_dilated(  # noqa: E731 - its line is named
        x, k, (1, 1), "SAME", dimension_numbers=DN, feature_group_count=4)
    proto = fb.export_tff(_conv_round(depthwise), *CONV_ARGS, placements=("server", "clients"))
    with pytest.raises(refusals.ConversionRefused) as caught:
        convert.convert_round(round_split.split_of(proto), use_cache=False)
    text = str(caught.value)
    assert caught.value.ops == ["tfl.conv_2d"], text  # the converter's op, a builtin
    assert f"(at {__file__}:{depthwise.__code__.co_firstlineno} (" in text, text
    assert "jnp.eye(channels)" in text and "unsigned" not in text, text


def test_the_depthwise_rewrite_the_refusal_names_runs_in_litert_as_jit_does(
        empty_litert_cache):
    def masked(x, k):  # a full convolution whose kernel keeps each channel to its own
        full = k * jnp.eye(k.shape[-1], dtype=k.dtype)[None, None]
        return jax.lax.conv_general_dilated(x, full, (1, 1), "SAME", dimension_numbers=DN)

    depthwise = lambda x, k: jax.lax.conv_general_dilated(  # noqa: E731
        x, k, (1, 1), "SAME", dimension_numbers=DN, feature_group_count=4)
    program = _conv_round(masked)
    proto = fb.export_tff(program, *CONV_ARGS, placements=("server", "clients"))
    got = run_computation(proto, *CONV_ARGS, client_runtime="litert")
    want = jax.jit(_conv_round(depthwise))(*CONV_ARGS)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)
