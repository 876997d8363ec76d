"""Rounds on Flower: the ServerApp and ClientApp with Flower's own Message objects in
process (the same bits as the fleet's plan, kernels whose partial sums spill to limbs
included; dropped nodes, min_clients, cohorts, checkpoints, refusals, values altered on
the way), the `fax-bridge flower` command, and one
real deployment (a SuperLink and two SuperNodes on loopback, `flwr run`)."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid

import jax
import numpy as np
import pytest
from processes import running
from federated_language.common_libs import structure
from hypothesis import example, given, settings, strategies as st

import fax_bridge as fb
from fax_bridge import cli
from fax_bridge.errors import CheckpointError, ExportError, FleetError
from fax_bridge import in_process
from fax_bridge.runtime import double_sums, npz_keys, values

flwr = pytest.importorskip("flwr")
from flwr.app import Context, Error, Message, RecordDict  # noqa: E402
from flwr.common.secure_aggregation.secaggplus_constants import Stage  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from fax_bridge.data import write_population  # noqa: E402
from fax_bridge.flower import app_dir, bundle, client, records, relay, server  # noqa: E402
from fax_bridge.tff.cli import resolve_program  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "examples", "quickstart.py")
N = 6
BLOCKS = [(0, 4), (4, 6)]
ROWS = 16  # rows per client in the populations: the quickstart's examples per client


@pytest.fixture(scope="module")
def quickstart():
    prog, args, placements = resolve_program(f"{QUICKSTART}:fedavg_round", N)
    return prog, args, bundle.build_round(prog, *args, placements=placements)


@pytest.fixture(scope="module")
def digits():
    """FedAvg (`fax_bridge.algorithms.fed_avg`, client SGD at 0.1) of a 64-64-10 MLP on
    N digits clients, each its first 80 examples as 16 local steps of 5 (so a client has
    the quickstart's 16 rows, and one store per node holds both data sets): a round
    `(state, {"dx", "dy", "dmask"})` and its example arguments."""
    import optax

    from fax_bridge import data as fd
    from fax_bridge.algorithms import fed_avg

    split = fd.load_federated_digits(num_clients=N, seed=0)
    batches = fd.to_batches(fd.pad_clients(
        [{k: v[:ROWS * 5] for k, v in c.items()} for c in split.clients], size=ROWS * 5), 5)
    rng = np.random.default_rng(0)
    params = {}
    for i, (m, n) in enumerate([(64, 64), (64, 10)]):
        limit = np.sqrt(6.0 / (m + n))
        params[f"w{i}"] = rng.uniform(-limit, limit, (m, n)).astype(np.float32)
        params[f"b{i}"] = np.zeros(n, np.float32)

    def loss(p, batch):
        h = jax.nn.relu(batch["x"] @ p["w0"] + p["b0"])
        logp = jax.nn.log_softmax(h @ p["w1"] + p["b1"])
        return -jax.numpy.mean(jax.numpy.take_along_axis(logp, batch["y"][:, None], 1))

    alg = fed_avg(loss, optax.sgd(0.1), clients=N)

    @fb.program(clients=N)
    def digits_round(state, data):
        return alg.next(state, {"x": data["dx"], "y": data["dy"]}, data["dmask"])

    data = {"dx": batches.data["x"], "dy": batches.data["y"], "dmask": batches.mask}
    return digits_round, (alg.init(params), data)


@pytest.fixture(scope="module")
def populations(tmp_path_factory, quickstart, digits):
    _, (_, data), _ = quickstart
    _, (_, more) = digits
    data = {**data, **more}
    assert all(len(v[0]) == ROWS for v in data.values())
    root = tmp_path_factory.mktemp("populations")
    configs = []
    for k, (a, b) in enumerate(BLOCKS):
        path = str(root / f"node-{k}")
        write_population(path, [{key: v[i] for key, v in data.items()}
                                for i in range(a, b)])
        configs.append({"population": path, "first-client": a})
    return configs


@pytest.fixture(scope="module")
def app(tmp_path_factory, quickstart):
    folder = str(tmp_path_factory.mktemp("app"))
    app_dir.write_app(quickstart[2], folder)
    return folder


class LocalGrid(Grid):
    """A Grid that hands each message to a ClientApp in this process; `silent` nodes
    answer a query but never a round (a node killed after the run started); `lose_at`
    {node: (SecAgg+ stage, "silent", "error" or "garbage")}: a node that answers
    nothing, an error, or a reply cut short, from that stage of SecAgg+ on (lost after
    it answered the round); `forged` nodes answer a round without its layout record."""

    def __init__(self, apps: dict, silent=(), lose_at=None, forged=()):
        self.apps, self.silent, self.replies = apps, set(silent), {}
        self.forged = set(forged)
        self.lose_at = dict(lose_at or {})

    def lost(self, message) -> str | None:
        """How the destination of `message` fails it (None: it answers)."""
        if message.metadata.dst_node_id in self.silent:
            return "silent" if message.metadata.message_type != "query" else None
        if message.metadata.dst_node_id in self.forged:
            return "forged" if message.metadata.message_type != "query" else None
        if (message.metadata.dst_node_id not in self.lose_at
                or relay.SECAGG_CONFIGS not in message.content.config_records):
            return None
        stage, how = self.lose_at[message.metadata.dst_node_id]
        order = list(Stage.all())
        at = message.content.config_records[relay.SECAGG_CONFIGS]["stage"]
        return how if order.index(at) >= order.index(stage) else None

    def set_run(self, run) -> None:
        pass

    @property
    def run(self):
        return None

    def create_message(self, *args, **kwargs):
        raise NotImplementedError

    def get_node_ids(self):
        return list(self.apps)

    def get_nodes(self):
        return []

    def push_messages(self, messages):
        ids = []
        for message in messages:
            message_id = uuid.uuid4().hex
            message.metadata.__dict__["_message_id"] = message_id
            node, how = message.metadata.dst_node_id, self.lost(message)
            if how is None:
                clientapp, context = self.apps[node]  # a copy, as a node receives one
                self.replies[message_id] = clientapp(copy.deepcopy(message), context)
            elif how == "error":
                self.replies[message_id] = Message(
                    Error(code=0, reason="the ClientApp failed"), reply_to=message)
            elif how == "forged":  # a round answer without its partials' layout
                clientapp, context = self.apps[node]
                reply = clientapp(copy.deepcopy(message), context)
                del reply.content.config_records[relay.LAYOUT]
                self.replies[message_id] = reply
            elif how == "garbage":  # an answer cut short: each list one item, bytes 3
                clientapp, context = self.apps[node]
                reply = clientapp(copy.deepcopy(message), context)
                configs = reply.content.config_records[relay.SECAGG_CONFIGS]
                for key in list(configs):
                    configs[key] = configs[key][:1 if isinstance(configs[key], list) else 3]
                self.replies[message_id] = reply
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids):
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]

    def send_and_receive(self, messages, *, timeout=None):
        raise AssertionError("the ServerApp pushes and pulls itself (`nodes.exchange`)")


def _grid(app_folder: str, configs: list, silent=(), lose_at=None,
          forged=()) -> LocalGrid:
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    clientapp = relay.client_app(os.path.join(app_folder, app_dir.PACKAGE), lambda: client)
    apps = {100 + k: (clientapp, Context(run_id=1, node_id=100 + k, node_config=c,
                                         state=RecordDict(), run_config={}))
            for k, c in enumerate(configs)}
    return LocalGrid(apps, silent={100 + k for k in silent},
                     lose_at={100 + k: v for k, v in (lose_at or {}).items()},
                     forged={100 + k for k in forged})


def _expected(made, args, rounds: int, clients=None, state=None, client_runtime="xla"):
    """The fleet plan's results (run in process) over `rounds` rounds."""
    bound = values.bind_arguments(made.prepared.parameter, args, {})
    if clients is not None:
        bound = bound.select_clients(np.asarray(clients))
    data = bound.runtime_value()[1]
    state = made.state_value(made.state) if state is None else state
    result = None
    for _ in range(rounds):
        result = in_process.run_in_process(made.split, structure.Struct(
            [("params", state), ("data", data)]), client_runtime=client_runtime)
        state = result[0]
    return result


def _bits(result, made) -> dict:
    return {k: v.tobytes() for k, v in
            npz_keys.result_to_npz(result, made.prepared.result).items()}


def _npz_bits(path: str) -> dict:
    with np.load(path) as f:
        return {k: f[k].tobytes() for k in f.files}


def _reports(folder: str) -> list:
    with open(os.path.join(folder, "reports.jsonl")) as f:
        return [json.loads(line) for line in f]


# ------------------------------------------------------------ rounds in process


def test_rounds_in_process_have_the_fleet_plans_bits(tmp_path, quickstart, populations,
                                                     app):
    prog, args, made = quickstart
    grid = _grid(app, populations)
    out = str(tmp_path / "out")
    got = server.run_server(grid, {"num-rounds": 3, "out-dir": out}, os.path.join(
        app, app_dir.PACKAGE), log=lambda text: None)
    want = _expected(made, args, 3)
    assert _bits(got, made) == _bits(want, made) == _npz_bits(f"{out}/result.npz")
    params = args[0]
    for _ in range(3):  # jit agrees as the fleet does (to rounding; exact sums above)
        params, loss = jax.jit(prog)(params, args[1])
    got_tree = values.to_pytree(got, made.prepared.result)
    for a, b in zip(jax.tree_util.tree_leaves(got_tree),
                    jax.tree_util.tree_leaves((params, loss))):
        np.testing.assert_allclose(a, b, rtol=1e-5)
    from fax_bridge.parity.flower import describe, parity_of_run

    report = parity_of_run(prog, args, made, f"{out}/result.npz", 3, 2, 0.0)
    assert report.ok and report.fleet_bits, describe(report, 3)
    assert "PARITY OK" in describe(report, 3)
    reports = _reports(out)
    # per round: the last round's time at the ServerApp; its first round apart
    assert report.fleet_s == reports[-1]["wall_s"]
    assert report.startup_s["the deployment's first round"] == reports[0]["wall_s"]
    assert "jit's first round (compiling)" in report.startup_s
    assert [r["round"] for r in reports] == [0, 1, 2]
    assert all(r["participants"] == list(range(N)) and r["devices"] == 2 and
               r["bytes_up"] > 0 and r["error"] is None for r in reports)


def test_a_node_whose_answer_is_wrong_in_one_element_fails_parity(tmp_path, quickstart,
                                                                    populations, app):
    """A SuperNode configured with a fault (`fault=` in its node config) wrong by a
    relative 1e-4 in one client's loss: the run's result is not the fleet plan's bits,
    and the report names the loss (1e-4/6 off, within jit's rtol=1e-5 and atol=1e-6
    here) as the leaf that is not."""
    from fax_bridge.parity.flower import describe, parity_of_run

    prog, args, made = quickstart
    configs = [dict(populations[0], fault="client=1,aggregation=mean"),
               *populations[1:]]
    out = str(tmp_path / "out")
    server.run_server(_grid(app, configs), {"num-rounds": 1, "out-dir": out},
                      os.path.join(app, app_dir.PACKAGE), log=lambda text: None)
    with pytest.raises(FleetError, match="--node-config fault: --fault: unknown key 'lief'"):
        client.NodeShare.from_config(dict(populations[0], fault="lief=1"))
    report = parity_of_run(prog, args, made, f"{out}/result.npz", 1, 2, 0.0)
    assert report.fleet_bits is False and not report.ok
    assert [leaf.path for leaf in report.leaves if not leaf.ok] == ["1"], describe(report, 1)
    text = describe(report, 1)
    assert "the same bits as the fleet's round plan: NO" in text and "MISMATCH" in text


KERNELS = {"d1": (1568, 64), "d2": (2048, 256)}  # a dense layer's kernel, and a larger one


def _kernel_round(state, data):
    """A round of two dense kernels: each client's update of a kernel is the outer
    product of its vectors (`KIND + "a"`, `KIND + "b"`, one example each); the state
    moves by the clients' mean update of d1 and their mean of d2 weighted by "w"."""
    import jax.numpy as jnp

    def local(d):
        ups = {k: jnp.outer(d[f"{k}a"][0], d[f"{k}b"][0]) for k in KERNELS}
        return ups, d["w"][0]

    ups, w = fb.federated_map_clients(local, data)
    step = {"d1": fb.federated_mean(ups["d1"]),
            "d2": fb.federated_weighted_mean(ups["d2"], w)}
    return {k: state[k] + step[k] for k in KERNELS}, fb.federated_sum(w)


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    """`_kernel_round` on 4 clients, 2 a node, its app and the nodes' populations. In
    each node, at 3 rows of each kernel one client's vector is 2**-40 of the other's,
    so the node's float64 partial sums spill those rows' elements to limbs (with
    b's 64 and 256 columns: 192 and 768 elements)."""
    rng = np.random.default_rng(5)
    data = {"w": rng.uniform(1, 3, (4, 1)).astype(np.float32)}
    for k, (m, n) in KERNELS.items():
        a = (rng.normal(size=(4, 1, m)) * 0.1).astype(np.float32)
        for node in (0, 1):
            rows = rng.choice(m, 3, replace=False)
            a[2 * node, 0, rows] = 1.5
            a[2 * node + 1, 0, rows] = np.float32(1.5 * 2.0 ** -40)
        data[f"{k}a"], data[f"{k}b"] = a, rng.normal(size=(4, 1, n)).astype(np.float32)
    state = {k: (rng.normal(size=shape) * 0.05).astype(np.float32)
             for k, shape in KERNELS.items()}
    prog = fb.program(clients=4)(_kernel_round)
    made = bundle.build_round(prog, state, data, placements=("server", "clients"))
    folder = str(tmp_path_factory.mktemp("kernels"))
    app_dir.write_app(made, f"{folder}/app")
    configs = []
    for node, (a, b) in enumerate([(0, 2), (2, 4)]):
        write_population(f"{folder}/node-{node}",
                         [{key: v[i] for key, v in data.items()} for i in range(a, b)])
        configs.append({"population": f"{folder}/node-{node}", "first-client": a})
    return prog, (state, data), made, folder, configs


def test_kernels_whose_partial_sums_spill_cross_flower_with_the_fleet_plans_bits(
        tmp_path, kernels):
    """A round of a 1568x64 and a 2048x256 kernel whose nodes' float64 partial sums keep
    some elements in limbs (a client's update 2**-40 of another's there) has the fleet
    plan's bits on Flower, with each node's ClientApp answering itself or through a
    warm worker (the relay between them); those elements are not the +0.0 the float64
    values hold there, and the round reports no error."""
    from fax_bridge.flower import worker

    prog, args, made, folder, configs = kernels
    node0 = np.stack([np.outer(args[1]["d1a"][i, 0], args[1]["d1b"][i, 0])
                      for i in (0, 1)])
    spilled = double_sums.sums_of([node0])[0]  # node 0's partial of d1 (as numpy makes it)
    assert 0 < spilled.cols.size <= double_sums.most_spilled(spilled.size)
    want = _bits(_expected(made, args, 1), made)
    token_file = tmp_path / "token"
    token_file.write_text("t" * 32)
    token_file.chmod(0o600)
    servers = [worker.serve("127.0.0.1:0", "t" * 32, c) for c in configs]
    for httpd in servers:
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
    warm = [{"worker": f"127.0.0.1:{h.server_address[1]}",
             "worker-token-file": str(token_file)} for h in servers]
    try:
        for nodes in (configs, warm):
            out = str(tmp_path / f"out-{len(nodes[0])}")
            got = server.run_server(_grid(f"{folder}/app", nodes), {
                "num-rounds": 1, "out-dir": out,
                "app-state": f"{folder}/app/initial_state.npz"},
                os.path.join(folder, "app", app_dir.PACKAGE), log=lambda text: None)
            assert _bits(got, made) == want
            assert _reports(out)[0]["error"] is None
    finally:
        for httpd in servers:
            httpd.shutdown()
            httpd.server_close()
    state = values.to_pytree(got, made.prepared.result)[0]
    jit_state = jax.jit(prog)(*args)[0]
    for k in KERNELS:
        np.testing.assert_allclose(state[k], jit_state[k], rtol=1e-6, atol=1e-7)


def _altering(grid, alter):
    """`grid` whose round messages and answers pass through `alter(message, reply)`,
    which may change either in place (the message before the node gets it)."""
    push = grid.push_messages

    def altering_push(messages):
        for message in messages:
            if records.PARTIALS not in message.content and \
                    records.BROADCAST in message.content:
                alter(message, None)
        ids = push(messages)
        for message, message_id in zip(messages, ids):
            reply = grid.replies.get(message_id)
            if reply is not None and records.PARTIALS in reply.content:
                alter(message, reply)
        return ids

    grid.push_messages = altering_push
    return grid


def test_a_round_whose_values_arrive_altered_fails_with_the_error_in_its_report(
        tmp_path, quickstart, populations, app):
    """A node's partial changed on its way to the ServerApp (to another well-formed
    value, or with a field left out), or a broadcast changed on its way to a node, is
    found by the sha256 its sender computed: the round fails with a TransferError
    naming the node and what arrived altered, written in reports.jsonl, never a round
    reported as done."""
    from fax_bridge.errors import TransferError

    bundle_dir = os.path.join(app, app_dir.PACKAGE)

    def partial(message, reply):
        if reply is not None and message.metadata.dst_node_id == 101:
            arrays = reply.content[records.PARTIALS]
            key = sorted(k for k in arrays.keys() if k.startswith("a0.v0."))[0]
            value = np.array(relay.array_view(arrays[key]))
            value.reshape(-1)[0] = value.reshape(-1)[0] + 1
            arrays[key] = records.array(value)

    def broadcast(message, reply):
        if reply is None and message.metadata.dst_node_id == 100:
            arrays = message.content[records.BROADCAST]
            value = np.array(relay.array_view(arrays["0"]))
            value.reshape(-1)[0] += 1
            arrays["0"] = records.array(value)

    for alter, said in ((partial, r"node 101 \(clients 4\.\.5\): partial tensor a0\.v0 "
                                  r"arrived other than the node sent it"),
                        (broadcast, r"node 100 \(clients 0\.\.3\): the round's message "
                                    r"arrived at the node other than this ServerApp sent")):
        out = str(tmp_path / alter.__name__)
        with pytest.raises(TransferError, match=said):
            server.run_server(_altering(_grid(app, populations), alter),
                              {"num-rounds": 1, "out-dir": out}, bundle_dir,
                              log=lambda text: None)
        rep = _reports(out)[0]
        assert re.search(said, rep["error"]) and rep["error"].startswith("TransferError")
        assert not os.path.exists(f"{out}/result.npz")


def test_supernodes_configured_for_litert_run_the_client_part_in_the_interpreter(
        tmp_path, quickstart, populations, app):
    _, args, made = quickstart
    configs = [dict(c, **{"client-runtime": "litert"}) for c in populations]
    out = str(tmp_path / "out")
    got = server.run_server(_grid(app, configs), {"num-rounds": 2, "out-dir": out},
                            os.path.join(app, app_dir.PACKAGE), log=lambda text: None)
    from fax_bridge.litert import runner

    # every node's answer, in every round, names LiteRT and the model that ran it
    assert [[(v["client_runtime"], v["model_sha256"]) for v in r["served"].values()]
            for r in _reports(out)] == 2 * [2 * [
                ("litert", runner.served(made.split.client_part_hash) or "none ran")]]
    # the bits of the same plan with the client part in LiteRT, wherever its clients sit
    assert _bits(got, made) == _bits(_expected(made, args, 2, client_runtime="litert"), made)
    assert _bits(got, made) != _bits(_expected(made, args, 2), made)  # not XLA's rounding
    with pytest.raises(FleetError, match="client-runtime.*expected one of"):
        client.NodeShare.from_config(dict(populations[0], **{"client-runtime": "tflite"}))


def test_a_silent_node_is_dropped_and_min_clients_is_kept(tmp_path, quickstart,
                                                          populations, app):
    _, args, made = quickstart
    bundle_dir = os.path.join(app, app_dir.PACKAGE)
    out = str(tmp_path / "out")
    grid = _grid(app, populations, silent=[1])
    quick = {"num-rounds": 1, "node-timeout-s": 0.2, "first-round-timeout-s": 0.0}
    got = server.run_server(grid, dict(quick, **{"out-dir": out}), bundle_dir,
                            log=lambda text: None)
    assert _bits(got, made) == _bits(_expected(made, args, 1, clients=range(4)), made)
    rep = _reports(out)[0]
    assert rep["participants"] == [0, 1, 2, 3] and rep["lost_clients"] == [4, 5]
    assert "node 101" in rep["lost_devices"][0]
    grid = _grid(app, populations, silent=[1])
    with pytest.raises(FleetError, match=r"node 101 .*no answer within 0.2s.*only 4 "
                                         r"clients are left but min_clients=5"):
        server.run_server(grid, dict(quick, **{"min-clients": 5, "out-dir": out}),
                          bundle_dir, log=lambda text: None)
    assert "min_clients=5" in _reports(out)[0]["error"]
    # a node whose answer is malformed is dropped the same way, named with what was wrong
    got = server.run_server(_grid(app, populations, forged=[1]),
                            dict(quick, **{"out-dir": out}), bundle_dir,
                            log=lambda text: None)
    assert _bits(got, made) == _bits(_expected(made, args, 1, clients=range(4)), made)
    rep = _reports(out)[0]
    assert rep["lost_clients"] == [4, 5] and rep["lost_devices"] == [
        "node 101 (clients 4..5): its answer has no layout record; the message is corrupt "
        "or forged; check that the node runs this fax_bridge (a malformed answer)"]
    with pytest.raises(FleetError, match=r"round 0: no SuperNode answered: node 100 .*"
                                         r"no client is left but min_clients=1; restart"):
        server.run_server(_grid(app, populations, silent=[0, 1]),
                          dict(quick, **{"out-dir": out}), bundle_dir,
                          log=lambda text: None)
    # every node answered, but every answer was refused: said so, each with its reason
    with pytest.raises(FleetError, match=(
            r"round 0: 2 SuperNodes answered but their answers were refused: node 100 "
            r"\(clients 0\.\.3\): its answer has no layout record.*\(a malformed "
            r"answer\); node 101 \(clients 4\.\.5\): .*\(a malformed answer\); no "
            r"client is left but min_clients=1; check that those nodes run this "
            r"fax_bridge")) as info:
        server.run_server(_grid(app, populations, forged=[0, 1]),
                          dict(quick, **{"out-dir": out}), bundle_dir,
                          log=lambda text: None)
    assert "did not answer" not in str(info.value)
    assert _reports(out)[0]["lost_clients"] == list(range(6))
    # one refused and one silent: each counted and named
    with pytest.raises(FleetError, match=(
            r"round 0: 1 SuperNode answered but its answer was refused: node 100 .*"
            r"; and 1 did not answer: node 101 .*no answer within 0\.2s; no client is "
            r"left but min_clients=1; check that those nodes run this fax_bridge, and "
            r"restart the silent ones")):
        server.run_server(_grid(app, populations, forged=[0], silent=[1]),
                          dict(quick, **{"out-dir": out}), bundle_dir,
                          log=lambda text: None)
    # min-clients=0 would let a round run with no clients, where FedAvg's means have no
    # value: refused before any node is asked
    grid = _grid(app, populations)
    with pytest.raises(FleetError, match=r"round 0: min_clients=0 .*federated_mean has "
                                         r"no value over zero clients"):
        server.run_server(grid, dict(quick, **{"min-clients": 0, "out-dir": out}),
                          bundle_dir, log=lambda text: None)
    assert not grid.replies and "min_clients=0" in _reports(out)[0]["error"]


def test_a_warm_worker_answers_for_its_node_with_the_same_bits(tmp_path, quickstart,
                                                               populations, app):
    from fax_bridge.flower import worker

    token_file = tmp_path / "token"
    token_file.write_text("t" * 32)
    token_file.chmod(0o600)  # a token others could read is refused
    servers, configs = [], []
    for config in populations:
        httpd = worker.serve("127.0.0.1:0", "t" * 32, config)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
        configs.append({"worker": f"127.0.0.1:{httpd.server_address[1]}",
                        "worker-token-file": str(token_file)})
    try:
        _, args, made = quickstart
        out = str(tmp_path / "out")
        got = server.run_server(_grid(app, configs), {"num-rounds": 2, "out-dir": out},
                                os.path.join(app, app_dir.PACKAGE), log=lambda text: None)
        assert _bits(got, made) == _bits(_expected(made, args, 2), made)
        with pytest.raises(RuntimeError, match="403: wrong or missing worker token"):
            relay.call(configs[0]["worker"], "u" * 32, "/share")
        assert json.loads(relay.call(configs[1]["worker"], "t" * 32, "/share")) == \
            {"first-client": 4, "num-clients": 2}
    finally:
        for httpd in servers:
            httpd.shutdown()
            httpd.server_close()


@settings(max_examples=6, deadline=None)
@given(stalls=st.lists(st.sampled_from([b"", b"POST /share HTTP/1.1\r\n",
                                        b"POST /round HTTP/1.1\r\nContent-Length: 100\r\n"
                                        b"X-Fax-Bridge-Token: " + b"t" * 32 + b"\r\n\r\n"
                                        b"partial body"]),
                       min_size=1, max_size=3))
def test_idle_or_stalled_connections_never_hold_up_a_warm_worker(populations, stalls):
    """Connections that send nothing, half a request line, or half a body and then go
    quiet stay open while the worker answers its SuperNode's requests (a connection per
    thread, each read under a timeout)."""
    import socket

    from fax_bridge.flower import worker

    httpd = worker.serve("127.0.0.1:0", "t" * 32, populations[1])
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{httpd.server_address[1]}"
    idle = []
    try:
        for sent in stalls:
            idle.append(socket.create_connection(("127.0.0.1", httpd.server_address[1])))
            idle[-1].sendall(sent)
        # a deadline only so that a blocked worker fails the test instead of hanging it
        assert json.loads(relay.call(address, "t" * 32, "/share", timeout_s=120)) == \
            {"first-client": 4, "num-clients": 2}
    finally:
        for conn in idle:
            conn.close()
        httpd.shutdown()
        httpd.server_close()


def test_a_node_compiles_its_client_part_once_however_its_share_of_the_cohort_varies(
        quickstart, populations, app):
    from fax_bridge.rounds import server_steps
    from fax_bridge.flower import nodes, transport
    from fax_bridge.runtime import client_map

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1  # Messages
    share = client.NodeShare.from_config(populations[0])  # clients 0..3
    assert [client.most_clients(share, c) for c in (0, 2, 6)] == [4, 2, 4]
    _, _, made = quickstart
    split = made.split
    env = server_steps.prepare(split, made.server_arg(made.state_value(made.state)),
                               None, 1)
    sent = structure.Struct([(None, env[name]) for name in split.broadcasts])
    bundle_dir = os.path.join(app, app_dir.PACKAGE)
    key = split.client_part_hash

    def serve(ids, cohort):
        (_, _, message), = transport.train_messages(
            split, sent, [nodes.Node(100, 0, 4)], np.array(ids), 0, 10.0, cohort=cohort)
        arrays, header = relay.request_of(message.content)
        assert header[relay.ROUND]["cohort"] == cohort
        out, _ = client.serve_round(bundle_dir, populations[0], arrays, header)
        return {k: v.tobytes() for k, v in out.items()}

    for entry in [k for k in client_map._batched if k[0] == key]:
        del client_map._batched[entry]  # as in a fresh worker
    got = [serve(ids, 6) for ids in ([2], [0, 3], [0, 1, 3], [0, 1, 2, 3])]
    # one bucket: that of the node's whole share of 4, split over this process's CPUs
    assert {k[3] for k in client_map._batched if k[0] == key} == {
        client_map.bucket(client_map.part_size(4))}
    # The same bits as each share in its own bucket, as without a cohort.
    assert got == [serve(ids, 1) for ids in ([2], [0, 3])] + \
        [serve(ids, 3) for ids in ([0, 1, 3], [0, 1, 2, 3])]
    assert {k[3] for k in client_map._batched if k[0] == key} == {
        client_map.bucket(client_map.part_size(n)) for n in (1, 2, 3, 4)}


def test_cohorts_follow_the_policy_and_a_resumed_run_has_the_same_bits(
        tmp_path, quickstart, populations, app):
    from fax_bridge.rounds.policy import RoundPolicy, plan_round

    bundle_dir = os.path.join(app, app_dir.PACKAGE)
    config = {"cohort-size": 4, "seed": 3, "out-dir": str(tmp_path / "a")}
    straight = server.run_server(_grid(app, populations), dict(config, **{"num-rounds": 3}),
                                 bundle_dir, log=lambda text: None)
    cohorts = [r["cohort"] for r in _reports(str(tmp_path / "a"))]
    assert cohorts == [list(plan_round(RoundPolicy(cohort_size=4, seed=3), N, r).cohort)
                       for r in range(3)]
    ckpt = str(tmp_path / "ckpt")
    config.update({"checkpoint-dir": ckpt, "out-dir": str(tmp_path / "b")})
    server.run_server(_grid(app, populations), dict(config, **{"num-rounds": 2}),
                      bundle_dir, log=lambda text: None)
    resumed = server.run_server(_grid(app, populations), dict(config, **{"num-rounds": 3}),
                                bundle_dir, log=lambda text: None)
    made = quickstart[2]
    assert _bits(resumed, made) == _bits(straight, made)
    assert [r["round"] for r in _reports(str(tmp_path / "b"))] == [2]
    with pytest.raises(CheckpointError, match="policy"):
        server.run_server(_grid(app, populations), dict(config, **{"seed": 4}), bundle_dir,
                          log=lambda text: None)


@pytest.mark.parametrize("key", ["out-dir", "checkpoint-dir"])
def test_a_result_folder_that_cannot_be_written_is_refused_before_any_node_is_asked(
        tmp_path, app, key):
    from fax_bridge.errors import OutputError

    (tmp_path / "file").write_text("x")
    bundle_dir = os.path.join(app, app_dir.PACKAGE)
    for bad, why in [(str(tmp_path / "file"), "is a file"),
                     (str(tmp_path / "file" / "sub"), "cannot be created"),
                     (str(tmp_path / ("d" * 300)), "shorter name")]:
        with pytest.raises(OutputError, match=f"run config {key} .*{why}"):
            server.run_server(None, {"num-rounds": 1, key: bad}, bundle_dir)  # no grid


def test_results_that_cannot_be_written_after_a_round_are_saved_elsewhere_and_said_so(
        tmp_path, quickstart, populations, app, monkeypatch):
    """out-dir failing after the rounds started (a full disk): the reports and result go
    to a new folder the log names; a checkpoint failing loses no result either."""
    from fax_bridge.rounds import checkpoint

    out, logged = str(tmp_path / "out"), []
    write_in = server._Outputs._write_in

    def full_disk(folder, name, write):
        if folder == out:
            raise OSError(28, "No space left on device")
        write_in(folder, name, write)

    def no_checkpoint(*args, **kwargs):
        raise OSError(13, "Permission denied")

    monkeypatch.setattr(server._Outputs, "_write_in", staticmethod(full_disk))
    monkeypatch.setattr(checkpoint, "save", no_checkpoint)
    got = server.run_server(_grid(app, populations),
                            {"num-rounds": 2, "out-dir": out,
                             "checkpoint-dir": str(tmp_path / "ckpt")},
                            os.path.join(app, app_dir.PACKAGE), log=logged.append)
    moved = [line for line in logged if "cannot be written" in line]
    assert len(moved) == 1 and "No space left on device" in moved[0], logged
    rescue = moved[0].rsplit(" go to ", 1)[1].split(" instead")[0]
    made = quickstart[2]
    assert _bits(got, made) == _npz_bits(os.path.join(rescue, "result.npz"))
    assert [r["round"] for r in _reports(rescue)] == [0, 1]
    assert sum("checkpoint after round" in line for line in logged) == 2
    assert os.listdir(out) == []
    import shutil

    shutil.rmtree(rescue)


@pytest.mark.parametrize("cohort_size", [N + 1, -1])
def test_a_run_config_cohort_the_nodes_cannot_hold_is_refused_before_any_round(
        tmp_path, app, populations, cohort_size):
    """The run config's cohort-size against the clients the SuperNodes' blocks hold: one
    refusal naming both, before any round message (only the nodes' queries went out)."""
    grid = _grid(app, populations)
    sent, push = [], grid.push_messages
    grid.push_messages = lambda messages: push(
        sent.extend(m.metadata.message_type for m in messages) or messages)
    out = str(tmp_path / "out")
    want = (rf"run config cohort-size={N + 1} exceeds the population of {N} clients "
            r"\(the SuperNodes' blocks, their --node-config num-clients\); lower run config "
            rf"cohort-size to at most {N}" if cohort_size > 0 else
            r"run config cohort-size=-1 is not a whole number in \[0, 2147483647\]; "
            "give e.g. cohort-size=0")
    with pytest.raises(FleetError, match=want):
        server.run_server(grid, {"num-rounds": 2, "cohort-size": cohort_size,
                                 "out-dir": out}, os.path.join(app, app_dir.PACKAGE),
                          log=lambda text: None)
    assert set(sent) <= {"query"} and not os.path.exists(os.path.join(out, "reports.jsonl"))


def test_node_configs_that_do_not_tile_the_population_are_refused(app, populations):
    with pytest.raises(FleetError, match="names no population.*--node-config"):
        client.NodeShare.from_config({"first-client": 0})
    overlapping = [populations[0], dict(populations[1], **{"first-client": 3})]
    with pytest.raises(FleetError, match="overlaps client 4"):
        server.run_server(_grid(app, overlapping), {"num-rounds": 1},
                          os.path.join(app, app_dir.PACKAGE), log=lambda text: None)
    with pytest.raises(FleetError, match="does not fit the population"):
        client.NodeShare.from_config(dict(populations[1], **{"num-clients": 3}))


@settings(max_examples=30, deadline=None)
@given(key=st.sampled_from(["first-client", "num-clients", "first-row"]),
       value=st.one_of(st.floats(0.01, 5.99).filter(lambda v: not v.is_integer()),
                       st.booleans(), st.just("1.5"), st.just("two"), st.just([1]),
                       st.just(1)))
@example(key="first-client", value=4.7)
@example(key="num-clients", value=1.9)
@example(key="first-row", value=0.5)
def test_node_config_numbers_are_whole_or_refused_by_name(populations, key, value):
    """A SuperNode's first-client, num-clients and first-row are whole numbers (an int,
    or its digits as a string); a fraction is refused naming the setting, never
    truncated; the run config's whole-number settings likewise."""
    config = dict(populations[1], **{key: value})
    if isinstance(value, int) and not isinstance(value, bool):
        share = client.NodeShare.from_config(config)
        assert {"first-client": share.first, "num-clients": share.count,
                "first-row": share.first_row}[key] == value
    else:
        with pytest.raises(FleetError, match=f"--node-config {key}=.* is not a whole "
                                             f"number; give e.g. {key}=4"):
            client.NodeShare.from_config(config)
    run_key = {"first-client": "num-rounds", "num-clients": "min-clients",
               "first-row": "cohort-size"}[key]
    if isinstance(value, float) or isinstance(value, bool):
        with pytest.raises(FleetError, match=f"run config {run_key}=.* is not a whole"):
            server.Settings.from_run_config({run_key: value})


_RUN_CONFIG_KINDS = {"num-rounds": "a whole number", "cohort-size": "a whole number",
                     "min-clients": "a whole number", "seed": "a whole number",
                     "dropout": "a number", "round-deadline-s": "a number",
                     "rounded-partials": "true or false"}


@settings(max_examples=30, deadline=None)
@given(key=st.sampled_from(sorted(_RUN_CONFIG_KINDS)),
       value=st.sampled_from(["two", "maybe", "1,5", "", [1], {"a": 1}, None]))
def test_a_run_config_value_of_the_wrong_kind_is_refused_naming_what_it_takes(key, value):
    """Every run config setting refuses a value it cannot read with the setting, the
    value, the kind it takes and an example (never a Python type's name)."""
    if value == "" and key == "rounded-partials":
        assert server.Settings.from_run_config({key: value}).policy.rounded_partials is False
        return
    with pytest.raises(FleetError, match=rf"run config {key}=.* is not "
                                         rf"{_RUN_CONFIG_KINDS[key]}( in [^;]*)?; "
                                         rf"give e\.g\. {key}="):
        server.Settings.from_run_config({key: value})


@settings(max_examples=15, deadline=None)
@given(name=st.text(st.sampled_from("ab '\"$`\\;&|*!"), min_size=1, max_size=8))
def test_written_commands_survive_any_path_the_shell_could_break_on(
        tmp_path_factory, quickstart, name):
    """Paths with spaces, quotes, apostrophes, `$`, backticks and backslashes reach the
    SuperNodes' node configs, FLWR_HOME and `flwr run` as they are: the README's
    commands are quoted with shlex.quote, and a SuperNode's --node-config reads back
    the population it names."""
    import shlex

    from flwr.common.config import parse_config_args  # how a SuperNode reads it

    root = tmp_path_factory.mktemp("quoted")
    folder, population = str(root / f"app {name}"), str(root / f"pop {name}")
    text = app_dir.readme(quickstart[2], folder, "127.0.0.1:9093",
                          [{"population": population, "first-client": 0}], litert=True)
    commands = []
    for block in app_dir.command_blocks(text):
        commands += [shlex.split(c) for c in block.replace("\\\n", " ").split("\n") if c]
    words = [w for c in commands for w in c]
    assert os.path.abspath(folder) in words
    assert f"FLWR_HOME={os.path.join(os.path.abspath(folder), '.flwr')}" in words
    assert population in words  # the warm worker's --population
    configs = [c[c.index("--node-config") + 1] for c in commands if "--node-config" in c]
    assert parse_config_args([configs[0]])["population"] == population


def test_rounds_of_two_trips_are_refused_naming_the_trips_and_where_they_run():
    @fb.program(clients=3)
    def two_trips(w, x):
        mean = fb.federated_mean(fb.federated_map_clients(
            lambda a, b: a * b, (fb.federated_broadcast(w), x)))
        again = fb.federated_broadcast(mean)
        return w, fb.federated_sum(fb.federated_map_clients(lambda m, b: m + b, (again, x)))

    w, x = np.float32(1.0), np.ones((3, 2), np.float32)
    with pytest.raises(ExportError, match=r"the round test_\w+\.two_trips cannot run on "
                       "Flower: its round asks the clients 2 times") as caught:
        bundle.build_round(two_trips, w, x, placements=("server", "clients"))
    assert "sends a value computed from federated_mean" in str(caught.value)
    assert "LocalFleet" in str(caught.value) and "reads what" not in str(caught.value)



# ------------------------------------------------------------ secure sums (SecAgg+)


def _secure_round(params, data):
    """Secure sums of every kind, and a secure mean, beside a plain mean: codes of the
    clients' targets (the secure mean's rounding keys are bits of them too)."""
    import jax.numpy as jnp

    codes = fb.federated_map_clients(
        lambda s, d: jnp.clip(jnp.round(jnp.abs(d["y"][:4]) * 10 + s), 0, 255).astype(
            jnp.int32), (fb.federated_broadcast(params), data))
    total = fb.federated_secure_sum_bitwidth(codes, 8)
    modular = fb.federated_secure_modular_sum(codes, 7)
    scaled = fb.federated_secure_sum(fb.federated_map_clients(lambda c: c * 1000, codes),
                                     255_000)
    keys = fb.federated_map_clients(
        lambda d: jax.lax.bitcast_convert_type(d["y"][:2], jnp.uint32), data)
    mean = fb.federated_secure_mean(fb.federated_map_clients(lambda d: d["y"][:3], data),
                                    keys, value_range=(-5.0, 5.0), bits=12)
    loss = fb.federated_mean(fb.federated_map_clients(lambda d: jnp.mean(d["y"]), data))
    return params + 1.0, (total, modular, scaled, mean, loss)


@pytest.fixture(scope="module")
def secure_app(tmp_path_factory, quickstart):
    _, (_, data), _ = quickstart
    prog = fb.program(clients=N)(_secure_round)
    args = (np.float32(2.0), data)
    made = bundle.build_round(prog, *args, placements=("server", "clients"))
    folder = str(tmp_path_factory.mktemp("secure_app"))
    app_dir.write_app(made, folder)
    return prog, args, made, folder


def _jit_secure(prog, args, rounds: int):
    state, out = args[0], None
    for _ in range(rounds):
        state, out = jax.jit(prog)(state, args[1])
    return state, out


def _assert_secure_result(got, made, args, rounds: int, clients=None) -> None:
    """The fleet plan's bits (its secure sums summed exactly in process), and jit's
    secure sums and secure mean exactly (its plain float mean to rounding, as the
    fleet), over all clients or those of `clients` (the secure mean too: it divides by
    the clients whose codes were summed)."""
    assert _bits(got, made) == _bits(_expected(made, args, rounds, clients), made)
    ids = np.arange(N) if clients is None else np.asarray(list(clients))
    prog = fb.program(clients=len(ids))(_secure_round)
    data = jax.tree_util.tree_map(lambda v: v[ids], args[1])
    state, (*secure, loss) = _jit_secure(prog, (args[0], data), rounds)
    tree = values.to_pytree(got, made.prepared.result)
    for g, w in zip(jax.tree_util.tree_leaves(tree[1][:4]), secure[:4]):
        assert g.dtype == w.dtype and g.tobytes() == np.asarray(w).tobytes()
    np.testing.assert_allclose(tree[1][4], loss, rtol=1e-6)
    assert float(tree[0]) == float(state)


def test_secure_sums_go_through_secaggplus_with_jits_exact_sums(
        tmp_path, secure_app, quickstart):
    """2 and 3 SuperNodes, the ServerApp and ClientApps in process with Flower's own
    SecAgg+ (secaggplus_mod, SecAggPlusWorkflow): no node's secure partial is in its
    answer to the round, and the totals are jit's."""
    prog, args, made, folder = secure_app
    _, data = args
    bundle_dir = os.path.join(folder, app_dir.PACKAGE)
    for blocks in ([(0, 4), (4, 6)], [(0, 2), (2, 5), (5, 6)]):
        configs = []
        for k, (a, b) in enumerate(blocks):
            path = str(tmp_path / f"{len(blocks)}-{k}")
            write_population(path, [{"x": data["x"][i], "y": data["y"][i]}
                                    for i in range(a, b)])
            configs.append({"population": path, "first-client": a})
        grid = _grid(folder, configs)
        answers = []
        push = grid.push_messages

        def recording_push(messages, push=push):
            ids = push(messages)
            answers.extend(grid.replies[i] for i in ids if i in grid.replies)
            return ids

        grid.push_messages = recording_push
        got = server.run_server(grid, {"num-rounds": 2}, bundle_dir, log=lambda text: None)
        _assert_secure_result(got, made, args, 2)
        round_answers = [a for a in answers if records.PARTIALS in a.content]
        assert len(round_answers) == 2 * len(blocks)
        for answer in round_answers:  # only the plain mean's and the count's partials
            assert answer.content[records.LAYOUT]["aggregations"] == 2
            assert not [k for k in answer.content[records.PARTIALS].keys()
                        if k.startswith(relay.KEPT)]
        # each node's masked vector, once a round, carries no plain parameters
        masked = [a for a in answers if "fitres.parameters" in a.content.array_records]
        assert len(masked) == 2 * len(blocks) and \
            not any(len(a.content.array_records["fitres.parameters"]) for a in masked)
    # a node that never answers the round is dropped before SecAgg+, which runs on the
    # others; a round of secure sums only (no partial crosses) does the same
    quick = {"num-rounds": 1, "node-timeout-s": 0.2, "first-round-timeout-s": 0.0}
    got = server.run_server(_grid(folder, configs, silent=[2]), quick, bundle_dir,
                            log=lambda text: None)
    _assert_secure_result(got, made, args, 1, clients=range(5))

    def only_secure(params, data):
        codes = fb.federated_map_clients(lambda d: (d["y"][:2] > 0).astype(np.int32), data)
        return params, fb.federated_secure_sum(codes, 1)

    made_only = bundle.build_round(fb.program(clients=N)(only_secure), *args,
                                   placements=("server", "clients"))
    only_folder = str(tmp_path / "only")
    app_dir.write_app(made_only, only_folder)
    got = server.run_server(_grid(only_folder, configs, silent=[2]), quick,
                            os.path.join(only_folder, app_dir.PACKAGE),
                            log=lambda text: None)
    want = jax.jit(fb.program(clients=5)(only_secure))(
        args[0], jax.tree_util.tree_map(lambda v: v[:5], data))
    assert np.asarray(got[1]).tobytes() == np.asarray(want[1]).tobytes()
    one_node = str(tmp_path / "one")
    write_population(one_node, [{"x": data["x"][i], "y": data["y"][i]} for i in range(N)])
    with pytest.raises(FleetError, match=r"SecAgg\+, which needs at least 2 SuperNodes.*"
                                         r"1 answered"):
        server.run_server(_grid(folder, [{"population": one_node, "first-client": 0}]),
                          {"num-rounds": 1}, bundle_dir, log=lambda text: None)


def test_a_node_whose_answer_reads_well_but_is_impossible_is_dropped_by_name(
        tmp_path, quickstart, populations, app):
    """A node's answer whose records parse but whose partials claim other clients than
    it was sent is refused by the round engine naming the node and what was wrong; the
    node leaves the round with its clients, as a lost node does."""
    _, args, made = quickstart
    forged = {101}

    def forging(grid):
        push = grid.push_messages

        def forging_push(messages):
            ids = push(messages)
            for message, message_id in zip(messages, ids):
                reply = grid.replies.get(message_id)
                if message.metadata.dst_node_id in forged and reply is not None \
                        and records.PARTIALS in reply.content:
                    metrics = reply.content[relay.METRICS]
                    metrics["num-clients"] = [n + 1 for n in metrics["num-clients"]]
            return ids

        grid.push_messages = forging_push
        return grid

    grid = forging(_grid(app, populations))
    out = str(tmp_path / "out")
    got = server.run_server(grid, {"num-rounds": 1, "out-dir": out},
                            os.path.join(app, app_dir.PACKAGE), log=lambda text: None)
    assert _bits(got, made) == _bits(_expected(made, args, 1, clients=range(4)), made)
    rep = _reports(out)[0]
    assert rep["participants"] == [0, 1, 2, 3] and rep["lost_clients"] == [4, 5]
    assert len(rep["lost_devices"]) == 1
    assert rep["lost_devices"][0].startswith("node 101 (clients 4..5)")
    assert "a partial over 3 clients; the device holds 2 (an impossible answer)" in \
        rep["lost_devices"][0]
    # every node's answer refused: the round says they answered and were refused
    forged.add(100)
    with pytest.raises(FleetError, match=r"round 0: 2 SuperNodes answered but their "
                                         r"answers were refused: node 100 .*\(an "
                                         r"impossible answer\); node 101 .*\(an "
                                         r"impossible answer\); no client is left but "
                                         r"min_clients=1"):
        server.run_server(forging(_grid(app, populations)), {"num-rounds": 1, "out-dir": out},
                          os.path.join(app, app_dir.PACKAGE), log=lambda text: None)
    assert _reports(out)[0]["lost_clients"] == list(range(6))


def test_a_round_whose_clients_all_drop_out_sums_to_zero_with_min_clients_0(
        tmp_path, quickstart, populations):
    """Every sampled client dropped out and min-clients=0: the round runs with no node
    asked (SecAgg+ included), its sum and secure sum the zeros of their types."""
    from fax_bridge.rounds.policy import plan_round

    _, (_, data), _ = quickstart

    def sums(params, data):
        codes = fb.federated_map_clients(lambda d: (d["y"][:2] > 0).astype(np.int32), data)
        total = fb.federated_sum(fb.federated_map_clients(lambda d: d["x"][0], data))
        return params + 1.0, (total, fb.federated_secure_sum(codes, 1))

    made = bundle.build_round(fb.program(clients=N)(sums), np.float32(2.0), data,
                              placements=("server", "clients"))
    folder = str(tmp_path / "sums")
    app_dir.write_app(made, folder)
    config = {"num-rounds": 1, "dropout": 0.9, "seed": 2, "min-clients": 0,
              "out-dir": str(tmp_path / "out")}
    settings_ = server.Settings.from_run_config(config)
    plan = plan_round(settings_.policy, N, 0)
    assert not len(plan.participants) and len(plan.dropped) == N  # this seed drops all
    grid = _grid(folder, populations)
    got = server.run_server(grid, config, os.path.join(folder, app_dir.PACKAGE),
                            log=lambda text: None)
    state, (total, secure) = values.to_pytree(got, made.prepared.result)
    assert float(state) == 3.0 and not grid.replies
    assert total.dtype == data["x"].dtype and total.shape == data["x"].shape[2:]
    assert secure.dtype == np.int32 and secure.shape == (2,)
    assert not total.any() and not secure.any()
    rep = _reports(str(tmp_path / "out"))[0]
    assert rep["participants"] == [] and rep["error"] is None
    # every node lost (silent), or its answer refused (forged): the same zeros, and the
    # report names both nodes and their clients
    config.update({"dropout": 0.0, "node-timeout-s": 0.2, "first-round-timeout-s": 0.0})
    for fault in ({"silent": [0, 1]}, {"forged": [0, 1]}):
        got = server.run_server(_grid(folder, populations, **fault), config,
                                os.path.join(folder, app_dir.PACKAGE), log=lambda text: None)
        state, (total, secure) = values.to_pytree(got, made.prepared.result)
        assert float(state) == 3.0 and not total.any() and not secure.any()
        assert total.dtype == data["x"].dtype and secure.dtype == np.int32
        rep = _reports(str(tmp_path / "out"))[0]
        assert rep["participants"] == [] and rep["lost_clients"] == list(range(N))
        assert [w.split(" (")[0] for w in rep["lost_devices"]] == ["node 100", "node 101"]
        assert rep["error"] is None


_SECURE_KINDS = {
    "bitwidth": lambda v, top: fb.federated_secure_sum_bitwidth(v, top.bit_length()),
    "max_input": lambda v, top: fb.federated_secure_sum(v, top),
    "modular": lambda v, top: fb.federated_secure_modular_sum(v, top + 1),
}


@settings(max_examples=5, deadline=None)
@given(kind=st.sampled_from(sorted(_SECURE_KINDS)),
       shape=st.sampled_from([(), (0,), (1,), (3,), (2, 0), (2, 3)]),
       dtype=st.sampled_from([np.int8, np.uint8, np.int16, np.int32, np.uint32]),
       top=st.sampled_from([1, 9, 100]))
@example(kind="bitwidth", shape=(), dtype=np.int32, top=9)
@example(kind="max_input", shape=(), dtype=np.int32, top=9)
@example(kind="modular", shape=(), dtype=np.uint8, top=9)
@example(kind="max_input", shape=(0,), dtype=np.int32, top=9)
@example(kind="bitwidth", shape=(2, 3), dtype=np.int16, top=100)
def test_secure_sums_of_every_shape_cross_secaggplus_with_jits_bits(
        tmp_path_factory, quickstart, kind, shape, dtype, top):
    """A secure sum of any shape (a scalar, no elements, a matrix), kind and integer
    dtype the fleet takes runs through Flower's SecAgg+ (two nodes, in process) with
    jit's exact bits, beside a bfloat16 scalar in the server state."""
    import jax.numpy as jnp

    _, (_, data), _ = quickstart
    if np.dtype(dtype).itemsize == 1 and top * N > np.iinfo(dtype).max:
        top = 9  # a sum that could wrap in the dtype is refused when traced

    def secure(state, data):
        values = fb.federated_map_clients(
            lambda d: jnp.broadcast_to(jnp.clip(jnp.floor(jnp.abs(d["y"][0]) * 7), 0, top),
                                       shape).astype(dtype), data)
        return state * jnp.bfloat16(2), _SECURE_KINDS[kind](values, top)

    prog = fb.program(clients=N)(secure)
    args = (jnp.bfloat16(1.5), data)
    made = bundle.build_round(prog, *args, placements=("server", "clients"))
    tmp_path = tmp_path_factory.mktemp("secure_shapes")
    folder = str(tmp_path / "app")
    app_dir.write_app(made, folder)
    configs = []
    for k, (a, b) in enumerate(BLOCKS):
        path = str(tmp_path / f"node-{k}")
        write_population(path, [{"x": data["x"][i], "y": data["y"][i]}
                                for i in range(a, b)])
        configs.append({"population": path, "first-client": a})
    out = str(tmp_path / "out")
    got = server.run_server(_grid(folder, configs), {"num-rounds": 1, "out-dir": out},
                            os.path.join(folder, app_dir.PACKAGE), log=lambda text: None)
    want = jax.jit(prog)(*args)
    rep = _reports(out)[0]  # SecAgg+'s four stages counted beside the train messages
    assert rep["rpcs"] == len(configs) * 5 and rep["payload_down"] > 0
    assert rep["bytes_down"] > rep["payload_down"] and rep["bytes_up"] > rep["payload_up"]
    tree = values.to_pytree(got, made.prepared.result)
    for g, w in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(want)):
        g, w = np.asarray(g), np.asarray(w)
        assert (g.dtype, g.shape) == (w.dtype, w.shape) and g.tobytes() == w.tobytes()


