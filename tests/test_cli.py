"""The `fax-bridge` command line: export prints the TFF signature and the tree."""

import os
import re
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from fax_bridge import cli
from fax_bridge.system import env_settings
from processes import descendants, parent, running

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


def test_export_prints_one_call_a_line_and_gives_the_bytes_with_o_dash(capfdbinary):
    from federated_language.compiler import building_blocks
    from federated_language.proto import computation_pb2

    target = f"{QUICKSTART}:fedavg_round"
    assert cli.main(["export", target, "--clients", "3"]) == 0
    lines = capfdbinary.readouterr().out.decode().splitlines()
    assert len(lines) > 20 and max(map(len, lines[1:])) < 100  # a tree, not one line
    assert any("federated_broadcast" in line for line in lines)
    assert cli.main(["export", target, "--clients", "3", "-o", "-"]) == 0
    out, err = capfdbinary.readouterr()
    block = building_blocks.ComputationBuildingBlock.from_proto(
        computation_pb2.Computation.FromString(out))
    def unhashed(text):  # a function's hash differs from one export to the next
        return re.sub(r"comp#[0-9a-f]+", "comp#", text)

    assert unhashed(block.formatted_representation()) == unhashed("\n".join(lines[1:]))
    assert f"wrote the proto to stdout ({len(out)} bytes)" in err.decode()


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


TFF_DATA = os.path.join(ROOT, "tests", "data", "tff087")
COMP = os.path.join(TFF_DATA, "zip_map_struct.pb")
INPUTS = os.path.join(TFF_DATA, "zip_map_struct.inputs.npz")


def _interrupted_at(monkeypatch, owner, name):
    seen = {}

    def interrupt(*args, **kwargs):
        if args and hasattr(args[0], "pids"):
            seen["pids"] = list(args[0].pids)
        raise KeyboardInterrupt

    monkeypatch.setattr(owner, name, interrupt)
    return seen


@pytest.mark.parametrize("command", ["parity", "export"])  # run: the real Ctrl-C below
def test_ctrl_c_is_one_line_exit_130_and_stops_the_devices(monkeypatch, capsys, command):
    import signal

    from fax_bridge.parity import check as parity
    from fax_bridge.tff import cli as tff_cli

    before = signal.getsignal(signal.SIGINT)
    owner, name, argv = {
        "parity": (parity.LocalFleet, "run", ["parity", f"{QUICKSTART}:fedavg_round",
                                              "--clients", "2", "--devices", "1"]),
        "export": (tff_cli, "export_tff", ["export", f"{QUICKSTART}:fedavg_round",
                                           "--clients", "2"]),
    }[command]
    seen = _interrupted_at(monkeypatch, owner, name)
    assert cli.main(argv) == 130
    err = capsys.readouterr().err
    assert err == f"fax-bridge {command}: interrupted (Ctrl-C); the processes it started " \
                  "are stopped\n"
    for pid in seen.get("pids", []):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # stopped and reaped
    assert command == "export" or seen["pids"]
    assert signal.getsignal(signal.SIGINT) is before


def _ctrl_c(*args) -> None:
    import signal

    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(1000):  # the handler runs here, between these bytecodes
        pass


def _ctrl_c_inside(where: str) -> None:
    """Sends this process SIGINT from code whose exceptions Python drops (reporting them
    to sys.unraisablehook), that swallows them, or from the unraisable hook itself while
    it reports another exception, so the handler's KeyboardInterrupt is raised there and
    lost."""
    import gc
    import weakref

    class Dropped:
        def __del__(self):
            if where == "unraisable hook":
                raise ValueError("dropped, then reported by the hook")
            _ctrl_c()

    if where in ("__del__", "unraisable hook"):
        Dropped()
    elif where == "gc callback":  # as jax's own callback, where a real one landed
        gc.callbacks.append(_ctrl_c)
        try:
            gc.collect()
        finally:
            gc.callbacks.remove(_ctrl_c)
    elif where == "weakref finalizer":
        obj = type("Obj", (), {})()
        weakref.finalize(obj, _ctrl_c)
        del obj
    else:  # a bare except, as grpc's channels have in __del__
        try:
            _ctrl_c()
        except:  # noqa: E722
            pass


