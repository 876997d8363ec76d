"""The ServerApp's run config (`fax_bridge.flower.server.Settings.from_run_config`):
every key is read once, checked for its kind and range, and a value it cannot take is
refused naming the key, the value and what the key accepts."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import example, given, settings, strategies as st

from fax_bridge.errors import FleetError
from fax_bridge.flower import server

KEYS = sorted(server.RUN_CONFIG)
_VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(-2 ** 70, 2 ** 70),
    st.booleans(), st.none(), st.text(max_size=6),
    st.sampled_from(["nan", "inf", "-inf", "1e400", "7", "-3", "0.5", "true", "1.5",
                     "a\0b", [1], {"a": 1}, 2 ** 63, -1, 0, 0.0, 1, 10 ** 6 + 1]))


def _attribute(settings_: server.Settings, key: str):
    """Where `Settings` keeps the value of run config `key`."""
    policy = settings_.policy
    return {"cohort-size": policy.cohort_size or 0, "dropout": policy.dropout,
            "round-deadline-s": policy.round_deadline_s or 0.0,
            "min-clients": policy.min_clients, "seed": policy.seed,
            "rounded-partials": policy.rounded_partials,
            }.get(key, getattr(settings_, key.replace("-", "_"), None))


@settings(max_examples=400, deadline=None)
@given(key=st.sampled_from(KEYS), value=_VALUES)
@example(key="node-timeout-s", value=float("nan"))
@example(key="wait-nodes-s", value=float("nan"))
@example(key="poll-s", value=-1)
@example(key="num-rounds", value=-3)
@example(key="first-round-timeout-s", value=float("inf"))
@example(key="seed", value=-1)
@example(key="population-size", value=2 ** 40)
@example(key="dropout", value=10 ** 400)
@example(key="seed", value=2 ** 62 + 1)
def test_every_run_config_value_is_in_range_or_refused_naming_key_value_and_range(
        key, value):
    """Whatever a run config gives a key: Settings holds a value of the key's kind in
    its range (never NaN, an infinity, a negative wait or count, a fraction cut to a
    whole number), or a FleetError names the key, the value and the range."""
    spec = server.RUN_CONFIG[key]
    try:
        got = server.Settings.from_run_config({key: value})
    except FleetError as e:
        text = str(e)
        assert text.startswith(f"run config {key}=") and spec.accepted() in text, text
        assert f"give e.g. {key}=" in text
        return
    held = _attribute(got, key)
    if spec.kind == "flag":
        assert isinstance(held, bool)
    elif spec.kind == "text":
        assert held == value and isinstance(held, str) and "\0" not in held
    else:
        assert not isinstance(value, bool) and not isinstance(held, bool)
        assert isinstance(held, int if spec.kind == "whole" else float)
        assert math.isfinite(held) and spec.holds(held), (key, value, held)
        want = value if isinstance(value, int) and spec.kind == "whole" else float(value)
        assert held == want  # never rounded, cut or wrapped


def test_the_findings_values_are_refused_by_name():
    for key, value, accepted in [
            ("node-timeout-s", float("nan"), "a number in (0, 604800]"),
            ("wait-nodes-s", float("nan"), "a number in [0, 604800]"),
            ("poll-s", -1, "a number in (0, 60]"),
            ("num-rounds", -3, "a whole number in [1, 1000000]"),
            ("dropout", 1.0, "a number in [0, 1)")]:
        with pytest.raises(FleetError, match=re.escape(
                f"run config {key}={value!r} is not {accepted}; give e.g. {key}=")):
            server.Settings.from_run_config({key: value})


def test_defaults_and_whole_numbers_written_as_text_or_floats():
    got = server.Settings.from_run_config({})
    assert (got.num_rounds, got.node_timeout_s, got.poll_s, got.population_size) == \
        (1, 120.0, 0.05, 0)
    got = server.Settings.from_run_config({"num-rounds": "4", "cohort-size": 3.0,
                                           "population-size": 10, "poll-s": "0.5"})
    assert (got.num_rounds, got.policy.cohort_size, got.population_size, got.poll_s) == \
        (4, 3, 10, 0.5)
