"""docs/algorithms.md's code runs as written: FedAvg rounds of an algorithm under jit on
the digits of fax_bridge.data, then the round exported."""

import math
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Appended to the page's code: the loss of the initial (zero) model and of the trained
# one on the last cohort's real examples, in numpy (an evaluation independent of the
# algorithm's own metrics).
_EVALUATE = """
import numpy as np

def _numpy_loss(p):
    x, y = np.asarray(batches.data["x"], np.float64), np.asarray(batches.data["y"])
    real = np.asarray(batches.mask, bool)
    z = x[real] @ np.asarray(p["w"], np.float64) + np.asarray(p["b"], np.float64)
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float(-np.mean(logp[np.arange(len(z)), y[real]]))

initial = alg.init({"w": jnp.zeros((64, 10)), "b": jnp.zeros(10)})
print(f"initial loss {_numpy_loss(initial.params):.6f}")
print(f"trained loss {_numpy_loss(state.params):.6f}")
"""


def _run_page(tmp_path, block: str, after: str = "") -> dict:
    """The page's code with `_EVALUATE` (and `after`) appended, run: its printed losses
    by name."""
    script = tmp_path / "algorithms.py"
    script.write_text(block + _EVALUATE + after)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not after or "held-out evaluation checked" in out.stdout, out.stdout
    return {name: float(v) for name, v in
            re.findall(r"^(round|initial|trained) loss ([\d.]+)$", out.stdout, re.M)}


def _trained(losses: dict) -> bool:
    """The round's own loss and the trained model's (numpy) loss both well below the
    initial model's: a quarter of the way down at least."""
    return (losses["round"] < 0.75 * losses["initial"]
            and losses["trained"] < 0.75 * losses["initial"])


def _page_block() -> str:
    with open(os.path.join(ROOT, "docs", "algorithms.md")) as f:
        text = f.read()
    return re.search(r"## Using an algorithm\n.*?```python\n(.*?)```", text, re.S).group(1)


def _evaluation_block() -> str:
    with open(os.path.join(ROOT, "docs", "algorithms.md")) as f:
        text = f.read()
    return re.search(r"## Padding, masks and evaluation\n.*?```python\n(.*?)```", text,
                     re.S).group(1)


# After the evaluation block: its values against numpy's on the held-out cohort.
_HELD_OUT = """
got = jax.jit(evaluate)(state.params, held_out.data, held_out.mask)
batches = held_out
real = np.asarray(held_out.mask, bool)
z = np.asarray(held_out.data["x"], np.float64)[real] @ np.asarray(state.params["w"]) \
    + np.asarray(state.params["b"])
assert abs(float(got["loss"]) - _numpy_loss(state.params)) < 1e-4, got
assert abs(float(got["accuracy"]) - np.mean(z.argmax(1) == np.asarray(
    held_out.data["y"])[real])) < 1e-6, got
assert float(got["examples"]) == real.sum(), got
print("held-out evaluation checked")
"""


def test_algorithms_page_runs(tmp_path):
    """The page's round, then its evaluation on a held-out cohort checked against numpy
    (one process: one start of jax)."""
    losses = _run_page(tmp_path, _page_block(), _evaluation_block() + _HELD_OUT)
    assert set(losses) == {"round", "initial", "trained"}, losses
    assert abs(losses["initial"] - math.log(10)) < 1e-6  # the zero model's uniform guess
    assert _trained(losses), losses


def test_the_check_fails_an_untrained_model():
    # Both learning rates at 0 leave the zero model, whose every loss is ln 10: refused.
    # So is a model trained a little (its loss a tenth of the way down).
    untrained = {"round": math.log(10), "initial": math.log(10), "trained": math.log(10)}
    assert not _trained(untrained)
    assert not _trained(dict(untrained, round=0.9 * math.log(10)))
    assert not _trained(dict(untrained, trained=0.9 * math.log(10)))
    assert _trained(dict(untrained, round=0.5, trained=0.5))