@pytest.mark.parametrize("where", ["__del__", "gc callback", "weakref finalizer",
                                   "bare except", "unraisable hook"])
@pytest.mark.parametrize("later", [0, 1, 3])
def test_a_ctrl_c_raised_where_python_drops_exceptions_still_stops_the_command(
        monkeypatch, capsys, where, later):
    """A Ctrl-C whose KeyboardInterrupt lands in a gc callback, a __del__ or a weakref
    finalizer (Python reports it as unraisable and goes on), in a bare except that
    swallows it, or in the unraisable hook reporting another exception, still ends the
    command (and only that other exception is reported): one line and 130, not the
    command running to its end; it lands `later` steps into the command's work, and a
    second Ctrl-C during the cleanup stays ignored."""
    import signal
    import time

    from fax_bridge.tff import cli as tff_cli

    reported = []

    def reporting(args) -> None:  # the hook before the command's (pytest's, a user's)
        reported.append(args.exc_type)
        if where == "unraisable hook":
            _ctrl_c()

    monkeypatch.setattr(sys, "unraisablehook", reporting)
    done, cleaned = [], []

    def export_tff(*args, **kwargs):
        try:
            for call in range(later + 100):  # the work goes on for 0.2 s after it
                if call == later:
                    _ctrl_c_inside(where)
                time.sleep(0.002)
            done.append("ran to its end")  # only when the interrupt was lost
            return 0
        except KeyboardInterrupt:
            os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C, during the cleanup
            for _ in range(1000):
                pass
            cleaned.append("cleaned up")
            raise

    monkeypatch.setattr(tff_cli, "export_tff", export_tff)
    ignored = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    try:  # (an xdist worker ignores SIGINT, and so would the command)
        before = signal.getsignal(signal.SIGINT)
        code = cli.main(["export", f"{QUICKSTART}:fedavg_round", "--clients", "2"])
        after = signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, ignored)
    assert (code, done, cleaned) == (130, [], ["cleaned up"])
    assert capsys.readouterr().err == "fax-bridge export: interrupted (Ctrl-C); the " \
        "processes it started are stopped\n"
    assert after is before and sys.unraisablehook is reporting
    assert reported == ([ValueError] if where == "unraisable hook" else [])  # not ours


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"),
                    reason="needs /proc/PID/task/PID/children")
def test_a_real_ctrl_c_while_devices_start(tmp_path):
    """SIGINT to the command's process group, as a terminal sends it, once it has
    started its device processes: one line, exit 130, no device left running."""
    import signal
    import time

    env = dict(os.environ, PYTHONPATH=ROOT)
    as_from_a_terminal = (  # SIGINT handled even if this test runs with it ignored
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler)"
        "; sys.argv[0] = 'fax-bridge'; runpy.run_module('fax_bridge.cli', "
        "run_name='__main__')")
    proc = subprocess.Popen(
        [sys.executable, "-c", as_from_a_terminal, "run", COMP, "--inputs", INPUTS,
         "--devices", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True, env=env, text=True)
    devices: list[int] = []  # its own children, or forked by its fork server (which
    deadline = time.monotonic() + 60  # shows the modules it holds: not counted)
    while len(devices) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
        devices = [pid for pid in descendants(proc.pid) if _is_device(pid) and not (
            parent(pid) == proc.pid and b"fax_bridge/system/fork_server.py" in _cmdline(pid))]
    assert len(devices) >= 2, "the command never started its devices"
    started = descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err == "fax-bridge run: interrupted (Ctrl-C); the processes it started are " \
                  "stopped\n"
    assert not running(devices)  # stopped (and reaped)
    deadline = time.monotonic() + 30  # the fork server follows once its launcher is gone
    while running(started) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(started)


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _is_device(pid: int) -> bool:
    return b"fax_bridge.fleet.device" in _cmdline(pid)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(env_settings.VARIABLES)),
       value=st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"),
                     max_size=12) | st.integers(-5, 1 << 40).map(str))
