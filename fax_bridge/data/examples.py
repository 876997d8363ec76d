"""Client populations as TFRecord files of `tf.Example`s, what an example store serves.

A Federated Compute client reads its round's data as a stream of serialized
`tf.Example` protos; the forms `fax-bridge forms --for fcp` builds parse one feature per
leaf of the client data, named by the round's argument and the leaf's path (`data/x`,
`mask`; `check_population_features`, `rename_features` for ones named by position),
dense, shape and dtype fixed: floats in a `float_list`, integers and booleans in an
`int64_list`. A client serves exactly one example per round, holding its whole data.

`write_population(directory, features, clients)` writes `client_00000.tfrecord`, ... (one
record each) and `features.json` (name, dtype, shape per feature); `ExamplePopulation`
reads them back. Neither needs TensorFlow: the TFRecord framing (little-endian uint64
length, masked CRC-32C of the length, the bytes, masked CRC-32C of the bytes) and the
Example message (field numbers of `tensorflow/core/example/example.proto` and
`feature.proto`) are implemented here; TensorFlow reads these files, and these readers
read what TensorFlow writes (checked by `make forms-check`).

The files are read as another party's: regular files only, sizes bounded before they are
read, every record's checksums verified, `features.json`'s dtypes number types
(`checks.numeric_dtype`) and shapes no larger than a record holds, each feature's value
count equal to its shape's (more values are refused before they are decoded; an int64
list takes 8 bytes a value, not a Python int), a number beyond 64 bits refused, and
every value within its declared dtype (an int32 feature holding 2**40, a uint8 one
holding -1, a bool one holding 5, a float16 one holding 1e10 are refused by name, not
wrapped or rounded to infinity).
"""

from __future__ import annotations

import dataclasses
import array
import json
import math
import os
import shutil
import struct
import tempfile
from typing import Iterable, Iterator, Mapping, Sequence

import ml_dtypes
import numpy as np

from fax_bridge.system import private_files
from fax_bridge.data import checks
from fax_bridge.errors import DataError

FEATURES_FILE = "features.json"
MAX_FEATURES_BYTES = 1 << 20
MAX_RECORD_BYTES = 1 << 31
MAX_FILE_BYTES = 1 << 32
MAX_RANK = 32
_FORMAT = 1
_FIX = "write the population again with fax_bridge.data.examples.write_population"

# ---------------------------------------------------------------------------- CRC-32C


def _crc_table() -> list:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc_table()


_NP_TABLE = np.array(_TABLE, np.uint32)
_LANE = 1024  # bytes per lane of the vectorized CRC


def _raw(c: int, data: bytes) -> int:
    """The CRC register after `data` from register `c` (no init or final xor)."""
    table = _TABLE
    for b in data:
        c = table[(c ^ b) & 0xFF] ^ (c >> 8)
    return c


def _lanes(states: np.ndarray, block: np.ndarray) -> np.ndarray:
    """The registers of many lanes after each lane's row of `block` (one byte column of
    all lanes at a time)."""
    c = states.astype(np.uint32)
    for t in range(block.shape[1]):
        c = _NP_TABLE[(c ^ block[:, t]) & 0xFF] ^ (c >> 8)
    return c


def _zeros_operator() -> np.ndarray:
    """Column j: the register `1 << j` after `_LANE` zero bytes (the register's linear
    map over GF(2))."""
    return _lanes(np.uint32(1) << np.arange(32, dtype=np.uint32),
                  np.zeros((32, _LANE), np.uint8))


