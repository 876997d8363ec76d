"""fax_bridge.flower.supernode: the app README's node commands start warm SuperNodes
(a worker, then Flower's `flower-supernode` naming it), and ending the command ends
every process it started."""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from processes import running

pytest.importorskip("flwr")

from fax_bridge.data import write_population  # noqa: E402
from fax_bridge.flower import app_dir, bundle, supernode  # noqa: E402
from fax_bridge.flower.deployment import free_port  # noqa: E402
from fax_bridge.flower.security import local_credentials  # noqa: E402
from fax_bridge.tff.cli import resolve_program  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "examples", "quickstart.py")


def _commands(text: str, start: str) -> list:
    """The shell commands of `text` beginning with `start` (continuations joined)."""
    joined = text.replace("\\\n", " ")
    return [shlex.split(line.rstrip(" &")) for line in joined.splitlines()
            if line.startswith(start)]


def test_the_written_readme_starts_a_warm_supernode_per_share(tmp_path):
    prog, args, placements = resolve_program(f"{QUICKSTART}:fedavg_round", 6)
    made = bundle.build_round(prog, *args, placements=placements)
    creds = local_credentials(str(tmp_path / "creds"), hosts=["10.77.0.1"])
    nodes = [{"population": str(tmp_path / "pop a"), "first-client": 0, "num-clients": 4},
             {"population": str(tmp_path / "pop'b"), "first-client": 4}]
    folder = tmp_path / "app"
    app_dir.write_app(made, str(folder), superlink="10.77.0.1:9093", nodes=nodes,
                      root_certificates=creds.ca_cert)
    text = (folder / "README.md").read_text()
    warm, cold = text.split("Cold SuperNodes", 1)
    starters = _commands(warm, "python -m fax_bridge.flower.supernode")
    assert len(starters) == len(nodes)
    for command, node in zip(starters, nodes):
        parsed = supernode._parser().parse_args(command[3:])
        assert supernode.share_config(parsed) == {"first-row": 0, **node}
        assert parsed.superlink == "10.77.0.1:9093" and not parsed.insecure
        assert parsed.root_certificates == creds.ca_cert and not parsed.cold
    assert "flower-supernode" not in app_dir.command_blocks(warm)[0]  # the fast path's
    assert "flower-supernode" in cold  # the slow path, documented below it
    assert "rounded-partials" in text


def test_ending_the_starter_ends_its_worker_and_supernode(tmp_path):
    from fax_bridge.system.process_tree import descendants

    population = str(tmp_path / "pop")
    write_population(population, [{"x": np.ones(3, np.float32)} for _ in range(2)])
    env = dict(os.environ, FLWR_HOME=str(tmp_path / "flwr"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "fax_bridge.flower.supernode", "--insecure",
         "--superlink", f"127.0.0.1:{free_port()}", "--population", population],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        started: list = []
        while time.monotonic() < deadline and proc.poll() is None:
            below = descendants(proc.pid)
            names = []
            for pid in below:
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        names.append(f.read().replace(b"\0", b" ").decode())
                except OSError:
                    pass
            if all(any(part in n for n in names) for part in (
                    "flower-supernode", "fax_bridge.flower.worker",
                    "fax_bridge/system/fork_server.py")):
                started = below
                break
            time.sleep(0.5)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert started, "the worker, the SuperNode and the fork server did not all start"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        end = time.monotonic() + 30
        while running(started) and time.monotonic() < end:
            time.sleep(0.2)
        assert not running(started)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


_ADDRESSES = (st.text(max_size=24)
              | st.builds(lambda host, port: f"{host}:{port}",
                          st.sampled_from(["10.0.0.1", "[::1]", "::1", "node-1.example",
                                           "bad host", "[zz]", "256.1.1.1", ""]),
                          st.integers(-1, 70000))
              | st.sampled_from([" 10.0.0.1:9093 ", "[fe80::1%eth0]:9093", "host:0"]))


@settings(max_examples=200, deadline=None)
@given(address=_ADDRESSES)
def test_superlink_is_read_as_every_other_command_reads_a_superlink(address):
    """`--superlink` takes exactly what `cli_args.connect_address` (`parse_address`, port
    1..65535) takes, in its one spelling; anything else stops argparse naming the flag
    and parse_address's reason, before a worker or SuperNode starts."""
    from fax_bridge.system import addresses
    from fax_bridge.errors import AddressError

    base = ["--insecure", "--population", "/nowhere", f"--superlink={address}"]
    try:
        want = addresses.normalized(address, "HOST:PORT")
    except AddressError as e:
        err = io.StringIO()
        with pytest.raises(SystemExit) as stopped, contextlib.redirect_stderr(err):
            supernode._parser().parse_args(base)
        assert stopped.value.code == 2
        err = err.getvalue()
        assert "argument --superlink" in err and str(e) in err
        return
    assert supernode._parser().parse_args(base).superlink == want


def test_the_loopback_ports_are_checked_when_read(capsys):
    base = ["--insecure", "--population", "/nowhere", "--superlink", "127.0.0.1:9093"]
    for flag in ("--port", "--worker-port"):
        with pytest.raises(SystemExit):
            supernode._parser().parse_args(base + [flag, "65536"])
        assert f"argument {flag}: must be an integer in 0..65535" in capsys.readouterr().err
