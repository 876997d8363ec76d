"""The `fax-bridge` command line: export prints the TFF signature and the tree."""

import os
import subprocess
import sys

from fax_bridge import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "examples", "quickstart.py")


def test_export_prints_signature_and_writes_proto(tmp_path, capsys):
    out = tmp_path / "round.pb"
    code = cli.main(["export", f"{QUICKSTART}:fedavg_round", "--clients", "3", "-o", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    assert text.splitlines()[0] == (
        "(<params=<b=float32,w=float32[4]>@SERVER,data={<x=float32[16,4],y=float32[16]>}"
        "@CLIENTS> -> <<b=float32,w=float32[4]>,float32>@SERVER)")
    assert "federated_broadcast" in text and "federated_weighted_mean" in text
    assert out.stat().st_size > 0


def test_export_errors_are_clear(capsys):
    assert cli.main(["export", f"{QUICKSTART}", "--clients", "3"]) == 2
    assert "MODULE_OR_FILE:FUNCTION" in capsys.readouterr().err
    assert cli.main(["export", f"{QUICKSTART}:nope", "--clients", "3"]) == 2
    assert "no attribute 'nope'" in capsys.readouterr().err


def test_console_script_is_installed():
    out = subprocess.run([sys.executable, "-m", "fax_bridge.cli", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "export" in out.stdout


def test_export_of_a_built_program_via_export_targets(capsys):
    target = os.path.join(ROOT, "examples", "algorithm_rounds.py") + ":fed_fish"
    assert cli.main(["export", target, "--clients", "3"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    params, result = first.split(" -> ")
    assert "@CLIENTS" in params and "@SERVER" in result
    assert cli.main(["export", target.replace("fed_fish", "nope"), "--clients", "3"]) == 2
    assert "export_targets(3) has no 'nope'" in capsys.readouterr().err
