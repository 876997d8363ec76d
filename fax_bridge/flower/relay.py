"""The ClientApp of a Flower round, and its link to a warm worker.

Flower 1.42 starts a new ClientApp process for every message a SuperNode receives. A
round's client part needs jax and an XLA compilation, which would then be paid on every
round; so a SuperNode can name a warm worker (`python -m fax_bridge.flower.worker`,
started once beside it, which keeps jax loaded and the compiled client part) in its
`--node-config`:

    worker="127.0.0.1:9300" worker-token-file="/path/token"

The ClientApp then only relays: it sends the round's broadcast and client ids to the
worker (HTTP on loopback, the token in a header, the arrays framed by `pack`: a JSON
header naming each array's dtype, shape and span, then their bytes, which `unpack`
views in place after checking every span; no pickles, no zip) and turns the worker's
partials into Flower records. This module
imports only the standard library, numpy and flwr, never fax_bridge's package (whose
`__init__` loads jax), so the app loads it by file path (`app_dir`). Without `worker`
the ClientApp computes in its own process: `client_app(..., local)` calls `local()`
for the module that does (`fax_bridge.flower.client`, imported only then).

A round with secure sums (`fax_bridge.flower.secagg`): the node's answer keeps back
its exact partials of them (`KEPT` + "0", ...); `keep` stores them in the node's run
state (`context.state`, which Flower keeps on the SuperNode between the ClientApp
processes of a run, never sending it), and the SecAgg+ stages that follow (messages
carrying `SECAGG_CONFIGS`) go through Flower's `secaggplus_mod`, whose masked stage
takes them minus the center the ServerApp names (`give_kept`).

The record names every side uses are kept here.
"""

from __future__ import annotations

import hmac
import http.client
import importlib
import importlib.util
import io
import json
import math
import os
import struct
import sys
import tokenize
from typing import Any, Callable, Optional

import numpy as np

BROADCAST = "broadcast"
IDS = "ids"
ROUND = "round"
PARTIALS = "partials"
LAYOUT = "layout"
METRICS = "metrics"
SERVED = "served"  # what computed a node's answer: client-runtime, model-sha256
TOKEN_HEADER = "X-Fax-Bridge-Token"
MAGIC = b"FAXRELAY1\n"  # what a `pack`ed body begins with
ALIGN = 64  # every array's bytes start at a multiple of this in a packed body
MAX_BODY_BYTES = 1 << 30
KEPT = "secure."            # a node's partials of the round's secure sums, kept back
KEPT_RECORD = "fax-secure"  # where the node's run state holds them (ArrayRecord),
KEPT_INFO = "fax-secure-info"  # and their round and count (ConfigRecord; one namespace)
SECAGG_CONFIGS = "secaggplus_configs"  # flwr's RECORD_KEY_CONFIGS: a SecAgg+ stage
ROUND_KEY = "fax-round"            # FitIns config of the masked stage: the round,
CENTER_KEY = "fax-secure-center"   # and C, subtracted from each kept partial


MAX_RANK = 32        # dimensions of an array a message may name (numpy takes 64)
MAX_DEPTH = 64       # nesting of a message header's JSON
_MAX_COUNT = 2 ** 63  # a dimension, offset or byte count is below this


def _count(value) -> bool:
    """Whether `value` (from a message's JSON) is a whole number in [0, 2**63): never a
    bool, a float (1e400 is read as infinity) or text."""
    return isinstance(value, int) and not isinstance(value, bool) and \
        0 <= value < _MAX_COUNT


def _shown(value) -> str:
    """A short text of a value read from a message, for an error (any nesting)."""
    try:
        return str(value)[:80]
    except RecursionError:
        return f"<a {type(value).__name__} nested too deep to show>"


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number a message may carry")


def _check_depth(value, depth: int = 0) -> None:
    """ValueError when JSON `value` nests deeper than `MAX_DEPTH`."""
    if depth > MAX_DEPTH:
        raise ValueError(f"the message's header nests deeper than {MAX_DEPTH} levels")
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for item in value:
            _check_depth(item, depth + 1)