def test_environment_numbers_are_checked_once_by_name_and_help_always_works(
        monkeypatch, capsys, name, value):
    """`--help` works whatever the environment holds; a command with a bad FAX_BRIDGE_*
    number stops before any work with one line naming it and the form it takes."""
    for other in env_settings.VARIABLES:  # examples share the test's monkeypatch
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as info:
        cli.main(["export", "--help"])
    assert info.value.code == 0 and "MODULE_OR_FILE:FUNCTION" in capsys.readouterr().out
    code = cli.main(["export", "no/such/file.py:f", "--clients", "1"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    raw = value.strip()
    low = env_settings.VARIABLES[name][1]
    if not raw or (raw.isascii() and raw.isdigit() and int(raw) >= low):
        assert "no such file" in err
    else:
        assert err.startswith(f"fax-bridge export: {name}=") and \
            f"is not a whole number >= {low}" in err and "unset it" in err


@pytest.mark.parametrize("given", [None, 3, 5])
def test_a_program_declaring_its_clients_needs_no_clients_flag(tmp_path, capsys, given):
    """`--clients` left out: the program's own N; given: it must be N; a plain function
    or a program built by export_targets needs it (each command taking a program reads
    it so: `cli_args.program_subcommand`, `tff.cli.resolve_program`)."""
    path = tmp_path / "declared.py"
    path.write_text("import numpy as np\nimport fax_bridge as fb\n\n"
                    "@fb.program(clients=3)\ndef total(x):\n    return fb.federated_sum(x)\n\n"
                    "def plain(x):\n    return fb.federated_sum(x)\n\n"
                    "def example_args(clients):\n"
                    "    return (np.ones((clients, 2), np.float32),), ('clients',)\n")
    flag = [] if given is None else ["--clients", str(given)]
    code = cli.main(["export", f"{path}:total", *flag])
    out, err = capsys.readouterr()
    if given == 5:
        assert code == 2 and "clients=3, but --clients 5 was given" in err
    else:
        assert code == 0 and out.splitlines()[0] == "({float32[2]}@CLIENTS -> float32[2]@SERVER)"
    code = cli.main(["export", f"{path}:plain", *flag])
    err = capsys.readouterr().err
    if given is None:
        assert code == 2 and "plain function" in err and "give --clients N" in err
    else:
        assert code == 0
    if given is None:
        target = os.path.join(ROOT, "examples", "algorithm_rounds.py") + ":fed_fish"
        assert cli.main(["export", target]) == 2
        assert "export_targets(clients): give --clients N" in capsys.readouterr().err


def test_device_takes_a_models_folder_for_litert_only(tmp_path, capsys):
    """`fax-bridge device --models DIR` (also spelt --litert-models) gives a LiteRT
    device a folder of carried models; a missing folder, or models for an XLA device,
    are refused in one line naming the fix, before the device serves."""
    from fax_bridge.fleet import device_cli

    seen = {}
    real = device_cli.serve
    try:
        device_cli.serve = lambda *a, **k: seen.setdefault("runtime", k["client_runtime"]) and 0
        for flag in ("--models", "--litert-models"):
            seen.clear()
            assert cli.main(["device", "--client-runtime", "litert", flag,
                             str(tmp_path)]) == 0
            assert seen["runtime"].name == "litert"
            assert seen["runtime"].models_dir == str(tmp_path)
        assert cli.main(["device", "--models", str(tmp_path)]) == 2
        assert "client_runtime=\"litert\"" in capsys.readouterr().err
    finally:
        device_cli.serve = real
    with pytest.raises(SystemExit):
        cli.main(["device", "--client-runtime", "litert", "--models",
                  str(tmp_path / "none")])
    assert "is not a folder" in capsys.readouterr().err
