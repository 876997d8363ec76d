"""The README's code runs as written: its first program (with a passing parity check) and
its DP snippet; its command-line section names every subcommand `fax-bridge` has."""

import math
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


def _dp_snippet_reference() -> tuple:
    """What the DP snippet must print, computed apart from fax_bridge.

    epsilon: dp_accounting's PLD accountant itself, 50 Poisson-sampled (q=0.2) Gaussian
    rounds of noise multiplier 1 at delta 1e-3. clip: the geometric quantile update of
    Andrew et al. 2021 (clip * exp(-0.2 * (below - 0.5)) a round from 0.1): every client's
    update (norm about 0.3) is above the clip in each of the 3 rounds, so without noise
    the clip is 0.1 * exp(0.3); the clipped count's noise (standard deviation 2 on 8
    clients) moves log(clip) by 0.05 a round (one standard deviation), returned as the
    band of four standard deviations over 3 rounds."""
    import dp_accounting

    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(0.2, dp_accounting.GaussianDpEvent(1.0)),
                50)
    return acc.get_epsilon(1e-3), 0.1 * math.exp(0.3), 4 * 0.05 * math.sqrt(3)


def _dp_output_agrees(stdout: str) -> bool:
    found = re.search(r"clip (\d+\.\d+), epsilon (\d+\.\d+) after 50 rounds", stdout)
    if found is None:
        return False
    clip, eps = float(found.group(1)), float(found.group(2))
    want_eps, want_clip, log_band = _dp_snippet_reference()
    return abs(eps - want_eps) <= 0.01 and abs(math.log(clip / want_clip)) <= log_band


def test_readme_dp_snippet_runs(tmp_path):
    out = _run_section(tmp_path, "Differential privacy")
    assert _dp_output_agrees(out.stdout), out.stdout


def test_dp_output_check_refuses_wrong_figures():
    eps, clip, _ = _dp_snippet_reference()
    line = "clip {:.3f}, epsilon {:.2f} after 50 rounds at q=0.2"
    assert _dp_output_agrees(line.format(clip, eps))
    assert not _dp_output_agrees(line.format(clip, eps + 0.05))   # another accountant's
    assert not _dp_output_agrees(line.format(clip * 1.5, eps))    # moved the wrong way
    assert not _dp_output_agrees(line.format(clip / 1.5, eps))
    assert not _dp_output_agrees("clip nan, epsilon inf")


def test_readme_command_line_names_every_subcommand():
    section = re.search(r"## The command line\n\n```sh\n(.*?)```", _readme(), re.S).group(1)
    # `fax-bridge forms run` is the subcommand forms-run (cli._two_word_commands)
    listed = {"-".join(w for w in m if w) for m in
              re.findall(r"^fax-bridge (\w+)(?: (run)\b)?", section, re.M)}
    registered = set(cli.build_parser()._subparsers._group_actions[0].choices)
    assert registered <= listed, f"README's command line lacks {sorted(registered - listed)}"
