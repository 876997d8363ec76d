"""A Flower deployment started from here: one SuperLink and SuperNodes.

    with LocalDeployment(nodes=[{"population": "/pop", "first-client": 0,
                                 "num-clients": 4}, ...], home="~/flwr-home") as d:
        d.run("app/", {"num-rounds": 3, "out-dir": "/tmp/out"})

The home (Flower's `FLWR_HOME`: its configuration, the processes' logs, the warm
workers' tokens, the fork servers' folders) must be a folder of the user running the
deployment, mode 0700, in folders no one else can write; one there already that is
another user's, writable by others or a link is refused (`private_files`), as is a
link planted under a file the deployment writes in it.

Each process is Flower's own command (`flower-superlink`, `flower-supernode`, then
`flwr run`), started on 127.0.0.1 with free ports, insecure or, with
`credentials=security.local_credentials(...)`, with TLS (the SuperLink's certificate,
the SuperNodes and `flwr run` checking it against the CA) and, when the credentials
hold node keys, SuperNode authentication (`--enable-supernode-auth`: each node's public
key is registered with `flwr supernode register` before the node starts with its
private key; a SuperNode whose key is not registered is refused by the SuperLink), and
with `warm=True` (the default) a warm worker per SuperNode (`worker`; the node's config
then names it), each in a process group of its own so that `stop()` (also on leaving
the `with`) ends it and every process it started (SuperExec, ServerApp and ClientApp
processes). With `fork_apps=True` (the default) the SuperLink and each SuperNode have a
fork server that has Flower loaded, and every Flower process of that host (the
SuperLink or SuperNode itself, its SuperExec, the ServerApp and ClientApp processes,
`flwr` on the SuperLink's host) is forked from it (`forked_apps`: Flower's own
commands less their imports). Flower's commands are found beside the running Python,
and that folder leads PATH, because the SuperLink and SuperNodes start
`flower-superexec` by name. Apps' dependencies are not installed at run time
(`--disable-runtime-dependency-installation`): fax_bridge and flwr are already here.
Each SuperExec polls for tasks every `poll_s` (0.5 s by default, `SUPEREXEC_POLL_S`).

By default everything listens on loopback. `host="10.0.0.1"` binds the SuperLink to
that address instead (the SuperNodes and `flwr run` connect to it; with TLS its
certificate must name it: `security.local_credentials(..., hosts=["10.0.0.1"])`), and
`wrap(name)` gives a command prefix per process (`superlink`, `supernode-I`,
`worker-I`, `flwr`), e.g. `["ip", "netns", "exec", "node-1"]` to run a SuperNode and
its worker on a host of their own: the code a multi-host deployment and the shaped
network benchmark (`benchmarks/links.py`) run is the same. A warm worker always serves
its SuperNode on that node's loopback.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Callable, Optional

from fax_bridge.system import private_files
from fax_bridge.errors import FleetError
from fax_bridge.flower.toml_text import (CONNECTION, connection_toml,
                                         node_config_text)
from fax_bridge.system.process_tree import descendants, end_group, signal_all

log = logging.getLogger("fax_bridge.flower")
LOOPBACK = "127.0.0.1"


_PROBE = ("import socket, sys, time\n"
          "end = time.monotonic() + float(sys.argv[2])\n"
          "while time.monotonic() < end:\n"
          "    try:\n"
          "        socket.create_connection(('127.0.0.1', int(sys.argv[1])), 0.5).close()\n"
          "        sys.exit(0)\n"
          "    except OSError:\n"
          "        time.sleep(0.2)\n"
          "sys.exit(1)\n")


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port on `host` (an address of this host) that was free a moment ago; one
    on loopback when `host` is not an address here (another host's, or one inside a
    network namespace)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, 0))
        except OSError:
            s.close()
            return free_port() if host != LOOPBACK else 0
        return s.getsockname()[1]


# How often each SuperExec asks for a task (Flower's FLWR_SUPEREXEC_TASK_POLL_INTERVAL):
# idle, every poll is a request; docs/flower.md "Poll intervals" has what it costs.
SUPEREXEC_POLL_S = 0.5


def flower_env(home: str, poll_s: float = SUPEREXEC_POLL_S) -> dict:
    """The environment Flower's processes run in (module docstring); `poll_s`: each
    SuperExec's task poll."""
    env = dict(os.environ)
    bin_dir = os.path.dirname(sys.executable)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    env["FLWR_HOME"] = home
    env["FLWR_TELEMETRY_ENABLED"] = "0"
    env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] = str(poll_s)
    env["FLWR_DISABLE_UPDATE_CHECK"] = "1"  # no network look-ups from `flwr`
    return env


