"""Parity of the two paths on a real local fleet, and the parity / run commands."""

import dataclasses
import os
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypothesis import given, settings, strategies as st

import fax_bridge as fb
from fax_bridge import cli
from fax_bridge.errors import ArgumentError
from fax_bridge.parity.check import compare_leaves

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "examples", "quickstart.py")
TFF_DATA = os.path.join(ROOT, "tests", "data", "tff087")
N = 6


@fb.program(clients=N)
def loss_and_grad_round(w, x):
    def loss(w):
        per = fb.federated_map_clients(lambda a, b: jnp.mean((b @ a - 1.0) ** 2),
                                       (fb.federated_broadcast(w), x))
        return fb.federated_mean(per)
    value, g = jax.value_and_grad(loss)(w)
    return {"loss": value, "w": w - 0.5 * g}


@pytest.fixture(scope="module")
def fleet():
    with fb.LocalFleet(devices=2) as f:
        yield f


def test_parity_of_a_gradient_round_on_a_fleet(fleet):
    w = jnp.array([0.1, 0.2, -0.3])
    x = jnp.asarray(np.random.default_rng(0).normal(size=(N, 8, 3)), jnp.float32)
    report = fb.check_parity(loss_and_grad_round, w, x, placements=("server", "clients"),
                             fleet=fleet)
    assert report.ok, report.table()
    assert [leaf.path for leaf in report.leaves] == ["result['loss']", "result['w']"]
    assert all(leaf.max_abs < 1e-5 for leaf in report.leaves)
    assert "PARITY OK" in report.table()


@fb.program(clients=N)
def frozen_parameter_round(params, x):
    def client_delta(p, b):  # `frozen` never enters the loss: its delta is exactly zero
        g = jax.grad(lambda q: jnp.mean((b @ q["w"] - 1.0) ** 2))(p)
        return jax.tree_util.tree_map(lambda d: -0.5 * d, g)
    deltas = fb.federated_map_clients(client_delta, (fb.federated_broadcast(params), x))
    return jax.tree_util.tree_map(lambda v, d: v + d, params, fb.federated_mean(deltas))


def test_parity_with_a_parameter_whose_update_is_exactly_zero(fleet):
    params = {"w": jnp.array([0.1, 0.2, -0.3]), "frozen": jnp.array([-0.0, 2.0])}
    x = jnp.asarray(np.random.default_rng(1).normal(size=(N, 8, 3)), jnp.float32)
    report = fb.check_parity(frozen_parameter_round, params, x,
                             placements=("server", "clients"), fleet=fleet)
    assert report.ok, report.table()


def test_parity_of_the_quickstart_round(fleet):
    from fax_bridge.tff.cli import resolve_program

    prog, args, placements = resolve_program(f"{QUICKSTART}:fedavg_round", N)
    report = fb.check_parity(prog, *args, placements=placements, fleet=fleet)
    assert report.ok, report.table()


def test_mismatch_is_reported_per_leaf():
    leaves = compare_leaves({"a": np.ones(3), "b": np.zeros(2)},
                            {"a": np.ones(3), "b": np.array([0.0, 0.1])}, 1e-5, 1e-6)
    assert [leaf.ok for leaf in leaves] == [True, False]
    assert leaves[1].max_abs == pytest.approx(0.1)
    shape = compare_leaves(np.ones(3), np.ones(4), 1e-5, 1e-6)
    assert not shape[0].ok and "shape" in shape[0].note


def test_parity_command(capsys):
    code = cli.main(["parity", f"{QUICKSTART}:fedavg_round", "--clients", "4",
                     "--devices", "2"])
    out, err = capsys.readouterr()
    assert code == 0, out
    # long work shows progress on stderr: the shadow's compile and each of its runs
    assert "fax-bridge parity: float64 shadow: compiled a program in " in err, err
    assert "fax-bridge parity: float64 shadow: sample 4 of 4 (" in err, err
    assert "PARITY OK" in out and "result0['w']" in out
    lines = out.splitlines()
    assert lines[0].startswith("PARITY OK: ") and lines[1].startswith("worst leaf: ")
    at = next(i for i, line in enumerate(lines) if line.startswith("per round: "))
    per_round, once = lines[at:at + 2]
    assert per_round.startswith("per round: local jit ") and "fleet of 2 device(s)" in per_round
    assert once.startswith("once, not per round: jit's first call (compiling) ")
    assert "fleet start" in once and "the fleet's first round (compiling)" in once


