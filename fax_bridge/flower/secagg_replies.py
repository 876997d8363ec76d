"""What a SuperNode may answer each SecAgg+ stage: its reply parsed strictly, in one place.

Flower 1.42's `SecAggPlusWorkflow` reads the nodes' replies with bare indexing (a
missing key is a `KeyError`, a short list an `IndexError`, a vector of another shape a
broadcasting error), which would end the round without naming the node. The ServerApp
(`secagg._Exchange`) hands the workflow only the replies `check` accepts; a node whose
reply deviates in any way is lost at that stage, named with what was wrong, exactly as
a node that did not answer (`secagg._lose`). What an honest node (`secaggplus_mod`)
answers, and so all `check` accepts:

- every stage: a reply from the node the stage's message went to, whose
  `secaggplus_configs` ConfigRecord holds exactly the stage's keys;
- setup: `pk1`, `pk2`: two different PEM elliptic-curve public keys (at most
  `MAX_KEY_BYTES` each), neither one another node of the stage gave;
- share keys: `dsts`, `ctxts`: one ciphertext (a Fernet token, at most
  `MAX_CIPHERTEXT_BYTES`) for each other node whose keys the node was sent, each node
  once, no two the same;
- collect masked vectors: `masked_params`: two int64 .npy arrays, the masked weight
  (shape (1,)) and the masked vector (shape (`Expected.carried`,): `secagg.node_vector`
  of the round's secure sums), every element in [0, 2**32); beside it the FitRes
  records `secaggplus_mod` leaves: no arrays, `num_examples` 1, status OK, no metrics;
- unmask: `nids`, `shares`: the node ids the stage's message named (its active ones,
  then its dead ones, in that order) and one Shamir share of each (4 bytes of index
  in [1, nodes], then whole 16-byte chunks, at most `MAX_SHARE_CHUNKS`).

Whether shares of different nodes combine cannot be told from one reply: the
ServerApp fails the round naming the stage when they do not (`secagg.aggregate`).
"""

from __future__ import annotations

import base64
import dataclasses
import types

import numpy as np

from fax_bridge.errors import FleetError
from fax_bridge.flower.relay import SECAGG_CONFIGS, array_view

MAX_KEY_BYTES = 1024        # a PEM public key (an honest one: 215 bytes)
MAX_CIPHERTEXT_BYTES = 4096  # one node's encrypted shares for another (about 600)
MAX_SHARE_CHUNKS = 64       # 16-byte chunks of one share (an honest one: 3 or 20)
_MOD = 2 ** 32              # SecAgg+'s modulus (`secagg.MOD_RANGE`)
_CURVE = "secp384r1"        # the curve of SecAgg+'s keys (flwr's `generate_key_pairs`)
_STAGE_KEYS = {
    "setup": ("pk1", "pk2"),
    "share_keys": ("ctxts", "dsts"),
    "collect_masked_vectors": ("masked_params",),
    "unmask": ("nids", "shares"),
}


@dataclasses.dataclass
class Expected:
    """What the ServerApp knows before a SecAgg+ attempt's replies arrive: the length of
    a node's vector (`secagg.carried_size`) and the nodes that start the attempt;
    `keys` gathers the public keys the setup stage was given (owner by key)."""

    carried: int
    nodes: int = 0
    keys: dict = dataclasses.field(default_factory=dict)


def check(stage: str, sent, reply, expected: Expected) -> None:
    """FleetError saying what is wrong when `reply` is not what an honest node answers
    `sent` (the stage's message to it) at SecAgg+ stage `stage` (module docstring);
    the caller names the node."""
    node = sent.metadata.dst_node_id
    if reply.metadata.src_node_id != node:
        raise FleetError(f"the reply came as node {reply.metadata.src_node_id}")
    configs = reply.content.config_records.get(SECAGG_CONFIGS)
    if configs is None:
        raise FleetError(f"the reply has no {SECAGG_CONFIGS!r} record")
    keys = sorted(configs.keys())
    if tuple(keys) != _STAGE_KEYS[stage]:
        raise FleetError(f"the reply holds {_shown(keys)}; the {stage} stage answers "
                         f"exactly {list(_STAGE_KEYS[stage])}")
    _CHECKS[stage](configs, sent.content.config_records[SECAGG_CONFIGS], reply.content,
                   node, expected)


def _shown(value) -> str:
    return repr(value)[:80]


def _byte_list(value, what: str, most_bytes: int) -> list:
    if not isinstance(value, list) or not all(isinstance(b, bytes) for b in value):
        raise FleetError(f"{what} is {_shown(value)}, not a list of bytes")
    if any(not 0 < len(b) <= most_bytes for b in value):
        raise FleetError(f"{what} holds an item of {max(len(b) for b in value)} bytes "
                         f"or none; at most {most_bytes} each")
    return value


def _id_list(value, what: str) -> list:
    if not isinstance(value, list) or any(isinstance(i, bool) or not isinstance(i, int)
                                          for i in value):
        raise FleetError(f"{what} is {_shown(value)}, not a list of node ids")
    return value


def _setup(configs, sent, content, node: int, expected: Expected) -> None:
    from flwr.supercore.primitives.asymmetric import bytes_to_public_key

    pk1, pk2 = _byte_list([configs["pk1"], configs["pk2"]], "its public keys",
                          MAX_KEY_BYTES)
    for key in (pk1, pk2):
        try:
            loaded = bytes_to_public_key(key)
            curve = loaded.curve.name
        except Exception as e:  # noqa: BLE001 - whatever the key loader raises on bytes
            raise FleetError(f"its public key {key[:24]!r}... is not a PEM elliptic-curve "
                             f"key ({type(e).__name__})") from None
        if curve != _CURVE:
            raise FleetError(f"its public key is on curve {curve}; SecAgg+ uses {_CURVE}")
        owner = expected.keys.get(key)
        if owner is not None and owner != node:
            raise FleetError(f"its public key is node {owner}'s")
    if pk1 == pk2:
        raise FleetError("its two public keys are the same key")
    expected.keys.update({pk1: node, pk2: node})


