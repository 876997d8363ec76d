"""Production forms: refusals naming operations, lines and fixes; StableHLO artifacts of
the Xla parts; DAF and MRF built by TFF 0.87 (side environment) through the API and CLI,
both in one start of TensorFlow (`tff_answers`)."""

import hashlib
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from federated_language.common_libs import structure
from federated_language.proto.computation_pb2 import Computation

import fax_bridge as fb
from fax_bridge.system import output_folders
from fax_bridge.cli import main as cli_main
from fax_bridge.runtime.interpreter import evaluate
from fax_bridge.tff import forms

N = 3
HERE = os.path.basename(__file__)
REPO = pathlib.Path(__file__).resolve().parents[1]


def _local_step(w, x):
    return jnp.mean((x @ w) ** 2), jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)


@fb.program(clients=N)
def one_trip(w, x):
    loss, g = fb.federated_map_clients(_local_step, (fb.federated_broadcast(w), x))
    new_w = fb.federated_map_server(lambda w, g: w - 0.1 * g, (w, fb.federated_mean(g)))
    return new_w, fb.federated_mean(loss)


@fb.program(clients=N)
def two_trips(w, x):
    _, g = fb.federated_map_clients(_local_step, (fb.federated_broadcast(w), x))
    w1 = fb.federated_map_server(lambda w, g: w - 0.1 * g, (w, fb.federated_mean(g)))
    again = fb.federated_broadcast(w1)  # the second trip
    loss, _ = fb.federated_map_clients(_local_step, (again, x))
    return w1, fb.federated_mean(loss)


@fb.program(clients=N)
def client_state(state, x):
    h = fb.federated_map_clients(lambda h, x: h + x.sum(), (state["h"], x))
    return {"w": state["w"], "h": h}, fb.federated_mean(h)


W = jnp.array([0.5, -0.25], jnp.float32)
X = np.arange(N * 4 * 2, dtype=np.float32).reshape(N, 4, 2) / 10


def two_trips_example_args(clients):  # for `fax-bridge forms THIS_FILE:two_trips`
    return (W, X[:clients]), ("server", "clients")


def test_two_trips_are_refused_naming_both_operations_and_lines():
    with pytest.raises(fb.ExportError) as e:
        forms.round_proto(two_trips, W, X, placements=("server", "clients"))
    msg = str(e.value)
    assert "two server-client trips" in msg
    assert f"federated_broadcast at {__file__}:" in msg and "(two_trips)" in msg
    assert "sends a value computed from federated_mean" in msg
    assert "carry it in the state" in msg


def test_client_state_is_refused_naming_the_values():
    state = {"w": W, "h": np.zeros(N, np.float32)}
    with pytest.raises(fb.ExportError, match=r"keeps client state: arguments arg0\['h'\].*"
                                             r"results out0\['h'\].*Move it to the server"):
        forms.round_proto(client_state, state, X,
                          placements=({"w": "server", "h": "clients"}, "clients"))


def test_intrinsics_outside_the_forms_are_refused():
    proto, _ = forms.round_proto(one_trip, W, X, placements=("server", "clients"))
    forms.check_intrinsics(proto)
    data = proto.SerializeToString().replace(b"federated_broadcast", b"federated_select___")
    odd = type(proto).FromString(data)
    with pytest.raises(fb.ExportError, match="calls federated_select___, which no production"):
        forms.check_intrinsics(odd)


def test_every_xla_part_gets_one_portable_artifact(tmp_path):
    proto, _ = forms.round_proto(one_trip, W, X, placements=("server", "clients"))
    parts = forms.xla_parts(proto)
    assert len(parts) == 2  # the clients' step and the server's update
    artifacts = forms.write_artifacts(proto, str(tmp_path))
    assert len(artifacts) == len(parts)
    for path in artifacts.values():
        assert pathlib.Path(path).read_bytes().startswith(b"ML\xefR")


def _check_manifest(folder, manifest):
    on_disk = json.loads((folder / "manifest.json").read_text())
    assert on_disk == manifest
    for entry in manifest["files"].values():
        data = (folder / entry["file"]).read_bytes()
        assert len(data) == entry["bytes"]
        assert hashlib.sha256(data).hexdigest() == entry["sha256"]


QUICKSTART = f"{REPO}/examples/quickstart.py:fedavg_round"


