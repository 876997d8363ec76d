"""fax_bridge.flower.forked_apps: the `flwr-clientapp`/`flwr-serverapp` a deployment's
SuperExecs start are forked from a server that has Flower loaded, and behave as the
command they stand for: arguments, environment, directory, streams, exit status and
signals; where no server serves, Flower's own command runs in their place."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings, strategies as st

from processes import alive, as_nobody, children
from fax_bridge.system import forks
from fax_bridge.flower import forked_apps

pytestmark = pytest.mark.skipif(not forks.available(), reason="needs Linux pidfds")

ENTRIES = '''
import os, signal, sys, time

def report():
    """Writes what it was started with; exits with X_CODE."""
    with open(os.environ["X_OUT"], "w") as f:
        f.write(repr((sys.argv, os.getcwd(), os.environ.get("X_VALUE"), os.getppid(),
                      sys.stdin.buffer.read())))
    print("to stdout", flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    return int(os.environ.get("X_CODE", "0"))

def wait():
    """Says it started, then waits for a signal (SIGTERM ends it with a line first)."""
    signal.signal(signal.SIGTERM, lambda *_: (print("terminated", flush=True),
                                              sys.exit(7)))
    print("started", flush=True)
    time.sleep(120)
'''


def _command(forks_: forked_apps.AppForks, name: str, entry: str, real: str) -> str:
    path = os.path.join(forks_.folder, "bin", name)
    with open(path, "w") as f:
        f.write(forked_apps._COMMAND.format(python=sys.executable, name=name, entry=entry,
                                            module=forked_apps.__file__, real=real))
    os.chmod(path, 0o755)
    return path


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """A server that has imported the test's entry points, with two commands."""
    folder = tmp_path_factory.mktemp("forked")
    (folder / "x_entries.py").write_text(ENTRIES)
    env = dict(os.environ, PYTHONPATH=f"{folder}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    served = forked_apps.AppForks(str(folder / "host"), env, ("x_entries",))
    assert served.wait(120), served.error
    real = folder / "real"
    real.write_text("#!/bin/sh\necho \"the real command: $*\"\nexit 5\n")
    real.chmod(0o755)
    _command(served, "x-report", "x_entries:report", str(real))
    _command(served, "x-wait", "x_entries:wait", str(real))
    yield served, folder
    served.close()


printable = st.text(st.characters(blacklist_characters="\x00",
                                  blacklist_categories=("Cs",)), max_size=12)
raw = st.binary(max_size=8).filter(lambda b: b"\x00" not in b).map(
    lambda b: b.decode(sys.getfilesystemencoding(), "surrogateescape"))


@settings(max_examples=12, deadline=None)
@given(args=st.lists(st.one_of(printable, raw), max_size=4), value=st.one_of(printable, raw),
       code=st.integers(0, 255), stdin=st.binary(max_size=64))
def test_a_forked_command_gets_what_flowers_own_would_and_exits_as_it_does(
        host, tmp_path_factory, args, value, code, stdin):
    """Any arguments and environment values (text, or bytes no encoding holds), the
    working directory and stdin reach the forked child as they reach a fresh
    interpreter; its stdout, stderr and exit status are the command's, and its parent
    is the server, not a new interpreter."""
    served, _ = host
    out = tmp_path_factory.mktemp("out")
    env = dict(served.env, X_OUT=str(out / "seen"), X_CODE=str(code))
    env["X_VALUE"] = value
    run = subprocess.run(["x-report", *args], env=env, cwd=str(out), input=stdin,
                         capture_output=True)
    argv, cwd, seen_value, ppid, seen_stdin = ast.literal_eval((out / "seen").read_text())
    assert run.returncode == code, run.stderr
    assert argv == [os.path.join(served.folder, "bin", "x-report"), *args]
    assert (cwd, seen_value, seen_stdin) == (str(out), value, stdin)
    assert ppid == served.server.pid
    assert (run.stdout, run.stderr) == (b"to stdout\n", b"to stderr\n")


def test_a_signal_to_the_command_reaches_its_child(host):
    """SIGTERM to the command: the child's own handler runs and the command exits with
    the child's status; SIGKILL to a child: the command ends by SIGKILL as the child
    did; SIGKILL to the command (which cannot pass it on): the server kills the child,
    as a process group's SIGKILL would have."""
    served, _ = host
    for to_child, sig, handled in ((False, signal.SIGTERM, 7),
                                   (True, signal.SIGKILL, -signal.SIGKILL),
                                   (False, signal.SIGKILL, -signal.SIGKILL)):
        proc = subprocess.Popen(["x-wait"], env=served.env, stdout=subprocess.PIPE)
        assert proc.stdout.readline() == b"started\n"
        (child,) = children(served.server.pid)
        os.kill(child if to_child else proc.pid, sig)
        assert proc.wait(timeout=60) == handled
        deadline = time.monotonic() + 30
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child)


