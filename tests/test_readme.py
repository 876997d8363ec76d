"""The README's API example runs as written and its parity check passes; its DP
snippet runs too."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_api_example_runs(tmp_path):
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    block = re.search(r"## The API\n\n```python\n(.*?)```", text, re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(block)
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "{f32[16,3]}@CLIENTS" in out.stdout
    assert "PARITY OK" in out.stdout
    assert (tmp_path / "round.pb").stat().st_size > 0


def test_readme_dp_snippet_runs(tmp_path):
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    block = re.search(r"## Privacy\n.*?```python\n(.*?)```", text, re.S).group(1)
    script = tmp_path / "dp.py"
    script.write_text(block)
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert 0 < float(out.stdout.split()[-1]) < 10  # epsilon of 100 rounds at z = 1
