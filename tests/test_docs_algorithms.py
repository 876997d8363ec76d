"""docs/algorithms.md's code runs as written: FedAvg rounds of an algorithm under jit on
the digits of fax_bridge.data, then the round exported."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_algorithms_page_runs(tmp_path):
    with open(os.path.join(ROOT, "docs", "algorithms.md")) as f:
        text = f.read()
    block = re.search(r"## Using an algorithm\n.*?```python\n(.*?)```", text, re.S).group(1)
    script = tmp_path / "algorithms.py"
    script.write_text(block)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    loss = float(re.search(r"round loss ([\d.]+)", out.stdout).group(1))
    assert 0 < loss < 2.31  # below the loss of the zero model's uniform guess, ln(10)
