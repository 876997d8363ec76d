"""The ClientApp's link to a warm worker (`fax_bridge.flower.relay`): the framed body
both sides exchange, and the zero-copy view of Flower's arrays."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from fax_bridge.flower import relay

DTYPES = [np.dtype(t) for t in ("float32", "float64", "float16", "int8", "int32",
                                "int64", "uint8", "uint16", "bool", "complex64", ">f4",
                                ">i8")]
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def _array(dtype: np.dtype):
    shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)
    if dtype == BFLOAT16:  # any 16 bits, as a bfloat16 array
        return hnp.arrays(np.uint16, shapes).map(lambda a: a.view(BFLOAT16))
    return hnp.arrays(dtype, shapes)


def _arrays():
    one = st.sampled_from(DTYPES + [BFLOAT16]).flatmap(_array)
    return st.dictionaries(st.text(min_size=1, max_size=8), one, max_size=5)


def _same(got: np.ndarray, want: np.ndarray) -> bool:
    return (got.dtype.str == want.dtype.str and got.shape == want.shape
            and np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes())


@settings(max_examples=80, deadline=None)
@given(arrays=_arrays(), header=st.dictionaries(st.text(max_size=6),
                                                st.integers() | st.text(max_size=6),
                                                max_size=4))
def test_any_arrays_and_header_cross_the_relay_whole(arrays, header):
    """Every array comes back with its dtype (byte order, ml_dtypes' as their bytes
    type), shape and bytes, 0-d and empty ones too, each viewing the body (read-only)
    at an offset that is a multiple of `relay.ALIGN`; the header comes back equal."""
    body = relay.pack(arrays, header)
    got, got_header = relay.unpack(body)
    assert got_header == header and list(got) == list(arrays)
    for name, want in arrays.items():
        if want.dtype == BFLOAT16:  # numpy knows it as 2 bytes
            want = want.view(np.dtype("V2"))
        assert _same(got[name], want), name
        assert not got[name].flags.writeable
        at = got[name].ctypes.data - np.frombuffer(body, np.uint8).ctypes.data
        assert got[name].nbytes == 0 or (0 < at < len(body) and at % relay.ALIGN == 0)


@settings(max_examples=150, deadline=None)
@given(arrays=_arrays(), cut=st.integers(0, 1 << 12), flip=st.integers(0, 1 << 12),
       byte=st.integers(0, 255))
def test_a_cut_or_altered_body_is_a_value_error_never_a_read_outside_it(
        arrays, cut, flip, byte):
    """A body cut short anywhere, or with bytes after it, or with any byte of its
    framing changed, is a ValueError naming what is wrong, or (a changed byte that
    still frames) arrays that lie inside the body; nothing else."""
    body = relay.pack(arrays, {"round": 1})
    for wrong in (bytes(body[:min(cut, len(body) - 1)]), bytes(body) + b"\0" * (1 + cut)):
        with pytest.raises(ValueError):
            relay.unpack(wrong)
    altered = bytearray(body)
    head = len(relay.MAGIC) + 8 + int.from_bytes(body[len(relay.MAGIC):len(relay.MAGIC) + 8],
                                                 "little")
    altered[flip % head] = byte
    try:
        got, _ = relay.unpack(bytes(altered))
    except ValueError as e:
        assert str(e)
    else:
        for value in got.values():
            assert value.nbytes <= len(altered)


def test_arrays_of_objects_or_strings_are_refused_by_name():
    for bad in (np.array([object()]), np.array(["text"]), np.zeros(2, "i4,f4")):
        with pytest.raises(ValueError, match="array 'x' has dtype"):
            relay.pack({"x": bad}, {})


@pytest.mark.parametrize("descr", ["|O", "(2,)<f4", "<U3", "[('a', '<f4')]", "nonsense"])
def test_an_entry_naming_a_dtype_the_relay_does_not_carry_is_refused(descr):
    """A forged entry whose span and size fit (8 bytes, one element of 8) but whose
    dtype is objects, a sub-array, text, a record or no dtype at all."""
    text = json.dumps({"header": {}, "arrays": [["x", descr, [1], 0, 8]]}).encode()
    forged = relay.MAGIC + len(text).to_bytes(8, "little") + text
    forged += b"\0" * (-(-len(forged) // relay.ALIGN) * relay.ALIGN - len(forged) + 64)
    with pytest.raises(ValueError, match="array entry"):
        relay.unpack(forged)


def test_a_body_of_another_format_is_refused_by_name():
    with pytest.raises(ValueError, match="not a fax_bridge worker message"):
        relay.unpack(b"PK\x03\x04" + b"\0" * 64)  # an npz (zip)


@settings(max_examples=60, deadline=None)
@given(value=st.sampled_from(DTYPES).flatmap(_array), fortran=st.booleans())
def test_a_flower_arrays_view_is_what_its_numpy_gives_without_a_copy(value, fortran):
    from flwr.app import Array

    value = np.asfortranarray(value) if fortran else value
    item = Array(value)
    got = relay.array_view(item)
    assert _same(got, item.numpy()) and not got.flags.writeable
    assert np.shares_memory(got, np.frombuffer(item.data, np.uint8)) or got.nbytes == 0


def test_an_array_of_another_npy_version_or_serialization_is_refused_by_name():
    from flwr.app import Array

    item = Array(np.arange(3, dtype=np.float32))
    item.data = item.data[:6] + bytes([3]) + item.data[7:]  # .npy format 3.0
    with pytest.raises(ValueError, match="format version"):
        relay.array_view(item)
    item.stype = "torch.Tensor"
    with pytest.raises(ValueError, match="expected numpy.ndarray"):
        relay.array_view(item)