_SHIFT = None


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of `data`, as TFRecord files check it. Long inputs run as
    lanes of `_LANE` bytes side by side (numpy), whose registers are then combined: the
    register is linear, raw(s, chunk) = shift(s) ^ raw(0, chunk).

    >>> hex(crc32c(b"123456789"))
    '0xe3069283'
    """
    global _SHIFT
    n = len(data) // _LANE
    if n < 4:
        return _raw(0xFFFFFFFF, data) ^ 0xFFFFFFFF
    if _SHIFT is None:
        _SHIFT = [int(x) for x in _zeros_operator()]
    block = np.frombuffer(data, np.uint8, n * _LANE).reshape(n, _LANE)
    starts = np.zeros(n, np.uint32)
    starts[0] = 0xFFFFFFFF
    lanes = [int(x) for x in _lanes(starts, block)]
    c, shift = lanes[0], _SHIFT
    for lane in lanes[1:]:
        moved = 0
        j = 0
        while c:
            if c & 1:
                moved ^= shift[j]
            c >>= 1
            j += 1
        c = moved ^ lane
    return _raw(c, data[n * _LANE:]) ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC: the CRC rotated right by 15 bits plus 0xa282ead8."""
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


# ---------------------------------------------------------------------------- TFRecord


def frame(record: bytes) -> bytes:
    """One TFRecord: length, its masked CRC, the bytes, their masked CRC."""
    head = struct.pack("<Q", len(record))
    return (head + struct.pack("<I", masked_crc(head)) + record
            + struct.pack("<I", masked_crc(record)))


def unframe(data: bytes, what: str = "TFRecord file") -> list:
    """The records of a TFRecord file's bytes, each checksum verified."""
    out, pos = [], 0
    while pos < len(data):
        if len(data) - pos < 12:
            raise DataError(f"{what} ends inside a record header at byte {pos}; {_FIX}")
        head = data[pos:pos + 8]
        (length,), (crc,) = struct.unpack("<Q", head), struct.unpack("<I", data[pos + 8:pos + 12])
        if crc != masked_crc(head):
            raise DataError(f"{what}: the length of the record at byte {pos} fails its "
                            f"checksum (a corrupt or non-TFRecord file); {_FIX}")
        if length > MAX_RECORD_BYTES or pos + 16 + length > len(data):
            raise DataError(f"{what}: the record at byte {pos} claims {length} bytes, more "
                            f"than the file holds; {_FIX}")
        record = data[pos + 12:pos + 12 + length]
        (crc,) = struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])
        if crc != masked_crc(record):
            raise DataError(f"{what}: the record at byte {pos} fails its checksum; {_FIX}")
        out.append(record)
        pos += 16 + length
    return out


# ---------------------------------------------------------------------------- tf.Example


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int64: ten bytes of two's complement
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _read_varint(data: bytes, pos: int, what: str) -> tuple:
    n = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise DataError(f"{what} holds a malformed number (it ends inside one, or one "
                            f"runs past 10 bytes); {_FIX}")
        b = data[pos]
        if shift == 63 and b > 1:
            raise DataError(f"{what} holds a malformed number beyond 64 bits (its 10th "
                            f"byte is {b:#04x}); {_FIX}")
        n |= (b & 0x7F) << shift
        pos += 1
        shift += 7
        if not b & 0x80:
            return n, pos


def _fields(data: bytes, what: str) -> Iterator[tuple]:
    """(field number, wire type, value) of a protobuf message's bytes: wire type 0 gives
    an int, 2 the bytes, 5 four bytes, 1 eight bytes."""
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos, what)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(data, pos, what)
        elif wire == 2:
            size, pos = _read_varint(data, pos, what)
            if pos + size > len(data):
                raise DataError(f"{what} holds a field longer than its message; {_FIX}")
            value, pos = data[pos:pos + size], pos + size
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            if pos + size > len(data):
                raise DataError(f"{what} ends inside a field; {_FIX}")
            value, pos = data[pos:pos + size], pos + size
        else:
            raise DataError(f"{what} holds a field of wire type {wire}, which a tf.Example "
                            f"has not; {_FIX}")
        yield number, wire, value


@dataclasses.dataclass(frozen=True)
class Feature:
    """One dense feature: its name (the leaf's path), dtype and per-client shape."""

    name: str
    dtype: np.dtype
    shape: tuple

    @property
    def kind(self) -> str:
        """'float' or 'int64': the tf.Example list holding it."""
        return feature_kind(self.dtype, self.name)

    @property
    def size(self) -> int:
        """The number of values (a Python integer: a shape's size never wraps)."""
        return math.prod(int(d) for d in self.shape)