def _share_keys(configs, sent, content, node: int, expected: Expected) -> None:
    dsts = _id_list(configs["dsts"], "its destinations")
    ctxts = _byte_list(configs["ctxts"], "its ciphertexts", MAX_CIPHERTEXT_BYTES)
    others = sorted(int(k) for k in sent.keys() if k != "stage" and int(k) != node)
    if len(ctxts) != len(dsts) or sorted(dsts) != others:
        raise FleetError(f"it sent {len(ctxts)} ciphertexts to nodes {_shown(dsts)}; "
                         f"expected one to each of {_shown(others)}")
    if len(set(ctxts)) != len(ctxts):  # each is encrypted afresh, with its own IV
        raise FleetError("it sent the same ciphertext to two nodes")
    for dst, token in zip(dsts, ctxts):
        if not _fernet_form(token):
            raise FleetError(f"its ciphertext for node {dst} is not a Fernet token "
                             f"({token[:16]!r}...)")


def _fernet_form(token: bytes) -> bool:
    """Whether `token` has the form of a Fernet token (what SecAgg+ encrypts shares
    with): url-safe base64 of version 0x80, an 8-byte time, a 16-byte IV, whole 16-byte
    blocks and a 32-byte HMAC. Whether it decrypts only its receiver can tell."""
    try:
        raw = base64.urlsafe_b64decode(token)
    except (ValueError, TypeError):  # binascii.Error is a ValueError
        return False
    return (base64.urlsafe_b64encode(raw) == token and len(raw) >= 1 + 8 + 16 + 16 + 32
            and raw[0] == 0x80 and (len(raw) - 57) % 16 == 0)


def _collect_masked_vectors(configs, sent, content, node: int,
                            expected: Expected) -> None:
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord

    vectors = _byte_list(configs["masked_params"], "its masked vectors", 1 << 62)
    if len(vectors) != 2:
        raise FleetError(f"it sent {len(vectors)} masked arrays; expected 2 (its weight "
                         "and its vector)")
    for data, shape, what in zip(vectors, [(1,), (expected.carried,)],
                                 ["masked weight", "masked vector"]):
        try:
            value = array_view(types.SimpleNamespace(stype="numpy.ndarray", data=data))
        except ValueError as e:
            raise FleetError(f"its {what} is not a .npy array ({e})") from None
        if value.dtype != np.int64 or value.shape != shape:
            raise FleetError(f"its {what} is {value.dtype}{list(value.shape)}; expected "
                             f"int64{list(shape)}")
        if value.size and not (int(value.min()) >= 0 and int(value.max()) < _MOD):
            raise FleetError(f"its {what} lies in {int(value.min())}..{int(value.max())}, "
                             f"outside SecAgg+'s modulus [0, 2**32)")
    records = {"array": ({"fitres.parameters"}, content.array_records),
               "metric": ({"fitres.num_examples"}, content.metric_records),
               "config": ({"fitres.metrics", "fitres.status", SECAGG_CONFIGS},
                          content.config_records)}
    for kind, (names, held) in records.items():
        if set(held.keys()) != names:
            raise FleetError(f"its {kind} records are {_shown(sorted(held.keys()))}; "
                             f"expected {sorted(names)}")
    examples = content.metric_records["fitres.num_examples"]
    status = content.config_records["fitres.status"]
    if not (isinstance(content.array_records["fitres.parameters"], ArrayRecord)
            and not len(content.array_records["fitres.parameters"])
            and isinstance(examples, MetricRecord) and dict(examples) == {"num_examples": 1}
            and isinstance(status, ConfigRecord) and sorted(status.keys()) == ["code",
                                                                                "message"]
            and type(status["code"]) is int and status["code"] == 0
            and isinstance(status["message"], str) and len(status["message"]) <= 4096
            and isinstance(content.config_records["fitres.metrics"], ConfigRecord)
            and not len(content.config_records["fitres.metrics"])):
        raise FleetError("its FitRes records are not what SecAgg+'s masked stage leaves (no "
                         "arrays, num_examples 1, status OK, no metrics)")


def _unmask(configs, sent, content, node: int, expected: Expected) -> None:
    nids = _id_list(configs["nids"], "its node ids")
    shares = _byte_list(configs["shares"], "its shares", 4 + 16 * MAX_SHARE_CHUNKS)
    named = list(sent["active_nids"]) + list(sent["dead_nids"])
    if nids != named or len(shares) != len(nids):
        raise FleetError(f"it sent {len(shares)} shares of nodes {_shown(nids)}; expected "
                         f"one of each of {_shown(named)}, in that order")
    for owner, share in zip(nids, shares):
        index = int.from_bytes(share[:4], "little")
        if (len(share) - 4) % 16 or len(share) < 20 or not 1 <= index <= expected.nodes:
            raise FleetError(f"its share of node {owner} is {len(share)} bytes with index "
                             f"{index}; a share is 4 bytes of an index in [1, "
                             f"{expected.nodes}] then whole 16-byte chunks")


_CHECKS = {"setup": _setup, "share_keys": _share_keys,
           "collect_masked_vectors": _collect_masked_vectors, "unmask": _unmask}
