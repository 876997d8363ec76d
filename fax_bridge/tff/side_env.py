"""Runs a script of `tools/tff087/` in the TensorFlow Federated 0.87 side environment.

TFF 0.87 needs numpy 1.25 and TensorFlow 2.14, which the main environment must not
have, so it lives in its own venv (`.venv-tff`, built by `tools/tff087/setup.sh` /
`make tff-venv`). A script there prints one JSON object on stdout; it runs in its own
process group, killed on timeout and after it exits, so no stray child survives.
`FAX_BRIDGE_TFF_PYTHON` names another interpreter.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
from typing import Optional, Sequence

from fax_bridge.errors import FaxBridgeError
from fax_bridge.system.process_tree import signal_group

REPO = pathlib.Path(__file__).resolve().parents[2]
SETUP_HINT = "build it with `make tff-venv` (tools/tff087/setup.sh)"


class SideEnvError(FaxBridgeError):
    """The TFF side environment is missing, or its script failed or timed out."""


def tff_python() -> pathlib.Path:
    """The interpreter of the TFF 0.87 venv."""
    return pathlib.Path(os.environ.get("FAX_BRIDGE_TFF_PYTHON",
                                       REPO / ".venv-tff" / "bin" / "python"))


def script(name: str) -> pathlib.Path:
    """The path of a side-environment script in `tools/tff087/`."""
    path = REPO / "tools" / "tff087" / name
    if not path.is_file():
        raise SideEnvError(f"{path} is missing; the TFF side scripts ship with the "
                           "fax_bridge source tree, not with an installed wheel.")
    return path


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILLs the process group `proc` leads (started with `start_new_session`)."""
    signal_group(proc, signal.SIGKILL)


def run_json(path: os.PathLike, args: Sequence[str], timeout_s: float,
             python: Optional[os.PathLike] = None) -> dict:
    """Runs `python path *args` (default: `tff_python()`); returns the JSON it printed."""
    python = pathlib.Path(python) if python is not None else tff_python()
    if not python.exists():
        raise SideEnvError(f"the TFF 0.87 interpreter {python} does not exist; {SETUP_HINT}")
    proc = subprocess.Popen([str(python), str(path), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, start_new_session=True, cwd=REPO)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        proc.communicate()
        raise SideEnvError(f"{pathlib.Path(path).name} did not finish within {timeout_s:g} s "
                           "and was killed")
    finally:
        kill_group(proc)
    tail = err.decode(errors="replace").strip()[-2000:]
    if proc.returncode != 0:
        raise SideEnvError(f"{pathlib.Path(path).name} exited with status {proc.returncode}; "
                           f"its stderr:\n{tail}")
    try:
        return json.loads(out.decode())
    except json.JSONDecodeError as e:
        raise SideEnvError(f"{pathlib.Path(path).name} printed no valid JSON ({e}); its "
                           f"stderr:\n{tail}") from e