def feature_kind(dtype, name: str = "a leaf") -> str:
    """'float' (float16, bfloat16, float32) or 'int64' (bool, integers but uint64): the
    `tf.Example` list that holds values of `dtype` exactly; DataError for others."""
    dtype = np.dtype(dtype)
    if dtype == np.float32 or dtype == np.float16 or dtype.name == "bfloat16":
        return "float"
    if dtype == np.bool_ or (dtype.kind in "iu" and dtype != np.uint64):
        return "int64"
    raise DataError(f"{name} has dtype {dtype}, which no tf.Example feature holds exactly "
                    "(float16, bfloat16 and float32 go in a float_list; bool, integers up "
                    "to 32 bits and int64 in an int64_list); cast it in the program")


def encode_example(features: Sequence[Feature], values: Mapping[str, np.ndarray]) -> bytes:
    """The serialized `tf.Example` holding `values[f.name]` for each feature (packed
    lists: field 1 of FloatList / Int64List; Feature's float_list is field 2, int64_list
    field 3; Features' map is field 1 of (key=1, value=2) entries; Example.features 1)."""
    entries = []
    for f in features:
        if f.name not in values:
            raise DataError(f"the client's data has no value for feature {f.name!r}")
        value = np.asarray(values[f.name])
        if value.shape != tuple(f.shape):
            raise DataError(f"feature {f.name!r} has shape {value.shape}, not {f.shape}")
        if f.kind == "float":
            packed = value.astype("<f4").tobytes()
            feature = _field(2, _field(1, packed))
        else:
            packed = b"".join(_varint(int(v)) for v in value.astype(np.int64).ravel())
            feature = _field(3, _field(1, packed))
        entries.append(_field(1, _field(1, f.name.encode()) + _field(2, feature)))
    return _field(1, b"".join(entries))


_HIGH_BYTES = bytes(range(0x80, 0x100))
_VARINT_CHUNK = 1 << 14  # bytes of packed varints decoded at a time


def _varint_count(value: bytes) -> int:
    """The varints packed in `value`: its bytes without the continuation bit."""
    return len(value.translate(None, _HIGH_BYTES))


def _packed_varints(value: bytes, what: str) -> np.ndarray:
    """The varints packed in `value` as uint64, decoded with numpy a chunk at a time (8
    bytes a value and bounded temporaries, not a Python int per byte)."""
    data = np.frombuffer(value, np.uint8)
    if data.size and data[-1] & 0x80:
        raise DataError(f"{what} holds a malformed number (it ends inside one); {_FIX}")
    out = np.empty(_varint_count(value), np.uint64)
    pos = done = 0
    while pos < data.size:
        chunk = data[pos:pos + _VARINT_CHUNK]
        ends = np.flatnonzero(chunk < 0x80)
        if ends.size == 0:
            raise DataError(f"{what} holds a malformed number (one runs past 10 bytes); "
                            f"{_FIX}")
        chunk = chunk[:ends[-1] + 1]
        starts = np.concatenate(([0], ends[:-1] + 1))
        lengths = ends - starts + 1
        if lengths.max() > 10:
            raise DataError(f"{what} holds a malformed number (one runs past 10 bytes); "
                            f"{_FIX}")
        values = np.zeros(ends.size, np.uint64)
        for k in range(int(lengths.max())):
            at = np.flatnonzero(lengths > k)
            byte = chunk[starts[at] + k]
            if k == 9 and byte.max() > 1:
                raise DataError(f"{what} holds a malformed number beyond 64 bits (its 10th "
                                f"byte is {int(byte.max()):#04x}); {_FIX}")
            values[at] |= (byte & 0x7F).astype(np.uint64) << np.uint64(7 * k)
        out[done:done + ends.size] = values
        done += ends.size
        pos += chunk.size
    return out


