"""Populations written to disk and read back a cohort at a time."""

import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fax_bridge.data import ClientStore, write_population
from fax_bridge.errors import DataError


def _population(n=7):
    rng = np.random.default_rng(0)
    for i in range(n):
        m = int(rng.integers(1, 6))
        yield {"x": rng.normal(size=(m, 3)).astype(np.float32),
               "y": np.full(m, i, dtype=np.int32)}


def test_round_trip(tmp_path):
    clients = list(_population())
    assert write_population(str(tmp_path), iter(clients)) == 7
    store = ClientStore(str(tmp_path))
    assert store.num_clients == 7 and store.keys == ["x", "y"]
    np.testing.assert_array_equal(store.sizes, [len(c["y"]) for c in clients])
    for i, c in enumerate(clients):
        got = store.client(i)
        np.testing.assert_array_equal(got["x"], c["x"])
        assert got["y"].dtype == np.int32 and (got["y"] == i).all()
    cohort = store.cohort([5, 2], multiple_of=4)
    assert cohort.data["x"].shape[1] % 4 == 0
    np.testing.assert_array_equal(cohort.counts, [len(clients[5]["y"]), len(clients[2]["y"])])
    np.testing.assert_array_equal(cohort.data["x"][0, : cohort.counts[0]], clients[5]["x"])


def test_arrays_are_read_on_demand_not_loaded(tmp_path):
    write_population(str(tmp_path), _population())
    with ClientStore(str(tmp_path)) as store:
        held = [v for v in vars(store).values() if isinstance(v, np.ndarray)]
        assert [a.size for a in held] == [store.num_clients + 1]  # the offsets only
        o = store.offsets  # examples 1..2 of client 3, then client 0's first one
        np.testing.assert_array_equal(store.rows("x", [o[3] + 1, o[0]], [2, 1]),
                                      [*store.client(3)["x"][1:3], store.client(0)["x"][0]])


def test_refuses_to_overwrite_and_checks_shapes(tmp_path):
    write_population(str(tmp_path), _population(2))
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_population(str(tmp_path), _population(2))
    bad = [{"x": np.ones((2, 3), np.float32)}, {"x": np.ones((2, 4), np.float32)}]
    with pytest.raises(ValueError, match="example shape"):
        write_population(str(tmp_path), bad, overwrite=True)
    with pytest.raises(FileNotFoundError, match="write_population"):
        ClientStore(str(tmp_path / "nothing"))


@settings(max_examples=20, deadline=None)
@given(ids=st.lists(st.integers(0, 6), min_size=1, max_size=5), keep=st.floats(0, 0.99))
def test_a_file_truncated_while_rows_are_read_fails_that_read(tmp_path_factory, ids, keep):
    """Whether the read runs past the new end (a short read) or not (the file checked
    again after reading), rows of a file truncated under the reader are never returned;
    a mapping would have raised SIGBUS in the reading process instead."""
    directory = str(tmp_path_factory.mktemp("truncated"))
    write_population(directory, _population())
    path = os.path.join(directory, "x.bin")
    with ClientStore(directory) as store:
        checked = store.check

        def check_then_truncate(keys=None):  # the file changes between check and read
            checked(keys)
            os.truncate(path, int(os.path.getsize(path) * keep))

        store.check = check_then_truncate
        starts = store.offsets[np.asarray(ids)]
        with pytest.raises(DataError, match=f"population file {path} changed .*truncated"):
            store.read(["x"], starts, store.offsets[np.asarray(ids) + 1] - starts)


def _forge(directory, meta=None, offsets=None, x=None):
    """A population folder holding the given files: `meta` (text or a dict as JSON),
    `offsets` (a list, saved as int64 .npy, or bytes), `x` (x.bin's bytes); a value of
    "fifo" makes that file a FIFO, None leaves it out."""
    import json as _json

    os.makedirs(directory, mode=0o700, exist_ok=True)
    for name, value in (("population.json", meta), ("offsets.npy", offsets),
                        ("x.bin", x)):
        path = os.path.join(directory, name)
        if value is None:
            continue
        if value == "fifo":
            os.mkfifo(path)
            continue
        if isinstance(value, dict):
            value = _json.dumps(value)
        if isinstance(value, list):
            np.save(path, np.asarray(value, np.int64))
            continue
        with open(path, "wb") as f:
            f.write(value.encode() if isinstance(value, str) else value)
    return directory


def _npy(array) -> bytes:
    import io

    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _npy_header(shape) -> bytes:
    import io

    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": "<i8", "fortran_order": False,
                                                  "shape": shape})
    return buffer.getvalue()


def _meta(dtype="<i1", shape=(), **extra):
    return dict({"format": 1, "arrays": {"x": {"dtype": dtype, "shape": list(shape)}},
                 "num_clients": 1}, **extra)


