"""benchmarks/links.py: hosts as network namespaces joined by shaped veth links, removed
on every exit. Runs only as root with `ip netns` and `tc` (skipped by name otherwise);
checks bytes and behaviour, never timings."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))

import links  # noqa: E402

PREFIX = "fxt-"  # apart from the benchmark's own, which a running benchmark holds


def _can_make_namespaces() -> bool:
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        return False
    probe = PREFIX + "probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, timeout=30)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return made.returncode == 0


pytestmark = pytest.mark.skipif(not _can_make_namespaces(),
                                reason="needs root with `ip netns` and `tc`")


def _namespaces() -> list:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                         timeout=30).stdout
    return [line.split()[0] for line in out.splitlines()
            if line.split() and line.startswith(PREFIX)]


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


def test_a_node_reaches_the_hub_over_its_shaped_link_until_the_link_goes_down():
    subprocess.run(["ip", "netns", "add", PREFIX + "stale"], check=True, timeout=30)
    with links.Network(2, prefix=PREFIX) as network:
        assert PREFIX + "stale" not in _namespaces()  # a stale one is removed first
        assert sorted(_namespaces()) == sorted([network.hub, network.ns(0),
                                                network.ns(1)])
        network.shape(0, 20, 100)
        shown = subprocess.run(["tc", "-n", network.ns(0), "qdisc", "show", "dev", "eth0"],
                               capture_output=True, text=True, timeout=30).stdout
        assert "tbf" in shown and "rate 20Mbit" in shown
        server = subprocess.Popen(["ip", "netns", "exec", network.hub, sys.executable,
                                   "-c", _SERVE, links.HUB_IP], stdout=subprocess.PIPE,
                                  text=True)
        try:
            assert server.stdout.readline().strip() == "ready"
            before = network.counters(0)
            size = 1 << 20
            subprocess.run(["ip", "netns", "exec", network.ns(0), sys.executable, "-c",
                            _SEND, links.HUB_IP, str(size)], check=True, timeout=60)
            assert int(server.stdout.readline()) == size
            assert network.counters(0)[0] - before[0] >= size  # the link carried it
        finally:
            server.kill()
            server.wait()
        network.set_link(0, False)
        refused = subprocess.run(["ip", "netns", "exec", network.ns(0), sys.executable,
                                  "-c", _SEND, links.HUB_IP, "1"], capture_output=True,
                                 timeout=60)
        assert refused.returncode != 0  # a cut link: nothing reaches the hub
    assert not _namespaces()


def test_the_namespaces_go_when_the_run_fails():
    with pytest.raises(RuntimeError, match="stops here"):
        with links.Network(1, prefix=PREFIX):
            assert len(_namespaces()) == 2
            raise RuntimeError("stops here")
    assert not _namespaces()