def _tail(path: Optional[str], chars: int = 2000) -> str:
    """The end of a process's log, to quote in an error."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - chars))
            return "; its log ends:\n" + f.read().decode(errors="replace")
    except OSError:
        return ""


def wait_port(port: int, proc: subprocess.Popen, what: str, timeout_s: float,
              log: Optional[str] = None, host: str = LOOPBACK) -> None:
    """Waits until `host`:`port` accepts connections; FleetError (quoting `log`) when
    `proc` exits first or `timeout_s` passes."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise FleetError(f"{what} exited with code {proc.returncode} before it listened "
                             f"on port {port}{_tail(log)}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise FleetError(f"{what} did not listen on {host}:{port} within {timeout_s}s"
                     f"{_tail(log)}")


class LocalDeployment:
    """A SuperLink and one SuperNode per entry of `nodes` (their `--node-config`)."""

    def __init__(self, nodes: list, home: str, *, warm: bool = True,
                 poll_s: float = SUPEREXEC_POLL_S,
                 log_dir: Optional[str] = None, start_timeout_s: float = 120.0,
                 credentials=None, host: str = LOOPBACK,
                 wrap: Optional[Callable[[str], list]] = None, fork_apps: bool = True):
        self.nodes = [dict(n) for n in nodes]
        self.host = host
        self.wrap = wrap or (lambda name: [])
        self.credentials = credentials  # security.Credentials, or None: insecure
        if credentials is not None and credentials.node_auth and \
                len(credentials.node_keys) < len(self.nodes):
            raise FleetError(f"{len(self.nodes)} SuperNodes but keys for only "
                             f"{len(credentials.node_keys)}; make one key pair per node "
                             "(security.local_credentials(folder, nodes=...))")
        self.warm, self.fork_apps = warm, fork_apps
        self.forks: dict = {}  # "superlink", "supernode-I" -> forked_apps.AppForks
        self.home = os.path.abspath(os.path.expanduser(home))
        self.env = flower_env(self.home, poll_s)
        self.log_dir = log_dir or os.path.join(self.home, "logs")
        self.start_timeout_s = start_timeout_s
        self.port = 0
        self.superlink: Optional[subprocess.Popen] = None
        self.supernodes: list = []
        self.workers: list = []
        self._configs: list = []  # the SuperNodes' node configs, as started
        self._logs: list = []

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __enter__(self) -> "LocalDeployment":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _spawn(self, name: str, command: list) -> subprocess.Popen:
        log = private_files.open_append(os.path.join(self.log_dir, f"{name}.log"))
        self._logs.append(log)
        forks = self.forks.get(name)
        if forks is not None:
            command = [forks.command(command[0]), *command[1:]]
        return subprocess.Popen(self.wrap(name) + command,
                                env=self.env if forks is None else forks.env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)

    def _cli(self, args: list, wrapped: bool = True) -> tuple:
        """`flwr ARGS` as the deployment runs it (under `wrap("flwr")` when `wrapped`;
        forked from the SuperLink's server when it runs on the SuperLink's host), and
        its environment."""
        prefix = self.wrap("flwr") if wrapped else []
        forks = self.forks.get("superlink")
        if forks is None or prefix != self.wrap("superlink"):
            return prefix + ["flwr", *args], self.env
        return prefix + [forks.command("flwr"), *args], forks.env

    def _wait_forks(self, prefix: str) -> None:
        for name, forks in self.forks.items():
            if name.startswith(prefix) and not forks.wait(self.start_timeout_s):
                log.warning("%s starts Flower's own commands, not forks: %s", name,
                            forks.error or "its fork server did not start in time")

    def _start_forks(self) -> None:
        """A fork server for the SuperLink's and each SuperNode's Flower commands, each
        starting on a thread of its own (`forked_apps.AppForks`)."""
        from fax_bridge.flower import forked_apps

        node_modules = forked_apps.NODE_MODULES if self.warm else \
            forked_apps.COLD_NODE_MODULES
        hosts = {"superlink": forked_apps.LINK_MODULES}
        hosts.update({f"supernode-{i}": node_modules for i in range(len(self.nodes))})
        private_files.private_dir(os.path.join(self.home, "forks"))
        for name, modules in hosts.items():
            self.forks[name] = forked_apps.AppForks(
                os.path.join(self.home, "forks", name), self.env, modules, self.wrap(name))

    def start(self) -> None:
        """Starts the SuperLink, waits for it, registers the nodes' keys (with node
        authentication), then starts the SuperNodes."""
        private_files.private_dir(self.home)  # ours alone: Flower runs from it as us
        private_files.private_dir(self.log_dir)
        self.port = free_port(self.host)
        creds = self.credentials
        private_files.write_file(os.path.join(self.home, "config.toml"), connection_toml(
            self.address, root_certificates=creds and creds.ca_cert))
        if self.fork_apps and not self.forks:
            self._start_forks()
        configs = [self._start_worker(i, c) for i, c in enumerate(self.nodes)] \
            if self.warm else self.nodes
        self._wait_forks("superlink")
        self._start_superlink()
        self._wait_superlink()
        if creds is not None and creds.node_auth:
            self.register([public for _, public in creds.node_keys[:len(configs)]])
        self._configs = configs
        self._wait_forks("supernode-")
        self._start_supernodes()
        for i, worker in enumerate(self.workers):
            self._wait_worker(i, int(configs[i]["worker"].rsplit(":", 1)[1]), worker)

    def _start_supernodes(self) -> None:
        creds = self.credentials
        for i, config in enumerate(self._configs):
            key = creds.node_keys[i][0] if creds is not None and creds.node_auth else None
            self.supernodes.append(self.start_supernode(config, key, f"supernode-{i}"))

    def _start_superlink(self) -> None:
        creds = self.credentials
        security = ["--insecure"] if creds is None else [
            "--ssl-ca-certfile", creds.ca_cert, "--ssl-certfile", creds.server_cert,
            "--ssl-keyfile", creds.server_key] + (
            ["--enable-supernode-auth"] if creds.node_auth else [])
        self.superlink = self._spawn("superlink", [
            "flower-superlink", *security, "--host", self.host, "--port", str(self.port),
            "--disable-runtime-dependency-installation"])

    def _wait_superlink(self) -> None:
        wait_port(self.port, self.superlink, "flower-superlink", self.start_timeout_s,
                  os.path.join(self.log_dir, "superlink.log"), self.host)

    def restart_superlink(self) -> None:
        """Ends the SuperLink (with every process it started, a run's ServerApp too)
        and starts it again on the same address, then the SuperNodes: the new
        SuperLink's state (runs, node ids) starts empty, and Flower 1.42's SuperNodes do
        not join it again by themselves. Their warm workers stay (and keep the compiled
        client part); with node authentication the keys are registered again."""
        for proc in self.supernodes:
            end_group(proc)
        self.supernodes = []
        if self.superlink is not None:
            end_group(self.superlink)
        self._start_superlink()
        self._wait_superlink()
        creds = self.credentials
        if creds is not None and creds.node_auth:
            self.register([public for _, public in creds.node_keys[:len(self.nodes)]])
        self._start_supernodes()

    def start_supernode(self, config: dict, private_key: Optional[str] = None,
                        name: str = "supernode-extra") -> subprocess.Popen:
        """Starts one `flower-supernode` with `config` as its `--node-config` (TLS when
        the deployment has credentials; authenticating with `private_key` when given)
        and returns it; its output goes to `log(name)`. `start` starts the deployment's
        own nodes with this; a node started later is the caller's to stop."""
        creds = self.credentials
        security = ["--insecure"] if creds is None else \
            ["--root-certificates", creds.ca_cert]
        if private_key is not None:
            security += ["--auth-supernode-private-key", private_key]
        return self._spawn(name, [
            "flower-supernode", *security, "--superlink", self.address,
            "--host", LOOPBACK, "--port", str(free_port()),
            "--node-config", node_config_text(config)])

    def register(self, public_keys: list, timeout_s: float = 120.0) -> None:
        """`flwr supernode register KEY fax-bridge` for each public key (OpenSSH), all at
        once; raises a `FleetError` quoting Flower's output when one is refused."""
        procs = []
        for key in public_keys:
            command, env = self._cli(["supernode", "register", key, CONNECTION],
                                     wrapped=False)
            procs.append((key, subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True)))
        failed = []
        for key, proc in procs:
            try:
                out, _ = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                end_group(proc)
                out, _ = proc.communicate()
            if proc.returncode != 0:
                failed.append(f"{key}: {out.decode(errors='replace')[-1000:]}")
        if failed:
            raise FleetError("the SuperLink did not register these SuperNode keys: "
                             + "; ".join(failed))

    def _wait_worker(self, index: int, port: int, worker: subprocess.Popen) -> None:
        """Waits for worker `index` to listen on its node's loopback (seen from the
        node's own host, through `wrap`)."""
        log = os.path.join(self.log_dir, f"worker-{index}.log")
        prefix = self.wrap(f"worker-{index}")
        if not prefix:
            wait_port(port, worker, f"the worker of SuperNode {index}",
                      self.start_timeout_s, log)
            return
        probe = prefix + [sys.executable, "-c", _PROBE, str(port),
                          str(self.start_timeout_s)]
        if subprocess.run(probe, stdin=subprocess.DEVNULL, capture_output=True,
                          timeout=self.start_timeout_s + 30).returncode != 0 \
                or worker.poll() is not None:
            raise FleetError(f"the worker of SuperNode {index} did not listen on its "
                             f"loopback port {port} within {self.start_timeout_s}s"
                             f"{_tail(log)}")

    def _start_worker(self, index: int, config: dict) -> dict:
        """Starts node `index`'s warm worker; returns the node's config naming it."""
        from fax_bridge.flower.worker import start_worker

        worker, node_config = start_worker(
            config, os.path.join(self.home, f"worker-{index}.token"),
            f"{LOOPBACK}:{free_port()}",  # free here: likely free on its host too
            lambda command: self._spawn(f"worker-{index}", command))
        self.workers.append(worker)
        return node_config

    def run(self, app_dir: str, run_config: Optional[dict] = None,
            timeout_s: float = 300.0) -> subprocess.CompletedProcess:
        """`flwr run APP_DIR fax-bridge --stream` with run config overrides; waits for it
        (at most `timeout_s`, then its process group is ended) and returns it."""
        command = ["flwr", "run", os.path.abspath(app_dir), CONNECTION, "--stream"]
        if run_config:
            command += ["--run-config", node_config_text(run_config)]
        argv, env = self._cli(command[1:])
        proc = subprocess.Popen(argv, env=env,
                                stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            end_group(proc)
            out, _ = proc.communicate()
            raise FleetError(f"`{' '.join(command)}` did not finish within {timeout_s}s; "
                             f"its output:\n{out.decode(errors='replace')[-4000:]}") from None
        return subprocess.CompletedProcess(command, proc.returncode, out.decode(
            errors="replace"), "")

    def kill_node(self, index: int) -> None:
        """SIGKILLs SuperNode `index`, everything it started, and its worker."""
        end_group(self.supernodes[index], signal.SIGKILL)
        if self.workers:
            end_group(self.workers[index], signal.SIGKILL)

    def pids(self) -> list:
        """The ids of every process the deployment runs now: its own and all they
        started (SuperExecs, ServerApp and ClientApp processes)."""
        procs = self.supernodes + self.workers + (
            [self.superlink] if self.superlink else [])
        pids = [p.pid for p in procs] + [pid for f in self.forks.values()
                                         for pid in f.pids()]
        return pids + [c for pid in pids for c in descendants(pid)]

    def log(self, name: str) -> str:
        """The output so far of `superlink` or `supernode-I`."""
        with open(os.path.join(self.log_dir, f"{name}.log"), "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self) -> None:
        """Ends the SuperNodes, then the SuperLink, each with its process group."""
        for proc in self.supernodes + self.workers + (
                [self.superlink] if self.superlink else []):
            end_group(proc)
        self.supernodes, self.workers, self.superlink = [], [], None
        servers = [pid for forks in self.forks.values() for pid in forks.pids()]
        end = time.monotonic() + 5.0  # their children end with the commands just ended
        while any(descendants(pid) for pid in servers) and time.monotonic() < end:
            time.sleep(0.05)
        signal_all([c for pid in servers for c in descendants(pid)], signal.SIGKILL)
        for forks in self.forks.values():
            forks.close()
        self.forks = {}
        for file in self._logs:
            file.close()
        self._logs = []