# (files of a population another party may have written, what the refusal names)
FORGED = {
    "object dtype": (dict(meta=_meta("|O"), offsets=[0, 1], x=b"A" * 8), r"'\|O'.*not a number"),
    "object dtype, 0x41 bytes": (dict(meta=_meta("|O"), offsets=[0, 8], x=b"\x41" * 64),
                                 "object"),
    "void of no size": (dict(meta=_meta("V0"), offsets=[0, 1], x=b""), "'V0'.*not a number"),
    "strings": (dict(meta=_meta("<U3"), offsets=[0, 1], x=b"\0" * 12), "not a number"),
    "a structure": (dict(meta=_meta("i4,f4"), offsets=[0, 1], x=b"\0" * 8), "not a number"),
    "an unknown dtype": (dict(meta=_meta("nonsense"), offsets=[0, 1], x=b"\0"),
                         "names no number type"),
    "negative shape, no x.bin": (dict(meta=_meta(shape=[-1]), offsets=[0, 1]),
                                 r"'shape'.* is -1, expected a whole number from 0"),
    "shape 1e400": (dict(meta='{"format": 1, "arrays": {"x": {"dtype": "<i1", "shape": '
                         '[1e400]}}, "num_clients": 1}', offsets=[0, 1]), "1e400"),
    "shape 2.0": (dict(meta=_meta(shape=[2.0]), offsets=[0, 1], x=b"\0\0"), "2.0, expected"),
    "shape true": (dict(meta=_meta(shape=[True]), offsets=[0, 1], x=b"\0"), "true, expected"),
    "nested 300,000 deep": (dict(meta="[" * 300_000 + "]" * 300_000, offsets=[0, 1]),
                            "nests deeper"),
    "a list at the top": (dict(meta="[1, 2]", offsets=[0, 1]), r"is \[1, 2\], expected an obj"),
    "format true": (dict(meta=_meta(format=True), offsets=[0, 1], x=b"\0"), "'format' is true"),
    "format NaN": (dict(meta='{"format": NaN}', offsets=[0, 1]), "NaN"),
    "a repeated key": (dict(meta='{"format": 1, "format": 1}', offsets=[0, 1]), "twice"),
    "not UTF-8": (dict(meta=b'{"format": "\xff"}', offsets=[0, 1]), "utf-8"),
    "no arrays": (dict(meta=_meta() | {"arrays": {}}, offsets=[0, 1]), "names no array"),
    "a key naming a path": (dict(meta={"format": 1, "num_clients": 1, "arrays": {
        "../x": {"dtype": "<i1", "shape": []}}}, offsets=[0, 1]), "cannot name a file"),
    "offsets of floats": (dict(meta=_meta(), offsets=_npy(np.array([0.0, 1.0])), x=b"\0"),
                          "holds float64"),
    "offsets decreasing": (dict(meta=_meta(num_clients=2), offsets=[0, 2, 1], x=b"\0"),
                           "never decrease"),
    "offsets of another count": (dict(meta=_meta(num_clients=3), offsets=[0, 1], x=b"\0"),
                                 "4 int64 offsets of 3 clients"),
    "offsets claiming 2^40": (dict(meta=_meta(), offsets=_npy_header((2 ** 40,)), x=b"\0"),
                              "header claims int64.1099511627776. .8796093022208 bytes"),
    "x.bin too short": (dict(meta=_meta(shape=[4]), offsets=[0, 2], x=b"\0" * 7),
                        "holds 7 bytes but 2 examples of int8.4. need 8"),
    "x.bin missing": (dict(meta=_meta(), offsets=[0, 1]), "x.bin is missing"),
    "population.json a FIFO": (dict(meta="fifo", offsets=[0, 1], x=b"\0"), "is a FIFO"),
    "offsets.npy a FIFO": (dict(meta=_meta(), offsets="fifo", x=b"\0"), "is a FIFO"),
    "x.bin a FIFO": (dict(meta=_meta(), offsets=[0, 1], x="fifo"), "is a FIFO"),
}


@pytest.mark.parametrize("case", sorted(FORGED))
def test_a_forged_population_is_refused_naming_the_file_and_field(tmp_path, case):
    """Every reader of a population's files: a regular file only (a FIFO never blocks:
    the files are opened non-blocking), the layout's JSON bounded in depth, finite and
    whole where it must be, number dtypes only (bytes never read as object pointers)."""
    files, match = FORGED[case]
    directory = _forge(str(tmp_path / "pop"), **files)
    with pytest.raises((DataError, PermissionError), match=match) as e:
        ClientStore(directory).client(0)
    assert directory in str(e.value)


def _read_all(directory) -> list:
    with ClientStore(directory) as store:
        return [{k: v.tolist() for k, v in store.client(i).items()}
                for i in range(store.num_clients)]