def test_without_a_server_flowers_own_command_runs_and_says_why(host, tmp_path):
    """No server (none named, or none listening): the real command runs in the
    command's place with the same arguments, after one line naming why; a real command
    that is this one is never run again (127)."""
    served, folder = host
    for env in (dict(served.env, **{forked_apps.ENV: str(tmp_path / "none.sock")}),
                {k: v for k, v in served.env.items() if k != forked_apps.ENV}):
        run = subprocess.run(["x-report", "a b", "c"], env=env, capture_output=True)
        assert (run.returncode, run.stdout) == (5, b"the real command: a b c\n")
        assert b"x-report: starting Flower's own command, not a fork" in run.stderr
    looping = _command(served, "x-loop", "x_entries:report",
                       os.path.join(served.folder, "bin", "x-loop"))
    run = subprocess.run([looping], env={"PATH": os.environ["PATH"]}, capture_output=True)
    assert run.returncode == 127 and b"is not set" in run.stderr


def test_the_commands_written_stand_for_flowers_own():
    """`write_commands` writes each of Flower's commands, running the entry point that
    Flower's installed console script of that name runs, with Flower's own command
    beside the interpreter to fall back on."""
    import tempfile
    from importlib.metadata import entry_points

    scripts = {e.name: e.value for e in entry_points(group="console_scripts")}
    with tempfile.TemporaryDirectory() as folder:
        bin_dir = forked_apps.write_commands(folder)
        for name, entry in forked_apps.COMMANDS.items():
            assert scripts[name] == entry
            text = open(os.path.join(bin_dir, name)).read()
            real = os.path.join(os.path.dirname(sys.executable), name)
            assert text.startswith(f"#!{sys.executable}\n") and repr(entry) in text
            assert repr(real) in text and os.access(real, os.X_OK)


# A deployment home another local user reaches first ------------------------------------

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="acts as another user (nobody)")
ROOTS_TEXT = b"#!/bin/sh\n# root's own program\n"


