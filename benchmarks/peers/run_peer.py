"""Runs one peer benchmark in its own venv and returns its result (standard library only).

Each peer script runs as ``<repo>/.venv-<peer>/bin/python benchmarks/peers/<peer>_peer.py``
in a new session (its own process group) under a hard timeout. When it ends, for any
reason, whatever is left of its process group is killed, so no worker (TFF's
``worker_binary``, Ray's daemons) outlives it. The result is the JSON object the script
prints as its last line.

    python benchmarks/peers/run_peer.py fax|tff|flower [--rounds N] [--seed S]
        [--timeout SECONDS] [--json OUT] [--log LOG] [-- EXTRA PEER ARGS]

Mode ``flower-sizes`` runs ``flower_sizes.py`` (one FedAvg round of a linear model at
several model sizes on Flower's simulation) in ``.venv-flower`` the same way and prints
its JSON line per size (``--rounds`` defaults to 5 there, the first a warm-up):

    python benchmarks/peers/run_peer.py flower-sizes --sizes 10k,100k,1M,4M,10M

Exit status: 0 with the JSON line on stdout; 2 when the peer's venv is missing
(build it with ``benchmarks/peers/setup_venvs.sh PEER``); 1 when the peer failed or
timed out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PEERS = ("fax", "tff", "flower")
# Exit status a peer uses for "runtime did not start" (TFF's worker hang): retried.
STARTUP_EXIT = 3
DEFAULT_TIMEOUT_S = {"fax": 300.0, "tff": 600.0, "flower": 900.0, "flower-sizes": 1800.0}
# Modes that run another script of a peer's venv: mode -> (peer, script).
MODES = {"flower-sizes": ("flower", "flower_sizes.py")}


class PeerUnavailable(RuntimeError):
    """The peer's venv has not been built."""


class PeerFailed(RuntimeError):
    """The peer exited non-zero, timed out, or printed no result."""

    def __init__(self, message: str, returncode: Optional[int] = None) -> None:
        super().__init__(message)
        self.returncode = returncode


def venv_python(peer: str, repo: str = REPO) -> str:
    """Path of the interpreter of ``peer``'s venv."""
    if peer not in PEERS:
        raise ValueError(f"unknown peer {peer!r}; one of {PEERS}")
    return os.path.join(repo, f".venv-{peer}", "bin", "python")


def peer_available(peer: str, repo: str = REPO) -> bool:
    """Whether ``peer``'s venv exists."""
    return os.access(venv_python(peer, repo), os.X_OK)


def kill_group(pgid: int, grace_s: float = 3.0) -> None:
    """SIGTERM the process group, SIGKILL what is left after `grace_s` seconds."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.1)


def last_json(stdout: str) -> Optional[Dict[str, Any]]:
    """The last line of `stdout` that is a JSON object with a `peer` key."""
    found = peer_json_lines(stdout)
    return found[-1] if found else None


def child_env() -> Dict[str, str]:
    """This environment without the parent venv's variables, output unbuffered."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def peer_json_lines(stdout: str) -> List[Dict[str, Any]]:
    """Every line of `stdout` that is a JSON object with a `peer` key, in order."""
    out = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict) and "peer" in obj:
                out.append(obj)
    return out


