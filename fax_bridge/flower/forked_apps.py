"""Flower's processes, forked from one that has Flower loaded.

Flower 1.42's SuperNode starts a new `flwr-clientapp` process for every message it
receives, and the SuperLink a `flwr-serverapp` process for every run; each first imports
Flower (about 2.8 CPU-seconds, several seconds of every round on a busy machine), as do
its daemons (`flower-superlink`, `flower-supernode`, the `flower-superexec` each
starts) and the `flwr` CLI. So a deployment started here (`deployment.LocalDeployment`,
`python -m fax_bridge.flower.supernode`) gives each SuperNode, and its SuperLink, a
fork server (`fax_bridge.system.forks`) that has imported what those commands import,
listening on a Unix socket in a private folder, and leads that host's PATH with the
folder's `bin/`, where each of `COMMANDS` runs `main` here; `LocalDeployment` also
starts the SuperLink, its SuperNodes and `flwr` through them (`AppForks.command`).

Started as Flower's own command would be (by Flower's SuperExec, by name on PATH), such a
command asks the server for a child that runs Flower's own entry point with the same
arguments, environment, working directory, CPUs and standard streams, waits for it,
passes on the signals it gets (SIGTERM, SIGINT, SIGHUP, SIGQUIT) and exits as the child
did: the child is Flower's command less its imports. A command killed outright takes
its child with it: the server kills a child whose requester's connection closes. Where
the server is gone or refuses, the command says so on stderr and runs Flower's own
command in its place (exec), as it would without any of this.

This file imports only the standard library and loads `forks` by its path, never
fax_bridge's package (whose `__init__` loads jax): the commands run it as a script. The
server side (`AppForks`, `write_commands`) imports `fax_bridge.system.forks` and
`fax_bridge.system.private_files` when it is called.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import sys
import tempfile
import threading
from typing import Optional, Sequence

ENV = "FAX_BRIDGE_FLOWER_FORKS"  # the listening socket of this host's fork server
# Each command and Flower's entry point that it is (what Flower's console script runs).
COMMANDS = {"flwr-clientapp": "flwr.supernode.cli:flwr_clientapp",
            "flwr-serverapp": "flwr.superlink.cli:flwr_serverapp",
            "flower-superexec": "flwr.supercore.cli:flower_superexec",
            "flower-supernode": "flwr.supernode.cli:flower_supernode",
            "flower-superlink": "flwr.superlink.cli:flower_superlink",
            "flwr": "flwr.cli.app:app"}
# What a SuperNode's server imports: the ClientApp command's imports, and numpy, which the
# ClientApp (`relay`) imports; a node without a warm worker computes in the ClientApp,
# which then imports `client` (jax) too.
NODE_MODULES = ("flwr.supernode.cli", "numpy")
COLD_NODE_MODULES = NODE_MODULES + ("fax_bridge.flower.client",)
# A SuperLink's: the ServerApp command's imports and the ServerApp's own (jax; no backend
# starts on import, so the server still runs one thread), and the `flwr` CLI's.
LINK_MODULES = ("flwr.superlink.cli", "fax_bridge.flower.server", "flwr.cli.app")
MAX_SOCKET_PATH = 100  # bytes; Linux holds at most 107
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def _forks():
    """`fax_bridge.system.forks`: the imported module where there is one, else loaded by path."""
    if "fax_bridge.system.forks" in sys.modules:
        return sys.modules["fax_bridge.system.forks"]
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "system", "forks.py")
    spec = importlib.util.spec_from_file_location("_fax_bridge_forks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(real: str, entry: str, argv: Optional[Sequence[str]] = None) -> int:
    """The command: Flower's entry point `entry` forked from this host's server with
    `argv` (default `sys.argv`, its first the command's name); `real` (Flower's own
    command) where that cannot be. Returns the child's exit status (a child ended by a
    signal ends this process by the same signal)."""
    argv = list(sys.argv if argv is None else argv)
    forks = _forks()
    # Held from before the child exists until they are passed on to it.
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    try:
        path = os.environ.get(ENV)
        if not path:
            raise forks.ForkServerError(f"{ENV} is not set")
        server = forks.ForkServer.connect(path)
        child = server.run(entry, argv, env=dict(os.environ),  # in our own directory
                           cpus=os.sched_getaffinity(0), stdio=(0, 1, 2))
    except forks.ForkServerError as e:
        os.write(2, f"{os.path.basename(argv[0])}: starting Flower's own command, not a "
                    f"fork ({e})\n".encode(errors="replace"))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        if os.path.realpath(real) == os.path.realpath(argv[0]):
            return 127  # never exec this command again
        os.execv(real, [real, *argv[1:]])
    for signum in FORWARDED:
        signal.signal(signum, lambda s, _frame: child.send_signal(s))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    code = child.wait()
    if code < 0:  # as Flower's command would have ended: by that signal
        if -code in FORWARDED:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code
    return code


_COMMAND = """#!{python}
# {name}, forked from this host's Flower fork server (fax_bridge.flower.forked_apps).
import runpy, sys
sys.exit(runpy.run_path({module!r})["main"]({real!r}, {entry!r}))
"""


def write_commands(folder: str, python: str = sys.executable) -> str:
    """Writes `folder/bin/` (private, 0700) with one executable per `COMMANDS` entry,
    each running `main` with Flower's own command beside `python`; returns that `bin`
    folder. Each is written anew and renamed into place (`private_files`): a link or
    another user's file planted under a command's name is refused, never written
    through."""
    from fax_bridge.system import private_files

    bin_dir = private_files.private_dir(os.path.join(folder, "bin"))
    for name, entry in COMMANDS.items():
        private_files.write_file(
            os.path.join(bin_dir, name),
            _COMMAND.format(python=python, name=name, entry=entry,
                            module=os.path.abspath(__file__),
                            real=os.path.join(os.path.dirname(python), name)), 0o700)
    return bin_dir


class AppForks:
    """The fork server of one host's Flower commands (a SuperNode's or a SuperLink's).

    Args:
        folder: made private (0700), or verified to be (`private_files.private_dir`:
            ours, not a link, writable by no one else, nor its parents): the listening
            socket, `bin/`, and the server's log `forks.log` (a line for each command
            it forks).
        env: the environment of the process whose commands it serves; `env` here is that
            environment with `bin/` leading PATH and `ENV` naming the socket.
        modules: what the server imports (`NODE_MODULES`, `COLD_NODE_MODULES`,
            `LINK_MODULES`).
        prefix: the command the host's processes run under (`LocalDeployment.wrap`).

    The server starts on a thread of its own (its imports take seconds), so the
    deployment starts beside it; a command that runs before it listens, or after it
    failed, runs Flower's own command. `close()` ends the server.
    """

    def __init__(self, folder: str, env: dict, modules: Sequence[str],
                 prefix: Sequence[str] = (), python: str = sys.executable):
        from fax_bridge.system import private_files

        folder = private_files.private_dir(folder)
        self.folder, self.socket = folder, os.path.join(folder, "forks.sock")
        self.log_path = os.path.join(folder, "forks.log")
        private_files.open_append(self.log_path).close()  # a planted link is refused
        self._short = None
        if len(self.socket.encode()) > MAX_SOCKET_PATH:  # a Unix socket's path is short
            self._short = tempfile.mkdtemp(prefix="fax-flwr-")  # made 0700
            self.socket = os.path.join(self._short, "forks.sock")
        elif os.path.lexists(self.socket):  # only a socket of ours: never a link, a
            private_files.check_entry(self.socket, kind="socket")  # folder or a file
            os.unlink(self.socket)  # a server of an earlier deployment here has ended
        bin_dir = write_commands(folder, python)
        self.env = dict(env, PATH=bin_dir + os.pathsep + env.get("PATH", ""),
                        **{ENV: self.socket})
        self.server, self.error = None, None
        server_env = dict(env, OMP_NUM_THREADS="1")  # numpy's BLAS starts no threads
        self._thread = threading.Thread(
            target=self._start, args=(python, server_env, tuple(modules), list(prefix)),
            daemon=True)
        self._thread.start()

    def _start(self, python: str, env: dict, modules: tuple, prefix: list) -> None:
        from fax_bridge.system import forks

        try:
            self.server = forks.ForkServer.start(
                python, env, modules, idle_seconds=float("inf"), listen=self.socket,
                prefix=prefix, log_path=self.log_path)
        except forks.ForkServerError as e:
            self.error = e

    def wait(self, timeout_s: Optional[float] = None) -> bool:
        """Waits for the server to start; whether it serves."""
        self._thread.join(timeout_s)
        return self.server is not None

    def forked(self) -> int:
        """How many commands the server has forked so far."""
        try:
            with open(self.log_path, "rb") as f:
                return f.read().count(b"fax_bridge.system.forks: forked ")
        except OSError:
            return 0

    def command(self, name: str) -> str:
        """The path of the forked `name` where the server serves and `name` is one of
        `COMMANDS`, else `name` itself (Flower's own command, found on PATH)."""
        return os.path.join(self.folder, "bin", name) \
            if self.server is not None and name in COMMANDS else name

    def pids(self) -> list:
        """The server's pid, while it runs (its children are its descendants)."""
        proc = self.server._proc if self.server is not None else None
        return [proc.pid] if proc is not None and proc.poll() is None else []

    def close(self) -> None:
        """Ends the server. Its children end with the commands that asked for them
        (`LocalDeployment.stop` waits for them first)."""
        self._thread.join()
        if self.server is not None:
            self.server.close()
            self.server = None
        if self._short is not None:
            shutil.rmtree(self._short, ignore_errors=True)
            self._short = None