THREE = [(0, 2), (2, 5), (5, 6)]  # the clients of three SuperNodes, 100 to 102
STAGE_WORDS = dict(zip(Stage.all(), ("setup", "share keys", "collect masked vectors",
                                     "unmask")))


@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory, secure_app):
    _, (_, data), _, _ = secure_app
    root = tmp_path_factory.mktemp("three_nodes")
    configs = []
    for k, (a, b) in enumerate(THREE):
        write_population(str(root / f"node-{k}"),
                         [{"x": data["x"][i], "y": data["y"][i]} for i in range(a, b)])
        configs.append({"population": str(root / f"node-{k}"), "first-client": a})
    return configs, str(root / "out")


def _secagg_outcome(losses: dict, shares: int, min_clients: int) -> tuple:
    """What a round over THREE's nodes should give when each node of `losses` {node:
    (stage, how)} is lost from that SecAgg+ stage on: (the clients left, None) or
    (None, (the condition not met, the nodes lost then, the stage))."""
    live = set(range(len(THREE)))
    for stage in Stage.all():
        gone = sorted(k for k, (at, _) in losses.items() if at == stage and k in live)
        if not gone:
            continue
        if len(live) - len(gone) < shares:
            return None, ("threshold", gone, stage)
        if stage != "unmask":  # lost in unmask: its vector is in the sum, it stays
            live -= set(gone)
            if sum(THREE[k][1] - THREE[k][0] for k in live) < min_clients:
                return None, ("min_clients", gone, stage)
    return [c for k in sorted(live) for c in range(*THREE[k])], None