@pytest.fixture(scope="module")
def tff_answers(tmp_path_factory):
    """TFF's answers for the two forms the tests below build (the DAF of `one_trip`, the
    MRF of the quickstart round at 3 clients), from one side-environment process: each
    start of TensorFlow takes 15 s or more of a core. Keyed by `_without_call_sites`."""
    from fax_bridge.tff.cli import resolve_program

    from fax_bridge.tff import fcp

    prog, prog_args, placements = resolve_program(QUICKSTART, 3)
    folder = str(tmp_path_factory.mktemp("forms"))
    jobs = [forms.job(kind, forms.round_proto(fn, *a, placements=pl)[0], [kind],
                      os.path.join(folder, kind))
            for kind, fn, a, pl in (("daf", one_trip, (W, X), ("server", "clients")),
                                    ("mrf", prog, prog_args, placements))]
    # Federated Compute's forms of `one_trip` (both kinds, no plain form).
    proto = forms.round_proto(one_trip, W, X, placements=("server", "clients"))[0]
    jobs.append(fcp.with_fcp(forms.job("fcp", proto, [], os.path.join(folder, "fcp"),
                                       artifacts=True), proto, ["mrf", "daf"]))
    answers = forms.build_forms(jobs, folder)
    return {_key(job): (job, answers[job["name"]]) for job in jobs}


def _key(job: dict) -> tuple:
    """A job as `tff_answers` keys it: its round (`_without_call_sites`), forms and FCP
    forms."""
    return (_without_call_sites(job["proto"]), tuple(job["forms"]),
            "fcp" in job)


def _without_call_sites(path: str) -> bytes:
    """The round proto at `path` with every Xla part's HLO module as its text: the same
    round exported from another caller differs only in the modules' Python stack
    frames (metadata, which the text leaves out)."""
    from jax._src.lib import xla_client

    proto = Computation.FromString(pathlib.Path(path).read_bytes())

    def strip(message) -> None:
        for field, value in message.ListFields():
            if field.name == "hlo_module":
                value.value = xla_client.XlaComputation(value.value).as_hlo_text(
                    print_large_constants=True).encode()
            elif field.message_type is not None:
                for item in (value if field.is_repeated else [value]):
                    strip(item)

    strip(proto)
    return proto.SerializeToString()


@pytest.fixture
def built_once(tff_answers, monkeypatch):
    """`forms.build_forms` answering from `tff_answers`, for a job whose round proto and
    forms are those of a job TFF built there (any other job fails the test)."""
    def replay(jobs, folder, timeout_s=600.0):
        answers = {}
        for job in jobs:
            key = _key(job)
            assert key in tff_answers, f"a round TFF was not asked to build: {job}"
            built, answer = tff_answers[key]
            assert set(job.get("fcp", {}).get("forms", ())) <= set(
                built.get("fcp", {}).get("forms", ())), job
            answers[job["name"]] = answer
        return answers

    monkeypatch.setattr(forms, "build_forms", replay)


def test_daf_built_by_tff_runs_piece_by_piece_like_jit(tmp_path, built_once):
    daf = fb.to_distribute_aggregate_form(one_trip, W, X, placements=("server", "clients"))
    assert list(daf.pieces) == list(forms.DAF_PIECES)
    assert daf.type_signature == ("(<float32[2]@SERVER,{float32[4,2]}@CLIENTS> -> "
                                  "<float32[2]@SERVER,float32@SERVER>)")
    new_w, loss = forms.run_daf(daf, W, list(X))
    want_w, want_loss = jax.jit(one_trip)(W, X)
    np.testing.assert_allclose(new_w, want_w, rtol=1e-6)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    back = evaluate(daf.round, [W, list(X)])  # the round TFF re-derived from the pieces
    np.testing.assert_allclose(structure.flatten(back)[0], want_w, rtol=1e-6)
    manifest = fb.write_form(daf, str(tmp_path))
    assert manifest["form"] == "DistributeAggregateForm"
    _check_manifest(tmp_path, manifest)


