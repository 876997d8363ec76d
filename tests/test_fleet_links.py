"""The gRPC fleet on shaped links: the link benchmarks' faults, checked as behaviour.

Two devices (`fax-bridge device`, mutual TLS and the fleet token) each on a host of its
own, a network namespace behind a veth link shaped with `tc` (`benchmarks/netns.py`,
`benchmarks/links_fleet.py`: the same hosts `make bench-links` builds), and this process
as the coordinator (`RemoteFleet`), attached to the hosts' bridge. One set of hosts and
devices for the module; each test shapes the links it needs. Runs only as root with
`ip netns`; skipped by name otherwise. Checks what the round does, never how long it
took: a fault's round ends by the fleet's own deadline (`rpc_timeout_s`), and its report
names the device and says why.
"""

from __future__ import annotations

import os
import secrets
import sys
import threading

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))

import netns  # noqa: E402

WHY_NOT = netns.unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")

PREFIX = "fxq-"  # apart from the benchmarks' and the other tests' namespaces
SIZE = 300_000  # float32 parameters: 1.2 MB a client's answer, 9.6 s at 1 Mbit/s
DEADLINE_S = 6.0  # the fault tests' rpc_timeout_s: a margin for the fast device under load
CLIENTS = 2  # one a device


def _data(clients):
    ids = np.asarray(clients)
    return {"x": ((ids + 1) / 1000).astype(np.float32), "w": (ids + 1).astype(np.float32)}


def _jit(params, clients):
    """The round under plain jax.jit over `clients` only."""
    import jax

    import links

    new, weight = jax.jit(links.fax_round(len(clients)))(params, _data(clients))
    return np.asarray(new), np.asarray(weight)


class Hosts:
    def __init__(self, network, addresses, tls, token_file, proto):
        self.network, self.addresses, self.tls = network, addresses, tls
        self.token_file, self.proto = token_file, proto

    def fleet(self, **options):
        from fax_bridge.fleet.remote import RemoteFleet

        return RemoteFleet(self.addresses, token_file=self.token_file, tls=self.tls,
                           connect_timeout_s=120, **options)

    def settle(self, k: int) -> None:
        """Waits until node `k`'s link has been quiet for a second (a dropped device's
        stale answer drained), at most a minute."""
        import time

        end, last, since = time.monotonic() + 60, None, time.monotonic()
        while time.monotonic() < end:
            now = self.network.counters(k)[0]
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= 1.0:
                return
            time.sleep(0.1)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    import links
    import links_fleet
    from fax_bridge.fleet import security
    from fax_bridge.system.process_tree import end_group
    from fax_bridge.tff import forms

    folder = str(tmp_path_factory.mktemp("links"))
    procs = []
    with netns.Network(CLIENTS, PREFIX, subnet="10.79.0", attach=True) as network:
        try:
            ips = [network.node_ip(k) for k in range(CLIENTS)]
            tls = links_fleet.fleet_tls(folder, ips)
            token_file = os.path.join(folder, "token")
            security.write_token_file(token_file, secrets.token_hex(32))
            procs = links_fleet.start_devices(network, folder, tls, token_file)
            links_fleet.wait_listening(procs, ips, timeout_s=300)
            params = np.zeros(SIZE, np.float32)
            proto, _ = forms.round_proto(links.fax_round(CLIENTS), params,
                                         _data(range(CLIENTS)),
                                         placements=("server", "clients"))
            made = Hosts(network, [f"{h}:{links_fleet.PORT}" for h in ips],
                         security.TlsConfig(tls["ca"], *tls["coordinator"]), token_file,
                         proto)
            with made.fleet(rpc_timeout_s=120) as fleet:  # the devices compile, unhurried
                fleet.run(proto, params, _data(range(CLIENTS)))
            yield made
        finally:
            for proc in procs:
                end_group(proc)
    # every exit path: the devices ended, no namespace of this module's prefix left
    assert all(proc.poll() is not None for proc in procs)
    assert netns.names(PREFIX) == []


def _close(got, want) -> None:
    """Within one float32 rounding of jit's own weighted mean: the fleet's sums are
    exact and rounded once, jit's float32 sum rounds on the way."""
    np.testing.assert_allclose(got, want, rtol=2.0 ** -22, atol=0)


