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
