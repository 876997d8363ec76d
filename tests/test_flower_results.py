"""What a Flower run says about itself: which client runtime and LiteRT model computed
each node's answer (`records.served_of`), and its result read back by name."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fax_bridge.errors import ArgumentError, FleetError
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


@settings(max_examples=80, deadline=None)
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

    from fax_bridge import cli
    from fax_bridge.parity import flower as parity_flower
    from fax_bridge.parity.report import LeafParity, ParityReport

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


# ------------------------------------------------------------------ a run's result


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """An app of the quickstart round and, in its default out-dir, what its ServerApp
    leaves after 2 rounds: the fleet plan's result and two round reports."""
    import json
    import os

    import numpy as np
    from federated_language.common_libs import structure

    from fax_bridge import in_process
    from fax_bridge.flower import app_dir, bundle
    from fax_bridge.runtime import npz_keys, values
    from fax_bridge.tff.cli import resolve_program

    quickstart = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "examples", "quickstart.py")
    prog, args, placements = resolve_program(f"{quickstart}:fedavg_round", 6)
    made = bundle.build_round(prog, *args, placements=placements)
    app = str(tmp_path_factory.mktemp("app"))
    app_dir.write_app(made, app)
    state = made.state_value(made.state)
    data = values.bind_arguments(made.prepared.parameter, args, {}).runtime_value()[1]
    for _ in range(2):
        result = in_process.run_in_process(made.split, structure.Struct(
            [(None, state), (None, data)]))
        state = result[0]
    out = os.path.join(app, "results")
    os.makedirs(out)
    np.savez(os.path.join(out, "result.npz"),
             **npz_keys.result_to_npz(result, made.prepared.result))
    with open(os.path.join(out, "reports.jsonl"), "w") as f:
        for r in range(2):
            f.write(json.dumps({"round": r, "error": None, "wall_s": 0.5, "devices": 2,
                                "lost_devices": [], "served": {
                                    "node 1 (clients 0..2)": {"client_runtime": "xla",
                                                              "model_sha256": None}}})
                    + "\n")
    return prog, args, placements, app, values.to_pytree(result, made.prepared.result)


def test_a_runs_result_is_read_back_as_the_rounds_pytree(finished_run, tmp_path):
    import os
    import shutil

    import jax
    import numpy as np

    from fax_bridge.parity import flower_results

    prog, args, _, app, want = finished_run
    got = flower_results.load_result(app)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    assert isinstance(got, tuple) and set(got[0]) == {"w", "b"}  # (params, loss) by name
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert a.dtype == b.dtype and a.tobytes() == np.asarray(b).tobytes()
    elsewhere = str(tmp_path / "out")
    shutil.copytree(os.path.join(app, "results"), elsewhere)
    for folder, kwargs in [(os.path.join(app, "results"), {}), (elsewhere, {"app": app})]:
        again = flower_results.load_result(folder, **kwargs)
        assert [x.tobytes() for x in jax.tree_util.tree_leaves(again)] == \
            [x.tobytes() for x in jax.tree_util.tree_leaves(got)]
    with pytest.raises(ArgumentError, match="load_result\\(out_dir, app=APP\\)"):
        flower_results.load_result(elsewhere)