@pytest.fixture
def shared_tmp():
    """A folder every user may create in, sticky as /tmp (where the docs' homes go)."""
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="fax-shared-", dir="/tmp")
    os.chmod(folder, 0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def roots_program(tmp_path):
    path = tmp_path / "program"
    path.write_bytes(ROOTS_TEXT)
    path.chmod(0o755)
    return str(path)


def _unchanged(path: str) -> None:
    assert open(path, "rb").read() == ROOTS_TEXT and os.stat(path).st_mode & 0o777 == 0o755


@as_root
def test_a_home_another_user_made_first_is_refused_before_anything_is_written(
        shared_tmp, roots_program):
    home = os.path.join(shared_tmp, "flwr")
    bin_dir = os.path.join(home, "forks", "superlink", "bin")

    def plant():
        os.makedirs(bin_dir, 0o755)
        os.symlink(roots_program, os.path.join(bin_dir, "flwr"))

    as_nobody(plant)
    with pytest.raises(PermissionError, match=f"{home} belongs to nobody") as e:
        forked_apps.AppForks(os.path.join(home, "forks", "superlink"), dict(os.environ),
                             ())
    assert "another path" in str(e.value)
    _unchanged(roots_program)
    assert os.listdir(bin_dir) == ["flwr"] and os.path.islink(os.path.join(bin_dir, "flwr"))

    from fax_bridge.flower.deployment import LocalDeployment

    with pytest.raises(PermissionError, match=f"{home} belongs to nobody"):
        with LocalDeployment([{"population": home}], home, fork_apps=False):
            pass
    assert sorted(os.listdir(home)) == ["forks"]  # no config, log or token written there


@as_root
@settings(max_examples=12, deadline=None)
@given(entry=st.sampled_from(sorted(forked_apps.COMMANDS) + ["forks.log"]),
       planted=st.sampled_from(["link", "another user's file"]))
def test_an_entry_planted_in_the_forks_folder_is_refused_naming_it(
        tmp_path_factory, entry, planted):
    import pwd

    folder = str(tmp_path_factory.mktemp("forks"))
    roots_program = os.path.join(folder, "program")
    with open(roots_program, "wb") as f:
        f.write(ROOTS_TEXT)
    os.chmod(roots_program, 0o755)
    forks_dir = os.path.join(folder, "home", "forks", "superlink")
    os.makedirs(os.path.join(forks_dir, "bin"), 0o700)
    path = os.path.join(forks_dir, "bin", entry) if entry in forked_apps.COMMANDS else \
        os.path.join(forks_dir, entry)
    if planted == "link":
        os.symlink(roots_program, path)
    else:
        open(path, "wb").close()
        os.chown(path, pwd.getpwnam("nobody").pw_uid, -1)
    with pytest.raises(PermissionError) as e:
        forked_apps.AppForks(forks_dir, dict(os.environ), ())
    assert str(e.value).startswith(path)
    _unchanged(roots_program)


@pytest.mark.parametrize("entry", ["config.toml", "worker-0.token", "logs/worker-0.log"])
def test_a_link_planted_in_a_deployment_home_is_refused_and_its_target_kept(
        tmp_path, roots_program, entry):
    from fax_bridge.flower.deployment import LocalDeployment

    home = tmp_path / "home"
    (home / "logs").mkdir(parents=True, mode=0o700)
    home.chmod(0o700)
    os.symlink(roots_program, home / entry)
    with pytest.raises(PermissionError, match=f"{home / entry} is a symbolic link"):
        with LocalDeployment([{"population": str(tmp_path)}], str(home), fork_apps=False):
            pass
    _unchanged(roots_program)


def test_the_worker_refuses_a_token_file_that_is_a_link_or_others_can_read(
        tmp_path, roots_program, capsys):
    from fax_bridge.flower import worker

    link = tmp_path / "worker.token"
    os.symlink(roots_program, link)
    args = ["--listen", "127.0.0.1:0", "--population", str(tmp_path)]
    assert worker.main(args + ["--token-file", str(link)]) == 2
    assert f"{link} is a symbolic link" in capsys.readouterr().err
    link.unlink()
    link.write_text("t" * 32)
    link.chmod(0o644)
    assert worker.main(args + ["--token-file", str(link)]) == 2
    assert f"chmod 600 {link}" in capsys.readouterr().err
    _unchanged(roots_program)


@pytest.mark.parametrize("entry", ["folder", "file", "fifo", "link"])
def test_anything_but_a_socket_at_the_socket_path_is_refused_naming_it(entry):
    """The socket path is removed before the server listens: only a socket of ours is;
    a folder, file, FIFO or link there is refused by name and left as it was."""
    import shutil
    import tempfile

    tmp = tempfile.mkdtemp(prefix="fb-")  # a socket path short enough to be used as is
    try:
        _socket_path_refusal(tmp, entry)
    finally:
        shutil.rmtree(tmp)


def _socket_path_refusal(tmp: str, entry: str) -> None:
    import socket as sockets

    folder = os.path.join(tmp, "forks")
    os.makedirs(folder, 0o700)
    path = os.path.join(folder, "forks.sock")
    if entry == "folder":
        os.mkdir(path)
    elif entry == "file":
        open(path, "wb").close()
    elif entry == "fifo":
        os.mkfifo(path)
    else:
        os.symlink(tmp, path)
    kind = {"folder": "a folder", "file": "a regular file", "fifo": "a FIFO",
            "link": "a symbolic link"}[entry]
    with pytest.raises(PermissionError, match=f"is {kind}") as e:
        forked_apps.AppForks(folder, dict(os.environ), ())
    assert str(e.value).startswith(path) and os.path.lexists(path)
    os.rmdir(path) if entry == "folder" else os.unlink(path)
    with sockets.socket(sockets.AF_UNIX) as left:  # a socket an ended server left
        left.bind(path)
    forks_ = forked_apps.AppForks(folder, dict(os.environ), (), python="/nonexistent")
    forks_.close()