def run_script(python: str, script: str, args: Sequence[str], timeout_s: float,
               repo: str = REPO, log_path: Optional[str] = None,
               on_start: Optional[Callable[[Optional[int]], None]] = None,
               parse: Callable[[str], Any] = last_json) -> Any:
    """Runs one script in a new session under a timeout; returns its JSON result
    (``parse`` of its stdout: by default the last result line).

    Whatever is left of the child's process group afterwards (device processes, TFF's
    worker, Ray's daemons) is killed, whether the run succeeded, failed or timed out.
    `on_start(pgid)` is told the group when it starts and `on_start(None)` when it is gone.
    """
    cmd = [python, script, *args]
    proc = subprocess.Popen(
        cmd, cwd=repo, env=child_env(), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    if on_start is not None:
        on_start(proc.pid)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_group(proc.pid)
        out, err = proc.communicate()
    finally:
        kill_group(proc.pid)  # stragglers of a finished run, too
        if on_start is not None:
            on_start(None)
    if log_path:
        with open(log_path, "w") as f:
            f.write(f"$ {' '.join(cmd)}\n--- stdout\n{out}\n--- stderr\n{err}\n")
    tail = "\n".join((err or "").strip().splitlines()[-15:])
    name = os.path.basename(script)
    if timed_out:
        raise PeerFailed(f"{name}: timed out after {timeout_s:.0f} s; stderr tail:\n{tail}")
    if proc.returncode != 0:
        raise PeerFailed(f"{name}: exit status {proc.returncode}; stderr tail:\n{tail}",
                         proc.returncode)
    result = parse(out)
    if not result:
        raise PeerFailed(f"{name}: no JSON result line; stderr tail:\n{tail}")
    return result


def run_once(
    peer: str,
    args: Sequence[str],
    timeout_s: float,
    repo: str = REPO,
    log_path: Optional[str] = None,
) -> Dict[str, Any]:
    """One run of ``peer`` with script arguments ``args``; returns its JSON object."""
    python = venv_python(peer, repo)
    if not os.access(python, os.X_OK):
        raise PeerUnavailable(
            f"{python} not found; build it with benchmarks/peers/setup_venvs.sh {peer}"
        )
    script = os.path.join(repo, "benchmarks", "peers", f"{peer}_peer.py")
    return run_script(python, script, args, timeout_s, repo=repo, log_path=log_path)


def run_peer(
    peer: str,
    rounds: int = 20,
    seed: int = 0,
    timeout_s: Optional[float] = None,
    extra_args: Sequence[str] = (),
    repo: str = REPO,
    retries: int = 1,
    log_path: Optional[str] = None,
) -> Dict[str, Any]:
    """Runs ``peer`` for ``rounds`` rounds and returns its result object.

    A run whose runtime did not start (exit status 3) is retried up to ``retries``
    times; any other failure raises ``PeerFailed`` at once.
    """
    timeout = DEFAULT_TIMEOUT_S[peer] if timeout_s is None else timeout_s
    args = ["--rounds", str(rounds), "--seed", str(seed), *extra_args]
    for attempt in range(retries + 1):
        try:
            return run_once(peer, args, timeout, repo=repo, log_path=log_path)
        except PeerFailed as e:
            if e.returncode != STARTUP_EXIT or attempt == retries:
                raise
            print(f"run_peer: {peer} did not start, retrying", file=sys.stderr)
    raise AssertionError("unreachable")


def run_flower_sizes(
    sizes: Sequence[str] = ("10k", "100k", "1M", "4M", "10M"),
    rounds: int = 5,
    seed: int = 0,
    timeout_s: Optional[float] = None,
    extra_args: Sequence[str] = (),
    repo: str = REPO,
    log_path: Optional[str] = None,
) -> List[Dict[str, Any]]:
    """Runs ``flower_sizes.py`` in ``.venv-flower`` (mode ``flower-sizes``) at ``sizes``
    (parameter counts such as ``"1M"``), ``rounds`` rounds each; returns one result
    object per size, smallest first. Raises ``PeerUnavailable`` without the venv and
    ``PeerFailed`` when the run fails, times out or does not report every size."""
    peer, script = MODES["flower-sizes"]
    python = venv_python(peer, repo)
    if not os.access(python, os.X_OK):
        raise PeerUnavailable(
            f"{python} not found; build it with benchmarks/peers/setup_venvs.sh {peer}"
        )
    timeout = DEFAULT_TIMEOUT_S["flower-sizes"] if timeout_s is None else timeout_s
    args = ["--sizes", ",".join(str(s) for s in sizes), "--rounds", str(rounds),
            "--seed", str(seed), *extra_args]
    results = run_script(python, os.path.join(repo, "benchmarks", "peers", script), args,
                         timeout, repo=repo, log_path=log_path, parse=peer_json_lines)
    if len(results) != len(sizes):
        raise PeerFailed(f"{script}: reported {len(results)} of {len(sizes)} sizes")
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description="Run one peer benchmark in its venv.")
    p.add_argument("peer", choices=PEERS + tuple(MODES))
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds (default 20; flower-sizes: 5 per size)")
    p.add_argument("--sizes", default="10k,100k,1M,4M,10M",
                   help="flower-sizes: comma-separated parameter counts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=None, help="seconds (default per peer)")
    p.add_argument("--json", metavar="OUT", default=None, help="also write the result to OUT")
    p.add_argument("--log", metavar="LOG", default=None,
                   help="write the peer's stdout/stderr to LOG")
    p.add_argument("extra", nargs="*", help="arguments passed on to the peer script (after --)")
    a = p.parse_args(argv)
    try:
        if a.peer in MODES:
            sizes = [s.strip() for s in a.sizes.split(",") if s.strip()]
            results = run_flower_sizes(sizes, a.rounds or 5, a.seed, a.timeout, a.extra,
                                       log_path=a.log)
        else:
            results = [run_peer(a.peer, a.rounds or 20, a.seed, a.timeout, a.extra,
                                log_path=a.log)]
    except PeerUnavailable as e:
        print(f"run_peer: {e}", file=sys.stderr)
        return 2
    except PeerFailed as e:
        print(f"run_peer: {e}", file=sys.stderr)
        return 1
    lines = "".join(json.dumps(r) + "\n" for r in results)
    if a.json:
        with open(a.json, "w") as f:
            f.write(lines)
    print(lines, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