def test_results_that_do_not_fit_the_round_or_a_failed_run_are_refused(finished_run,
                                                                        tmp_path):
    import json
    import os
    import shutil

    import numpy as np

    from fax_bridge.parity import flower_results
    from fax_bridge.errors import ComputationError

    _, _, _, app, _ = finished_run
    out = str(tmp_path / "out")
    shutil.copytree(os.path.join(app, "results"), out)
    with np.load(os.path.join(out, "result.npz")) as f:
        good = {k: f[k] for k in f.files}
    key = sorted(good)[0]
    for bad in [dict(good, extra=np.zeros(1)),
                {k: (v.astype(np.float64) if k == key else v) for k, v in good.items()},
                {k: (np.zeros((7,) + v.shape, v.dtype) if k == key else v)
                 for k, v in good.items()}]:
        np.savez(os.path.join(out, "result.npz"), **bad)
        with pytest.raises(ComputationError, match="result"):
            flower_results.load_result(out, app=app)
    with open(os.path.join(out, "reports.jsonl"), "a") as f:
        f.write(json.dumps({"round": 2, "error": "FleetError: no SuperNode answered",
                            "lost_devices": ["node 3 (clients 0..2): no answer within 5s"]})
                + "\n")
    with pytest.raises(FleetError, match="round 2 failed.*\n  round 2: lost node 3"):
        flower_results.load_result(out, app=app)


def test_a_deployment_started_by_hand_is_compared_with_jit(finished_run):
    import jax
    import jax.numpy as jnp

    from fax_bridge.parity import flower_results

    prog, args, placements, app, _ = finished_run
    report = flower_results.compare_with_jit(app, prog, *args, placements=placements)
    assert report.ok and report.fleet_bits, report.table()
    assert report.target == "flower" and report.devices == 2
    other = (jax.tree_util.tree_map(lambda v: jnp.asarray(v, jnp.float16), args[0]),
             args[1])  # another round: its state in another dtype
    with pytest.raises(ArgumentError, match="not the round"):
        flower_results.compare_with_jit(app, prog, *other, placements=placements)


def test_a_result_read_back_in_another_structure_is_a_mismatch(finished_run, tmp_path):
    import json
    import os
    import shutil

    import jax

    from fax_bridge.parity import flower_results
    from fax_bridge.flower import app_dir, bundle
    from fax_bridge.runtime import result_structure

    prog, args, placements, app, _ = finished_run
    copy = str(tmp_path / "app")
    shutil.copytree(app, copy)
    path = os.path.join(copy, app_dir.PACKAGE, bundle.FILE_NAME)
    with open(path) as f:
        data = json.load(f)
    jitted = jax.tree.structure(jax.eval_shape(prog, *args))
    assert result_structure.structure_from_json(data["result-structure"]) == jitted
    as_list = jax.tree.structure(list(jax.tree.unflatten(jitted, range(jitted.num_leaves))))
    data["result-structure"] = result_structure.structure_to_json(as_list)
    with open(path, "w") as f:
        json.dump(data, f)
    assert isinstance(flower_results.load_result(copy), list)
    report = flower_results.compare_with_jit(copy, prog, *args, placements=placements)
    assert not report.ok and report.leaves[0].path == "result structure", report.table()
    # the structure row first, then one row per leaf of jit's result, each the same
    assert len(report.leaves[1:]) == jitted.num_leaves and \
        all(leaf.ok for leaf in report.leaves[1:]) and report.fleet_bits, report.table()


def _flower_round(extra):
    """A Flower round `(state, client_data)` whose output has the structure of `extra`."""
    import jax
    import jax.numpy as jnp

    import fax_bridge as fb

    @fb.program(clients=3)
    def step(state, data):
        m = fb.federated_mean(data)
        out = jax.tree.map(lambda x: fb.federated_map_server(
            lambda w: jnp.sum(x).astype(jnp.float32) + w, m), extra)
        return jax.tree.map(lambda x: x + m, state), {"mean": m, "extra": out}

    return step


