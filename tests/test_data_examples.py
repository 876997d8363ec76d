"""TFRecord files of tf.Example without TensorFlow: CRC-32C and framing, the Example's
wire format (packed and unpacked lists), populations written whole and read back
checked. That TensorFlow reads these files and these readers read TensorFlow's is
checked by `make forms-check` (in the TFF side environment)."""

import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fax_bridge.data import examples as E
from fax_bridge.errors import DataError

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.int32, np.int64, np.int8,
          np.uint8, np.uint16, np.uint32, np.bool_]


def test_crc32c_and_its_mask_match_the_published_values():
    assert E.crc32c(b"") == 0
    assert E.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert E.crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4: 32 bytes of zeros
    c = E.crc32c(b"abc")
    assert E.masked_crc(b"abc") == (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


@settings(max_examples=15, deadline=None)
@given(n=st.integers(0, 9 * E._LANE), seed=st.integers(0, 2**16))
def test_the_lane_parallel_crc_equals_the_byte_by_byte_one(n, seed):
    data = np.random.default_rng(seed).integers(0, 256, n).astype(np.uint8).tobytes()
    assert E.crc32c(data) == E._raw(0xFFFFFFFF, data) ^ 0xFFFFFFFF


def _features_and_values(draw_dtypes, shapes, rng):
    features, values = [], {}
    for i, (dtype, shape) in enumerate(zip(draw_dtypes, shapes)):
        f = E.Feature(f"arg{i}/leaf", np.dtype(dtype), tuple(shape))
        if np.dtype(dtype) == np.bool_:
            v = rng.integers(0, 2, shape).astype(bool)
        elif np.issubdtype(np.dtype(dtype), np.integer):
            info = np.iinfo(dtype)
            v = rng.integers(info.min, info.max, shape, dtype=np.int64, endpoint=True
                             ).astype(dtype) if info.bits < 64 else rng.integers(
                -2**63, 2**63 - 1, shape, dtype=np.int64)
        else:
            v = rng.normal(size=shape).astype(dtype)
        features.append(f)
        values[f.name] = v
    return features, values


@settings(max_examples=40, deadline=None)
@given(dtypes=st.lists(st.sampled_from(DTYPES), min_size=1, max_size=4),
       shapes=st.lists(st.lists(st.integers(0, 3), max_size=3), min_size=4, max_size=4),
       seed=st.integers(0, 2**16))
def test_every_leaf_dtype_round_trips_exactly(dtypes, shapes, seed):
    features, values = _features_and_values(dtypes, shapes, np.random.default_rng(seed))
    records = E.unframe(b"".join(E.frame(E.encode_example(features, values))
                                 for _ in range(2)))
    assert len(records) == 2
    back = E.decode_example(features, records[1])
    for f in features:
        assert back[f.name].dtype == f.dtype and back[f.name].shape == f.shape
        np.testing.assert_array_equal(back[f.name], values[f.name])


def test_unpacked_lists_read_like_packed_ones():
    f = [E.Feature("i", np.dtype(np.int32), (2,)), E.Feature("f", np.dtype(np.float32), ())]
    # Int64List with two unpacked entries (-1 as ten bytes), FloatList one fixed32 entry.
    ints = b"\x08\x05" + b"\x08" + E._varint(-1)
    floats = b"\x0d" + struct.pack("<f", 1.5)
    entry_i = E._field(1, b"i") + E._field(2, E._field(3, ints))
    entry_f = E._field(1, b"f") + E._field(2, E._field(2, floats))
    data = E._field(1, E._field(1, entry_i) + E._field(1, entry_f))
    back = E.decode_example(f, data)
    assert back["i"].tolist() == [5, -1] and back["f"] == np.float32(1.5)


def test_refusals_name_the_feature_and_what_was_wrong():
    f = [E.Feature("x", np.dtype(np.float32), (3,))]
    data = E.encode_example(f, {"x": np.zeros(3, np.float32)})
    with pytest.raises(DataError, match="'x' holds 3 float values, not the 4 of shape"):
        E.decode_example([E.Feature("x", np.dtype(np.float32), (4,))], data)
    with pytest.raises(DataError, match="has no feature 'y'"):
        E.decode_example([E.Feature("y", np.dtype(np.float32), (3,))], data)
    with pytest.raises(DataError, match="float64, which no tf.Example feature holds"):
        E.Feature("z", np.dtype(np.float64), ()).kind
    with pytest.raises(DataError, match="uint64"):
        E.feature_kind(np.uint64)
    with pytest.raises(DataError, match="shape"):
        E.encode_example(f, {"x": np.zeros(2, np.float32)})


@pytest.mark.parametrize("damage", ["length", "payload", "truncate", "garbage"])
def test_a_damaged_record_is_refused_by_its_checksum(damage):
    good = E.frame(b"some record")
    bad = {"length": bytes([good[0] ^ 1]) + good[1:],
           "payload": good[:14] + bytes([good[14] ^ 1]) + good[15:],
           "truncate": good[:-3], "garbage": good + b"\x00" * 5}[damage]
    with pytest.raises(DataError, match="checksum|ends inside|more than the file"):
        E.unframe(bad, "f.tfrecord")


def test_population_is_written_whole_and_read_back_checked(tmp_path):
    features = [E.Feature("data/x", np.dtype(np.float32), (2, 3)),
                E.Feature("1", np.dtype(np.uint32), (2,))]
    clients = [{"data/x": np.full((2, 3), i, np.float32),
                "1": np.array([i, 2**32 - 1], np.uint32)} for i in range(3)]
    assert E.write_population(str(tmp_path), features, clients) == 3
    pop = E.ExamplePopulation(str(tmp_path))
    assert len(pop) == 3 and pop.features == features
    np.testing.assert_array_equal(pop.client(2)["1"], clients[2]["1"])

    def failing():  # a writer that fails leaves the old population as it was
        yield clients[0]
        raise RuntimeError("source failed")

    with pytest.raises(RuntimeError):
        E.write_population(str(tmp_path), features, failing())
    assert len(E.ExamplePopulation(str(tmp_path))) == 3
    assert sorted(os.listdir(tmp_path)) == ["client_00000.tfrecord", "client_00001.tfrecord",
                                            "client_00002.tfrecord", "features.json"]


def test_population_files_are_read_as_another_partys(tmp_path):
    features = [E.Feature("x", np.dtype(np.float32), (1,))]
    E.write_population(str(tmp_path), features, [{"x": np.ones(1, np.float32)}])
    meta = tmp_path / "features.json"
    spec = json.loads(meta.read_text())
    spec["features"][0]["dtype"] = "O"
    meta.write_text(json.dumps(spec))
    with pytest.raises(DataError, match="not a number type"):
        E.ExamplePopulation(str(tmp_path))
    for field, value, said in (("shape", [1.0], "expected a whole number"),
                               ("name", 3, "expected a string"),
                               ("shape", [1] * 40, "40 dimensions")):
        bad = json.loads(json.dumps(spec))
        bad["features"][0]["dtype"] = "<f4"
        bad["features"][0][field] = value
        meta.write_text(json.dumps(bad))
        with pytest.raises(DataError, match=said):
            E.ExamplePopulation(str(tmp_path))
    spec["features"][0]["dtype"] = "<f4"
    meta.write_text(json.dumps(spec))
    record = tmp_path / "client_00000.tfrecord"
    record.unlink()
    os.mkfifo(record)  # a FIFO never blocks the reader
    with pytest.raises(Exception, match="FIFO"):
        E.ExamplePopulation(str(tmp_path)).client(0)
    record.unlink()
    record.write_bytes(E.frame(b"x") * 2)
    with pytest.raises(DataError, match="holds 2 examples"):
        E.ExamplePopulation(str(tmp_path)).client(0)


NARROW = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.bool_,
          np.float16, ml_dtypes.bfloat16]


