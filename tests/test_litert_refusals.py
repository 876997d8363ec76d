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
    assert "gradient of a strided convolution" in text and "::s, ::s]" in text
    # an op the converter leaves is named as the StableHLO op it comes from
    assert refusals.refuse("x", ["mhlo.convolution", "tfl.conv_2d"]).ops == \
        ["stablehlo.convolution"]


DN = ("NHWC", "HWIO", "NHWC")
CONV_ARGS = (np.random.default_rng(1).normal(size=(3, 3, 2, 4)).astype(np.float32) * 0.3,
             np.random.default_rng(2).normal(size=(2, 2, 9, 9, 2)).astype(np.float32))


def test_a_refusal_in_a_cnns_client_part_names_the_users_line(empty_litert_cache):
    """A client part with a convolution's gradient (whose module XLA's CPU form rewrites)
    keeps its source lines: a sort there is refused at the user's line."""
    def client(k, x):
        conv = lambda k: jax.lax.conv_general_dilated(  # noqa: E731
            x, k, (2, 2), "SAME", dimension_numbers=DN)
        new = k - 0.1 * jax.grad(lambda k: jnp.mean(jnp.tanh(conv(k))))(k)
        return jnp.sort(new, axis=-1)  # the line the refusal names

    proto = fb.export_tff(_round(client), *CONV_ARGS, placements=("server", "clients"))
    with pytest.raises(refusals.ConversionRefused) as caught:
        convert.convert_round(round_split.split_of(proto), use_cache=False)
    text = str(caught.value)
    assert caught.value.ops == ["stablehlo.sort"], text
    assert f"(at {__file__}:{client.__code__.co_firstlineno + 4} (" in text, text
