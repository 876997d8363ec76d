"""local.chunk_size: "auto" measures the whole cohort first (one compile where it fits),
says each size it compiles and why it chose, and shows a bar for a program made with
progress=True."""

import logging

import jax.numpy as jnp
from hypothesis import given, settings, strategies as st

import fax_bridge as fb
from fax_bridge.local import chunk_size


def _federated_dot(n: int, progress: bool = False):
    return fb.program(clients=n, clients_per_step="auto", progress=progress)(
        lambda w, x: fb.federated_sum(
            fb.federated_map_clients(lambda w, x: w * x, (fb.federated_broadcast(w), x))))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 300), per_client=st.integers(1, 50), budget=st.integers(1, 20000))
def test_auto_picks_the_largest_power_of_two_or_the_cohort_that_fits(n, per_client,
                                                                     budget):
    """Memory grows with the chunk: the choice is the cohort where it fits (after one
    compile), else the largest power of two below it that fits, else 1."""
    compiled = []

    def sized(program, k, args, kwargs, gradient=False):
        compiled.append(k)
        return per_client * k

    original = chunk_size.round_bytes
    chunk_size.round_bytes = sized
    try:
        got = chunk_size.fitting_chunk(_federated_dot(n), (1.0, jnp.ones(n)), {}, budget)
    finally:
        chunk_size.round_bytes = original
    fitting = [k for k in [1 << i for i in range(12)] + [n]
               if k <= n and per_client * k <= budget]
    assert got == max(fitting, default=1)
    assert compiled[0] == n
    if per_client * n <= budget:
        assert compiled == [n]  # one compile where the whole cohort fits
    assert len(compiled) <= n.bit_length() + 1


def test_auto_says_each_size_it_compiles_and_why_it_chose(monkeypatch, caplog, capsys):
    monkeypatch.setattr(chunk_size, "round_bytes",
                        lambda program, k, args, kwargs, gradient=False: 1000 * k)
    program = _federated_dot(16, progress=True)
    with caplog.at_level(logging.INFO, logger="fax_bridge.local.chunk_size"):
        assert program.chunk_size(1.0, jnp.ones(16), memory_bytes=5000) == 4
    text = caplog.text
    assert "compiling the forward round at 16 of 16 clients a step" in text
    assert "16 clients a step need 16000 bytes: does not fit" in text
    assert "4 clients a step need 4000 bytes: fits" in text
    assert "4 of 16 clients a step (forward round: 4000 bytes of 5000 bytes; the largest " \
        "size tried that fits, of " in text
    assert "sizing clients_per_step='auto'" in capsys.readouterr().err  # the bar
