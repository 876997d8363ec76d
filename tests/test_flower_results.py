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


def test_a_litert_check_deploys_litert_nodes_and_names_each_node_lost_and_why(
        tmp_path, monkeypatch, capsys):
    """`fax-bridge flower --check --litert` starts SuperNodes that run the carried model
    and compares with the fleet plan run by LiteRT; its output names what computed each
    node's answer and each node lost, with the reason its report gives."""
    import json
    import os

    import numpy as np

    from fax_bridge import cli, parity_flower
    from fax_bridge.parity_report import LeafParity, ParityReport

    asked = {}

    def run_check(app, nodes, home, rounds):
        asked["nodes"] = nodes
        out = os.path.join(home, "results", "run-1")
        os.makedirs(out)
        with open(os.path.join(out, "reports.jsonl"), "w") as f:
            f.write(json.dumps({"round": 0, "error": None, "lost_devices": [
                "node 12 (clients 2..3): no answer within 5.0s"], "served": {
                "node 11 (clients 0..1)": {"client_runtime": "litert",
                                           "model_sha256": DIGEST}}}) + "\n")
        np.savez(os.path.join(out, "result.npz"), result=np.zeros(1))
        return "", os.path.join(out, "result.npz"), 1.0

    def parity_of_run(*args, client_runtime="xla", **kwargs):
        asked["client_runtime"] = client_runtime
        return ParityReport([LeafParity("result", (1,), "float32", 1.0, 1.0, False)],
                            1e-5, 1e-6, 2, 0.001, 1.0, "sig", target="flower")

    monkeypatch.setattr(parity_flower, "run_check", run_check)
    monkeypatch.setattr(parity_flower, "parity_of_run", parity_of_run)
    quickstart = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "examples", "quickstart.py")
    code = cli.main(["flower", f"{quickstart}:fedavg_round", "-o", str(tmp_path / "app"),
                     "--clients", "4", "--litert", "--check", "--rounds", "1"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert [c["client-runtime"] for c in asked["nodes"]] == ["litert", "litert"]
    assert asked["client_runtime"] == "litert"
    assert "round 0: lost node 12 (clients 2..3): no answer within 5.0s" in out
    assert f"round 0: node 11 (clients 0..1) computed by litert (LiteRT model sha256 " \
        f"{DIGEST})" in out