def test_parity_times_a_warm_round_apart_from_compiling(fleet):
    """With warm_round=True (as `fax-bridge parity` asks) the fleet's time per round is
    a second round's: the proto runs twice, the first round (the devices compiling) and
    the jit's first call reported apart. Without it the proto runs once and no warm
    time is claimed."""
    calls = []

    class Counting:
        num_devices = fleet.num_devices

        def run(self, *args, **kwargs):
            calls.append(args[0])
            return fleet.run(*args, **kwargs)

    w = jnp.array([0.1, 0.2, -0.3])
    x = jnp.ones((N, 8, 3), jnp.float32)
    report = fb.check_parity(loss_and_grad_round, w, x, placements=("server", "clients"),
                             fleet=Counting(), warm_round=True)
    assert report.ok, report.table()
    assert len(calls) == 2 and calls[0] is calls[1]
    assert list(report.startup_s) == ["jit's first call (compiling)",
                                      "the fleet's first round (compiling)"]
    assert all(s > 0 for s in report.startup_s.values()) and report.fleet_s > 0
    assert "once, not per round: jit's first call (compiling)" in report.table()
    calls.clear()
    once = fb.check_parity(loss_and_grad_round, w, x, placements=("server", "clients"),
                           fleet=Counting())
    assert once.ok and len(calls) == 1 and once.fleet_s is None, once.table()
    assert list(once.startup_s) == list(report.startup_s)
    assert "fleet of 2 device(s) not timed warm" in next(
        line for line in once.table().splitlines() if line.startswith("per round: "))


@settings(max_examples=15, deadline=None)
@given(rounds=st.one_of(st.integers(max_value=0), st.booleans(),
                        st.floats(allow_nan=False), st.text(max_size=3)))
def test_a_flower_check_with_bad_arguments_is_refused_before_anything_starts(rounds):
    """Refused by name before a deployment starts: rounds that are not a whole number
    >= 1, rounds without flower=, flower= beside fleet=, a program that is not a round
    (state, client_data)."""
    w = jnp.zeros(3)
    x = jnp.ones((N, 8, 3))
    with pytest.raises(ArgumentError, match="rounds"):
        fb.check_parity(loss_and_grad_round, w, x, flower=True, rounds=rounds)
    with pytest.raises(ArgumentError, match="needs flower="):
        fb.check_parity(loss_and_grad_round, w, x, rounds=2)
    with pytest.raises(ArgumentError, match="not both"):
        fb.check_parity(loss_and_grad_round, w, x, fleet=object(), flower=True)
    with pytest.raises(ArgumentError, match="3 arguments"):
        fb.check_parity(loss_and_grad_round, w, x, x, flower=True)