@settings(max_examples=5, deadline=None)
@given(extra=st.deferred(lambda: __import__("test_runtime_result_structure").PYTREES))
def test_load_result_gives_the_structure_jit_gives(extra, tmp_path_factory):
    """Lists, tuples, dicts, NamedTuples, dataclasses, None and empty containers in a
    round's result come back from the app's result.npz as `jax.jit(program)` gives them."""
    import json
    import os

    import jax
    import numpy as np
    from federated_language.common_libs import structure

    from fax_bridge import in_process
    from fax_bridge.parity import flower_results
    from fax_bridge.flower import app_dir, bundle
    from fax_bridge.runtime import npz_keys, values

    state = {"w": np.zeros(2, np.float32), "steps": [np.float32(1.0)]}
    data = np.arange(3, dtype=np.float32)
    step = _flower_round(extra)
    want = jax.jit(step)(state, data)
    made = bundle.build_round(step, state, data, placements=("server", "clients"))
    app = str(tmp_path_factory.mktemp("app"))
    app_dir.write_app(made, app)
    result = in_process.run_in_process(made.split, structure.Struct(
        [(None, made.state_value(made.state)),
         (None, values.bind_arguments(made.prepared.parameter, (state, data),
                                      {}).runtime_value()[1])]))
    out = os.path.join(app, "results")
    os.makedirs(out)
    np.savez(os.path.join(out, "result.npz"),
             **npz_keys.result_to_npz(result, made.prepared.result))
    with open(os.path.join(out, "reports.jsonl"), "w") as f:
        f.write(json.dumps({"round": 0, "error": None, "devices": 1}) + "\n")
    got = flower_results.load_result(app)  # round.json read back, as another process does
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, np.asarray(w), rtol=1e-6)
        assert g.dtype == np.asarray(w).dtype


# ------------------------------------------- result files another party may have written


def _copy_app(finished_run, tmp_path) -> str:
    import os
    import shutil

    copy = str(tmp_path / "app")
    shutil.copytree(finished_run[3], copy)
    os.chmod(copy, 0o755)
    return copy


def _round_path(app: str) -> str:
    import os

    from fax_bridge.flower import app_dir, bundle

    return os.path.join(app, app_dir.PACKAGE, bundle.FILE_NAME)


def _deep(n: int) -> str:
    return "[" * n + "]" * n


# round.json's text made from the good one (a dict `data`), and what the refusal names
ROUND_FILES = {
    "a list": (lambda data: "[1, 2]", r"round.json is \[1, 2\], expected an object"),
    "a string": (lambda data: '"round"', "expected an object"),
    "nested 300,000 deep": (lambda data: _deep(300_000), "nests deeper than"),
    "nested in a field": (lambda data: __import__("json").dumps(data)[:-1]
                          + ', "x": ' + _deep(5000) + "}", "nests deeper than"),
    "format true": (lambda data: dict(data, format=True), "field 'format' is true"),
    "format 1": (lambda data: dict(data, format=1), "field 'format' is 1, expected a str"),
    "round not base64": (lambda data: dict(data, round="%%%"), "field 'round'"),
    "state-layout Infinity": (
        lambda data: __import__("json").dumps(dict(data, state=None)).replace(
            '"state-layout": [[', '"state-layout": [[ "float32", [Infinity]], [', 1),
        "Infinity is not a number"),
    "state-layout 1e400": (
        lambda data: __import__("json").dumps(dict(data, state=None)).replace(
            '"state-layout": [[', '"state-layout": [[ "float32", [1e400]], [', 1),
        "1e400 is beyond a float"),
    "state-layout 2.0": (lambda data: dict(data, state=None, **{
        "state-layout": [["float32", [2.0]]]}), r"'state-layout'\[0\]'s shape is 2.0"),
    "state-layout true": (lambda data: dict(data, state=None, **{
        "state-layout": [["float32", [True]]]}), "shape is true"),
    "state-layout -1": (lambda data: dict(data, state=None, **{
        "state-layout": [["float32", [-1]]]}), "shape is -1"),
    "state-layout object dtype": (lambda data: dict(data, state=None, **{
        "state-layout": [["object", [1]]]}), "unknown tensor dtype 'object'"),
    "state-layout a string": (lambda data: dict(data, state=None, **{
        "state-layout": "two"}), "field 'state-layout' is \"two\", expected a list"),
    "state bytes short": (lambda data: dict(data, state=[dict(data["state"][0],
                                                               base64="AAAA")]),
                          r"'state'\[0\] holds 3 bytes"),
    "state-sha256 a number": (lambda data: dict(data, **{"state-sha256": 5}),
                              "field 'state-sha256' is 5"),
    "litert-models a list": (lambda data: dict(data, **{"litert-models": ["a"]}),
                             "field 'litert-models'"),
    "a repeated field": (lambda data: __import__("json").dumps(data)[:-1]
                         + ', "format": "x"}', "key 'format' twice"),
    "dict keys 1 and 1.0": (lambda data: dict(data, **{"result-structure": {
        "format": 1, "tree": {"type": "dict", "data": {"list": [1, 1.0]},
                              "children": ["*", "*"]}}}), "not one distinct key"),
    "dict keys true and 1": (lambda data: dict(data, **{"result-structure": {
        "format": 1, "tree": {"type": "dict", "data": {"list": [True, 1]},
                              "children": ["*", "*"]}}}), "not one distinct key"),
}


