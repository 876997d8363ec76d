"""Flower apps that carry the client part as a LiteRT model (`fax-bridge flower --litert`):
what the app holds, a SuperNode with no converter running the carried model with the
fleet LiteRT device's bits, the refusal of a model of another round, and the refusal at
write time of a client part LiteRT cannot run, before anything is written."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shlex
import shutil
import textwrap

import numpy as np
import pytest
from federated_language.common_libs import structure
from hypothesis import given, settings, strategies as st

pytest.importorskip("flwr")

from fax_bridge import cli  # noqa: E402
from fax_bridge.data import write_population  # noqa: E402
from fax_bridge.errors import ExportError  # noqa: E402
from fax_bridge.flower import app_dir, bundle, client  # noqa: E402
from fax_bridge.litert import carried, convert, refusals, runner  # noqa: E402
from fax_bridge.rounds import partials, round_split, server_steps  # noqa: E402
from fax_bridge.runtime import backend, population  # noqa: E402
from fax_bridge.tff.cli import resolve_program  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "examples", "quickstart.py")
N = 4

SORTING_ROUND = '''
import jax.numpy as jnp
import numpy as np

import fax_bridge as fb


def sorting_round(state, data):
    """A client part with a sort, which LiteRT has no builtin for."""
    top = fb.federated_map_clients(lambda s, x: jnp.sort(x)[-2:] * s,
                                   (fb.federated_broadcast(state), data))
    return state + 1.0, fb.federated_mean(top)


def example_args(clients):
    x = np.arange(clients * 5, dtype=np.float32).reshape(clients, 5)
    return (np.float32(1.0), x), ("server", "clients")
'''


@pytest.fixture(scope="module")
def quickstart():
    prog, args, placements = resolve_program(f"{QUICKSTART}:fedavg_round", N)
    return args, bundle.build_round(prog, *args, placements=placements)


@pytest.fixture(scope="module")
def litert_app(tmp_path_factory, quickstart):
    folder = str(tmp_path_factory.mktemp("litert_app"))
    app_dir.write_app(quickstart[1], folder, litert=True)
    return folder


@pytest.fixture(scope="module")
def node(tmp_path_factory, quickstart):
    """A LiteRT SuperNode's config serving all N clients, and one round's inputs to it:
    (config, client ids, broadcast tensors, the clients' members)."""
    (_, data), made = quickstart
    path = str(tmp_path_factory.mktemp("population") / "node-0")
    write_population(path, [{k: v[i] for k, v in data.items()} for i in range(N)])
    split = made.split
    env = server_steps.prepare(split, made.server_arg(made.state_value(made.state)),
                               None, 1)
    sent = structure.Struct([(None, env[name]) for name in split.broadcasts])
    config = {"population": path, "first-client": 0, "client-runtime": "litert"}
    ids = np.arange(N)
    store = population.open_store(path)
    share = client.NodeShare.from_config(config)
    import federated_language

    member_type = federated_language.StructType([(None, t) for t in split.input_types])
    keys = [k for t in split.input_types for k in population.default_keys(t, None)]
    members = population.read_members(store, member_type,
                                      population.plan_columns(store, member_type, keys),
                                      share.rows(ids))
    return config, ids, backend.leaves(backend.as_numpy(sent)), sent, members


@pytest.fixture
def no_converter(monkeypatch, tmp_path, empty_litert_cache):
    """A node with no converter environment and nothing converted yet."""
    monkeypatch.setenv("FAX_BRIDGE_LITERT_PYTHON", str(tmp_path / "no" / "python"))


def _bits(found) -> list:
    """The partials as the bytes a node sends."""
    return [partials.to_message(p).SerializeToString(deterministic=True) for p in found]


def test_the_written_app_carries_the_model_and_its_manifest_by_client_part_hash(
        tmp_path, quickstart, litert_app):
    _, made = quickstart
    key = made.split.client_part_hash
    models = bundle.models_dir(os.path.join(litert_app, app_dir.PACKAGE))
    assert os.listdir(models) == [f"{key}.json"]  # a file type a Flower bundle carries
    with open(os.path.join(models, f"{key}.json")) as f:
        data = json.load(f)
    manifest = data["manifest"]
    tflite = base64.b64decode(data["tflite_base64"])
    assert manifest["round"]["version"] == key
    assert manifest["round"]["type_signature"] == str(made.prepared.type)
    assert manifest["model"]["sha256"] == hashlib.sha256(tflite).hexdigest()
    assert manifest["model"]["bytes"] == len(tflite) and tflite[4:8] == b"TFL3"
    # named by pytree path, as `fax-bridge litert` names the same client part's tensors
    assert [t["name"] for t in manifest["inputs"]] == [
        "broadcast/params/b", "broadcast/params/w", "client/data/x", "client/data/y"]
    assert [o["name"] for o in manifest["outputs"]] == [
        "aggregate/0/value/b", "aggregate/0/value/w", "aggregate/0/weight",
        "aggregate/1/value"]
    with open(os.path.join(litert_app, "README.md")) as f:
        text = f.read()
    assert "## LiteRT SuperNodes" in text and 'client-runtime="litert"' in text \
        and "--client-runtime litert" in text and "`aggregate/<k>/value/<path>`" in text
    # Complete commands: every warm node's with the LiteRT flag, every cold one's with
    # client-runtime="litert" in its node config, each parsed as its command parses it.
    from flwr.common.config import parse_config_args

    from fax_bridge.flower import supernode

    warm_block, cold_block = app_dir.command_blocks(text.split("## LiteRT SuperNodes", 1)[1])[:2]
    for line in warm_block.replace("\\\n", " ").strip().splitlines():
        argv = shlex.split(line.rstrip("&"))
        assert argv[:3] == ["python", "-m", "fax_bridge.flower.supernode"], line
        parsed = supernode._parser().parse_args(argv[3:])
        assert supernode.share_config(parsed)["client-runtime"] == "litert"
    for line in cold_block.replace("\\\n", " ").strip().splitlines():
        argv = shlex.split(line.rstrip("&"))
        config = parse_config_args([argv[argv.index("--node-config") + 1]])
        assert argv[0] == "flower-supernode" and config["client-runtime"] == "litert"
    # Without --litert nothing changes, and a rewritten app drops an older model.
    plain = str(tmp_path / "plain")
    app_dir.write_app(made, plain)
    shutil.copytree(litert_app, str(tmp_path / "again"))
    app_dir.write_app(made, str(tmp_path / "again"))
    for folder in (plain, str(tmp_path / "again")):
        assert not os.path.exists(bundle.models_dir(os.path.join(folder, app_dir.PACKAGE)))
        with open(os.path.join(folder, "README.md")) as f:
            assert "LiteRT" not in f.read()


def test_a_node_without_a_converter_runs_the_carried_model_with_the_devices_bits(
        quickstart, litert_app, node, request):
    _, made = quickstart
    split = made.split
    config, ids, broadcast, sent, members = node
    specs = [a.spec for a in split.aggregations]
    # What a fleet device running LiteRT answers (it converts: the converter is here).
    want = runner.LiteRTClientRuntime().client_partials(split.client_part,
                                                        split.client_part_hash,
                                                        sent, members, specs)
    request.getfixturevalue("no_converter")
    bundle_dir = os.path.join(litert_app, app_dir.PACKAGE)
    share = client.NodeShare.from_config(config)
    got = client.partials_for(bundle_dir, share, ids, broadcast)
    assert _bits(got) == _bits(want)
    assert convert._MADE == {}  # taken as carried: nothing converted here
    xla = round_split.client_partials(split.client_part, split.client_part_hash, sent,
                                      members, specs)
    assert _bits(got) != _bits(xla)  # LiteRT's rounding, not XLA's


def test_without_a_carried_model_a_node_needs_the_converter_and_says_so(
        tmp_path, quickstart, node, no_converter):
    _, made = quickstart
    folder = str(tmp_path / "plain")
    app_dir.write_app(made, folder)
    config, ids, broadcast, _, _ = node
    with pytest.raises(convert.ConverterMissing, match=r"(?s)does not exist.*carry the "
                                                       r"model.*fax-bridge flower.*--litert"):
        client.partials_for(os.path.join(folder, app_dir.PACKAGE),
                            client.NodeShare.from_config(config), ids, broadcast)


def test_a_carried_model_of_another_round_is_refused_naming_both_hashes(
        tmp_path, quickstart, litert_app, node, no_converter):
    _, made = quickstart
    key = made.split.client_part_hash
    folder = str(tmp_path / "app")
    shutil.copytree(litert_app, folder)
    models = bundle.models_dir(os.path.join(folder, app_dir.PACKAGE))
    other = "0" * 64
    os.replace(os.path.join(models, f"{key}.json"), os.path.join(models, f"{other}.json"))
    config, ids, broadcast, _, _ = node
    with pytest.raises(carried.CarriedMismatch) as caught:
        client.partials_for(os.path.join(folder, app_dir.PACKAGE),
                            client.NodeShare.from_config(config), ids, broadcast)
    assert other in str(caught.value) and key in str(caught.value)
    assert "`fax-bridge flower MODULE:FUNCTION -o APP --litert`" in str(caught.value)


def test_a_model_the_app_was_not_written_with_is_refused_by_server_and_node(
        tmp_path, quickstart, litert_app, node, no_converter):
    """round.json records each carried model's sha256: a model of other content under
    the expected name (here another client part's, its manifest made to name this one)
    is refused by the ServerApp before any node is asked and by a node before it runs,
    naming the file and both digests."""
    from fax_bridge.flower import server

    _, made = quickstart
    key = made.split.client_part_hash
    folder = str(tmp_path / "app")
    shutil.copytree(litert_app, folder)
    package = os.path.join(folder, app_dir.PACKAGE)
    path = os.path.join(bundle.models_dir(package), f"{key}.json")
    with open(path, "rb") as f:
        raw = f.read()
    recorded = bundle.read_round(package).litert_models
    assert recorded == {f"{key}.json": hashlib.sha256(raw).hexdigest()}
    data = json.loads(raw)
    data["manifest"]["model"]["operators"] = ["ANOTHER"]  # what no check reads
    changed = json.dumps(data).encode()
    with open(path, "wb") as f:
        f.write(changed)
    bundle.read_round.cache_clear()
    try:
        with pytest.raises(carried.CarriedMismatch) as caught:
            server.run_server(None, {}, package, log=lambda text: None)
        for text in (str(caught.value),):
            assert path in text and recorded[f"{key}.json"] in text
            assert hashlib.sha256(changed).hexdigest() in text
        config, ids, broadcast, _, _ = node
        with pytest.raises(carried.CarriedMismatch, match="not the one the app was written"):
            client.partials_for(package, client.NodeShare.from_config(config), ids,
                                broadcast)
    finally:
        bundle.read_round.cache_clear()


def test_the_state_beside_the_app_is_recorded_by_its_sha256(tmp_path, quickstart):
    _, made = quickstart
    folder = tmp_path / "app"
    import unittest.mock

    with unittest.mock.patch.object(bundle, "MAX_STATE_IN_BUNDLE_BYTES", 0):
        app_dir.write_app(made, str(folder))
    read = bundle.read_round(str(folder / app_dir.PACKAGE))
    state_path = folder / app_dir.STATE_FILE
    assert read.state_sha256 == hashlib.sha256(state_path.read_bytes()).hexdigest()
    bundle.read_state(str(state_path), read.state, read.state_sha256)
    bundle.write_state([np.asarray(t) + 1 for t in made.state], str(state_path))
    with pytest.raises(ExportError, match="written for another round or changed since"):
        bundle.read_state(str(state_path), read.state, read.state_sha256)


def test_a_client_part_litert_cannot_run_is_refused_before_anything_is_written(
        tmp_path, capsys):
    source = tmp_path / "sorting.py"
    source.write_text(textwrap.dedent(SORTING_ROUND))
    out, pops = tmp_path / "app", tmp_path / "pops"
    code = cli.main(["flower", f"{source}:sorting_round", "-o", str(out), "--clients", "2",
                     "--litert", "--write-population", str(pops), "--nodes", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert "stablehlo.sort" in err and "jnp.sort" in err and "cannot run in LiteRT" in err
    assert not out.exists() and not pops.exists()
    # The refusal is the converter's own (`refusals.ConversionRefused`).
    prog, args, placements = resolve_program(f"{source}:sorting_round", 2)
    made = bundle.build_round(prog, *args, placements=placements)
    with pytest.raises(refusals.ConversionRefused) as caught:
        app_dir.write_app(made, str(out), litert=True)
    assert "stablehlo.sort" in caught.value.ops and not out.exists()


@settings(max_examples=200, deadline=None)
@given(bodies=st.lists(st.text(st.sampled_from("ab `'\"\\\n$"), max_size=24).filter(
    lambda body: body.strip("\n") == body and body.strip() != ""), min_size=1, max_size=4))
def test_any_block_body_reads_back_whole_whatever_backticks_it_holds(bodies):
    """A README's code blocks (`app_dir.fenced`) hold any text, backtick runs of any
    length and lines of only backticks included, and `app_dir.command_blocks` (how the
    tests and the README benchmark read the commands, as CommonMark does) gives each
    body back whole, in order."""
    text = "# Title\n\n" + "\n\nA paragraph with `code`.\n\n".join(
        app_dir.fenced(body) for body in bodies) + "\n"
    assert app_dir.command_blocks(text) == [body + "\n" for body in bodies]


@settings(max_examples=25, deadline=None)
@given(offset=st.integers(-64, 64))
def test_only_a_small_state_travels_in_the_bundle_and_the_server_starts_from_it_either_way(
        quickstart, tmp_path_factory, offset):
    """Flower hands the bundle to every ClientApp process, which never uses the state:
    a state over `MAX_STATE_IN_BUNDLE_BYTES` is written beside the app and named by the
    run config's app-state, one at or under it stays in round.json; either way the
    state the ServerApp starts from has the example's bits."""
    _, made = quickstart
    size = sum(np.asarray(t).nbytes for t in made.state)
    limit = max(0, size + offset)
    folder = tmp_path_factory.mktemp("app")
    import unittest.mock

    with unittest.mock.patch.object(bundle, "MAX_STATE_IN_BUNDLE_BYTES", limit):
        app_dir.write_app(made, str(folder))
    read = bundle.read_round(str(folder / app_dir.PACKAGE))
    state_path = str(folder / app_dir.STATE_FILE)
    with open(folder / "pyproject.toml") as f:
        named = f'app-state = "{state_path}"' in f.read()
    assert read.state_outside == named == (size > limit)
    assert os.path.exists(state_path) == named
    start = bundle.read_state(state_path, read.state) if named else read.state
    assert [np.asarray(t).tobytes() for t in start] == [
        np.asarray(t).tobytes() for t in made.state]


def test_a_state_file_is_written_anew_never_through_a_planted_link(tmp_path):
    precious = tmp_path / "precious"
    precious.write_bytes(b"kept\n")
    path = tmp_path / "app" / app_dir.STATE_FILE
    tensors = [np.arange(3, dtype=np.float32), np.ones((2, 2), np.int32)]
    bundle.write_state(tensors, str(path))
    assert [t.tolist() for t in bundle.read_state(str(path), tensors)] == \
        [t.tolist() for t in tensors]
    path.unlink()
    os.symlink(precious, path)
    with pytest.raises(PermissionError, match=f"{path} is a symbolic link"):
        bundle.write_state(tensors, str(path))
    assert precious.read_bytes() == b"kept\n"


# ------------------------------------------------------------ the app folder


def _one_line_refusal(argv, capsys) -> str:
    try:
        code = cli.main(argv)
    except SystemExit as e:  # refused while the arguments are read
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_an_app_written_into_a_project_never_replaces_the_projects_files(
        tmp_path, monkeypatch, capsys):
    """`-o .` in a project refuses naming its pyproject.toml, README.md and
    .flwr/config.toml and leaves them as they were; --force replaces them; written
    again, the app replaces only its own files and keeps the user's."""
    monkeypatch.chdir(tmp_path)
    mine = {"pyproject.toml": '[project]\nname = "mine"\n', "README.md": "mine\n",
            ".flwr/config.toml": "[superlink]\n"}
    for name, text in mine.items():
        os.makedirs(os.path.dirname(name) or ".", exist_ok=True)
        with open(name, "w") as f:
            f.write(text)
    argv = ["flower", f"{QUICKSTART}:fedavg_round", "--clients", str(N), "-o", "."]
    err = _one_line_refusal(argv, capsys)
    for name in mine:
        assert os.path.join(".", name) in err or f"and {len(mine) - 2} more" in err
        with open(name) as f:
            assert f.read() == mine[name]
    assert sorted(os.listdir(".")) == [".flwr", "README.md", "pyproject.toml"]
    assert cli.main(argv + ["--force"]) == 0
    capsys.readouterr()
    with open("pyproject.toml") as f:
        assert "fax_round.server_app:app" in f.read()
    with open("notes.txt", "w") as f:
        f.write("mine")
    assert cli.main(argv + ["--write-population", "pops", "--nodes", "2"]) == 0
    assert sorted(os.listdir("pops")) == [".fax-bridge-written", "node-0", "node-1"]
    with open("notes.txt") as f:
        assert f.read() == "mine"


@pytest.mark.parametrize("flag", ["-o", "--write-population"])
def test_an_output_path_that_cannot_be_a_folder_is_one_line_with_exit_2(
        tmp_path, capsys, flag):
    (tmp_path / "file").write_text("x")
    base = ["flower", f"{QUICKSTART}:fedavg_round", "-o", str(tmp_path / "app")]
    for bad, why in [(tmp_path / "file", "is a file"), (tmp_path / "file" / "x",
                                                          "cannot be created"),
                     (tmp_path / ("n" * 256), "shorter name"),
                     (tmp_path / "/".join(["d" * 250] * 17), "shorter path")]:
        argv = [a for a in base if flag != "-o" or a != str(tmp_path / "app")]
        argv = argv + ([str(bad)] if flag == "-o" else [flag, str(bad)])
        err = _one_line_refusal(argv, capsys)
        assert f"argument {flag}" in err and why in err
    assert (tmp_path / "file").read_text() == "x"


@settings(max_examples=100, deadline=None)
@given(values=st.dictionaries(st.text(st.sampled_from("abc-_"), min_size=1, max_size=6),
                              st.text(max_size=12) | st.integers() | st.booleans() |
                              st.floats(allow_nan=False, allow_infinity=False)),
       name=st.text(max_size=12))
def test_any_run_config_value_reads_back_from_pyproject_as_written(values, name):
    """Strings with quotes, backslashes, newlines or any Unicode end no string early and
    add no key: pyproject.toml reads back exactly the values written."""
    import tomllib

    values = {k: v for k, v in values.items()
              if not isinstance(v, str) or not any(0xD800 <= ord(c) <= 0xDFFF for c in v)}
    name = "".join(c for c in name if not 0xD800 <= ord(c) <= 0xDFFF)
    data = tomllib.loads(app_dir.pyproject(name, values))
    assert data["project"]["name"] == name
    assert data["tool"]["flwr"]["app"]["config"] == values


def test_every_run_config_key_the_server_reads_can_be_set_with_run_config(tmp_path,
                                                                          quickstart):
    """The written pyproject.toml lists every `RUN_CONFIG` key (population-size at 0,
    not declared), so Flower's own `--run-config` merge takes each of them."""
    import pathlib

    from flwr.common.config import get_fused_config_from_dir, parse_config_args

    from fax_bridge.flower.server import RUN_CONFIG, Settings

    folder = tmp_path / "app"
    app_dir.write_app(quickstart[1], str(folder))
    assert set(app_dir.DEFAULT_CONFIG) == set(RUN_CONFIG)
    written = get_fused_config_from_dir(pathlib.Path(folder), {})
    assert set(written) == set(RUN_CONFIG) and written["population-size"] == 0
    fused = get_fused_config_from_dir(
        pathlib.Path(folder), parse_config_args(["population-size=12 cohort-size=3"]))
    settings = Settings.from_run_config(fused)
    assert (settings.population_size, fused["num-rounds"]) == (12, 3)
    with pytest.raises(ValueError, match="not present"):  # Flower's refusal, kept
        get_fused_config_from_dir(pathlib.Path(folder), {"no-such-key": 1})


@pytest.mark.parametrize("mine", list(app_dir.FILES) + [".flwr/check/x"])
def test_a_users_file_is_refused_before_the_round_is_built(tmp_path, monkeypatch, capsys,
                                                           mine):
    """Each file every app writes (`app_dir.FILES`, and the check's folder under
    --check) is refused before the round is exported or converted, with the text the
    placing check gives; the app written then holds every one of `FILES`."""
    from fax_bridge.flower import bundle

    (tmp_path / mine).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / mine).write_text("mine\n")
    built = bundle.build_round

    def never(*a, **k):
        raise AssertionError("the round was built before the folder was checked")

    monkeypatch.setattr(bundle, "build_round", never)
    argv = ["flower", f"{QUICKSTART}:fedavg_round", "--clients", str(N), "-o",
            str(tmp_path)] + (["--check"] if mine.startswith(".flwr/check") else [])
    err = _one_line_refusal(argv, capsys)
    assert "fax-bridge did not write" in err and "--force" in err
    assert (tmp_path / mine).read_text() == "mine\n"
    if mine == app_dir.FILES[0]:
        monkeypatch.setattr(bundle, "build_round", built)
        assert cli.main(argv + ["--force"]) == 0
        for name in app_dir.FILES:
            assert (tmp_path / name).is_file(), name