def _json_object(text: bytes) -> dict:
    """A message header's JSON object: finite numbers only (no NaN, no Infinity, no
    float that overflows), nested at most `MAX_DEPTH` deep; ValueError for anything
    else, whatever the bytes (never a RecursionError or OverflowError)."""
    def finite(literal: str) -> float:
        value = float(literal)
        if not math.isfinite(value):
            raise ValueError(f"the number {literal[:40]} overflows a float")
        return value

    try:
        framed = json.loads(text.decode(), parse_constant=_refuse_constant,
                            parse_float=finite)
    except RecursionError:
        raise ValueError(f"the message's header nests deeper than {MAX_DEPTH} levels "
                         "(JSON)") from None
    except (ValueError, TypeError) as e:  # UnicodeDecodeError and JSONDecodeError too
        raise ValueError(f"the message's header is not the relay's JSON "
                         f"({str(e)[:200]})") from None
    if not isinstance(framed, dict):
        raise ValueError("the message's header is not a JSON object")
    _check_depth(framed)
    return framed


def _aligned(size: int) -> int:
    """`size` rounded up to a multiple of `ALIGN`."""
    return -(-size // ALIGN) * ALIGN


def c_order(value) -> np.ndarray:
    """`value` as a C-contiguous array, keeping its shape (np.ascontiguousarray would
    make a 0-d array 1-d)."""
    value = np.asarray(value)
    return value if value.flags.c_contiguous else value.copy(order="C")


def _descr(name: str, dtype: np.dtype) -> str:
    """`dtype` as `unpack` takes it: a number, bool or plain bytes type."""
    if dtype.kind not in "biufcV" or dtype.hasobject or dtype.fields is not None \
            or dtype.subdtype is not None:
        raise ValueError(f"array {name!r} has dtype {dtype}, which a worker message does "
                         "not carry (numbers, booleans and plain bytes only)")
    return dtype.str


def pack(arrays: dict, header: dict) -> bytearray:
    """`arrays` (name -> numpy array) and `header` (a JSON object) as one body: `MAGIC`,
    the JSON's length (8 bytes, little-endian), the JSON {"header", "arrays": [[name,
    dtype, shape, offset, bytes], ...]}, then each array's bytes at its offset (a
    multiple of `ALIGN`). `unpack` reads it back."""
    values = {str(k): c_order(v) for k, v in arrays.items()}
    entries, offset = [], 0
    for name, value in values.items():
        entries.append([name, _descr(name, value.dtype), list(value.shape), offset,
                        value.nbytes])
        offset += _aligned(value.nbytes)
    _check_depth(header)
    try:
        text = json.dumps({"header": header, "arrays": entries}, allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise ValueError("a worker message's header must be plain JSON (objects, lists, "
                         f"strings, finite numbers): {str(e)[:200]}") from None
    start = _aligned(len(MAGIC) + 8 + len(text))
    body = bytearray(start + offset)
    body[:len(MAGIC) + 8 + len(text)] = MAGIC + struct.pack("<Q", len(text)) + text
    for (_, _, _, at, size), value in zip(entries, values.values()):
        np.frombuffer(body, np.uint8, size, start + at)[:] = value.reshape(-1).view(np.uint8)
    return body


def unpack(data) -> tuple:
    """(arrays, header) of a `pack`ed body; each array views `data` (read-only) where
    its entry says, after checking the entry against the body: anything else (another
    format, a span outside the body, a dtype of objects) is a ValueError naming it."""
    data = memoryview(data).cast("B").toreadonly()
    head = len(MAGIC) + 8
    if len(data) < head or bytes(data[:len(MAGIC)]) != MAGIC:
        raise ValueError("the body is not a fax_bridge worker message (its first bytes "
                         "are not the relay's); are both sides the same fax_bridge?")
    (length,) = struct.unpack("<Q", data[len(MAGIC):head])
    if length > len(data) - head:
        raise ValueError(f"the message's header claims {length} bytes; the body has "
                         f"{len(data) - head} after it")
    framed = _json_object(bytes(data[head:head + length]))
    header, entries = framed.get("header"), framed.get("arrays")
    if not isinstance(header, dict) or not isinstance(entries, list):
        raise ValueError("the message's header is not a JSON object with a list of arrays")
    start = _aligned(head + length)
    arrays, end = {}, start
    for entry in entries:
        shown = _shown(entry)
        try:
            name, descr, shape, offset, size = entry
            ok = (isinstance(name, str) and isinstance(descr, str) and len(descr) <= 16
                  and isinstance(shape, list) and len(shape) <= MAX_RANK
                  and all(_count(d) for d in shape) and _count(offset) and _count(size))
            dtype = np.dtype(descr) if ok else None
            ok = ok and (_descr(name, dtype) == dtype.str
                         and size == math.prod(shape) * dtype.itemsize
                         and start + offset + size <= len(data))
            if ok:
                value = np.frombuffer(data, dtype, math.prod(shape), start + offset)
                value = value.reshape(shape)
        except (ValueError, TypeError) as e:
            raise ValueError(f"the message's array entry {shown} is malformed "
                             f"({e})") from None
        if not ok:
            raise ValueError(f"the message's array entry {shown} does not fit its body of "
                             f"{len(data)} bytes or its own dtype and shape (whole "
                             f"numbers below 2**63, at most {MAX_RANK} dimensions)")
        arrays[name] = value
        end = max(end, start + _aligned(offset + size))
    if len(data) != end:
        raise ValueError(f"the message's body has {len(data)} bytes; its header frames "
                         f"{end} (cut short, or bytes after its arrays)")
    return arrays, header


def token_matches(given: Optional[str], token: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), token.encode())


def _private_files():
    """`fax_bridge.system.private_files`: imported where fax_bridge's package is, else loaded
    by its path (this module never loads the package, which loads jax)."""
    if "fax_bridge" in sys.modules:
        return importlib.import_module("fax_bridge.system.private_files")
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "system", "private_files.py")
    spec = importlib.util.spec_from_file_location("_fax_bridge_private_files", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_token(path: str) -> str:
    """The worker token in `path`: a file of ours that others can neither read nor
    write, never read through a link (`private_files.read_private`)."""
    token = _private_files().read_private(path).decode(errors="replace").strip()
    if len(token) < 16:
        raise ValueError(f"the worker token in {path} is shorter than 16 characters")
    return token


def call(address: str, token: str, path: str, body: bytes = b"",
         timeout_s: float = 600.0) -> bytes:
    """POSTs `body` to the worker at `address` (HOST:PORT, loopback); its answer."""
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        connection.request("POST", path, body=body, headers={
            TOKEN_HEADER: token, "Content-Type": "application/octet-stream"})
        response = connection.getresponse()
        data = response.read()
    finally:
        connection.close()
    if response.status != 200:
        raise RuntimeError(f"the fax_bridge worker at {address} answered {path} with "
                           f"{response.status}: {data.decode(errors='replace')[:2000]}")
    return data


def array_view(item) -> np.ndarray:
    """A Flower `Array`'s numpy array, read-only, viewing its bytes in place (what
    `Array.numpy()` gives, without its copy): the .npy header read as numpy reads it,
    never unpickling; a dtype of objects, or a header that is not a Python literal, is a
    ValueError."""
    if item.stype != "numpy.ndarray":
        raise ValueError(f"an array serialized as {item.stype!r}; expected numpy.ndarray")
    data = item.data
    header = io.BytesIO(data)  # shares `data`'s bytes until written
    version = np.lib.format.read_magic(header)
    if version not in ((1, 0), (2, 0)):
        raise ValueError(f".npy format version {version}; Flower writes 1.0 (or 2.0)")
    read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
            else np.lib.format.read_array_header_2_0)
    try:
        shape, fortran, dtype = read(header)
    except tokenize.TokenError as e:  # numpy lets the tokenizer's own error through
        raise ValueError(f"a .npy header Python cannot read: {e}") from None
    if dtype.hasobject:
        raise ValueError(f"an array of dtype {dtype}: objects are never read")
    if len(shape) > MAX_RANK or not all(_count(d) for d in shape):
        raise ValueError(f"an array of shape {_shown(shape)}: expected at most {MAX_RANK} "
                         "whole dimensions, each in [0, 2**63)")
    count = math.prod(shape)
    if count * dtype.itemsize != len(data) - header.tell():
        raise ValueError(f"an array of shape {list(shape)} and dtype {dtype} takes "
                         f"{count * dtype.itemsize} bytes; its .npy holds "
                         f"{len(data) - header.tell()} after its header")
    flat = np.frombuffer(data, dtype, count, header.tell())
    return flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)