@pytest.mark.parametrize("case", sorted(ROUND_FILES))
def test_a_forged_round_file_is_refused_naming_the_file_and_field(finished_run, tmp_path,
                                                                   case):
    import json

    from fax_bridge.parity import flower_results
    from fax_bridge.errors import ExportError

    app = _copy_app(finished_run, tmp_path)
    path = _round_path(app)
    with open(path) as f:
        data = json.load(f)
    make, match = ROUND_FILES[case]
    text = make(data)
    with open(path, "w") as f:
        f.write(text if isinstance(text, str) else json.dumps(text))
    with pytest.raises(ExportError, match=match) as e:
        flower_results.load_result(app)
    assert path in str(e.value)


@pytest.mark.parametrize("kind", ["fifo", "sparse 1 GB", "link", "folder"])
def test_a_round_file_that_is_not_a_small_regular_file_is_refused_unread(
        finished_run, tmp_path, kind):
    """Refused from the opened file's own type and size: a FIFO never blocks the reader,
    a sparse 1 GB file is never read."""
    import os

    from fax_bridge.parity import flower_results
    from fax_bridge.errors import ExportError

    app = _copy_app(finished_run, tmp_path)
    path = _round_path(app)
    os.replace(path, str(tmp_path / "saved"))
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link":
        os.symlink(str(tmp_path / "saved"), path)
    elif kind == "folder":
        os.mkdir(path)
    else:
        with open(path, "wb") as f:
            f.truncate(1 << 30)
    match = {"fifo": "is a FIFO", "link": "is a symbolic link", "folder": "is a folder",
             "sparse 1 GB": f"holds {1 << 30} bytes, more than the 10485760"}[kind]
    with pytest.raises((ExportError, ArgumentError), match=match if kind != "folder"
                       else "is a folder|holds no"):
        flower_results.load_result(app)


# reports.jsonl's lines, and what the refusal names
REPORT_LINES = {
    "a list": ('[1, 2]', r"line 1 is \[1, 2\], expected an object"),
    "a string": ('"done"', "line 1 is \"done\", expected an object"),
    "nested 300,000 deep": (_deep(300_000), "line 1 is not JSON .*nests deeper"),
    "devices two": ('{"round": 0, "devices": "two"}', "field 'devices' is \"two\""),
    "devices 1e400": ('{"round": 0, "devices": 1e400}', "1e400 is beyond a float"),
    "devices 2.0": ('{"round": 0, "devices": 2.0}', "field 'devices' is 2.0"),
    "devices true": ('{"round": 0, "devices": true}', "field 'devices' is true"),
    "devices -1": ('{"round": 0, "devices": -1}', "field 'devices' is -1"),
    "served a list": ('{"round": 0, "served": ["node 1"]}', "field 'served' is"),
    "served entry a string": ('{"round": 0, "served": {"n": "xla"}}',
                              "field 'served' entry 'n' is \"xla\""),
    "wall_s NaN": ('{"round": 0, "wall_s": NaN}', "NaN is not a number"),
    "error a number": ('{"round": 0, "error": 7}', "field 'error' is 7"),
    "round true": ('{"round": true}', "field 'round' is true"),
    "not UTF-8": (b'{"round": 0, "error": "\xff"}', "utf-8"),
}