def _list_values(data: bytes, kind: str, what: str, limit: int) -> np.ndarray:
    """A FloatList's / Int64List's values, packed or not, in order; refused once they
    number more than `limit` (what the feature's shape holds), before they are decoded.
    Memory: the values' own (4 or 8 bytes each) and bounded temporaries."""
    parts: list = []
    count = 0
    single = bytearray() if kind == "float" else array.array("Q")  # unpacked values

    def flush():
        nonlocal single
        if single:
            parts.append(np.frombuffer(single, "<f4" if kind == "float" else np.uint64))
            single = bytearray() if kind == "float" else array.array("Q")

    for number, wire, value in _fields(data, what):
        if number != 1:
            continue
        if kind == "float" and wire == 2 and len(value) % 4:
            raise DataError(f"{what}'s floats are not whole; {_FIX}")
        if kind == "float":
            new = len(value) // 4 if wire in (2, 5) else 0
        else:
            new = 1 if wire == 0 else _varint_count(value) if wire == 2 else 0
        count += new
        if count > limit:
            raise DataError(f"{what} holds more than the {limit} values of its shape "
                            f"(refused before they are decoded); {_FIX}")
        if not new:
            continue
        if wire in (0, 5):  # one value, unpacked
            if kind == "float":
                single.extend(value)
            else:
                single.append(value)
            continue
        flush()
        parts.append(np.frombuffer(value, "<f4") if kind == "float"
                     else _packed_varints(value, what))
    flush()
    if not parts:
        return np.zeros(0, np.float32 if kind == "float" else np.int64)
    out = np.concatenate(parts) if len(parts) > 1 else parts[0]
    return out if kind == "float" else out.view(np.int64)


def _in_range(values: np.ndarray, f: "Feature", what: str) -> np.ndarray:
    """`values` (float32 or int64, as their list holds them) as `f.dtype`; DataError
    naming the feature, the first value beyond the dtype's range and where it is (a
    float16/bfloat16 overflow to infinity, an integer outside the dtype, a bool neither
    0 nor 1) instead of a value wrapped or rounded to another."""
    dtype = np.dtype(f.dtype)
    if f.kind == "float":
        with np.errstate(over="ignore"):  # an overflow is refused below, by name
            cast = values.astype(dtype)
        bad = np.isfinite(values) & ~np.isfinite(cast)
        top = float(ml_dtypes.finfo(dtype).max)
        limits = f"[-{top:g}, {top:g}]"
    else:
        low, high = (0, 1) if dtype == np.bool_ else (int(np.iinfo(dtype).min),
                                                      int(np.iinfo(dtype).max))
        bad = (values < low) | (values > high) if dtype != np.int64 else None
        limits = f"[{low}, {high}]"
        cast = values.astype(dtype, copy=False)
    if bad is not None and bad.any():
        i = int(np.flatnonzero(bad)[0])
        at = np.unravel_index(i, f.shape) if f.shape else ()
        raise DataError(f"{what}'s feature {f.name!r} holds {values[i].item()!r} at index "
                        f"{i}{f' {list(map(int, at))}' if len(f.shape) > 1 else ''}, beyond "
                        f"{dtype.name}'s range {limits}; write values of its dtype, or "
                        f"declare a wider one; {_FIX}")
    return cast.reshape(f.shape)


def decode_example(features: Sequence[Feature], data: bytes,
                   what: str = "example") -> dict:
    """{name: array of the feature's dtype and shape} from a serialized `tf.Example`;
    DataError naming a missing feature, the wrong list kind or value count."""
    found = {}
    for number, wire, value in _fields(data, what):
        if number != 1 or wire != 2:
            continue
        for n2, w2, entry in _fields(value, what):
            if n2 != 1 or w2 != 2:
                continue
            key, body = None, b""
            for n3, w3, v3 in _fields(entry, what):
                if n3 == 1 and w3 == 2:
                    key = v3.decode(errors="replace")
                elif n3 == 2 and w3 == 2:
                    body = v3
            if key is not None:
                found[key] = body
    out = {}
    for f in features:
        if f.name not in found:
            raise DataError(f"{what} has no feature {f.name!r} (it has "
                            f"{sorted(found)[:8]}); {_FIX}")
        number = 2 if f.kind == "float" else 3
        lists = [v for n, w, v in _fields(found[f.name], what) if n == number and w == 2]
        name = f"{what}'s feature {f.name!r}"
        values = _list_values(lists[0] if len(lists) == 1 else b"".join(lists), f.kind, name,
                              min(f.size, MAX_RECORD_BYTES))
        if values.size != f.size:
            raise DataError(f"{name} holds {values.size} "
                            f"{'float' if f.kind == 'float' else 'int64'} values, not the "
                            f"{f.size} of shape {tuple(f.shape)}; {_FIX}")
        out[f.name] = _in_range(values, f, what)
    return out


