"""Carried LiteRT models (`litert.carried`): written, found by client-part hash and never
converted again; another round's models, other shapes and damaged files are refused by
name, whatever the damage."""

from __future__ import annotations

import base64
import json
import os
import pathlib
import re

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import fax_bridge as fb
from fax_bridge.errors import ComputationError
from fax_bridge.litert import carried, convert, lowering, manifest, runner
from fax_bridge.rounds import round_split


@pytest.fixture(scope="module")
def packed(tmp_path_factory, small_round_split):
    """A small round's split, its carried model's folder and file name."""
    split = small_round_split
    folder = str(tmp_path_factory.mktemp("models"))
    pair = carried.pack(split, "one_round")
    carried.write(folder, [pair])
    return split, folder, pair[0]


def _signature(split):
    return lowering.client_signature(*lowering.split_types(split), split.aggregations)


def test_a_carried_model_is_found_by_its_hash_and_runs_as_converted(packed):
    split, folder, name = packed
    key = split.client_part_hash
    assert name == f"{key}.json" and carried.versions(folder) == [key]
    found = carried.find(folder, key, _signature(split))
    made = manifest.convert_named(split)  # named by pytree path, as `pack` converts
    assert found.tflite == made.tflite and found.convert_s == 0.0
    assert [t.name for t in found.inputs] == [t.name for t in made.inputs] == \
        ["broadcast/w", "client/x"]
    leaves = [np.full((3, 2), 0.5, np.float32), np.arange(12, dtype=np.float32)
              .reshape(4, 3) / 12]
    got = runner.ClientRunner(found)(leaves)
    want = runner.ClientRunner(convert.convert_round(split))(leaves)  # the names alone
    assert [g.tobytes() for g in got] == [w.tobytes() for w in want]
    assert carried.find(None, key, _signature(split)) is None
    assert carried.find(os.path.join(folder, "absent"), key, _signature(split)) is None


def test_models_of_another_client_part_or_shape_are_refused_naming_both(packed):
    split, folder, _ = packed
    key = split.client_part_hash
    with pytest.raises(carried.CarriedMismatch) as caught:
        carried.find(folder, "f" * 64, _signature(split))
    assert "f" * 64 in str(caught.value) and key in str(caught.value)
    assert f"`fax-bridge litert MODULE:FUNCTION --clients N -o {folder}`" in str(caught.value)
    sig = _signature(split)
    wider = lowering.Tensor(sig.inputs[-1].name, (5, 3), sig.inputs[-1].dtype)
    other = lowering.ClientSignature(sig.parameter, sig.result,
                                     sig.inputs[:-1] + (wider,), sig.outputs)
    with pytest.raises(carried.CarriedMismatch, match=r"has inputs .*\[5, 3\]"):
        carried.find(folder, key, other)


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(at=st.integers(0, 10**6), flip=st.integers(1, 255),
       where=st.sampled_from(["model", "file"]))
def test_a_damaged_carried_model_is_refused_never_run(packed, tmp_path, at, flip, where):
    split, folder, name = packed
    with open(os.path.join(folder, name), "rb") as f:
        raw = f.read()
    if where == "model":  # a byte of the flatbuffer: its sha256 no longer matches
        data = json.loads(raw)
        model = bytearray(base64.b64decode(data["tflite_base64"]))
        model[at % len(model)] ^= flip
        data["tflite_base64"] = base64.b64encode(bytes(model)).decode()
        raw = json.dumps(data).encode()
    else:  # a byte of the file: unreadable, or a manifest that no longer holds
        raw = bytearray(raw)
        raw[at % len(raw)] ^= flip
        raw = bytes(raw)
    damaged = tmp_path / f"d{at}-{flip}-{where}"
    damaged.mkdir()
    (damaged / name).write_bytes(raw)
    try:
        found = carried.find(str(damaged), split.client_part_hash, _signature(split))
    except ComputationError as e:
        assert str(damaged) in str(e) and "write the models again" in str(e)
        return
    # A change to what the node does not read (an operator list, a converter version).
    made = manifest.convert_named(split)
    assert found.tflite == made.tflite and found.signature == made.signature
    assert [t.name for t in found.inputs + found.outputs] == \
        [t.name for t in made.inputs + made.outputs]


def _rewrite(raw: bytes, tflite: bytes = None, **manifest) -> bytes:
    """A carried file's bytes with another flatbuffer (its manifest's sha256 made to
    match, as a careless copy or a hand edit would) and manifest entries replaced."""
    import hashlib

    data = json.loads(raw)
    if tflite is not None:
        data["tflite_base64"] = base64.b64encode(tflite).decode()
        data["manifest"]["model"]["sha256"] = hashlib.sha256(tflite).hexdigest()
    for key, value in manifest.items():
        data["manifest"][key] = value
    return json.dumps(data).encode()


