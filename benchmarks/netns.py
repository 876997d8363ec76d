"""Hosts as Linux network namespaces joined by shaped veth links: the one copy of the
namespace, veth and `tc` code the link benchmarks and their tests share.

A `Network` is a hub namespace holding a bridge at SUBNET.1/24 and one namespace per
node at SUBNET.(10+K), each joined to the bridge by a veth pair (`eth0` in the node,
`hvK` on the bridge) whose node end can be shaped to an uplink rate and whose hub end to
a downlink rate (`tc tbf` on each end's egress). With `attach=True` the namespace this
process runs in joins the bridge too, at SUBNET.2 (unshaped): code here then reaches
the nodes directly (the tests' coordinator). Namespaces are named PREFIX + "hub" and
PREFIX + "nK"; making a network first removes stale ones of its prefix (with every
process in them), and leaving it, an error, or the process's exit removes them again
(the attached veth goes with the hub). Needs root and `ip netns` (iproute2) with `tc`:
`unavailable()` says what is missing.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
from typing import Optional

NEEDS = "needs root and ip netns (iproute2)"


def ip(*args: str, check: bool = True) -> str:
    """Runs `ip ARGS`; its output (RuntimeError naming the command when it fails)."""
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def tc(ns: str, *args: str) -> None:
    """Runs `tc -n NS ARGS` (RuntimeError naming the command when it fails)."""
    out = subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True,
                         timeout=30)
    if out.returncode:
        raise RuntimeError(f"tc -n {ns} {' '.join(args)}: {out.stderr.strip()}")


def unavailable(probe_prefix: str = "fxprobe-") -> Optional[str]:
    """None where namespaces can be made here; else why not (starting with `NEEDS`)."""
    if os.geteuid() != 0:
        return f"{NEEDS}: not running as root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{NEEDS} with tc: {', '.join(missing)} not found"
    probe = f"{probe_prefix}{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                          timeout=30)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    if made.returncode:
        return f"{NEEDS}: `ip netns add` failed ({made.stderr.strip()})"
    return None


def names(prefix: str) -> list:
    """The namespaces whose names start with `prefix`."""
    return [line.split()[0] for line in ip("netns", "list", check=False).splitlines()
            if line.split() and line.split()[0].startswith(prefix)]


def remove_stale(prefix: str) -> None:
    """Ends every process in, and deletes, each namespace whose name starts with
    `prefix`."""
    for name in names(prefix):
        for pid in ip("netns", "pids", name, check=False).split():
            try:
                os.kill(int(pid), 9)
            except (ProcessLookupError, ValueError):
                pass
        ip("netns", "del", name, check=False)


class Network:
    """The hub and `nodes` node namespaces (module docstring), their names starting with
    `prefix`; `shape` sets the links. Leaving the `with` (or the process) removes them."""

    def __init__(self, nodes: int, prefix: str, subnet: str = "10.77.0",
                 attach: bool = False):
        self.nodes, self.prefix, self.subnet, self.attach = nodes, prefix, subnet, attach
        self.hub = prefix + "hub"
        self.hub_ip = f"{subnet}.1"
        self.host_ip = f"{subnet}.2" if attach else None
        # this namespace's end of the attached veth (interface names: 15 characters)
        self.host_link = prefix.rstrip("-")[:12] + "-up" if attach else None

    def ns(self, k: int) -> str:
        return f"{self.prefix}n{k}"

    def node_ip(self, k: int) -> str:
        return f"{self.subnet}.{10 + k}"

    def __enter__(self) -> "Network":
        self._remove()
        atexit.register(self._remove)
        hub = self.hub
        try:
            ip("netns", "add", hub)
            ip("-n", hub, "link", "set", "lo", "up")
            ip("-n", hub, "link", "add", "br0", "type", "bridge")
            ip("-n", hub, "addr", "add", f"{self.hub_ip}/24", "dev", "br0")
            ip("-n", hub, "link", "set", "br0", "up")
            for k in range(self.nodes):
                ns = self.ns(k)
                ip("netns", "add", ns)
                ip("-n", ns, "link", "set", "lo", "up")
                ip("-n", hub, "link", "add", f"hv{k}", "type", "veth", "peer", "name",
                   "eth0", "netns", ns)
                ip("-n", hub, "link", "set", f"hv{k}", "master", "br0", "up")
                ip("-n", ns, "addr", "add", f"{self.node_ip(k)}/24", "dev", "eth0")
                ip("-n", ns, "link", "set", "eth0", "up")
            if self.attach:
                mine = self.host_link
                ip("-n", hub, "link", "add", "hvhost", "type", "veth", "peer", "name",
                   mine, "netns", str(os.getpid()))
                ip("-n", hub, "link", "set", "hvhost", "master", "br0", "up")
                ip("addr", "add", f"{self.host_ip}/24", "dev", mine)
                ip("link", "set", mine, "up")
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._remove()

    def _remove(self) -> None:
        """The attached veth (deleted here: a deleted namespace's links go only later,
        when the kernel gets to it), then the namespaces and what runs in them."""
        if self.attach:
            ip("link", "del", self.host_link, check=False)
        remove_stale(self.prefix)

    def shape(self, k: int, up_mbit: float, down_mbit: float) -> None:
        """Node `k`'s uplink (its veth end's egress) and downlink (the hub end's)."""
        for ns, dev, rate in ((self.ns(k), "eth0", up_mbit), (self.hub, f"hv{k}", down_mbit)):
            burst = max(32 << 10, int(rate * 1e6 / 8 / 50))  # 20 ms of the rate
            tc(ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
               f"{rate}mbit", "burst", str(burst), "latency", "200ms")

    def set_link(self, k: int, up: bool) -> None:
        """Takes node `k`'s link down (a cut cable) or brings it up again."""
        ip("-n", self.ns(k), "link", "set", "eth0", "up" if up else "down")

    def wrap(self, name: str) -> list:
        """`LocalDeployment`'s command prefix: SuperNode K and its worker on node K's
        host; the SuperLink and `flwr run` where this runs (the hub)."""
        if name.startswith(("supernode-", "worker-")):
            return ["ip", "netns", "exec", self.ns(int(name.rsplit("-", 1)[1]))]
        return []

    def counters(self, k: int) -> tuple:
        """(bytes node `k` sent, bytes it received) on its link so far."""
        stats = json.loads(ip("-n", self.ns(k), "-s", "-j", "link", "show", "eth0"))[0]
        return stats["stats64"]["tx"]["bytes"], stats["stats64"]["rx"]["bytes"]


def run_in_hub(network: Network, script: str, timeout_s: float) -> int:
    """Runs `script` again with this command's arguments and `--inside`, in the network's
    hub namespace; the whole process group is killed on timeout or interruption."""
    command = ["ip", "netns", "exec", network.hub, sys.executable, os.path.abspath(script),
               "--inside", *sys.argv[1:]]
    proc = subprocess.Popen(command, start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s)
    except BaseException:
        os.killpg(proc.pid, 9)
        proc.wait()
        raise
