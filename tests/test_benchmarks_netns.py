"""benchmarks/netns.py: hosts as network namespaces joined by shaped veth links, removed
on every exit. Runs only as root with `ip netns` and `tc` (skipped by name otherwise);
checks bytes and behaviour, never timings."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))

import netns  # noqa: E402

PREFIX = "fxt-"  # apart from the benchmark's own, which a running benchmark holds


WHY_NOT = netns.unavailable()
needs_netns = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")


def _namespaces() -> list:
    return netns.names(PREFIX)


_SERVE = ("import socket, sys\n"
          "s = socket.socket(); s.settimeout(60)\n"
          "s.bind((sys.argv[1], 9999)); s.listen(); print('ready', flush=True)\n"
          "c, _ = s.accept(); c.settimeout(60); n = 0\n"
          "while True:\n"
          "    b = c.recv(1 << 20)\n"
          "    if not b: break\n"
          "    n += len(b)\n"
          "print(n, flush=True)\n")
_SEND = ("import socket, sys\n"
         "c = socket.create_connection((sys.argv[1], 9999), timeout=10)\n"
         "c.sendall(b'x' * int(sys.argv[2])); c.close()\n")


@needs_netns
def test_a_node_reaches_the_hub_over_its_shaped_link_until_the_link_goes_down():
    subprocess.run(["ip", "netns", "add", PREFIX + "stale"], check=True, timeout=30)
    with netns.Network(2, prefix=PREFIX) as network:
        assert PREFIX + "stale" not in _namespaces()  # a stale one is removed first
        assert sorted(_namespaces()) == sorted([network.hub, network.ns(0),
                                                network.ns(1)])
        network.shape(0, 20, 100)
        shown = subprocess.run(["tc", "-n", network.ns(0), "qdisc", "show", "dev", "eth0"],
                               capture_output=True, text=True, timeout=30).stdout
        assert "tbf" in shown and "rate 20Mbit" in shown
        server = subprocess.Popen(["ip", "netns", "exec", network.hub, sys.executable,
                                   "-c", _SERVE, network.hub_ip], stdout=subprocess.PIPE,
                                  text=True)
        try:
            assert server.stdout.readline().strip() == "ready"
            before = network.counters(0)
            size = 1 << 20
            subprocess.run(["ip", "netns", "exec", network.ns(0), sys.executable, "-c",
                            _SEND, network.hub_ip, str(size)], check=True, timeout=60)
            assert int(server.stdout.readline()) == size
            assert network.counters(0)[0] - before[0] >= size  # the link carried it
        finally:
            server.kill()
            server.wait()
        network.set_link(0, False)
        refused = subprocess.run(["ip", "netns", "exec", network.ns(0), sys.executable,
                                  "-c", _SEND, network.hub_ip, "1"], capture_output=True,
                                 timeout=60)
        assert refused.returncode != 0  # a cut link: nothing reaches the hub
    assert not _namespaces()


@needs_netns
def test_the_namespaces_go_when_the_run_fails():
    with pytest.raises(RuntimeError, match="stops here"):
        with netns.Network(1, prefix=PREFIX):
            assert len(_namespaces()) == 2
            raise RuntimeError("stops here")
    assert not _namespaces()


@needs_netns
def test_an_attached_network_reaches_its_nodes_from_here_and_its_link_goes_with_it():
    with netns.Network(1, prefix=PREFIX, subnet="10.78.0", attach=True) as network:
        server = subprocess.Popen(["ip", "netns", "exec", network.ns(0), sys.executable,
                                   "-c", _SERVE, network.node_ip(0)],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "ready"
            subprocess.run([sys.executable, "-c", _SEND, network.node_ip(0), "1000"],
                           check=True, timeout=60)  # from this namespace, no `ip netns exec`
            assert int(server.stdout.readline()) == 1000
        finally:
            server.kill()
            server.wait()
        mine = network.host_link
        assert network.host_ip in netns.ip("addr", "show", "dev", mine)
    assert not _namespaces()
    assert subprocess.run(["ip", "link", "show", mine], capture_output=True,
                          timeout=30).returncode != 0  # the attached veth went too


def test_where_namespaces_cannot_be_made_the_reason_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert netns.unavailable() == "needs root and ip netns (iproute2): not running as root"
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None)
    assert netns.unavailable().startswith("needs root and ip netns (iproute2)")
    assert "ip, tc not found" in netns.unavailable()