def _as_stored(name: str, wide, values) -> bytes:
    """An example whose feature `name` holds `values` as the list of `wide` stores them."""
    f = E.Feature(name, np.dtype(wide), (len(values),))
    return E.encode_example([f], {name: np.asarray(values, wide)})


@settings(max_examples=80, deadline=None)
@given(dtype=st.sampled_from(NARROW), data=st.data())
def test_a_value_beyond_the_declared_dtype_is_refused_by_name(dtype, data):
    dtype = np.dtype(dtype)
    if dtype.kind == "f" or dtype.name == "bfloat16":
        big = float(ml_dtypes.finfo(dtype).max)
        top = float(np.finfo(np.float32).max)
        value = data.draw(st.one_of(st.floats(width=32), st.floats(big, top, width=32),
                                    st.floats(-top, -big, width=32)))
        stored = _as_stored("x", np.float32, [0.5, value])
        with np.errstate(over="ignore"):
            beyond = bool(np.isfinite(value)
                          and not np.isfinite(np.float32(value).astype(dtype)))
    else:
        low, high = (0, 1) if dtype == np.bool_ else (int(np.iinfo(dtype).min),
                                                      int(np.iinfo(dtype).max))
        value = data.draw(st.one_of(st.integers(-2**63, 2**63 - 1),
                                    st.integers(low - 4, high + 4)))
        stored = _as_stored("x", np.int64, [1, value])
        beyond = not low <= value <= high
    feature = E.Feature("x", dtype, (2,))
    if beyond:
        with pytest.raises(DataError, match=f"'x' holds .* at index 1, beyond {dtype.name}"):
            E.decode_example([feature], stored)
    else:
        got = E.decode_example([feature], stored)["x"]
        assert got.dtype == dtype
        np.testing.assert_array_equal(got.astype(np.float64)[1],
                                      np.asarray(value).astype(dtype).astype(np.float64))


