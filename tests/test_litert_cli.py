"""`fax-bridge litert`: the quickstart round's client part written as a LiteRT model with
its manifest, example client and a check that passes; a program with no single client
part is refused with the reason."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np

from fax_bridge import cli
from fax_bridge.system import output_folders

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "examples", "quickstart.py")


def test_litert_writes_the_model_manifest_example_and_a_passing_check(tmp_path, capsys):
    out = tmp_path / "litert"
    assert cli.main(["litert", f"{QUICKSTART}:fedavg_round", "--clients", "3", "-o",
                     str(out), "--no-check"]) == 0
    assert "client_update.tflite" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"]["signature"] == "client_update"
    assert manifest["model"]["bytes"] == (out / "client_update.tflite").stat().st_size
    assert not [op for op in manifest["model"]["operators"] if op.startswith("CUSTOM")]
    assert [t["name"] for t in manifest["inputs"]] == [
        "broadcast/params/b", "broadcast/params/w", "client/data/x", "client/data/y"]
    assert [t["name"] for t in manifest["outputs"]] == [
        "aggregate/0/value/b", "aggregate/0/value/w", "aggregate/0/weight",
        "aggregate/1/value"]
    assert {(t["kind"], t["role"]) for t in manifest["outputs"]} == {
        ("weighted_mean", "value"), ("weighted_mean", "weight"), ("mean", "value")}
    example = np.load(out / "example_client.npz")
    for t in manifest["inputs"] + manifest["outputs"]:
        assert tuple(example[t["name"]].shape) == tuple(t["shape"])
    for t in manifest["outputs"]:  # twice a bound under 1e-4 of the client's values
        top = np.float32(np.abs(example[t["name"]]).max())
        assert 0 <= t["bound"] <= 2 * (1e-4 * top + np.spacing(top)), (t, top)
    # each output's bound, element by element, is twice the rounding analysis's
    from fax_bridge.parity import rounding as parity_rounding
    from fax_bridge.language import tracing
    from fax_bridge.tff.cli import resolve_program

    prog, args, placements = resolve_program(f"{QUICKSTART}:fedavg_round", 3)
    recorded = parity_rounding.aggregand_bounds(
        tracing.trace(prog, *args, placements=placements), args)
    analysis = [2 * errs[0][0] for _, errs in recorded] + [2 * recorded[0][1][1][0]]
    by_name = dict(zip(["aggregate/0/value/b", "aggregate/0/value/w", "aggregate/1/value",
                        "aggregate/0/weight"], analysis))
    for t in manifest["outputs"]:
        bound = example[f"bound/{t['name']}"]
        assert np.array_equal(bound, by_name[t["name"]]), t["name"]
        assert t["bound"] == float(np.max(bound, initial=0.0))
    check = subprocess.run([sys.executable, str(out / "check.py")], capture_output=True,
                           text=True, timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "CHECK OK" in check.stdout
    for t in manifest["outputs"]:  # each output: its difference and its bound
        assert re.search(re.escape(t["name"]) + r"\s+max \|LiteRT - jit\| \S+  bound there "
                         r"\S+  largest bound \S+  ok", check.stdout), check.stdout
    # written again: its own files replaced; a file of the user's in the way refused
    (out / "notes.txt").write_text("mine")
    (out / output_folders.RECORD).write_text('{"format": 1, "written": {"litert": '
                                             '["manifest.json"]}}')
    assert cli.main(["litert", f"{QUICKSTART}:fedavg_round", "--clients", "3", "-o",
                     str(out), "--no-check"]) == 2
    assert f"would replace '{out / 'check.py'}'" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "mine"


def test_litert_refuses_a_program_without_one_client_part(tmp_path, capsys):
    path = tmp_path / "two_trips.py"
    path.write_text(
        "import numpy as np\nimport fax_bridge as fb\n\n"
        "def two_trips(params, x):\n"
        "    m = fb.federated_mean(fb.federated_map_clients(lambda p, x: p * x,\n"
        "        (fb.federated_broadcast(params), x)))\n"
        "    return fb.federated_sum(fb.federated_map_clients(lambda m, x: m + x,\n"
        "        (fb.federated_broadcast(m), x)))\n\n"
        "def example_args(clients):\n"
        "    return (np.ones(2, np.float32), np.ones((clients, 2), np.float32)), "
        "('server', 'clients')\n")
    assert cli.main(["litert", f"{path}:two_trips", "--clients", "2", "-o",
                     str(tmp_path / "out")]) == 2
    assert "no single client part" in capsys.readouterr().err


DECLARED = '''
import numpy as np
import fax_bridge as fb


@fb.program(clients=3)
def declared(w, x):
    return fb.federated_mean(fb.federated_map_clients(lambda w, x: w * x,
                                                      (fb.federated_broadcast(w), x)))


def plain(w, x):
    return declared.fn(w, x)


def example_args(clients):
    return (np.ones(2, np.float32), np.ones((clients, 2), np.float32)), ("server", "clients")
'''


def test_litert_takes_the_clients_a_program_declares(tmp_path, capsys):
    """`--clients` may be left out for `@fb.program(clients=N)` (the program's N, as for
    `fax-bridge export`); a plain function still needs it, and a different N is refused."""
    path = tmp_path / "declared.py"
    path.write_text(DECLARED)
    out = tmp_path / "out"
    assert cli.main(["litert", f"{path}:declared", "-o", str(out), "--no-check"]) == 0
    capsys.readouterr()
    assert np.load(out / "example_client.npz")["broadcast/w"].shape == (2,)
    assert json.loads((out / "manifest.json").read_text())["model"]["bytes"] > 0
    assert cli.main(["litert", f"{path}:plain", "-o", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert "is a plain function" in err and "give --clients N" in err
    assert cli.main(["litert", f"{path}:declared", "--clients", "4", "-o",
                     str(tmp_path / "o3")]) == 2
    assert "clients=3, but --clients 4" in capsys.readouterr().err


def test_litert_refuses_a_file_in_the_way_before_converting(tmp_path, capsys,
                                                            monkeypatch):
    import fax_bridge as fb
    from fax_bridge.litert import manifest

    def never(*args, **kwargs):
        raise AssertionError("the round was exported or converted before the folder "
                             "was checked")

    monkeypatch.setattr(fb, "export_tff", never)
    monkeypatch.setattr(manifest, "convert_named", never)
    out = tmp_path / "out"
    out.mkdir()
    (out / "check.py").write_text("mine")
    assert cli.main(["litert", f"{QUICKSTART}:fedavg_round", "--clients", "3", "-o",
                     str(out)]) == 2
    err = capsys.readouterr().err
    assert f"would replace '{out}{os.sep}check.py'" in err and "--force" in err, err
    assert (out / "check.py").read_text() == "mine" and os.listdir(out) == ["check.py"]


def test_litert_converts_the_client_part_once(tmp_path, monkeypatch):
    # The check before writing and the named model written are one conversion: a model
    # whose tensors are named by pytree path, checked (refused naming the op) as it is made.
    from fax_bridge.litert import convert, model_cache

    monkeypatch.setattr(model_cache, "read", lambda *a, **k: model_cache.Lookup(None))
    monkeypatch.setattr(convert, "_MADE", {})
    made = []
    real = convert.stablehlo_to_tflite
    monkeypatch.setattr(convert, "stablehlo_to_tflite",
                        lambda *a, **k: made.append(a[1:]) or real(*a, **k))
    assert cli.main(["litert", f"{QUICKSTART}:fedavg_round", "--clients", "3", "-o",
                     str(tmp_path / "m"), "--no-check"]) == 0
    assert len(made) == 1, made