def _node_name(k: int) -> str:
    return f"node {100 + k} (clients {THREE[k][0]}..{THREE[k][1] - 1})"


_LOSSES = st.dictionaries(st.integers(0, len(THREE) - 1),
                          st.tuples(st.sampled_from(Stage.all()),
                                    st.sampled_from(["silent", "error", "garbage"])),
                          min_size=1, max_size=2)


@settings(max_examples=6, deadline=None)
@given(losses=_LOSSES, threshold=st.sampled_from([0.0, 1.0]),
       min_clients=st.sampled_from([1, 5]))
@example(losses={1: ("setup", "silent")}, threshold=0.0, min_clients=1)
@example(losses={2: ("share_keys", "error")}, threshold=0.0, min_clients=1)
@example(losses={0: ("collect_masked_vectors", "silent")}, threshold=0.0, min_clients=1)
@example(losses={1: ("unmask", "silent")}, threshold=0.0, min_clients=6)
@example(losses={1: ("share_keys", "silent")}, threshold=1.0, min_clients=1)
@example(losses={0: ("collect_masked_vectors", "error")}, threshold=0.0, min_clients=5)
@example(losses={0: ("setup", "silent"), 2: ("unmask", "error")}, threshold=0.0,
         min_clients=1)
@example(losses={1: ("setup", "garbage")}, threshold=0.0, min_clients=1)
@example(losses={0: ("collect_masked_vectors", "garbage")}, threshold=0.0, min_clients=1)
@example(losses={2: ("unmask", "garbage"), 1: ("share_keys", "garbage")}, threshold=0.0,
         min_clients=1)
