"""Client runtimes chosen once: a name parsed in one place, a LiteRT runtime that runs or
refuses by name, every entry point agreeing on which rounds convert (secure sums
included), and a fleet refusing an answer its devices computed with another runtime."""

from __future__ import annotations

import numpy as np
import pytest

import fax_bridge as fb
from fax_bridge import cli, in_process
from fax_bridge.errors import ArgumentError, FleetError
from fax_bridge.fleet.config import FleetConfig
from fax_bridge.fleet.launcher import LocalFleet
from fax_bridge.litert import runner
from fax_bridge.litert.runner import LiteRTClientRuntime
from fax_bridge.parity.check import check_parity
from fax_bridge.rounds import client_runtime as runtimes
from fax_bridge.rounds import round_split
from fax_bridge.runtime import interpreter, values

N = 4
# The programs, as `fax-bridge litert` loads them from a file, and as the tests use them.
SOURCE = f"""
import jax.numpy as jnp
import numpy as np
import fax_bridge as fb

N = {N}


def secure_round(p, x):
    codes = fb.federated_map_clients(lambda p, x: (jnp.sum(x) * p).astype(jnp.int32) % 7,
                                     (fb.federated_broadcast(p), x))
    mean = fb.federated_mean(fb.federated_map_clients(lambda p, x: p * x,
                                                      (fb.federated_broadcast(p), x)))
    return mean, fb.federated_secure_sum_bitwidth(codes, 8)


def two_trips(p, x):
    m = fb.federated_mean(fb.federated_map_clients(lambda p, x: p * x,
                                                   (fb.federated_broadcast(p), x)))
    return fb.federated_sum(fb.federated_map_clients(lambda m, x: m + x,
                                                     (fb.federated_broadcast(m), x)))


def example_args(clients):
    return (np.float32(1.5), np.arange(clients * 3, dtype=np.float32).reshape(clients, 3)), \\
        ("server", "clients")
"""
_NAMES: dict = {}
exec(compile(SOURCE, "programs", "exec"), _NAMES)
secure_round = fb.program(clients=N)(_NAMES["secure_round"])
two_trips = fb.program(clients=N)(_NAMES["two_trips"])


def _args():
    return _NAMES["example_args"](N)[0]


PLACE = ("server", "clients")


def test_a_name_is_parsed_once_into_a_runtime():
    assert runtimes.resolve("xla") == runtimes.resolve(None) == runtimes.XlaClientRuntime()
    litert = runtimes.resolve("litert", models_dir="/m")
    assert litert == LiteRTClientRuntime(models_dir="/m") and litert.name == "litert"
    assert litert.device_args() == ["--client-runtime", "litert", "--litert-models", "/m"]
    assert runtimes.resolve(litert) is litert
    assert FleetConfig(client_runtime="litert").client_runtime == LiteRTClientRuntime()
    with pytest.raises(ArgumentError, match="'tflite': expected one of"):
        runtimes.resolve("tflite")
    with pytest.raises(ArgumentError, match="got int"):
        FleetConfig(client_runtime=3)
    with pytest.raises(ArgumentError, match="models directory"):
        runtimes.resolve("xla", models_dir="/m")


def _models_ran(proto, run) -> dict:
    """{local of each client map that computes: (trip, clients LiteRT ran it on)} while
    `run()` runs."""
    maps = [m for m in round_split.client_maps(proto) if m.computes]
    before = runner.loaded()
    run()
    after = runner.loaded()
    return {m.local: (m.trip, after.get(m.key, 0) - before.get(m.key, 0)) for m in maps}