def _other_round(scale: float, rows: int = 4):
    @fb.program(clients=2)
    def other_round(w, x):
        return fb.federated_mean(fb.federated_map_clients(
            lambda p, c: jnp.tanh(c @ p) * scale, (fb.federated_broadcast(w), x)))

    args = (np.ones((3, 2), np.float32), np.ones((2, rows, 3), np.float32))
    return round_split.split_round(fb.export_tff(other_round, *args,
                                                 placements=("server", "clients")))


def _plant(tmp_path, name: str, raw: bytes) -> str:
    folder = tmp_path / "models"
    folder.mkdir(exist_ok=True)
    (folder / name).write_bytes(raw)
    return str(folder)


def test_another_rounds_model_under_the_expected_name_is_refused_by_the_apps_record(
        packed, tmp_path):
    """Another round's model of the same shapes, its manifest made to name this client
    part, parses and declares the round's tensors: only the record of what the app was
    written with tells it apart, and it does, naming the file and both digests."""
    import hashlib

    split, folder, name = packed
    raw = (pathlib.Path(folder) / name).read_bytes()
    other = manifest.convert_named(_other_round(1.33))
    data = json.loads(raw)
    lying = _rewrite(raw, other.tflite, round=data["manifest"]["round"])
    planted = _plant(tmp_path, name, lying)
    record = {name: hashlib.sha256(raw).hexdigest()}
    with pytest.raises(carried.CarriedMismatch) as caught:
        carried.find(planted, split.client_part_hash, _signature(split), record)
    text = str(caught.value)
    assert os.path.join(planted, name) in text and record[name] in text
    assert hashlib.sha256(lying).hexdigest() in text and "write the models again" in text
    with pytest.raises(carried.CarriedMismatch, match="not a LiteRT model this app"):
        carried.find(folder, split.client_part_hash, _signature(split), {})
    assert carried.recorded_files(folder, record) == {name: raw}
    carried.expect(planted, record)  # as the Flower ClientApp does from round.json
    with pytest.raises(carried.CarriedMismatch, match="not the one the app was written"):
        carried.find(planted, split.client_part_hash, _signature(split))
    assert carried.find(folder, split.client_part_hash, _signature(split), record).tflite \
        == base64.b64decode(data["tflite_base64"])


def test_a_model_whose_manifest_lies_about_its_shapes_is_refused_before_it_runs(
        packed, tmp_path):
    split, folder, name = packed
    raw = (pathlib.Path(folder) / name).read_bytes()
    wider = manifest.convert_named(_other_round(1.0, rows=5))  # client/x: [5, 3]
    planted = _plant(tmp_path, name, _rewrite(raw, wider.tflite))
    with pytest.raises(ComputationError) as caught:
        carried.find(planted, split.client_part_hash, _signature(split))
    text = str(caught.value)
    assert f"the carried LiteRT model {planted}/{name}" in text
    assert "float32[5, 3] in the model" in text and "needs float32[4, 3]" in text


def _tree_of(raw: bytes):
    from fax_bridge.litert import flatbuffer

    return flatbuffer.read(base64.b64decode(json.loads(raw)["tflite_base64"]))


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_tensor_of_another_shape_or_dtype_or_a_custom_op_is_refused_naming_it(
        packed, tmp_path_factory, data):
    """The flatbuffer's own signature is checked against the round, whatever the
    manifest beside it says: a signature tensor given another dtype or shape, or an
    operator made a custom op, is refused naming the file and what differs."""
    from fax_bridge.litert import flatbuffer

    split, folder, name = packed
    raw = (pathlib.Path(folder) / name).read_bytes()
    tree = _tree_of(raw)
    sig = tree.signatureDefs[0]
    tensors = tree.subgraphs[sig.subgraphIndex].tensors
    kind = data.draw(st.sampled_from(["dtype", "shape", "custom", "none"]))
    entries = list(sig.inputs) + list(sig.outputs)
    entry = entries[data.draw(st.integers(0, len(entries) - 1))]
    tensor = tensors[entry.tensorIndex]
    if kind == "dtype":
        tensor.type = data.draw(st.sampled_from([2, 4, 6, 10]))  # int32 int64 bool f64
    elif kind == "shape":
        shape = data.draw(st.lists(st.integers(1, 6), max_size=3))
        if list(shape) == list(tensor.shape):
            shape = list(shape) + [7]
        tensor.shape = np.array(shape, np.int32)
    elif kind == "custom":
        code = tree.operatorCodes[data.draw(st.integers(0, len(tree.operatorCodes) - 1))]
        code.builtinCode, code.deprecatedBuiltinCode = 32, 32  # BuiltinOperator.CUSTOM
        code.customCode = data.draw(st.sampled_from([b"MyOp", b"FlexSort"]))
    planted = _plant(tmp_path_factory.mktemp("lie"), name,
                     _rewrite(raw, flatbuffer.write(tree)))
    try:
        found = carried.find(planted, split.client_part_hash, _signature(split))
    except ComputationError as e:
        assert kind != "none" and f"{planted}/{name}" in str(e), str(e)
        if kind == "custom":
            assert "CUSTOM:" in str(e) and "builtins" in str(e)
        else:
            assert _text(entry.name) in str(e) and "the round's client part needs" in str(e)
        return
    assert kind == "none" and [t.name for t in found.inputs] == ["broadcast/w", "client/x"]


