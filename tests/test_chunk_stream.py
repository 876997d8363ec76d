"""Clients fed chunk by chunk from the host (`fb.stream_clients`): the streamed round
computes the round with its data in memory, chunked the same way, to the bit; it
compiles once per shapes; the fetch function is asked for each chunk once and every
answer is checked alike; misuse is refused naming the fix."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fax_bridge as fb
from fax_bridge.data import ClientStore, write_population
from fax_bridge.errors import ArgumentError


def _round(n, k):
    @fb.program(clients=n, clients_per_step=k)
    def fedavg(w, data):
        def local(w, d):
            g = jax.grad(lambda w: jnp.mean((d["x"] @ w - d["y"]) ** 2))(w)
            return w - 0.1 * g, jnp.float32(d["y"].shape[0])
        new_w, count = fb.federated_map_clients(local, (fb.federated_broadcast(w), data))
        return fb.federated_weighted_mean(new_w, count), fb.federated_sum(count), new_w
    return fedavg


def test_a_streamed_round_computes_the_round_in_memory(tmp_path):
    n, k = 11, 4
    rng = np.random.default_rng(0)
    clients = [{"x": rng.normal(size=(6, 3)).astype(np.float32),
                "y": rng.normal(size=(6,)).astype(np.float32)} for _ in range(n)]
    write_population(str(tmp_path / "pop"), clients)
    asked = []
    with ClientStore(str(tmp_path / "pop")) as store:
        def fetch(ids):
            asked.append([int(i) for i in ids])
            return store.cohort(ids).data

        w = jnp.array([0.3, -0.2, 0.5])
        streamed = fb.stream_clients(_round(n, k), 1)(w, fetch)
    in_memory = jax.jit(_round(n, k))(w, {key: np.stack([c[key] for c in clients])
                                          for key in ("x", "y")})
    for a, b in zip(streamed, in_memory):  # the same chunks, program and sums: same bits
        np.testing.assert_array_equal(a, b)
    chunks = asked[1:]  # the first call reads client 0 for the data's structure
    assert sorted(i for ids in chunks for i in ids) == list(range(n))
    assert chunks[0] == [0, 2, 4, 6] and chunks[-1] == [8, 9, 10]  # strided, then the tail


def test_a_fetch_of_another_structure_or_shape_is_refused():
    data = np.arange(8.0, dtype=np.float32)

    def fetch(ids):
        return data[ids] if len(ids) == 1 else data[ids][:, None]

    run = fb.stream_clients(_sum_program(), 1)
    with pytest.raises(ArgumentError, match="one row a client"):
        run(jnp.float32(1.0), fetch)


def _sum_program():
    @fb.program(clients=8, clients_per_step=4)
    def total(w, x):
        return fb.federated_sum(fb.federated_map_clients(lambda w, x: w * x,
                                                         (fb.federated_broadcast(w), x)))
    return total


def test_misuse_is_refused_naming_the_fix():
    data = np.arange(8.0, dtype=np.float32)
    with pytest.raises(ArgumentError, match="integer clients_per_step"):
        fb.stream_clients(fb.program(clients=8)(lambda w, x: x), 1)(1.0, lambda i: data[i])
    with pytest.raises(ArgumentError, match="must be a function"):
        fb.stream_clients(_sum_program(), 1)(jnp.float32(1.0), data)

    @fb.program(clients=8, clients_per_step=4)
    def reads_it_at_the_server(w, x):
        return fb.federated_sum(x) + jnp.sum(x)

    with pytest.raises(ArgumentError, match="outside client work"):
        fb.stream_clients(reads_it_at_the_server, 1)(jnp.float32(1.0), lambda i: data[i])


def _compiles(fn) -> int:
    """How many XLA compiles `fn()` ran."""
    seen = []

    def listen(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        fn()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return len(seen)


def test_a_streamed_round_compiles_once_per_shapes():
    data = np.arange(8.0, dtype=np.float32)
    program = _sum_program()
    assert _compiles(lambda: fb.stream_clients(program, 1)(jnp.float32(1.0),
                                                          lambda i: data[i])) > 0
    again = fb.stream_clients(program, 1)  # a new wrapper of the same program: its cache
    assert _compiles(lambda: again(jnp.float32(2.0), lambda i: 2 * data[i])) == 0
    assert float(again(jnp.float32(2.0), lambda i: 2 * data[i])) == 2 * 2 * data.sum()


def test_a_chunk_size_above_the_cohort_streams_one_chunk():
    n = 5
    data = {"x": np.arange(n * 18, dtype=np.float32).reshape(n, 6, 3) / 100,
            "y": np.ones((n, 6), np.float32)}
    asked = []

    def fetch(ids):
        asked.append(len(ids))
        return {key: v[ids] for key, v in data.items()}

    w = jnp.array([0.3, -0.2, 0.5])
    streamed = fb.stream_clients(_round(n, 8), 1)(w, fetch)
    in_memory = jax.jit(_round(n, 8))(w, data)
    for a, b in zip(streamed, in_memory):  # new_w, a CLIENTS value, too
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert asked == [1, n]


BAD_ANSWERS = {  # what fetch(ids) gives, and what the refusal says
    "objects": (lambda n: np.array([object()] * n), "is object, not an array of numbers"),
    "strings": (lambda n: np.array(["a"] * n), "is <U1, not an array of numbers"),
    "none": (lambda n: None, "gave no arrays|one structure"),
}


@pytest.mark.parametrize("bad", sorted(BAD_ANSWERS))
@pytest.mark.parametrize("first", [True, False])
def test_every_fetch_answer_is_checked_alike(bad, first):
    data = np.arange(8.0, dtype=np.float32)
    answer, says = BAD_ANSWERS[bad]

    def fetch(ids):  # the first answer (client 0 alone), or a later chunk's
        return answer(len(ids)) if first == (len(ids) == 1) else data[ids]

    with pytest.raises(ArgumentError, match=r"fetch\(ids\)") as refused:
        fb.stream_clients(_sum_program(), 1)(jnp.float32(1.0), fetch)
    assert re.search(says, str(refused.value)), str(refused.value)


class _ReusedBuffer:
    """A fetch that fills one preallocated buffer per call and returns it (or a view of it,
    or a dict of such buffers): each answer is overwritten by the next call."""

    def __init__(self, data: np.ndarray, k: int, kind: str):
        self.data, self.kind = data, kind
        self.buffer = np.empty((k + 1,) + data.shape[1:], data.dtype)

    def __call__(self, ids):
        rows = self.buffer[:len(ids)] if self.kind == "view" else np.empty(0)
        if self.kind != "view":
            if len(self.buffer) != len(ids):
                self.buffer = np.empty((len(ids),) + self.data.shape[1:], self.data.dtype)
            rows = self.buffer
        rows[...] = self.data[ids]
        return {"x": rows} if self.kind == "dict" else rows


@settings(max_examples=8, deadline=None)
@given(n=st.integers(2, 24), k=st.integers(1, 6),
       kind=st.sampled_from(["same array", "view", "dict"]))
def test_a_fetch_that_reuses_its_buffer_streams_every_client_s_own_rows(n, k, kind):
    data = (1000.0 * np.arange(n)[:, None] + np.arange(3)).astype(np.float32)

    @fb.program(clients=n, clients_per_step=k)
    def rows(w, x):
        x = x["x"] if kind == "dict" else x
        mapped = fb.federated_map_clients(lambda w, x: w * x, (fb.federated_broadcast(w), x))
        return fb.federated_sum(mapped), mapped

    total, each = fb.stream_clients(rows, 1)(jnp.float32(1.0), _ReusedBuffer(data, k, kind))
    np.testing.assert_array_equal(np.asarray(each), data)  # every client its own rows
    np.testing.assert_array_equal(np.asarray(total), data.sum(axis=0))
