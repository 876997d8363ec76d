"""Carried LiteRT models (`litert.carried`): written, found by client-part hash and never
converted again; another round's models, other shapes and damaged files are refused by
name, whatever the damage."""

from __future__ import annotations

import base64
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import fax_bridge as fb
from fax_bridge.errors import ComputationError
from fax_bridge.litert import carried, convert, lowering, runner
from fax_bridge.rounds import round_split


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A small round's split, its carried model's folder and file name."""
    @fb.program(clients=2)
    def one_round(w, x):
        return fb.federated_mean(fb.federated_map_clients(
            lambda p, c: jnp.tanh(c @ p), (fb.federated_broadcast(w), x)))

    args = (np.ones((3, 2), np.float32), np.ones((2, 4, 3), np.float32))
    split = round_split.split_round(fb.export_tff(one_round, *args,
                                                  placements=("server", "clients")))
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
    made = convert.convert_round(split)
    assert found.tflite == made.tflite and found.convert_s == 0.0
    assert [t.name for t in found.inputs] == [t.name for t in made.inputs]
    leaves = [np.full((3, 2), 0.5, np.float32), np.arange(12, dtype=np.float32)
              .reshape(4, 3) / 12]
    got = runner.ClientRunner(found)(leaves)
    want = runner.ClientRunner(made)(leaves)
    assert [g.tobytes() for g in got] == [w.tobytes() for w in want]
    assert carried.find(None, key, _signature(split)) is None
    assert carried.find(os.path.join(folder, "absent"), key, _signature(split)) is None


def test_models_of_another_client_part_or_shape_are_refused_naming_both(packed):
    split, folder, _ = packed
    key = split.client_part_hash
    with pytest.raises(carried.CarriedMismatch) as caught:
        carried.find(folder, "f" * 64, _signature(split))
    assert "f" * 64 in str(caught.value) and key in str(caught.value)
    assert "fax-bridge flower ... --litert" in str(caught.value)
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
    made = convert.convert_round(split)
    assert found.tflite == made.tflite and found.signature == made.signature
    assert [t.name for t in found.inputs + found.outputs] == \
        [t.name for t in made.inputs + made.outputs]
