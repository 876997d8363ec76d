"""The disk cache of converted LiteRT models (`litert.model_cache`): an entry is
believed only when it is a regular file of ours whose header names its key and whose
bytes have the recorded sha256 and the round's signature; a cut, zeroed, flipped or
copied entry is named in a warning and rebuilt from the round, or, with no converter,
refused naming the file and the fix."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import fax_bridge as fb
from fax_bridge.rounds import round_split


@pytest.fixture(scope="module")
def converted(small_round_split):
    """The round's split, its client signature and its model converted afresh."""
    from fax_bridge.litert import convert, lowering

    split = small_round_split
    param, result = lowering.split_types(split)
    sig = lowering.client_signature(param, result, split.aggregations)
    model = convert.convert_client_part(split.client_part, param, result,
                                        split.aggregations, key=split.client_part_hash,
                                        use_cache=False)
    return split, sig, model.tflite


def _damage(raw: bytes, kind: str, at: int, flip: int) -> bytes:
    line, _, model = raw.partition(b"\n")
    if kind == "cut":
        return raw[:at % len(raw)]
    if kind == "zeroed":
        return bytes(len(raw))
    if kind == "flip":
        out = bytearray(raw)
        out[at % len(out)] ^= flip
        return bytes(out)
    if kind == "other key":  # another key's entry copied under this name
        return line.replace(b'"key": "k"', b'"key": "other"') + b"\n" + model
    return b""


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["cut", "zeroed", "flip", "other key", "empty"]),
       at=st.integers(0, 10**6), flip=st.integers(1, 255))
def test_a_damaged_cache_entry_is_never_believed_and_is_named(
        converted, empty_litert_cache, kind, at, flip):
    """Cut, zeroed, flipped, empty, or another key's entry under this name: `read`
    gives no model and names the file (a warning), or gives exactly the stored model
    where the change was to nothing it holds (a flip inside the header's whitespace)."""
    import warnings

    from fax_bridge.litert import model_cache

    _, sig, tflite = converted
    model_cache.store("k", tflite)
    path = model_cache.path_of("k")
    raw = path.read_bytes()
    path.write_bytes(_damage(raw, kind, at, flip))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = model_cache.read("k", sig, "client_update")
    if found.model is not None:
        assert found.model == tflite and kind == "flip"
        return
    assert str(path) in found.damaged and f"rm {path}" in found.damaged
    model_cache._WARNED.clear()
    assert any(str(path) in str(w.message) for w in caught)


def test_a_cache_entry_of_other_shapes_or_through_a_link_is_not_believed(
        converted, empty_litert_cache):
    from fax_bridge.litert import lowering, model_cache

    _, sig, tflite = converted
    wider = lowering.Tensor(sig.inputs[-1].name, (9,), sig.inputs[-1].dtype)
    other = lowering.ClientSignature(sig.parameter, sig.result, sig.inputs[:-1] + (wider,),
                                     sig.outputs)
    model_cache.store("k", tflite)
    assert model_cache.read("k", sig, "client_update").model == tflite
    with pytest.warns(RuntimeWarning, match="needs float32\\[9\\]"):
        assert model_cache.read("k", other, "client_update").model is None
    target = model_cache.path_of("k")
    moved = target.with_name("elsewhere")
    target.rename(moved)
    target.symlink_to(moved)
    with pytest.warns(RuntimeWarning, match="is a symbolic link"):
        assert model_cache.read("k", sig, "client_update").damaged is not None


def test_a_cache_folder_others_can_write_is_not_used(converted, empty_litert_cache):
    from fax_bridge.litert import model_cache

    _, sig, tflite = converted
    model_cache.store("k", tflite)
    os.chmod(empty_litert_cache, 0o777)
    with pytest.warns(RuntimeWarning, match="is not used"):
        assert model_cache.read("k", sig, "client_update").model is None
        model_cache.store("k", tflite)


def test_a_damaged_entry_is_rebuilt_from_the_round_or_refused_naming_it(
        converted, empty_litert_cache, monkeypatch, tmp_path):
    from fax_bridge.litert import convert, lowering, model_cache

    split, sig, tflite = converted
    param, result = lowering.split_types(split)

    def convert_once():
        monkeypatch.setattr(convert, "_MADE", {})
        return convert.convert_client_part(split.client_part, param, result,
                                           split.aggregations, key=split.client_part_hash)

    assert convert_once().tflite == tflite
    (entry,) = empty_litert_cache.glob(f"*{model_cache.SUFFIX}")
    entry.write_bytes(entry.read_bytes()[:100])  # cut
    with pytest.warns(RuntimeWarning, match=f"{entry}.*converting again"):
        made = convert_once()
    assert made.tflite == tflite and made.convert_s > 0
    assert convert_once().convert_s == 0.0  # the entry was written anew, and holds
    entry.write_bytes(bytes(entry.stat().st_size))  # zeroed
    monkeypatch.setenv("FAX_BRIDGE_LITERT_PYTHON", str(tmp_path / "no" / "python"))
    monkeypatch.setattr(model_cache, "_WARNED", set())
    with pytest.warns(RuntimeWarning), \
            pytest.raises(convert.ConverterMissing, match=f"(?s){entry}.*rm {entry}.*"
                                                          "does not exist"):
        convert_once()


def test_a_model_of_more_than_ten_indexed_tensors_is_read_back_not_called_damaged(
        empty_litert_cache, monkeypatch):
    """A flatbuffer lists its signature's tensors sorted as text (`.../10` before
    `.../2`); the entry is still the round's, so it is believed, with no warning and no
    conversion."""
    import warnings

    from fax_bridge.litert import convert, lowering

    @fb.program(clients=2)
    def many(w, x):
        return fb.federated_sum(fb.federated_map_clients(
            lambda p, c: tuple(c[i] * p for i in range(12)), (fb.federated_broadcast(w), x)))

    args = (np.float32(2.0), np.arange(24, dtype=np.float32).reshape(2, 12))
    split = round_split.split_round(fb.export_tff(many, *args,
                                                  placements=("server", "clients")))
    param, result = lowering.split_types(split)

    def convert_once():
        monkeypatch.setattr(convert, "_MADE", {})
        return convert.convert_client_part(split.client_part, param, result,
                                           split.aggregations, key=split.client_part_hash)

    first = convert_once()
    names = [t.name for t in first.outputs]
    assert names[2] == "aggregate/0/value/2" and sorted(names)[2] == "aggregate/0/value/10"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "damaged ... converting again" would raise
        again = convert_once()
    assert again.tflite == first.tflite and again.convert_s == 0.0


def test_a_names_record_through_a_link_or_of_another_owner_is_not_believed(
        empty_litert_cache, tmp_path):
    """The tensor names a round recorded for a client part are read as a file another
    party may have planted: a link to a record elsewhere, or a record another user owns,
    is named in a warning and the model is named by index (None here)."""
    import os

    from fax_bridge.litert import model_cache

    names = (("broadcast/params/w",), ("aggregate/0/value",))
    model_cache.store_names("part", names)
    assert model_cache.read_names("part") == names
    record = model_cache.names_path("part")
    planted = tmp_path / "planted.names"
    planted.write_text(record.read_text())
    record.unlink()
    record.symlink_to(planted)
    with pytest.warns(RuntimeWarning, match="names record .* is damaged.*named by index"):
        assert model_cache.read_names("part") is None
    record.unlink()
    model_cache.store_names("part", names)
    os.chown(record, 65534, 65534)  # as another user (the tests run as root)
    with pytest.warns(RuntimeWarning, match="names record .* is damaged.*named by index"):
        assert model_cache.read_names("part") is None
