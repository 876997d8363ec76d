"""HOST:PORT parsing (one reader for --listen, device addresses, fleet files, multihost),
the client layout, and how fleets take their round policy."""

import pytest
from hypothesis import given, strategies as st

from fax_bridge.errors import AddressError, ArgumentError
from fax_bridge.fleet import fleet_file
from fax_bridge.fleet.protocol import format_address, parse_address, partition
from fax_bridge.rounds.policy import RoundPolicy, resolve_policy


@given(st.sampled_from(["127.0.0.1", "localhost", "10.0.0.2", "::1", "fe80::1"]),
       st.integers(1, 65535))
def test_addresses_round_trip(host, port):
    assert parse_address(format_address(host, port)) == (host, port)


@pytest.mark.parametrize("bad", ["nohost", "127.0.0.1", ":80", "h:", "h:x", "h:99999",
                                 "h:65536", "::1:80", 80, None])
def test_malformed_addresses_are_refused_by_every_reader(bad):
    with pytest.raises(AddressError):
        parse_address(bad)
    with pytest.raises(ValueError):  # AddressError is also a ValueError
        fleet_file.check_address(bad)


def test_port_zero_only_where_listening():
    assert parse_address("127.0.0.1:0", allow_port_zero=True) == ("127.0.0.1", 0)
    with pytest.raises(AddressError, match="1..65535"):
        parse_address("127.0.0.1:0")


@given(st.integers(0, 500), st.integers(1, 40))
def test_partition_covers_clients_in_order(clients, devices):
    blocks = partition(clients, devices)
    assert [c for b in blocks for c in b] == list(range(clients))
    assert max(map(len, blocks)) - min(map(len, blocks)) <= 1


def test_fleets_take_a_policy_or_its_fields():
    assert resolve_policy(None, {"seed": 3}, "LocalFleet") == RoundPolicy(seed=3)
    policy = RoundPolicy(cohort_size=5)
    assert resolve_policy(policy, {}, "LocalFleet") is policy
    with pytest.raises(ArgumentError, match="cohort_sise"):
        resolve_policy(None, {"cohort_sise": 5}, "LocalFleet")
    with pytest.raises(ArgumentError, match="policy= and also"):
        resolve_policy(policy, {"seed": 1}, "RemoteFleet")
    with pytest.raises(TypeError):
        resolve_policy({"seed": 1}, {}, "RemoteFleet")


@given(st.fixed_dictionaries({}, optional={
    "max_clients": st.integers(1, 1 << 30), "max_connections": st.integers(1, 65536),
    "idle_timeout_s": st.floats(1.0, 1e4), "max_call_seconds": st.floats(0.001, 1e5),
    "max_stored_bytes": st.integers(1, 1 << 40)}))
def test_device_limits_go_through_the_device_flags_unchanged(fields):
    """What a launcher writes (`DeviceLimits.flags`) the device command reads back."""
    import argparse

    from fax_bridge.fleet import device_cli
    from fax_bridge.fleet.protocol import DeviceLimits

    parser = argparse.ArgumentParser()
    device_cli._add_arguments(parser)
    limits = DeviceLimits(**fields)
    assert DeviceLimits.from_flags(parser.parse_args(limits.flags())) == limits
    assert len(limits.flags()) == 2 * len([k for k, v in fields.items()
                                           if v != getattr(DeviceLimits(), k)])
