"""The README's code runs as written: its first program (with a passing parity check) and
its DP snippet; its command-line section names every subcommand `fax-bridge` has."""

import os
import re
import subprocess
import sys

from fax_bridge import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def _run_section(tmp_path, heading: str):
    block = re.search(rf"## {heading}\n\n```python\n(.*?)```", _readme(), re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(block)
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_readme_first_program_runs(tmp_path):
    out = _run_section(tmp_path, "A first program")
    assert "{f32[16,3]}@CLIENTS" in out.stdout
    assert "PARITY OK" in out.stdout
    assert (tmp_path / "round.pb").stat().st_size > 0


def test_readme_dp_snippet_runs(tmp_path):
    out = _run_section(tmp_path, "Differential privacy")
    assert re.search(r"clip \d+\.\d+, epsilon \d+\.\d+ after 50 rounds", out.stdout)


def test_readme_command_line_names_every_subcommand():
    section = re.search(r"## The command line\n\n```sh\n(.*?)```", _readme(), re.S).group(1)
    listed = set(re.findall(r"^fax-bridge (\w+)", section, re.M))
    registered = set(cli.build_parser()._subparsers._group_actions[0].choices)
    assert registered <= listed, f"README's command line lacks {sorted(registered - listed)}"