def _write_reports(out: str, line) -> None:
    import os

    with open(os.path.join(out, "reports.jsonl"), "wb") as f:
        f.write((line.encode() if isinstance(line, str) else line) + b"\n")


@pytest.mark.parametrize("case", sorted(REPORT_LINES))
def test_forged_reports_are_refused_naming_the_file_line_and_field(finished_run, tmp_path,
                                                                   case):
    import os

    from fax_bridge.parity import flower_results

    app = _copy_app(finished_run, tmp_path)
    out = os.path.join(app, "results")
    line, match = REPORT_LINES[case]
    _write_reports(out, line)
    with pytest.raises(FleetError, match=match) as e:
        flower_results.load_result(app)
    assert os.path.join(out, "reports.jsonl") in str(e.value)


@pytest.mark.parametrize("kind", ["fifo", "sparse 500 MB"])
def test_reports_that_are_not_a_small_regular_file_are_refused_unread(
        finished_run, tmp_path, kind):
    import os

    from fax_bridge.parity import flower_results

    app = _copy_app(finished_run, tmp_path)
    path = os.path.join(app, "results", "reports.jsonl")
    os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path)
    else:
        with open(path, "wb") as f:
            f.truncate(500 << 20)
    with pytest.raises(FleetError, match="is a FIFO" if kind == "fifo" else
                       f"holds {500 << 20} bytes, more than the"):
        flower_results.load_result(app)


def test_an_app_written_again_is_read_again(finished_run, tmp_path):
    """The round is parsed once per content of round.json, not once per folder: an app
    written again in the same folder with another round gives that round's structure."""
    import dataclasses

    import jax

    from fax_bridge.parity import flower_results
    from fax_bridge.flower import app_dir, bundle

    prog, args, placements, _, _ = finished_run
    app = _copy_app(finished_run, tmp_path)
    assert isinstance(flower_results.load_result(app), tuple)
    made = bundle.build_round(prog, *args, placements=placements)
    jitted = made.result_structure
    as_list = jax.tree.structure(list(jax.tree.unflatten(jitted, range(jitted.num_leaves))))
    app_dir.write_app(dataclasses.replace(made, result_structure=as_list), app, force=True)
    assert isinstance(flower_results.load_result(app), list)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats()
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=3),
    max_leaves=10)


@settings(max_examples=60, deadline=None)
@given(field=st.sampled_from(["format", "round", "state", "state-layout", "litert-models",
                              "state-sha256", "result-structure"]),
       value=_JSON, line=st.dictionaries(st.sampled_from(
           ["round", "devices", "wall_s", "error", "lost_devices", "served"]), _JSON,
           max_size=3) | _JSON)
def test_any_value_in_a_result_file_is_read_or_refused_naming_the_file(
        finished_run, tmp_path_factory, field, value, line):
    import json
    import os

    from fax_bridge.parity import flower as parity_flower
    from fax_bridge.errors import ExportError
    from fax_bridge.flower import bundle

    with open(_round_path(finished_run[3])) as f:
        data = json.load(f)
    if field == "state-layout":
        data["state"] = None
    data[field] = value
    folder = str(tmp_path_factory.mktemp("round"))
    path = os.path.join(folder, bundle.FILE_NAME)
    with open(path, "w") as f:
        json.dump(data, f)
    try:
        bundle.read_round(folder)
    except ExportError as e:
        assert path in str(e)
    _write_reports(folder, json.dumps(line))
    try:
        parity_flower.read_reports(folder)
    except FleetError as e:
        assert os.path.join(folder, "reports.jsonl") in str(e)
