"""FleetConfig: a LocalFleet's options as one object, or as keywords beside the policy's."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, strategies as st

from fax_bridge.errors import ArgumentError, FleetError
from fax_bridge.fleet import security
from fax_bridge.fleet.config import FleetConfig, resolve_config
from fax_bridge.fleet.launcher import LocalFleet

_FIELDS = [f.name for f in dataclasses.fields(FleetConfig)]


@given(st.sampled_from(["rpc_timeout_s", "startup_timeout_s", "probe_timeout_s"]),
       st.floats(0.5, 100.0), st.integers(1, 50))
def test_keywords_and_config_give_the_same_fleet(name, value, cohort):
    by_keywords = LocalFleet(devices=1, **{name: value}, cohort_size=cohort)
    by_config = LocalFleet(devices=1, config=FleetConfig(**{name: value}),
                           cohort_size=cohort)
    assert by_keywords.config == by_config.config
    assert getattr(by_keywords.config, name) == value
    assert by_keywords.policy == by_config.policy
    assert by_keywords.policy.cohort_size == cohort


def test_every_option_lands_in_the_config_and_the_rest_in_the_policy():
    config, rest = resolve_config(None, {"share_cpus": False, "seed": 3}, "LocalFleet")
    assert config == FleetConfig(share_cpus=False) and rest == {"seed": 3}
    assert set(_FIELDS) >= {"rpc_timeout_s", "token", "population", "shared_memory"}


def test_unknown_or_doubled_options_are_named():
    with pytest.raises(ArgumentError, match=r"\['bogus'\].*FleetConfig\) are"):
        LocalFleet(devices=1, bogus=1)
    with pytest.raises(ArgumentError, match="devices always reduce their own clients"):
        LocalFleet(devices=1, preaggregate=False)
    with pytest.raises(ArgumentError, match=r"config= and also \['rpc_timeout_s'\]"):
        LocalFleet(devices=1, config=FleetConfig(), rpc_timeout_s=3)
    with pytest.raises(ArgumentError, match="needs a FleetConfig"):
        LocalFleet(devices=1, config={"rpc_timeout_s": 3})
    with pytest.raises(FleetError, match="both device_tls and coordinator_tls"):
        FleetConfig(device_tls=security.TlsConfig("ca", "cert", "key"))