def test_parity_command_with_flower_checks_on_a_deployment(monkeypatch, capsys):
    """`fax-bridge parity ... --flower --devices 3 --rounds 2` asks check_parity for a
    Flower deployment of 3 SuperNodes and 2 rounds, prints its table, and exits 1 when
    the result lacks the fleet plan's bits."""
    from fax_bridge.parity import check as parity
    from fax_bridge.parity.report import LeafParity, ParityReport

    asked = {}

    def fake(prog, *args, **kwargs):
        asked.update(kwargs)
        return ParityReport([LeafParity("result", (3,), "float32", 0.0, 0.0, True)],
                            0.0, 0.0, kwargs["devices"], 0.001, 1.0,
                            "sig", target="flower", fleet_bits=asked.get("bits", True))

    monkeypatch.setattr(parity, "check_parity", fake)
    argv = ["parity", f"{QUICKSTART}:fedavg_round", "--clients", "4", "--devices", "3",
            "--flower", "--rounds", "2"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert asked["flower"] is True and asked["devices"] == 3 and asked["rounds"] == 2
    assert asked["rtol"] is None and asked["atol"] is None  # the rounding bounds
    assert "Flower deployment of 3 SuperNode(s)" in out and "PARITY OK" in out
    asked["bits"] = False
    assert cli.main(argv) == 1
    assert "the same bits as the fleet's round plan: NO" in capsys.readouterr().out


def test_run_command_on_a_tff_written_computation(tmp_path, capsys):
    out = tmp_path / "out.npz"
    code = cli.main(["run", os.path.join(TFF_DATA, "zip_map_struct.pb"), "--inputs",
                     os.path.join(TFF_DATA, "zip_map_struct.inputs.npz"), "--devices", "2",
                     "--output", str(out)])
    assert code == 0, capsys.readouterr().err
    got = np.load(out)
    want = np.load(os.path.join(TFF_DATA, "zip_map_struct.expected.npz"))
    assert sorted(got.files) == sorted(want.files)
    for k in want.files:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6)


def test_run_command_errors_name_the_problem(tmp_path, capsys):
    bad = tmp_path / "in.npz"
    np.savez(bad, wrong=np.ones(3))
    code = cli.main(["run", os.path.join(TFF_DATA, "zip_map_struct.pb"), "--inputs",
                     str(bad)])
    assert code == 2
    assert "wrong" in capsys.readouterr().err


class _Pair(typing.NamedTuple):
    w: jax.Array
    b: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Params:
    w: jax.Array
    b: jax.Array


@fb.program(clients=N)
def _pytree_round(p, x):
    scaled = fb.federated_map_clients(
        lambda q, xx: jax.tree_util.tree_map(lambda a: a * jnp.mean(xx), q),
        (fb.federated_broadcast(p), x))
    return fb.federated_map_server(lambda a, m: jax.tree_util.tree_map(jnp.add, a, m),
                                   (p, fb.federated_mean(scaled)))


@pytest.mark.parametrize("kind", [_Pair, _Params])
def test_namedtuples_and_registered_dataclasses_pass_parity(fleet, kind):
    p = kind(jnp.array([1.0, -2.0]), jnp.float32(0.5))
    x = jnp.asarray(np.random.default_rng(1).normal(size=(N, 4)), jnp.float32)
    local = jax.jit(_pytree_round)(p, x)
    assert isinstance(local, kind)
    report = fb.check_parity(_pytree_round, p, x, placements=("server", "clients"),
                             fleet=fleet)
    assert report.ok, report.table()
    assert [leaf.path for leaf in report.leaves] == ["result.w", "result.b"]


@pytest.mark.parametrize("k", [2, "auto"])
def test_parity_of_a_chunked_program_checks_its_jit_in_chunks(fleet, monkeypatch, k):
    """check_parity traces the program whole for export, then runs the user's jit of
    the same object: that jit runs in its chunks (each chunk ticks the progress bar),
    and the report says which."""
    from fax_bridge.local import chunking

    chunks = []
    monkeypatch.setattr(chunking.Progress, "tick", lambda self, i: chunks.append(self.k))
    monkeypatch.setattr(chunking, "fitting_chunk", lambda program, args, kwargs, m=None: 2)
    program = fb.program(clients=N, clients_per_step=k, progress=True)(
        loss_and_grad_round.fn)
    w = jnp.array([0.1, 0.2, -0.3])
    x = jnp.linspace(-1.0, 1.0, N * 8 * 3, dtype=jnp.float32).reshape(N, 8, 3)
    for fn in (program, jax.jit(program)):  # the program, or the user's jit of it
        chunks.clear()
        report = fb.check_parity(fn, w, x, placements=("server", "clients"), fleet=fleet)
        assert report.ok, report.table()
        assert chunks and set(chunks) == {2}, chunks  # jit ran the clients 2 at a time
        assert report.chunking.startswith(f"in chunks of 2 (of {N} clients")
        assert ("'auto'" in report.chunking) == (k == "auto")
