"""Tests of fax_bridge.runtime.npz_keys: one npz key rule for inputs and results."""

import federated_language as fl
import numpy as np
import pytest
from federated_language.common_libs import structure
from hypothesis import example, given, settings, strategies as st

from fax_bridge.errors import ComputationError
from fax_bridge.runtime import npz_keys, values
from sample_computations import clients, server

F32 = np.float32
V2 = fl.TensorType(F32, [2])


def test_npz_keys_follow_element_names_and_indices():
    t = fl.StructType([("x", clients(V2)), (None, server(fl.StructType([("m", F32)]))),
                       ("lr", server(F32))])
    npz = {"x": np.ones((4, 2), F32), "1.m": np.float32(2.0), "lr": np.float32(0.1)}
    arg = npz_keys.args_from_npz(npz, t)
    assert len(arg[0]) == 4 and arg[1].m == 2.0
    out = npz_keys.result_to_npz(arg, t)
    assert sorted(out) == ["1.m", "lr", "x"]
    np.testing.assert_array_equal(out["x"], npz["x"])


def test_npz_single_tensor_uses_arg_and_result_keys():
    arg = npz_keys.args_from_npz({"arg": np.ones((3, 2), F32)}, clients(V2))
    assert len(arg) == 3
    assert sorted(npz_keys.result_to_npz(np.float32(1.0), server(F32))) == ["result"]
    with pytest.raises(ComputationError, match="no key `arg`"):
        npz_keys.args_from_npz({"x": np.ones(2)}, server(V2))
    with pytest.raises(ComputationError, match=r"keys \['extra'\]"):
        npz_keys.args_from_npz({"arg": np.ones(2, F32), "extra": np.ones(1)}, server(V2))
    assert npz_keys.args_from_npz({}, None) is None


def test_npz_keys_ignore_placements_so_inputs_and_results_agree():
    pair = fl.StructType([("a", V2), ("b", F32)])
    for t in (server(pair), fl.StructType([("a", server(V2)), ("b", server(F32))])):
        npz = {"a": np.ones(2, F32), "b": np.float32(3)}
        arg = npz_keys.args_from_npz(npz, t)
        assert sorted(npz_keys.result_to_npz(arg, t)) == ["a", "b"]


_tensor_types = st.sampled_from([fl.TensorType(F32), V2, fl.TensorType(np.int32, [3])])


def _types(depth: int):
    base = _tensor_types if depth == 0 else st.one_of(_tensor_types, st.builds(
        lambda children, named: fl.StructType(
            [(f"e{i}" if named else None, c) for i, c in enumerate(children)]),
        st.lists(_types(depth - 1), min_size=1, max_size=3), st.booleans()))
    return base


@settings(max_examples=60, deadline=None)
@given(_types(2), st.sampled_from(["server", "clients", "none"]), st.integers(1, 3))
def test_npz_round_trip_for_any_type(member, placement, n):
    t = {"server": server, "clients": clients, "none": lambda x: x}[placement](member)
    rng = np.random.default_rng(0)

    def sample(tt, lead):
        if isinstance(tt, fl.StructType):
            return tuple(sample(c, lead) for _, c in tt.items())
        return rng.normal(size=lead + tuple(tt.shape)).astype(tt.dtype)

    tree = sample(member, (n,) if placement == "clients" else ())
    value = values.from_pytree(tree, t)
    out = npz_keys.result_to_npz(value, t)
    keys = sorted(out)
    assert keys == ["result"] if isinstance(member, fl.TensorType) else "result" not in keys
    back = npz_keys.args_from_npz({("arg" if k == "result" else k): v for k, v in out.items()},
                                t)
    again = npz_keys.result_to_npz(back, t)
    assert sorted(again) == keys
    for k in keys:
        np.testing.assert_array_equal(again[k], out[k])


_awkward_names = st.one_of(
    st.none(), st.text(max_size=5),
    st.sampled_from(["", ".", "..", "a.b", "a", "b", "%", "%2E", "%25", "0", "1", "01", "\\",
                     "\\.", "\0", "arg", "result", "x.npy", "x", "file",
                     "allow_pickle"]))