# ---------------------------------------------------------------------------- populations


def client_file(i: int) -> str:
    return f"client_{i:05d}.tfrecord"


def write_population(directory: str, features: Sequence[Feature],
                     clients: Iterable[Mapping[str, np.ndarray]]) -> int:
    """Writes each client's data as one `tf.Example` in `client_NNNNN.tfrecord` and the
    features in `features.json`, replacing a population there before only once all is
    written; returns the number of clients.

    >>> import tempfile
    >>> f = [Feature("data/x", np.dtype(np.float32), (2,))]
    >>> d = tempfile.mkdtemp()
    >>> write_population(d, f, [{"data/x": np.array([1., 2.], np.float32)}])
    1
    >>> ExamplePopulation(d).client(0)["data/x"]
    array([1., 2.], dtype=float32)
    """
    features = [Feature(f.name, np.dtype(f.dtype), tuple(f.shape)) for f in features]
    for f in features:
        checks.numeric_dtype(checks.stored_dtype_name(f.dtype), f"feature {f.name!r}")
        f.kind  # refuses a dtype no list holds exactly
    os.makedirs(directory, exist_ok=True)
    part = tempfile.mkdtemp(prefix=".examples-", dir=directory)
    try:
        count = 0
        for i, values in enumerate(clients):
            with open(os.path.join(part, client_file(i)), "wb") as out:
                out.write(frame(encode_example(features, values)))
            count = i + 1
        spec = {"format": _FORMAT, "clients": count,
                "features": [{"name": f.name, "dtype": checks.stored_dtype_name(f.dtype),
                              "shape": list(f.shape)} for f in features]}
        with open(os.path.join(part, FEATURES_FILE), "w") as out:
            json.dump(spec, out, indent=1)
        meta = os.path.join(directory, FEATURES_FILE)
        if os.path.lexists(meta):
            os.remove(meta)
        for name in os.listdir(directory):
            if name.startswith("client_") and name.endswith(".tfrecord"):
                os.remove(os.path.join(directory, name))
        for name in sorted(os.listdir(part)):
            if name != FEATURES_FILE:
                os.replace(os.path.join(part, name), os.path.join(directory, name))
        os.replace(os.path.join(part, FEATURES_FILE), meta)
    finally:
        shutil.rmtree(part, ignore_errors=True)
    return count


def read_features(directory: str) -> tuple:
    """(features, number of clients) from `features.json`, read as another party's file
    (`private_files.read_json`: a regular file of bounded size, bounded depth, finite
    numbers; each field of the kind written), dtypes number types, names unrepeated."""
    path = os.path.join(directory, FEATURES_FILE)
    j = private_files
    try:
        spec = j.read_json(path, MAX_FEATURES_BYTES, what="features file", fix=_FIX)
        j.json_value(spec, "object", path)
        j.json_field(spec, "format", "int", path, low=_FORMAT, high=_FORMAT)
        clients = j.json_field(spec, "clients", "int", path, low=0, high=1 << 40)
        features, names = [], set()
        for k, entry in enumerate(j.json_field(spec, "features", "list", path)):
            where = f"{path}: feature {k}"
            j.json_value(entry, "object", where)
            name = j.json_field(entry, "name", "str", where)
            if name in names:
                raise DataError(f"{path} names feature {name!r} twice; {_FIX}")
            names.add(name)
            dtype = checks.numeric_dtype(j.json_field(entry, "dtype", "str", where),
                                         f"{path}'s feature {name!r}", _FIX)
            shape = j.json_field(entry, "shape", "list", where)
            if len(shape) > MAX_RANK:
                raise DataError(f"{where} has {len(shape)} dimensions, more than "
                                f"{MAX_RANK}; {_FIX}")
            shape = tuple(j.json_value(d, "int", f"{where}: field 'shape'", low=0,
                                       high=MAX_RECORD_BYTES) for d in shape)
            if math.prod(shape) > MAX_RECORD_BYTES:  # a value takes a byte at least
                raise DataError(f"{where} has shape {list(shape)}: {math.prod(shape)} "
                                f"values, more than a record of at most {MAX_RECORD_BYTES} "
                                f"bytes holds; {_FIX}")
            features.append(Feature(name, dtype, shape))
            features[-1].kind  # a dtype no tf.Example list holds exactly is refused
    except private_files.HandedFileError as e:
        raise DataError(f"{e}; {_FIX}" if _FIX not in str(e) else str(e)) from None
    return features, clients