def request_of(content) -> tuple:
    """(arrays, header) of a `train` message's content, as a worker takes them."""
    arrays = {IDS: array_view(content[IDS][IDS])}
    for key, item in content[BROADCAST].items():
        arrays[f"b{key}"] = array_view(item)
    header = {LAYOUT: dict(content[LAYOUT]), ROUND: dict(content[ROUND])}
    return arrays, header


def keep(state, out: dict, round_index: int) -> None:
    """Moves the kept partials (`KEPT` keys) out of a node's answer `out` into its run
    state `state` (a RecordDict), for round `round_index`."""
    from flwr.app import Array, ArrayRecord, ConfigRecord

    kept = {k: out.pop(k) for k in [k for k in out if k.startswith(KEPT)]}
    for records, name in ((state.array_records, KEPT_RECORD),
                          (state.config_records, KEPT_INFO)):
        if name in records:
            del records[name]
    if kept:
        state.array_records[KEPT_RECORD] = ArrayRecord(
            {k: Array(np.ascontiguousarray(v)) for k, v in kept.items()})
        state.config_records[KEPT_INFO] = ConfigRecord(
            {"round": int(round_index), "count": len(kept)})


def give_kept(msg, context):
    """The FitRes SecAgg+'s masked stage asks of a node (`secaggplus_mod` calls it): its
    kept partials of the round the FitIns config names, as one flat float64 vector minus
    the center C (exact; laid out as `fax_bridge.flower.secagg.node_vector` lays it out),
    with weight 1."""
    from flwr.app import Message
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
    from flwr.compat.common import recorddict_compat as compat

    config = msg.content.config_records["fitins.config"]
    round_index, center = int(config[ROUND_KEY]), float(config[CENTER_KEY])
    state = context.state
    info = state.config_records.get(KEPT_INFO)
    if info is None or int(info["round"]) != round_index:
        raise RuntimeError(
            f"SecAgg+ asks for this node's secure partials of round {round_index}, but it "
            f"keeps {'none' if info is None else 'those of round ' + str(info['round'])}")
    arrays = state.array_records[KEPT_RECORD]
    # one flat vector (as fax_bridge.flower.secagg.node_vector lays it out)
    flat = [np.asarray(arrays[f"{KEPT}{i}"].numpy(), np.float64).reshape(-1)
            for i in range(int(info["count"]))]
    vector = np.concatenate(flat) if flat else np.zeros(0)
    vector = [(vector if vector.size else np.zeros(1)) - center]
    del state.array_records[KEPT_RECORD], state.config_records[KEPT_INFO]
    fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(vector), 1, {})
    return Message(compat.fitres_to_recorddict(fitres, False), reply_to=msg)