@st.composite
def _named_types(draw, depth: int = 3):
    """A struct type whose element names are any strings, with a value as a pytree."""
    if depth == 0 or draw(st.booleans()):
        dtype = draw(st.sampled_from([F32, np.int32]))
        return fl.TensorType(dtype, draw(st.sampled_from([[], [2]])))
    names, seen = [], set()
    for name in draw(st.lists(_awkward_names, max_size=4)):
        names.append(None if name in seen else name)  # a struct's names are distinct
        seen.add(name)
    return fl.StructType([(n, draw(_named_types(depth - 1))) for n in names])


def _fill(type_, counter):
    """A pytree of `type_`: dicts for all-named structs, lists or tuples otherwise."""
    if isinstance(type_, fl.TensorType):
        counter[0] += 1
        return np.full(type_.shape, counter[0], type_.dtype)
    items = list(type_.items())
    children = [_fill(t, counter) for _, t in items]
    if items and all(n for n, _ in items):
        return dict(zip((n for n, _ in items), children))
    return children if counter[0] % 2 else tuple(children)


@settings(max_examples=80, deadline=None)
@given(_named_types(), st.booleans())
def test_npz_keys_never_collide_and_round_trip_through_a_file(tmp_path_factory, t, placed):
    """Any element names (dots, %, backslashes, NUL, digits, empty) give one distinct key
    per tensor, which `split_npz_key` reads back as the tensor's path, and a result
    saved and loaded comes back as the same argument."""
    from fax_bridge.system import cli_args

    t = server(t) if placed else t
    local = values.to_local(_fill(t.member if placed else t, [0]), t.member if placed else t)
    out = npz_keys.result_to_npz(local, t)
    layout = npz_keys.npz_layout(t, root="result")
    assert [k for k, _ in layout] == list(out)  # one key per tensor: nothing merged
    tensors = [leaf for leaf in structure.flatten(local)] if isinstance(
        local, structure.Struct) else [local]
    for (key, _), leaf in zip(layout, tensors):
        np.testing.assert_array_equal(out[key], leaf)  # each key holds its own tensor
    for key in out:
        if key != "result":
            path = npz_keys.split_npz_key(key)
            node = t.member if placed else t
            for step in path:  # the decoded path leads to a tensor of the type
                items = list(node.items())
                node = items[step][1] if isinstance(step, int) else dict(
                    (n, c) for n, c in items if n)[step]
            assert isinstance(node, fl.TensorType)
    path = tmp_path_factory.mktemp("npz") / "r.npz"
    written, failed = cli_args.save_result(str(path), out)
    assert failed is None and written == str(path)
    loaded = cli_args.load_npz(str(path))
    assert sorted(loaded) == sorted(out)
    single = isinstance(t.member if placed else t, fl.TensorType)
    back = npz_keys.args_from_npz({("arg" if single else k): v for k, v in loaded.items()}, t)
    again = npz_keys.result_to_npz(back, t)
    assert list(again) == list(out)
    for k in out:
        np.testing.assert_array_equal(again[k], out[k])


def test_a_dotted_name_and_a_nested_path_get_different_keys():
    t = fl.StructType([("a.b", F32), ("a", fl.StructType([("b", F32)])),
                       ("1", F32), (None, F32)])
    out = npz_keys.result_to_npz(values.to_local((1.0, {"b": 2.0}, 3.0, 4.0), t), t)
    assert {k: float(v) for k, v in out.items()} == {"a%2Eb": 1.0, "a.b": 2.0, "%31": 3.0,
                                                      "3": 4.0}
    assert [npz_keys.split_npz_key(k) for k in out] == [["a.b"], ["a", "b"], ["1"], [3]]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([np.float64, np.int32, np.int64, np.float16, np.uint8, np.bool_]),
       st.sampled_from([(), (2,)]), st.sampled_from(["x", "a.b"]))