def test_a_node_lost_during_secaggplus_is_dropped_or_named_with_the_unmet_condition(
        secure_app, three_nodes, losses, threshold, min_clients):
    """Three SuperNodes (SecAgg+'s threshold: 2 of them by default, all 3 with
    secagg-threshold=1); each node of `losses` stops answering, or answers an error,
    from a SecAgg+ stage on. Lost before its masked vector is summed, a node is dropped
    with its clients and the round has the fleet plan's bits and jit's exact secure sums
    over the others (its plain partials left out too); lost in the unmask stage, its
    vector is in the sum and its clients stay. Too few nodes for the threshold, or too
    few clients for min-clients, fail the round naming the nodes, the stage and the
    condition."""
    prog, args, made, folder = secure_app
    configs, out = three_nodes
    config = {"num-rounds": 1, "node-timeout-s": 0.2, "first-round-timeout-s": 0.0,
              "secagg-threshold": threshold, "min-clients": min_clients, "out-dir": out}
    shares = 2 if threshold == 0.0 else 3
    left, failure = _secagg_outcome(losses, shares, min_clients)
    grid = _grid(folder, configs, lose_at=losses)

    def run():
        return server.run_server(grid, config, os.path.join(folder, app_dir.PACKAGE),
                                 log=lambda text: None)

    if failure is not None:
        condition, gone, stage = failure
        named = ".*".join(f"{re.escape(_node_name(k))}: lost during SecAgg\\+'s "
                          f"{STAGE_WORDS[stage]} stage" for k in gone)
        unmet = (f"reconstruction threshold of {shares} shares" if condition == "threshold"
                 else f"min_clients={min_clients}")
        with pytest.raises(FleetError, match=f"{named}.*{unmet}"):
            run()
        rep = _reports(out)[0]
        assert gone and unmet in rep["error"] and \
            all(_node_name(k) in rep["error"] for k in gone)
        return
    got = run()
    _assert_secure_result(got, made, args, 1,
                          clients=None if len(left) == N else left)
    rep = _reports(out)[0]
    assert rep["error"] is None and rep["participants"] == left
    assert rep["lost_clients"] == [c for c in range(N) if c not in left]
    order = sorted(losses, key=lambda k: (Stage.all().index(losses[k][0]), k))
    assert len(rep["lost_devices"]) == len(order)
    for k, lost in zip(order, rep["lost_devices"]):
        stage, how = losses[k]
        assert lost.startswith(f"{_node_name(k)}: lost during SecAgg+'s "
                               f"{STAGE_WORDS[stage]} stage (")
        assert {"silent": "no answer within 0.2s", "error": "the ClientApp failed",
                "garbage": "a malformed reply: "}[how] in lost
        assert ("its clients stay in the round" in lost) == (stage == "unmask")