def _int64_list(payload: bytes, packed: bool) -> bytes:
    """An example whose feature 'i' is an Int64List of the varints in `payload`."""
    body = E._field(1, payload) if packed else b"".join(
        b"\x08" + v for v in _split_varints(payload))
    return E._field(1, E._field(1, E._field(1, b"i") + E._field(2, E._field(3, body))))


def _split_varints(payload: bytes) -> list:
    out, start = [], 0
    for i, b in enumerate(payload):
        if b < 0x80:
            out.append(payload[start:i + 1])
            start = i + 1
    return out + ([payload[start:]] if start < len(payload) else [])


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("number", [b"\xff" * 9 + b"\x02", b"\xff" * 9 + b"\x7f",
                                    b"\x80" * 10 + b"\x01", b"\xff" * 3])
def test_a_varint_beyond_64_bits_or_cut_short_is_refused_by_name(packed, number):
    data = _int64_list(E._varint(7) + number, packed)
    with pytest.raises(DataError, match="malformed number|beyond 64 bits|ends inside"):
        E.decode_example([E.Feature("i", np.dtype(np.int64), (2,))], data)


def test_a_shape_whose_size_wraps_int64_is_refused_before_anything_is_read(tmp_path):
    shape = (2**31, 2**31, 4)  # 2**64 values: 0 in int64
    data = E.encode_example([E.Feature("x", np.dtype(np.float32), (0,))],
                            {"x": np.zeros(0, np.float32)})
    with pytest.raises(DataError, match=r"'x' holds 0 float values, not the "
                       r"18446744073709551616 of shape \(2147483648, 2147483648, 4\)"):
        E.decode_example([E.Feature("x", np.dtype(np.float32), shape)], data)
    E.write_population(str(tmp_path), [E.Feature("x", np.dtype(np.float32), (1,))],
                       [{"x": np.ones(1, np.float32)}])
    spec = json.loads((tmp_path / "features.json").read_text())
    spec["features"][0]["shape"] = list(shape)
    (tmp_path / "features.json").write_text(json.dumps(spec))
    with pytest.raises(DataError, match="18446744073709551616 values, more than a record"):
        E.ExamplePopulation(str(tmp_path))


@pytest.mark.parametrize("declared", [1 << 20, 4])
def test_int64_lists_of_one_byte_varints_take_memory_bounded_by_their_shape(declared):
    import tracemalloc

    n = 1 << 20
    data = _int64_list((np.arange(n) % 100).astype(np.uint8).tobytes(), packed=True)  # 1 MiB of 1-byte varints
    feature = E.Feature("i", np.dtype(np.int64), (declared,))
    tracemalloc.start()
    try:
        if declared == n:
            got = E.decode_example([feature], data)["i"]
            assert got[:3].tolist() == [0, 1, 2] and got.size == n
        else:  # more values than the shape has: refused before they are decoded
            with pytest.raises(DataError, match=f"more than the {declared} values of its shape"):
                E.decode_example([feature], data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # the int64 result and a few copies of the bytes, not a Python int per byte
    assert peak <= 8 * declared + 8 * len(data), peak


NAMED = [E.Feature("data/x", np.dtype(np.float32), (2,)),
         E.Feature("data/y", np.dtype(np.int32), ()), E.Feature("mask", np.dtype(np.bool_), (2,))]
CLIENT = {"data/x": np.float32([1.5, -2.0]), "data/y": np.int32(7),
          "mask": np.array([True, False])}


def test_features_named_after_the_arguments_read_back_and_their_positions_are_known():
    assert E.positional_names(["data/x", "data/y", "mask"]) == ["0/x", "0/y", "1"]
    assert E.positional_names(["0/x", "1"]) == ["0/x", "1"]  # unnamed: as they were


def test_a_population_named_by_position_is_refused_with_its_renaming(tmp_path):
    named, old = str(tmp_path / "named"), str(tmp_path / "old")
    E.write_population(named, NAMED, [CLIENT])
    E.check_population_features(named, NAMED)
    renames = dict(zip(["0/x", "0/y", "1"], ["data/x", "data/y", "mask"]))
    E.write_population(old, [E.Feature(o, f.dtype, f.shape) for o, f in zip(renames, NAMED)],
                       [{o: CLIENT[n] for o, n in renames.items()}])
    with pytest.raises(DataError, match=r"names its features by position \(0/x, 0/y, 1\).*"
                                        r"rename_features\(.*'0/x': 'data/x'"):
        E.check_population_features(old, NAMED)
    assert E.rename_features(old, renames) == 1
    E.check_population_features(old, NAMED)
    for name, value in CLIENT.items():
        np.testing.assert_array_equal(E.ExamplePopulation(old).client(0)[name], value)
    other = [E.Feature("data/x", np.dtype(np.float32), (3,))] + NAMED[1:]
    with pytest.raises(DataError, match=r"holds features .* but the round reads"):
        E.check_population_features(named, other)