def test_npz_inputs_of_another_dtype_are_refused_naming_key_dtypes_and_fix(dtype, shape,
                                                                         name):
    t = fl.StructType([(name, fl.TensorType(F32, list(shape)))])
    key = npz_keys.npz_layout(t)[0][0]
    npz = {key: np.ones(shape, dtype)}
    with pytest.raises(ComputationError) as e:
        npz_keys.args_from_npz(npz, t)
    text = str(e.value)
    assert f"`{key}`" in text and np.dtype(dtype).name in text and "float32" in text
    assert "astype(numpy.float32)" in text and "--cast" in text
    if np.can_cast(dtype, F32, "same_kind"):
        got = npz_keys.args_from_npz(npz, t, cast=True)
        assert got[0].dtype == F32


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([(np.int64, np.int32), (np.float64, F32), (np.int32, np.int16),
                        (np.uint16, np.uint8), (np.float64, np.float16)]),
       st.lists(st.floats(-1e40, 1e40, allow_nan=False), min_size=1, max_size=4))
def test_a_cast_never_wraps_or_overflows_a_value(pair, numbers):
    """With cast=True a value the tensor's dtype cannot hold is refused, never wrapped
    to another integer or turned into an infinity."""
    given_dtype, want = pair
    if np.dtype(given_dtype).kind == "f":
        arr = np.asarray(numbers, given_dtype)
    else:
        info = np.iinfo(given_dtype)
        arr = np.asarray([int(max(info.min, min(info.max, x))) for x in numbers], given_dtype)
    t = fl.StructType([("v", fl.TensorType(want, [len(numbers)]))])
    try:
        got = npz_keys.args_from_npz({"v": arr}, t, cast=True)[0]
    except ComputationError as e:
        assert "`v`" in str(e) and "does not fit" in str(e)
        return
    assert got.dtype == want
    if np.dtype(want).kind == "f":
        assert np.isfinite(got).all()
    else:
        np.testing.assert_array_equal(got.astype(given_dtype), arr)


def _member(shape, dtype, data: bytes) -> bytes:
    import io

    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": np.dtype(dtype).str,
                                               "fortran_order": False, "shape": shape})
    return out.getvalue() + data


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(0, 2**31), max_size=3), size=st.integers(0, 64),
       dtype=st.sampled_from(["<f4", "<i8", ">f8", "|u1", "|b1"]),
       compressed=st.booleans())
# no element, but more than numpy's largest array in its other dimensions
@example(shape=[0, 2**31, 2**31], size=0, dtype="<i8", compressed=False)
def test_a_member_whose_header_claims_other_bytes_is_refused_before_allocating(
        tmp_path_factory, shape, size, dtype, compressed):
    """Whatever shape a header claims over whatever bytes follow it, the reader gives
    exactly those bytes as that array or refuses naming the member, never a
    MemoryError (a claim of 2^40 elements included)."""
    import zipfile

    path = tmp_path_factory.mktemp("claims") / "x.npz"
    data = bytes(range(size))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED if compressed
                         else zipfile.ZIP_STORED) as archive:
        archive.writestr("a.npy", _member(tuple(shape), dtype, data))
    try:
        got = npz_keys.read_npz(path, what="--inputs")
    except npz_keys.NpzUnreadable as e:
        assert f"--inputs {path}" in str(e) and "'a.npy'" in str(e)
        if int(np.prod(shape)) * np.dtype(dtype).itemsize == size:  # the bytes fit
            with pytest.raises(ValueError):  # but numpy makes no array of that shape
                np.zeros(0, dtype).reshape(shape)
        return
    assert got["a"].shape == tuple(shape) and got["a"].tobytes() == data


def test_a_recorded_hash_is_checked_before_the_arrays_are_read(tmp_path):
    path = tmp_path / "x.npz"
    np.savez(path, a=np.arange(3))
    import hashlib

    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert npz_keys.read_npz(path, sha256=digest)["a"].tolist() == [0, 1, 2]
    with pytest.raises(npz_keys.NpzUnreadable, match=f"recorded {'0' * 64}"):
        npz_keys.read_npz(path, sha256="0" * 64)