# ---------------------------------------------------------------------- command


class _ScriptedDeployment:
    """A deployment whose `flwr run` exits 0 and leaves in its out-dir what `leaves`
    says: the reports of `reported` rounds (round `failed` with an error) and, with
    `result`, a result.npz (what a ServerApp that failed at various points leaves)."""

    nodes = [{}, {}]

    def __init__(self, reported: int, failed, result: bool):
        self.reported, self.failed, self.result = reported, failed, result
        self.out_dirs: list = []

    def run(self, app, config, timeout_s=300.0):
        out = config["out-dir"]
        self.out_dirs.append(out)
        assert os.path.isdir(out) and not os.listdir(out)  # this run's own, empty
        if self.reported:
            with open(os.path.join(out, "reports.jsonl"), "w") as f:
                for r in range(self.reported):
                    error = "FleetError: node 7 lost" if r == self.failed else None
                    lost = ["node 7 (clients 0..3): no answer within 5s"] if error else []
                    f.write(json.dumps({"round": r, "error": error,
                                        "lost_devices": lost}) + "\n")
        if self.result:
            np.savez(os.path.join(out, "result.npz"), fresh=np.ones(1))
        return subprocess.CompletedProcess(["flwr"], 0, "ServerApp traceback ...", "")


@settings(max_examples=20, deadline=None)
@given(rounds=st.integers(1, 3), reported=st.integers(0, 3), failed=st.integers(0, 3),
       result=st.booleans())