def test_an_interrupted_overwrite_keeps_the_old_population_whole(tmp_path, monkeypatch):
    directory = str(tmp_path / "pop")
    old = [{"x": np.full((2, 2), i, np.int8), "y": np.full(2, i, np.int8)} for i in range(3)]
    write_population(directory, old)
    before = _read_all(directory)
    opened = ClientStore(directory)

    def failing():  # six rows, then the generator fails
        yield {"x": np.full((3, 2), 99, np.int8), "y": np.zeros(3, np.int8)}
        yield {"x": np.full((3, 2), 77, np.int8), "y": np.zeros(3, np.int8)}
        raise RuntimeError("the source failed")

    with pytest.raises(RuntimeError, match="the source failed"):
        write_population(directory, failing(), overwrite=True)
    assert _read_all(directory) == before
    assert opened.client(2)["x"].tolist() == [[2, 2], [2, 2]]  # an open store reads on
    assert sorted(os.listdir(directory)) == ["offsets.npy", "population.json", "x.bin",
                                             "y.bin"]
    # A whole write: a reader opening the folder while the files are renamed in finds
    # no population (never the new arrays under the old layout), then the new one
    seen = []
    rename = os.replace

    def spying_replace(src, dst, *a, **k):
        try:
            seen.append(_read_all(directory))
        except FileNotFoundError:
            seen.append("none")
        return rename(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", spying_replace)
    new = [{"x": np.full((1, 2), 5, np.int8)}]
    assert write_population(directory, new, overwrite=True) == 1
    monkeypatch.undo()
    assert seen == ["none"] * 3 and _read_all(directory) == [{"x": [[5, 5]]}]
    assert sorted(os.listdir(directory)) == ["offsets.npy", "population.json", "x.bin"]
    with pytest.raises(DataError, match="changed since this store opened it"):
        opened.client(0)  # the store opened before sees the change by name


def test_a_link_or_a_folder_where_a_population_file_goes_is_refused_and_kept(tmp_path):
    directory = str(tmp_path / "pop")
    write_population(directory, [{"x": np.zeros(1, np.int8)}])
    target = tmp_path / "precious"
    target.write_bytes(b"kept")
    os.unlink(os.path.join(directory, "x.bin"))
    os.symlink(target, os.path.join(directory, "x.bin"))
    with pytest.raises(PermissionError, match="x.bin is a symbolic link"):
        write_population(directory, [{"x": np.ones(4, np.int8)}], overwrite=True)
    with pytest.raises(PermissionError, match="x.bin is a symbolic link"):
        ClientStore(directory)
    os.unlink(os.path.join(directory, "x.bin"))
    os.mkdir(os.path.join(directory, "x.bin"))
    with pytest.raises(PermissionError, match="x.bin is a folder, where only a regular"):
        write_population(directory, [{"x": np.ones(4, np.int8)}], overwrite=True)
    assert target.read_bytes() == b"kept" and os.path.exists(
        os.path.join(directory, "population.json"))
    link = str(tmp_path / "link")
    os.symlink(directory, link)
    with pytest.raises(PermissionError, match="is a symbolic link"):
        write_population(link, [{"x": np.ones(4, np.int8)}], overwrite=True)


def test_number_types_round_trip_and_others_are_refused_by_name(tmp_path):
    import ml_dtypes

    data = {"b": np.arange(4, dtype=ml_dtypes.bfloat16).reshape(2, 2),
            "c": np.ones(2, np.complex64), "q": np.array([True, False]),
            "e": np.arange(2, dtype=">i4")}
    write_population(str(tmp_path / "ok"), [data])
    with ClientStore(str(tmp_path / "ok")) as store:
        got = store.client(0)
    for key, value in data.items():
        assert got[key].dtype == value.dtype and got[key].tobytes() == value.tobytes()
    for bad in (np.array(["ab", "c"]), np.array([b"a", b"b"]),
                np.zeros(2, "datetime64[s]"), np.zeros(2, "i4,f4")):
        with pytest.raises(DataError, match=f"client 0: 'x': dtype .* is not a number"):
            write_population(str(tmp_path / "bad"), [{"x": bad}], overwrite=True)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats()
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=3),
    max_leaves=10)
_FIELDS = [("format",), ("num_clients",), ("arrays",), ("arrays", "x"),
           ("arrays", "x", "dtype"), ("arrays", "x", "shape"), ("arrays", "x", "shape", 0)]


@settings(max_examples=80, deadline=None)
@given(field=st.sampled_from(_FIELDS), value=_JSON)
def test_any_value_in_any_layout_field_is_read_or_refused_by_name(tmp_path_factory, field,
                                                                  value):
    """Whatever JSON value stands in a field of population.json (floats beyond range
    written as 1e999, NaN as NaN), the store reads the population or refuses it with a
    DataError naming the layout file: never another error."""
    import json as _json

    meta = _meta(shape=[2])
    node = meta
    for key in field[:-1]:
        node = node[key]
    node[field[-1]] = value
    directory = _forge(str(tmp_path_factory.mktemp("pop")), meta=_json.dumps(meta),
                       offsets=[0, 1], x=b"\1\2")
    try:
        with ClientStore(directory) as store:
            store.client(0)
    except DataError as e:
        assert directory in str(e)