def test_a_round_of_two_trips_runs_one_litert_model_per_trip_everywhere(tmp_path, capsys):
    args = _args()
    proto = fb.export_tff(two_trips, *args, placements=PLACE)
    assert round_split.split_of(proto) is None
    assert "two trips" in round_split.why_not_split(proto)
    LiteRTClientRuntime().check_round(proto, None)  # each trip's model, made up front
    found: dict = {}
    ran = _models_ran(proto, lambda: found.setdefault("alone", in_process.run_computation(
        proto, *args, client_runtime="litert")))
    assert sorted(ran.values()) == [(1, N), (2, N)]  # one model per trip, every client
    with LocalFleet(devices=2, client_runtime="litert") as fleet:
        got = fleet.run(proto, *args)  # every device's Map answered "litert"
        report = check_parity(two_trips, *args, placements=PLACE, fleet=fleet,
                              client_runtime="litert")
    assert [np.asarray(x).tobytes() for x in jax_leaves(got)] == \
        [np.asarray(x).tobytes() for x in jax_leaves(found["alone"])]
    assert report.ok, report.table()
    path = tmp_path / "prog.py"
    path.write_text(SOURCE)
    assert cli.main(["litert", f"{path}:two_trips", "--clients", str(N), "-o",
                     str(tmp_path / "out"), "--no-check"]) == 2
    assert "two trips" in capsys.readouterr().err  # one model per file: refused by name


def test_a_secure_sum_round_converts_and_runs_in_litert_on_every_path(tmp_path, capsys):
    args = _args()
    proto = fb.export_tff(secure_round, *args, placements=PLACE)
    split = round_split.split_of(proto)
    assert [a.kind for a in split.aggregations] == ["mean", "secure_sum_bitwidth"]
    assert split.client_part_hash == round_split.split_round(proto, secure=True) \
        .client_part_hash  # the split Flower's apps carry
    prepared = interpreter.prepare(proto)
    arg = values.bind_arguments(prepared.parameter, args, {}).runtime_value()
    before = runner.loaded().get(split.client_part_hash, 0)
    alone = in_process.run_in_process(split, arg, client_runtime="litert")
    assert runner.loaded()[split.client_part_hash] == before + N  # LiteRT ran each client

    def bits(result):
        return [np.asarray(x).tobytes() for x in jax_leaves(result)]

    with LocalFleet(devices=2, client_runtime="litert") as fleet:
        got = fleet.run(proto, *args)  # every device answered "litert", or it is refused
        report = check_parity(secure_round, *args, placements=PLACE, fleet=fleet,
                              client_runtime="litert")
    assert bits(got) == bits(values.to_pytree(alone, prepared.result, prepared.structure))
    assert report.ok and "running client parts in litert" in report.table()
    path = tmp_path / "prog.py"
    path.write_text(SOURCE)
    assert cli.main(["litert", f"{path}:secure_round", "--clients", str(N), "-o",
                     str(tmp_path / "out"), "--no-check"]) == 0
    assert "client_update.tflite" in capsys.readouterr().out


def jax_leaves(tree) -> list:
    import jax

    return jax.tree_util.tree_leaves(tree)


class _NamedLiteRTButStartsXla:
    """A runtime that says "litert" but starts its devices as XLA ones."""

    name = "litert"

    def check_round(self, proto, split):
        del proto, split

    def client_partials(self, *a, **k):
        raise AssertionError("runs on the devices")

    def map_clients(self, *a, **k):
        raise AssertionError("runs on the devices")

    def carrying(self, models_dir):
        return self

    def device_args(self) -> list:
        return []


def test_a_fleet_refuses_answers_its_devices_computed_with_another_runtime():
    args = _args()
    proto = fb.export_tff(secure_round, *args, placements=PLACE)
    with LocalFleet(devices=1, client_runtime=_NamedLiteRTButStartsXla(),
                    survive_device_loss=False) as fleet:
        with pytest.raises(FleetError, match="client runtime 'xla', but this fleet runs "
                                             "client parts with 'litert'"):
            fleet.run(proto, *args)
        with pytest.raises(FleetError, match="client map with client runtime 'xla', but "
                                             "this fleet runs client work with 'litert'"):
            fleet.run(fb.export_tff(two_trips, *args, placements=PLACE), *args)


def test_check_parity_refuses_litert_on_flower():
    with pytest.raises(ArgumentError, match="SuperNodes run XLA here"):
        check_parity(secure_round, *_args(), placements=PLACE, flower=True,
                     client_runtime="litert")