def test_cli_writes_the_map_reduce_form_and_its_manifest(tmp_path, capsys, built_once):
    out = tmp_path / "mrf"
    rc = cli_main(["forms", QUICKSTART, "--form", "mrf", "--clients", "3", "-o", str(out)])
    assert rc == 0, capsys.readouterr().err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["form"] == "MapReduceForm"
    assert manifest["pieces"] == list(forms.MRF_PIECES)
    assert manifest["files"]["work"]["type"].startswith("(<<x=float32[16,4],y=float32[16]>,")
    _check_manifest(out, manifest)
    (out / "round.pb").write_bytes(b"mine")  # the user's file where a piece goes
    (out / output_folders.RECORD).unlink()
    rc = cli_main(["forms", QUICKSTART, "--form", "mrf", "--clients", "3", "-o", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and f"would replace '{out}{os.sep}" in err and "--force" in err, err
    assert (out / "round.pb").read_bytes() == b"mine"


def test_cli_refusal_exits_2_with_the_reason(tmp_path, capsys):
    rc = cli_main(["forms", f"{__file__}:two_trips", "--form", "daf", "-o", str(tmp_path)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "two server-client trips" in err and "(two_trips)" in err


@settings(max_examples=20, deadline=None)
@given(steps=st.lists(st.sampled_from(["aggregate", "send_state", "send_aggregate", "work"]),
                      min_size=1, max_size=6))
def test_refused_exactly_when_a_broadcast_depends_on_an_aggregate(steps):
    """Random rounds: two trips are found however the aggregate reaches the broadcast."""

    @fb.program(clients=N)
    def round_fn(w, x):
        client = x
        server = fb.federated_map_server(lambda w: w * 2.0, w)  # pure state: no trip
        tainted = False
        for step in steps:
            if step == "aggregate":
                server = fb.federated_map_server(
                    jnp.add, (server, fb.federated_mean(client).sum(0)))
                tainted = True
            elif step in ("send_state", "send_aggregate"):
                sent = fb.federated_broadcast(server if step == "send_aggregate" else w)
                client = fb.federated_map_clients(lambda c, s: c * s[0], (client, sent))
            else:
                client = fb.federated_map_clients(jnp.tanh, client)
        return server, fb.federated_mean(client).sum()

    two_trips = any(s == "send_aggregate" and "aggregate" in steps[:i]
                    for i, s in enumerate(steps))
    if two_trips:
        with pytest.raises(fb.ExportError, match="two server-client trips"):
            forms.round_proto(round_fn, W, X, placements=("server", "clients"))
    else:
        proto, _ = forms.round_proto(round_fn, W, X, placements=("server", "clients"))
        assert set(forms.intrinsic_uris(proto)) <= forms.FORM_INTRINSICS


@pytest.mark.parametrize("form", ["daf", "mrf"])
def test_cli_refuses_a_file_in_the_way_before_building_the_form(tmp_path, capsys,
                                                                monkeypatch, form):
    def never(*args, **kwargs):
        raise AssertionError("the form was built before the folder was checked")

    monkeypatch.setattr(forms, "to_distribute_aggregate_form", never)
    monkeypatch.setattr(forms, "to_map_reduce_form", never)
    out = tmp_path / "out"
    out.mkdir()
    piece = forms.form_files(form)[0]
    (out / piece).write_bytes(b"mine")  # the user's file where a piece goes
    rc = cli_main(["forms", f"{REPO}/examples/quickstart.py:fedavg_round", "--form", form,
                   "--clients", "3", "-o", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and f"would replace '{out}{os.sep}{piece}'" in err and "--force" in err
    assert (out / piece).read_bytes() == b"mine" and sorted(os.listdir(out)) == [piece]


def test_federated_compute_forms_through_the_api_and_the_cli(tmp_path, capsys, built_once):
    from fax_bridge.data.examples import Feature

    mrf = fb.to_map_reduce_form(one_trip, W, X, placements=("server", "clients"),
                                target="fcp")
    assert list(mrf.pieces) == list(forms.MRF_PIECES)
    assert mrf.features == [Feature("value", np.dtype(np.float32), (4, 2))]
    assert mrf.piece_types["work"].startswith("(<str*,"), mrf.piece_types["work"]
    assert mrf.state_codes == [None]
    manifest = fb.write_form(mrf, str(tmp_path / "api"))
    assert manifest["for"] == "fcp" and manifest["features"] == [
        {"name": "value", "dtype": "float32", "shape": [4, 2], "list": "float"}]
    assert manifest["files"]["round"]["type"].startswith("(<state=float32[2]@SERVER,"
                                                         "examples={str*}@CLIENTS>")
    assert manifest["files"]["input_round"]["type"].startswith(
        "(<float32[2]@SERVER,{float32[4,2]}@CLIENTS>")
    _check_manifest(tmp_path / "api", manifest)
    out = tmp_path / "cli"
    rc = cli_main(["forms", f"{__file__}:one_trip", "--form", "daf", "--for", "fcp",
                   "-o", str(out)])
    assert rc == 0, capsys.readouterr().err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["form"] == "DistributeAggregateForm" and manifest["for"] == "fcp"
    assert manifest["files"]["client_work"]["type"].startswith("(<{str*}@CLIENTS,")
    with np.load(out / "state.npz") as z:  # what `fax-bridge forms run` starts from
        np.testing.assert_array_equal(z["state.0"], W)


def one_trip_example_args(clients):  # for `fax-bridge forms THIS_FILE:one_trip`
    return (W, X[:clients]), ("server", "clients")
