"""Every PlacementError and ProgramError names the user's line that placed or called
the offending operation (fax_bridge/errors.py), however the program was run."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fax_bridge as fb
from fax_bridge.errors import PlacementError, ProgramError, user_location

N = 3
S, X = jnp.float32(1.0), jnp.ones(N, jnp.float32)


def here() -> str:
    """`file:line` of the caller's line."""
    frame = inspect.currentframe().f_back
    return f"{__file__}:{frame.f_lineno}"


@fb.program(clients=N)
def sum_of_a_server_value(s, x):
    return fb.federated_sum(s), fb.federated_sum(x)
SUM_LINE = f"{__file__}:{sum_of_a_server_value.fn.__code__.co_firstlineno + 2}"


@fb.program(clients=N)
def client_value_at_the_server(s, x):
    doubled = fb.federated_map_clients(lambda v: 2 * v, x)
    return fb.federated_map_server(lambda v: v + 1, doubled)
SERVER_LINE = f"{__file__}:{client_value_at_the_server.fn.__code__.co_firstlineno + 3}"


@fb.program(clients=N)
def round_(s, x):
    return s + fb.federated_mean(x)


ARGS, PLACED = (S, X), ("server", "clients")


def run_eagerly(fn, *args):
    return fn(*args)


def run_jitted(fn, *args):
    return jax.jit(fn)(*args)


def run_traced(fn, *args):
    return fb.trace(fn, *args, placements=PLACED)


def run_exported(fn, *args):
    return fb.export_tff(fn, *args, placements=PLACED)


@pytest.mark.parametrize("run", [run_eagerly, run_jitted, run_traced, run_exported])
def test_a_server_value_given_to_a_sum_names_its_line(run):
    with pytest.raises(PlacementError, match=SUM_LINE):
        run(sum_of_a_server_value, *ARGS)


@pytest.mark.parametrize("run", [run_traced, run_exported])
def test_a_client_value_used_at_the_server_names_its_line(run):
    with pytest.raises(PlacementError, match=SERVER_LINE):
        run(client_value_at_the_server, *ARGS)


def test_a_program_traced_after_it_was_jitted_names_the_line():
    jax.block_until_ready(jax.jit(round_)(*ARGS))        # jitted and run: fine
    jax.jit(client_value_at_the_server).lower(*ARGS)     # lowered under jit: no analysis
    with pytest.raises(PlacementError, match=SERVER_LINE):
        fb.export_tff(client_value_at_the_server, *ARGS, placements=PLACED)
    with pytest.raises(PlacementError, match=SERVER_LINE):
        fb.trace(jax.jit(client_value_at_the_server), *ARGS, placements=PLACED)
    with pytest.raises(PlacementError) as caught:
        line = here(); fb.export_tff(round_, S, jnp.ones(N + 1), placements=PLACED)  # noqa: E702
    assert line in str(caught.value)


def test_a_program_called_with_the_wrong_structure_names_the_call():
    with pytest.raises(ProgramError) as caught:
        line = here(); fb.export_tff(round_, *ARGS, placements=("server",))  # noqa: E702
    assert line in str(caught.value)
    with pytest.raises(ProgramError) as caught:
        bad = ("server", {"a": "clients"})
        line = here(); fb.trace(round_, *ARGS, placements=bad)  # noqa: E702
    assert line in str(caught.value)
    with pytest.raises(PlacementError) as caught:
        line = here(); round_(S, jnp.ones((N + 1,)))  # noqa: E702
    assert "federated_mean" in str(caught.value)
    assert f"{__file__}:{round_.fn.__code__.co_firstlineno + 2}" in str(caught.value)


def test_a_program_declared_wrongly_names_the_declaration():
    with pytest.raises(ProgramError) as caught:
        line = here(); fb.program(clients=0)(lambda x: x)  # noqa: E702
    assert line in str(caught.value)
    with pytest.raises(ProgramError) as caught:
        line = here(); fb.program(round_, clients=N + 1)  # noqa: E702
    assert line in str(caught.value)


def test_the_line_is_named_once():
    with pytest.raises(PlacementError) as caught:
        run_traced(client_value_at_the_server, *ARGS)
    assert str(caught.value).count(SERVER_LINE) == 1
    line = here(); error = ProgramError("a message")  # noqa: E702
    assert str(error) == f"a message (at {line} (test_the_line_is_named_once))"
    assert error.location.startswith(line)
    assert user_location().startswith(here())


def test_errors_survive_pickling():
    import pickle

    error = pickle.loads(pickle.dumps(PlacementError("moved")))
    assert str(error).count(" (at ") == 1 and np.char.count(str(error), __file__) == 1