def test_a_check_reads_only_what_its_own_run_wrote_and_surfaces_its_error(
        tmp_path_factory, rounds, reported, failed, result):
    """`flwr run` exits 0 when the ServerApp fails; the check reads the run's own
    reports and result in a folder made for that run (never an earlier run's
    result.npz beside it), and any failure is a FleetError quoting the run's error."""
    from fax_bridge.parity import flower as check

    out = tmp_path_factory.mktemp("results")
    np.savez(out / "result.npz", stale=np.zeros(1))  # an earlier run's
    (out / "reports.jsonl").write_text('{"round": 0, "error": null}\n')
    deployment = _ScriptedDeployment(reported, failed if failed < reported else None,
                                     result)
    ok = reported == rounds and deployment.failed is None and result
    if not ok:
        with pytest.raises(FleetError) as info:
            check.run_rounds(deployment, "app", rounds, str(out))
        if deployment.failed is not None:
            assert f"round {failed} failed: FleetError: node 7 lost\n  round {failed}: " \
                "lost node 7 (clients 0..3): no answer within 5s" in str(info.value)
        elif not reported:
            assert "left no reports.jsonl" in str(info.value)
    else:
        _, path, _ = check.run_rounds(deployment, "app", rounds, str(out))
        assert os.path.dirname(path) == deployment.out_dirs[0] != str(out)
        with np.load(path) as f:
            assert f.files == ["fresh"]


