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


def _framed(text: bytes, tail: bytes = b"") -> bytes:
    """A body of `relay.MAGIC`, the length of `text`, `text`, padding and `tail`."""
    body = relay.MAGIC + len(text).to_bytes(8, "little") + text
    return body + b"\0" * (-len(body) % relay.ALIGN) + tail


def _deep(depth: int, kind: str = "[]") -> str:
    return kind[0] * depth + kind[1] * depth


_NUMBERS = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1.5",
                            "-1", "0", str(2 ** 63), str(2 ** 64), "9" * 5000, "true"])
_JSON = st.recursive(
    st.one_of(_NUMBERS, st.integers(-2 ** 70, 2 ** 70).map(str),
              st.text(max_size=6).map(json.dumps), st.just("null")),
    lambda inner: st.one_of(
        st.lists(inner, max_size=5).map(lambda xs: "[" + ",".join(xs) + "]"),
        st.dictionaries(st.text(max_size=4), inner, max_size=4).map(
            lambda d: "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in d.items()) + "}")),
    max_leaves=12)


@st.composite
def _entries(draw):
    """A header's JSON text: entries of any values (numbers the relay never takes
    among them), shapes and spans of any size, or nesting far past any limit."""
    deep = draw(st.sampled_from([0, 0, 0, 70, 5000, 200000]))
    if deep:
        where = draw(st.sampled_from(["header", "arrays", "entry", "shape"]))
        nested = _deep(deep, draw(st.sampled_from(["[]", "{}"]))) if where != "header" \
            else _deep(deep)
        nested = nested.replace("{}", '{"a":{}}', 0) if nested.startswith("{") else nested
        if nested.startswith("{"):  # a nested object needs keys
            nested = '{"a":' * deep + "0" + "}" * deep
        return {"header": f'{{"header": {nested}, "arrays": []}}',
                "arrays": f'{{"header": {{}}, "arrays": {nested}}}',
                "entry": f'{{"header": {{}}, "arrays": [{nested}]}}',
                "shape": f'{{"header": {{}}, "arrays": [["x", "<f4", {nested}, 0, 0]]}}',
                }[where]
    entry = [json.dumps(draw(st.text(max_size=3))),
             draw(st.sampled_from(['"<f4"', '"|u1"', '"<f999999999999999999"', '"|O"',
                                   "7", "null"])),
             draw(st.one_of(_JSON, st.lists(_JSON, max_size=4).map(
                 lambda xs: "[" + ",".join(xs) + "]"))),
             draw(_JSON), draw(_JSON)]
    entries = draw(st.sampled_from(["[[{}]]", "[{}]", "{}"]))
    return ('{"header": ' + draw(_JSON) + ', "arrays": '
            + entries.replace("{}", ", ".join(entry), 1) + "}")


@settings(max_examples=300, deadline=None)
@given(text=_entries(), tail=st.binary(max_size=200))
def test_any_header_a_peer_frames_is_a_value_error_or_arrays_inside_the_body(text, tail):
    """Whatever JSON a peer frames (NaN, Infinity, 1e400, integers past 2**63, text,
    objects and lists nested 70 to 200000 deep, in the header, the entries or a shape):
    a ValueError naming it, or arrays that lie inside the body; never an OverflowError,
    a RecursionError or any other exception."""
    body = _framed(text.encode(), tail)
    try:
        got, header = relay.unpack(body)
    except ValueError as e:
        assert str(e)
        return
    assert isinstance(header, (dict, list, str, int, float, type(None)))
    for value in got.values():
        assert value.nbytes <= len(body)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=300))
def test_arbitrary_bytes_after_the_magic_are_a_value_error(data):
    for body in (relay.MAGIC + data, _framed(data), relay.MAGIC + len(data).to_bytes(
            8, "little") + data):
        with pytest.raises(ValueError):
            relay.unpack(body)


_HEADER_VALUES = st.recursive(
    st.one_of(st.integers(-2 ** 70, 2 ** 70), st.floats(), st.text(max_size=4),
              st.none(), st.booleans(), st.just(2 ** 64), st.builds(object)),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=3), inner, max_size=3)),
    max_leaves=8)


def _nested(depth: int):
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@settings(max_examples=150, deadline=None)
@given(header=st.one_of(st.dictionaries(st.text(max_size=3), _HEADER_VALUES, max_size=4),
                        st.sampled_from([70, 3000, 100000]).map(
                            lambda d: {"deep": _nested(d)})))
def test_a_header_pack_cannot_carry_is_a_value_error(header):
    """A header of objects, NaN or infinities, integers JSON will not write, or lists
    nested past the relay's limit (or past Python's recursion limit) is a ValueError
    when packed; any other comes back equal."""
    try:
        body = relay.pack({"x": np.arange(3)}, header)
    except ValueError as e:
        assert str(e)
        return
    assert relay.unpack(body)[1] == header


def _npy(header: str, payload: bytes = b"") -> bytes:
    text = header.encode()
    text += b" " * (-(len(text) + 11) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + payload


@settings(max_examples=200, deadline=None)
@given(descr=st.sampled_from(["'<f4'", "'|u1'", "'|O'", "[('a', '<f4')]",
                              "[('a', " * 300 + "'<f4'" + ")]" * 300, "'<f4'"]),
       shape=st.one_of(st.lists(st.integers(-2, 2 ** 65), max_size=40).map(
           lambda xs: "(" + "".join(f"{x}," for x in xs) + ")"),
           st.sampled_from(["(" * 2000 + ")" * 2000, "(-1,)", "(1.5,)", "'x'"])),
       fortran=st.booleans(), payload=st.binary(max_size=64))
def test_any_npy_header_a_peer_sends_is_a_value_error_or_an_array_of_its_bytes(
        descr, shape, fortran, payload):
    """A Flower array whose .npy header names any shape (negative, past 2**63, of more
    dimensions than a message may carry, nested) or dtype (objects, deep records), over
    any bytes: a ValueError, or an array exactly as large as the bytes after its header
    (never an OverflowError or RecursionError)."""
    from flwr.app import Array

    item = Array(np.zeros(1, np.float32))
    item.data = _npy(f"{{'descr': {descr}, 'fortran_order': {fortran}, "
                     f"'shape': {shape}, }}", payload)
    try:
        got = relay.array_view(item)
    except ValueError as e:
        assert str(e)
        return
    assert got.nbytes == len(payload) and not got.flags.writeable


@settings(max_examples=60, deadline=None)
@given(field=st.sampled_from(["descr", "shape"]),
       broken=st.one_of(
           st.integers(201, 3000).map(lambda n: "(" * n + ")" * n),  # past the parser's depth
           st.integers(1, 40).map(lambda n: "(" * n + "1,"),  # never closed
           st.sampled_from(["'<f4", "'x", "(1,)'", "\"<f4"])))  # an unterminated string
def test_an_npy_header_python_cannot_tokenize_is_a_value_error(field, broken):
    """A header numpy's reader cannot even split into tokens (parentheses deeper than the
    tokenizer's limit, unbalanced, a string never closed: `tokenize.TokenError` on every
    Python, for more headers from 3.12) is refused as any bad header is: a ValueError."""
    from flwr.app import Array

    entries = {"descr": "'<f4'", "fortran_order": "False", "shape": "(1,)", field: broken}
    item = Array(np.zeros(1, np.float32))
    item.data = _npy("{" + "".join(f"'{k}': {v}, " for k, v in entries.items()) + "}",
                     np.zeros(1, np.float32).tobytes())
    with pytest.raises(ValueError, match="header"):
        relay.array_view(item)