def _text(name) -> str:
    return name.decode() if isinstance(name, bytes) else name


def test_a_link_or_a_fifo_where_a_model_goes_is_refused_naming_it(packed, tmp_path):
    split, folder, name = packed
    links = tmp_path / "links"
    links.mkdir()
    os.symlink(os.path.join(folder, name), links / name)
    with pytest.raises(ComputationError, match=f"{links}/{name} is a symbolic link"):
        carried.find(str(links), split.client_part_hash, _signature(split))
    fifos = tmp_path / "fifos"
    fifos.mkdir()
    os.mkfifo(fifos / name)
    with pytest.raises(ComputationError, match=f"{fifos}/{name} is a FIFO"):
        carried.find(str(fifos), split.client_part_hash, _signature(split))


def test_a_runtime_refuses_a_lying_model_before_any_round_starts(packed, tmp_path):
    """`LiteRTClientRuntime.check_round`, which fleets and in-process rounds call before
    any client work, refuses a carried model of other shapes, naming the file."""
    split, folder, name = packed
    raw = (pathlib.Path(folder) / name).read_bytes()
    wider = manifest.convert_named(_other_round(1.0, rows=5))
    planted = _plant(tmp_path, name, _rewrite(raw, wider.tflite))
    with pytest.raises(ComputationError, match=f"{planted}/{name}: input client"):
        runner.LiteRTClientRuntime(models_dir=planted).check_round(None, split)


OTHER_PROGRAM = """
import jax.numpy as jnp
import numpy as np
import fax_bridge as fb


def other_round(w, x):
    return fb.federated_mean(fb.federated_map_clients(
        lambda p, c: jnp.tanh(c @ p) * 1.33, (fb.federated_broadcast(w), x)))


def example_args(clients):
    return (np.ones((3, 2), np.float32), np.ones((clients, 4, 3), np.float32)), \
        ("server", "clients")
"""


def test_a_program_exported_again_finds_its_model_and_another_gets_a_command_that_works(
        packed, tmp_path, empty_litert_cache, capsys):
    """A carried model is found for the same program exported anywhere (its proto's
    bytes, so its hash, depend on the exporting call stack; what it computes does not);
    a folder of another program's models is refused with the command that writes this
    round's model there, which, run, makes the round find it."""
    from fax_bridge import cli

    split, folder, name = packed
    @fb.program(clients=2)
    def one_round(w, x):  # conftest's small round, exported here
        return fb.federated_mean(fb.federated_map_clients(
            lambda p, c: jnp.tanh(c @ p), (fb.federated_broadcast(w), x)))

    again = round_split.split_round(fb.export_tff(
        one_round, np.ones((3, 2), np.float32), np.ones((2, 4, 3), np.float32),
        placements=("server", "clients")))
    assert again.client_part_hash != split.client_part_hash
    found = carried.find(folder, again.client_part_hash, _signature(again),
                         fn=again.client_part)
    assert found.tflite == manifest.convert_named(split).tflite
    assert found.client_part_hash == again.client_part_hash  # what the runner serves

    models = tmp_path / "models"
    models.mkdir()
    (models / name).write_bytes((pathlib.Path(folder) / name).read_bytes())
    other = _other_round(1.33)
    with pytest.raises(carried.CarriedMismatch) as caught:
        carried.find(str(models), other.client_part_hash, _signature(other),
                     fn=other.client_part)
    command = re.search(r"`fax-bridge (litert MODULE:FUNCTION --clients N -o \S+)`",
                        str(caught.value)).group(1).split()
    (tmp_path / "other.py").write_text(OTHER_PROGRAM)
    command[1:4] = [f"{tmp_path / 'other.py'}:other_round", "--clients", "2"]
    assert cli.main(command + ["--no-check"]) == 0
    printed = capsys.readouterr().out.splitlines()  # each tensor as the manifest has it
    assert printed[1:5] == ["inputs:", "  broadcast/w: float32[3, 2]",
                            "  client/x: float32[4, 3]", "outputs:"]
    assert printed[5] == "  aggregate/0/value: float32[4, 2]"
    found = carried.find(str(models), other.client_part_hash, _signature(other),
                         fn=other.client_part)
    assert found.program_sha256 == convert.program_sha256_of(
        other.client_part, _signature(other))