def _params(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(SIZE).astype(np.float32)


def test_a_device_of_one_client_sends_4_bytes_a_parameter_up_a_shaped_link(hosts):
    for k in range(CLIENTS):
        hosts.network.shape(k, 20, 100)
    params = _params(1)
    with hosts.fleet(rpc_timeout_s=120) as fleet:
        fleet.run(hosts.proto, params, _data(range(CLIENTS)))  # it sends the computation
        before = [hosts.network.counters(k) for k in range(CLIENTS)]
        (new, weight), rep = fleet.run(hosts.proto, params, _data(range(CLIENTS)),
                                       report=True)
        after = [hosts.network.counters(k) for k in range(CLIENTS)]
    expected = _jit(params, range(CLIENTS))
    _close(new, expected[0])
    np.testing.assert_array_equal(weight, expected[1])
    # The report: one client's addend in float32, plus the messages' few framing bytes.
    assert 4 * SIZE <= rep.bytes_up_per_client < 4 * SIZE + 4096
    assert 4 * SIZE <= rep.bytes_down_per_client < 4 * SIZE + 4096
    # The link: what each device's veth carried up (TLS, HTTP/2, TCP and the Health
    # calls on top) is within 5% of it.
    for k in range(CLIENTS):
        up = after[k][0] - before[k][0]
        assert 4 * SIZE <= up < 4 * SIZE * 1.05, (k, up)


def test_a_straggler_behind_1_mbit_is_dropped_at_the_deadline_and_named(hosts):
    hosts.network.shape(0, 20, 100)
    hosts.network.shape(1, 1, 100)  # its 1.2 MB answer needs 9.6 s; the deadline is 6 s
    params = _params(2)
    try:
        with hosts.fleet(rpc_timeout_s=DEADLINE_S, probe_timeout_s=1.0,
                         min_clients=1) as fleet:
            (new, weight), rep = fleet.run(hosts.proto, params, _data(range(CLIENTS)),
                                           report=True)
            assert rep.error is None and list(rep.participants) == [0]
            assert list(rep.lost_clients) == [1] and len(rep.lost_devices) == 1
            why = rep.lost_devices[0]
            assert why.startswith(hosts.addresses[1]) and "deadline" in why, why
            expected = _jit(params, [0])  # the round over the client that answered
            np.testing.assert_array_equal(new, expected[0])
            np.testing.assert_array_equal(weight, expected[1])
            # The next round runs, on the device left, over every client.
            (new, weight), rep = fleet.run(hosts.proto, new, _data(range(CLIENTS)),
                                           report=True)
            assert rep.error is None and list(rep.participants) == [0, 1]
            assert fleet.addresses == hosts.addresses[:1]
            _close(new, _jit(expected[0], range(CLIENTS))[0])
    finally:
        hosts.network.shape(1, 20, 100)
        hosts.settle(1)


def test_a_link_cut_mid_upload_drops_its_device_and_the_rounds_go_on(hosts):
    hosts.network.shape(0, 20, 100)
    hosts.network.shape(1, 2, 100)  # its answer's upload lasts about 5 s
    stop, cut = threading.Event(), threading.Event()

    def cut_mid_upload():
        start = hosts.network.counters(1)[0]
        while not stop.is_set():
            if hosts.network.counters(1)[0] - start > SIZE:  # a quarter of the answer
                hosts.network.set_link(1, False)
                cut.set()
                return
            stop.wait(0.02)

    params = _params(3)
    try:
        with hosts.fleet(rpc_timeout_s=DEADLINE_S, probe_timeout_s=1.0,
                         min_clients=1) as fleet:
            watch = threading.Thread(target=cut_mid_upload, daemon=True)
            watch.start()
            try:
                (new, _), rep = fleet.run(hosts.proto, params, _data(range(CLIENTS)),
                                          report=True)
            finally:
                stop.set()
                watch.join()
            assert cut.is_set()  # the link went down while the device was uploading
            assert rep.error is None and list(rep.participants) == [0]
            assert len(rep.lost_devices) == 1
            why = rep.lost_devices[0]
            # it ended by the deadline, not hanging on the dead link
            assert why.startswith(hosts.addresses[1]) and "deadline" in why, why
            assert "no Health answer" in why, why
            np.testing.assert_array_equal(new, _jit(params, [0])[0])
            (again, _), rep = fleet.run(hosts.proto, new, _data(range(CLIENTS)),
                                        report=True)
            assert rep.error is None and list(rep.participants) == [0, 1]
            _close(again, _jit(new, range(CLIENTS))[0])
    finally:
        hosts.network.set_link(1, True)
        hosts.network.shape(1, 20, 100)
    # With the link back, a fleet over both devices runs every client again.
    with hosts.fleet(rpc_timeout_s=120) as fleet:
        (new, _), rep = fleet.run(hosts.proto, params, _data(range(CLIENTS)), report=True)
    assert rep.lost_devices == [] and rep.devices == CLIENTS
    _close(new, _jit(params, range(CLIENTS))[0])