def positional_names(names: Sequence[str]) -> list:
    """`data/x`, `mask` as named by argument position before: `0/x`, `1`."""
    tops = list(dict.fromkeys(n.split("/", 1)[0] for n in names))
    return list(names) if len(tops) == 1 else [
        "/".join([str(tops.index(n.partition("/")[0]))] + n.split("/")[1:]) for n in names]


def check_population_features(directory: str, features: Sequence[Feature]) -> None:
    """Refuses a population whose features are not `features`; one named by position
    (as written before) with the `rename_features` call that reads it."""
    want = [(f.name, np.dtype(f.dtype), tuple(f.shape)) for f in features]
    got = [(f.name, f.dtype, tuple(f.shape)) for f in read_features(directory)[0]]
    if got == want:
        return
    old = positional_names([n for n, _, _ in want])
    if [(n, d, sh) for n, (_, d, sh) in zip(old, want)] == got and old != [w[0] for w in want]:
        renames = {o: n for o, (n, _, _) in zip(old, want)}
        raise DataError(
            f"{directory} names its features by position ({', '.join(old)}); the round "
            f"reads them named after its arguments ({', '.join(renames.values())}). "
            f"Rename them: fax_bridge.data.examples.rename_features({directory!r}, "
            f"{renames!r})")
    raise DataError(f"{directory} holds features {got}, but the round reads {want}; write "
                    "the population from the round's client arguments "
                    "(fcp.client_features names them)")


def rename_features(directory: str, renames: Mapping[str, str]) -> int:
    """Writes the population in `directory` again with its features renamed."""
    pop, name = ExamplePopulation(directory), lambda k: renames.get(k, k)
    features = [Feature(name(f.name), f.dtype, f.shape) for f in pop.features]
    return write_population(directory, features, ({name(k): v for k, v in
                                                   pop.client(i).items()} for i in range(len(pop))))


class ExamplePopulation:
    """A population written by `write_population`: `client(i)` is client i's data
    ({feature name: array}), `paths` its files (what a TensorFlow reader takes)."""

    def __init__(self, directory: str):
        self.directory = directory
        self.features, self.num_clients = read_features(directory)
        self.paths = [os.path.join(directory, client_file(i)) for i in range(self.num_clients)]

    def __len__(self) -> int:
        return self.num_clients

    def records(self, i: int) -> list:
        """Client i's serialized examples."""
        path = self.paths[checks.integer("client", i, 0, self.num_clients - 1)]
        return read_records(path)

    def client(self, i: int) -> dict:
        records = self.records(i)
        if len(records) != 1:
            raise DataError(f"{self.paths[i]} holds {len(records)} examples; a client "
                            f"serves exactly one per round; {_FIX}")
        return decode_example(self.features, records[0], f"{self.paths[i]}'s example")


def read_records(path: str) -> list:
    """The records of the TFRecord file `path` (checked: a regular file, at most
    MAX_FILE_BYTES, every checksum)."""
    data = private_files.read_regular(path, MAX_FILE_BYTES, what="TFRecord file", fix=_FIX)
    return unframe(data, path)