def _worker(config) -> tuple:
    return str(config["worker"]), read_token(str(config["worker-token-file"]))


def client_app(bundle_dir: str, local: Callable[[], Any]):
    """The Flower `ClientApp` of the round whose `round.json` is in `bundle_dir`;
    `local()` gives the module that answers in this process (`answer_query`,
    `serve_round`) for a node without a worker."""
    from flwr.app import (Array, ArrayRecord, ConfigRecord, Message, MetricRecord,
                          RecordDict)
    from flwr.clientapp import ClientApp

    app = ClientApp()

    @app.query()
    def query(msg: Message, context) -> Message:
        config = context.node_config
        if "worker" in config:
            address, token = _worker(config)
            share = json.loads(call(address, token, "/share"))
        else:
            share = local().answer_query(config)
        return Message(RecordDict({METRICS: MetricRecord(share)}), reply_to=msg)

    @app.train()
    def train(msg: Message, context) -> Message:
        if SECAGG_CONFIGS in msg.content.config_records:  # a SecAgg+ stage
            from flwr.client.mod import secaggplus_mod

            return secaggplus_mod(msg, context, give_kept)
        config = context.node_config
        arrays, header = request_of(msg.content)
        if "worker" in config:
            address, token = _worker(config)
            header["bundle"] = bundle_dir
            out, info = unpack(call(address, token, "/round", pack(arrays, header)))
        else:
            out, info = local().serve_round(bundle_dir, config, arrays, header)
        keep(context.state, out, header[ROUND].get("round", -1))
        metrics = MetricRecord({"num-clients": [int(c) for c in info["counts"]],
                                "compute-s": float(info["compute-s"])})
        return Message(RecordDict({
            PARTIALS: ArrayRecord({k: Array(v) for k, v in out.items()}),
            LAYOUT: ConfigRecord(info["layout"]), METRICS: metrics,
            SERVED: ConfigRecord({k: str(v) for k, v in info["served"].items()}),
            ROUND: ConfigRecord(header[ROUND])}), reply_to=msg)

    return app