def test_flower_command_writes_an_app_flower_accepts(tmp_path, capsys):
    from pathlib import Path

    from flwr.cli.build import build_fab_from_disk
    from flwr.cli.config_utils import load_and_validate

    out = tmp_path / "app"
    code = cli.main(["flower", f"{QUICKSTART}:fedavg_round", "-o", str(out), "--clients",
                     "6", "--write-population", str(tmp_path / "pop"), "--nodes", "2"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "flwr run" in text and "first client 3" in text
    config, _ = load_and_validate(out / "pyproject.toml", check_module=False)
    assert config["tool"]["flwr"]["app"]["components"]["clientapp"] == \
        "fax_round.client_app:app"
    assert config["tool"]["flwr"]["app"]["config"]["min-nodes"] == 2
    assert len(build_fab_from_disk(Path(out))) < 10 * 1024 * 1024
    # What Flower runs for every message: without a worker it is all that loads.
    probe = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location("
             f"'client_app', {str(out / 'fax_round' / 'client_app.py')!r}); "
             "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
             "print(type(m.app).__name__, sorted(k for k in sys.modules if k.split('.')[0] "
             "in ('jax', 'fax_bridge', 'federated_language')))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=120, env=dict(os.environ, FLWR_TELEMETRY_ENABLED="0"))
    assert loaded.stdout.split() == ["ClientApp", "[]"], loaded.stderr[-2000:]
    made = bundle.read_round(str(out / "fax_round"))
    assert made.split.aggregations[0].kind == "weighted_mean"
    assert client.NodeShare.from_config({"population": str(tmp_path / "pop" / "node-1"),
                                         "first-client": 3}).stop == 6


def test_an_app_for_a_tls_superlink_names_its_ca_as_flower_reads_it(tmp_path, quickstart):
    import tomllib

    from flwr.cli.config_utils import load_certificate_in_connection
    from flwr.cli.flower_config import parse_superlink_connection

    from fax_bridge.flower.security import local_credentials

    creds = local_credentials(str(tmp_path / "creds"))
    folder = tmp_path / "app"
    app_dir.write_app(quickstart[2], str(folder), root_certificates=creds.ca_cert,
                      nodes=[{"population": "/p", "first-client": 0}])
    with open(folder / ".flwr" / "config.toml", "rb") as f:
        connection = parse_superlink_connection(
            tomllib.load(f)["superlink"]["fax-bridge"], "fax-bridge")
    assert not connection.insecure
    with open(creds.ca_cert, "rb") as f:
        assert load_certificate_in_connection(connection) == f.read()
    text = (folder / "README.md").read_text()
    assert f"--root-certificates {creds.ca_cert}" in text
    assert "supernode --insecure" not in text and "superlink --insecure" not in text
    assert f"--ssl-ca-certfile {creds.ca_cert}" in text
    assert "--enable-supernode-auth" in text
    assert os.stat(creds.server_key).st_mode & 0o077 == 0


# ------------------------------------------------------------------- deployment


class Deployed:
    """The shared deployment, the app `fax-bridge flower` wrote for it, and the wall
    time of every round of that app its tests ran (`walls`: what sizes the killed-node
    test's deadline on this machine)."""

    def __init__(self, deployment, folder: str, creds):
        self.deployment, self.folder, self.creds, self.walls = deployment, folder, creds, []

    def reports(self, out: str) -> list:
        reports = _reports(out)
        self.walls += [r["wall_s"] for r in reports if r["wall_s"] is not None]
        return reports


@pytest.fixture(scope="module")
def deployed(tmp_path_factory, populations):
    """One SuperLink and two warm SuperNodes on loopback with TLS (a CA, the
    SuperLink's certificate for loopback) and SuperNode authentication (both nodes' keys
    made here and registered), shared by the deployment tests below (the last one kills
    node 1), and the app the command writes; every process started is ended."""
    from fax_bridge.flower.deployment import LocalDeployment
    from fax_bridge.flower.security import local_credentials

    folder = str(tmp_path_factory.mktemp("deployed") / "app")
    assert cli.main(["flower", f"{QUICKSTART}:fedavg_round", "-o", folder, "--clients",
                     str(N)]) == 0
    creds = local_credentials(str(tmp_path_factory.mktemp("creds")), nodes=2)
    # The SuperExecs poll for runs every 0.5 s (LocalDeployment's default): polling idle
    # every 0.05 s took a third of a core all through this module's tests.
    with LocalDeployment(populations, str(tmp_path_factory.mktemp("flwr")),
                         credentials=creds, poll_s=0.5) as d:
        yield Deployed(d, folder, creds)
        pids = d.pids()
    assert not running(pids), f"processes left running: {running(pids)}"


@pytest.mark.peers  # a loopback deployment's processes: make test-peers
def test_check_parity_on_a_deployment_runs_fed_avg_on_digits_as_jit_does(digits, deployed):
    """`check_parity(..., flower=deployment, rounds=2)`: two rounds of fed_avg on the
    digits clients on the running deployment (round 0 compiles on the nodes, round 1 is
    warm and fed round 0's state; the app is written as `fax-bridge flower` writes one)
    equal two rounds under jit within the rounding bound of two chained rounds, and have
    the fleet plan's bits."""
    prog, args = digits
    report = fb.check_parity(prog, *args, placements=("server", "clients"),
                             flower=deployed.deployment, rounds=2)
    assert report.ok, report.table()
    assert report.target == "flower" and report.fleet_bits and report.devices == 2
    assert (report.rtol, report.atol) == (0.0, 0.0)  # held to the rounding bound
    floats = [leaf for leaf in report.leaves if leaf.dtype == "float32"]
    assert floats and all(leaf.bound is not None and "2 chained rounds" in
                          leaf.bound_method for leaf in floats), report.table()
    paths = [leaf.path for leaf in report.leaves]
    assert len(paths) == len(jax.tree_util.tree_leaves(jax.jit(prog)(*args)))
    assert any("loss" in p for p in paths) and any("w0" in p for p in paths)
    text = report.table()
    assert "Flower deployment of 2 SuperNode(s)" in text and "PARITY OK" in text
    assert "the same bits as the fleet's round plan: yes" in text
    # Every Flower process was forked from its host's server, which has Flower loaded
    # (`forked_apps`): on the SuperLink's, the SuperLink, its SuperExec, the two key
    # registrations, `flwr run` and the ServerApp; on each node's, the SuperNode, its
    # SuperExec and the ClientApps (a query and two rounds).
    forked = {name: f.forked() for name, f in deployed.deployment.forks.items()}
    assert forked["superlink"] >= 6 and forked["supernode-0"] >= 5, forked
    assert forked["supernode-1"] >= 5, forked


@pytest.mark.peers  # a loopback deployment's processes: make test-peers
def test_a_deployment_sums_secure_sums_through_secaggplus(tmp_path, secure_app, deployed):
    """`flwr run` of a round with secure sums on the shared deployment: SecAgg+'s four
    stages run through the SuperLink after the round's message, and the result has the
    fleet plan's bits, whose integers are jit's."""
    prog, args, made, folder = secure_app
    out = str(tmp_path / "out")
    run = deployed.deployment.run(folder, {"num-rounds": 1, "out-dir": out,
                                           "min-nodes": 2}, timeout_s=400)
    assert run.returncode == 0, run.stdout[-3000:]
    (report,) = _reports(out)
    assert report["participants"] == list(range(N)) and report["error"] is None
    want = _expected(made, args, 1)
    assert _npz_bits(f"{out}/result.npz") == _bits(want, made)
    _assert_secure_result(want, made, args, 1)
    assert "round 0 (SecAgg+): summed the secure sums of nodes [" in run.stdout


@pytest.mark.peers  # a loopback deployment's processes: make test-peers
def test_a_tls_deployment_with_node_auth_has_the_same_bits_and_refuses_unknown_nodes(
        tmp_path, quickstart, populations, deployed):
    """On the shared deployment (TLS, the SuperLink's certificate for loopback, both
    nodes' keys registered with `--enable-supernode-auth`): a SuperNode whose key is not
    registered is refused, and the round runs on the registered ones with the fleet
    plan's bits."""
    from fax_bridge.flower.security import node_key_pair

    _, args, made = quickstart
    d = deployed.deployment
    unknown_key, _ = node_key_pair(str(tmp_path / "creds"), "unknown")
    out = str(tmp_path / "out")
    intruder = d.start_supernode(populations[1], unknown_key, "intruder")
    try:  # the round runs while the SuperLink refuses the intruder
        run = d.run(deployed.folder, {"num-rounds": 1, "out-dir": out, "min-nodes": 2},
                    timeout_s=400)
        intruder.wait(timeout=120)
    finally:
        if intruder.poll() is None:
            intruder.kill()
            intruder.wait()
    assert intruder.returncode != 0 and "Failed to activate SuperNode" in d.log("intruder")
    assert "Uvicorn running on https://" in d.log("superlink")
    assert run.returncode == 0, run.stdout[-3000:]
    (report,) = deployed.reports(out)
    assert report["participants"] == list(range(N)) and report["devices"] == 2
    assert _npz_bits(f"{out}/result.npz") == _bits(_expected(made, args, 1), made)


def _trains(deployment, node: int) -> int:
    return deployment.log(f"supernode-{node}").count("Receiving: train message")


@pytest.mark.peers  # a loopback deployment's processes: make test-peers
def test_a_node_killed_mid_round_is_dropped_by_the_rounds_deadline(
        tmp_path, quickstart, deployed):
    """SuperNode 1 is SIGKILLed as soon as it has taken the round's message; the round
    stops waiting for it at its own deadline (`node-timeout-s`, which is also the
    message's TTL, far below Flower's heartbeat expiry) and finishes on node 0's
    clients with the bits of a plan over them."""
    _, args, made = quickstart
    deployment, folder = deployed.deployment, deployed.folder
    out = str(tmp_path / "out")
    # Two and a half times the slowest round of this app the deployment has run (its
    # first, compiling on the nodes; a warm one took 16 s at load 15), within 10 to 30
    # s: node 0's answer fits, node 1's wait is short.
    deadline = round(min(30.0, max(10.0, 2.5 * max(deployed.walls, default=12.0))), 1)
    before, seen = _trains(deployment, 1), {}

    def kill_when_node_1_has_the_round():
        end = time.monotonic() + 240
        while time.monotonic() < end and not seen.get("done"):
            if _trains(deployment, 1) > before:
                deployment.kill_node(1)
                seen["killed"] = True
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=kill_when_node_1_has_the_round)
    watcher.start()
    try:
        run = deployment.run(folder, {"num-rounds": 1, "out-dir": out, "min-nodes": 2,
                                      "node-timeout-s": deadline,
                                      "first-round-timeout-s": 0.0}, timeout_s=300)
    finally:
        seen["done"] = True
        watcher.join()
    assert run.returncode == 0, run.stdout[-3000:]
    assert seen.get("killed"), run.stdout[-3000:]
    (report,) = deployed.reports(out)
    assert report["participants"] == [0, 1, 2, 3] and report["lost_clients"] == [4, 5]
    lost = report["lost_devices"][0]  # the round's wait ran out, or the message's TTL
    assert "clients 4..5" in lost
    assert f"no answer within {deadline}s" in lost or "TTL" in lost
    want = _expected(made, args, 1, clients=range(4))
    assert _npz_bits(f"{out}/result.npz") == _bits(want, made)
    assert "round 0: 4/6 clients reported" in run.stdout


def test_a_state_over_the_bundle_limit_is_read_from_initial_state(tmp_path, quickstart,
                                                                  populations, monkeypatch):
    prog, args, made = quickstart
    folder = tmp_path / "app"
    without = os.path.getsize(bundle.write_round(made, str(tmp_path / "probe"),
                                                 str(tmp_path / "probe.npz")))
    monkeypatch.setattr(bundle, "MAX_BUNDLE_BYTES", without + 16)  # the state: over it
    app_dir.write_app(made, str(folder))
    state_path = str(folder / app_dir.STATE_FILE)
    with open(folder / "pyproject.toml") as f:
        assert f'app-state = "{state_path}"' in f.read()
    package = str(folder / app_dir.PACKAGE)
    with open(os.path.join(package, bundle.FILE_NAME)) as f:
        assert json.load(f)["state"] is None  # only its layout travels in the bundle
    grid = _grid(str(folder), populations)
    with pytest.raises(FleetError, match="set the run config's app-state"):
        server.run_server(grid, {"num-rounds": 1}, package, log=lambda text: None)
    out = str(tmp_path / "out")
    got = server.run_server(grid, {"num-rounds": 3, "out-dir": out,
                                   "app-state": state_path}, package,
                            log=lambda text: None)
    assert _bits(got, made) == _bits(_expected(made, args, 3), made)
    other = [np.zeros((2,), np.float32)]
    bundle.write_state(other, str(tmp_path / "other.npz"))
    for key in ("app-state", "initial-state"):  # another round's state: refused either way
        with pytest.raises(ExportError, match="written for another round"):
            server.run_server(grid, {"num-rounds": 1, key: str(tmp_path / "other.npz")},
                              package, log=lambda text: None)
    # A start of the user's own (the round's state, changed: a warm start) is input,
    # checked entry by entry, and runs where the app's recorded digest refuses it.
    warm = [np.asarray(t) + 1 for t in made.state]
    bundle.write_state(warm, str(tmp_path / "warm.npz"))
    with pytest.raises(ExportError, match="^app-state .*not the file that was recorded with it"):
        server.run_server(grid, {"num-rounds": 1, "app-state": str(tmp_path / "warm.npz")},
                          package, log=lambda text: None)
    got = server.run_server(grid, {"num-rounds": 1, "initial-state": str(
        tmp_path / "warm.npz")}, package, log=lambda text: None)
    assert _bits(got, made) == _bits(
        _expected(made, args, 1, state=made.state_value(warm)), made)


def test_a_reply_still_uploading_does_not_hold_the_exchange_past_its_deadline(
        quickstart, populations, app):
    from fax_bridge.flower import nodes as flower_nodes

    grid = _grid(app, populations)
    released = threading.Event()
    slow_node = 101
    pull = grid.pull_messages

    def pull_messages(message_ids):  # Flower's pull waits while a reply's arrays upload
        ids = list(message_ids)
        if any(grid.destinations.get(i) == slow_node for i in ids):
            released.wait(60)
        return pull(ids)

    grid.destinations = {}
    push = grid.push_messages

    def push_messages(messages):
        ids = push(messages)
        grid.destinations.update((i, m.metadata.dst_node_id) for i, m in zip(ids, messages))
        return ids

    grid.push_messages, grid.pull_messages = push_messages, pull_messages
    from flwr.app import Message, MessageType, RecordDict

    messages = [Message(RecordDict(), dst_node_id=node, message_type=MessageType.QUERY)
                for node in (100, slow_node)]
    try:
        replies = flower_nodes.exchange(grid, messages, timeout_s=1.0, poll_s=0.05)
        assert set(replies) == {100} and not released.is_set()  # returned without it
    finally:
        released.set()


def test_a_deployment_polls_for_tasks_at_the_interval_the_docs_measured(tmp_path):
    """Flower's SuperExecs poll for tasks (a request each time, idle or not): a
    deployment sets the interval docs/flower.md measured the idle cost of, unless told."""
    from fax_bridge.flower.deployment import SUPEREXEC_POLL_S, LocalDeployment

    nodes = [{"population": str(tmp_path / "pop")}]
    default = LocalDeployment(nodes, str(tmp_path / "home"))  # nothing starts yet
    assert default.env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] == str(SUPEREXEC_POLL_S)
    faster = LocalDeployment(nodes, str(tmp_path / "home"), poll_s=0.05)
    assert faster.env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] == "0.05"
    with open(os.path.join(ROOT, "docs", "flower.md")) as f:
        doc = f.read()
    assert f"`poll_s={SUPEREXEC_POLL_S}` by default" in doc
    assert f"| {SUPEREXEC_POLL_S} s (the default) |" in doc
