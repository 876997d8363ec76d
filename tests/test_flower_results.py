"""What a Flower run says about itself: which client runtime and LiteRT model computed
each node's answer (`records.served_of`), and its result read back by name."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fax_bridge.errors import FleetError
from fax_bridge.flower import records

DIGEST = "0123456789abcdef" * 4
WHERE = "node 7 (clients 0..3)"


def _content(served) -> dict:
    return {records.SERVED: served}


@pytest.mark.parametrize("served, want", [
    ({"client-runtime": "xla", "model-sha256": ""}, ("xla", None)),
    ({"client-runtime": "litert", "model-sha256": DIGEST}, ("litert", DIGEST)),
])
def test_an_answer_names_its_client_runtime_and_model(served, want):
    assert records.served_of(_content(served), WHERE) == want


_VALUES = st.one_of(
    st.sampled_from(["xla", "litert", "", "tflite", "XLA", DIGEST, DIGEST.upper(),
                     DIGEST[:-1], DIGEST + "0", "g" * 64, "litert\x00"]),
    st.text(max_size=80), st.integers(), st.floats(allow_nan=True), st.booleans(),
    st.lists(st.text(max_size=3), max_size=3), st.none())


@settings(max_examples=200, deadline=None)
@given(served=st.one_of(
    st.dictionaries(st.sampled_from(["client-runtime", "model-sha256", "extra", "model"]),
                    _VALUES, max_size=4),
    _VALUES))
def test_only_a_known_runtime_with_its_models_digest_is_believed(served):
    honest = isinstance(served, dict) and set(served) == set(records.SERVED_KEYS) and (
        (served["client-runtime"], served["model-sha256"]) in [("xla", ""),
                                                               ("litert", DIGEST)])
    try:
        got = records.served_of(_content(served), WHERE)
    except FleetError as e:
        assert WHERE in str(e) and "forged" in str(e)
        assert not honest
        return
    assert honest, f"{served!r} was believed as {got}"


def test_an_answer_without_the_record_is_refused_by_name():
    with pytest.raises(FleetError, match=r"3\): its answer has no served record"):
        records.served_of({}, WHERE)
