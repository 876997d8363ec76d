"""Runs an FCP-shaped DistributeAggregateForm the way a plan's `server_phase_v2` runs.

Imported by `build_forms.py` (a job's `"fcp": {"run": ...}`), inside the TFF 0.87
environment. As Federated Compute's builder does, each TensorFlow phase is the DAF piece's
local processing consolidated into one TensorFlow computation
(`consolidate_and_extract_local_processing`), imported once into a graph whose
checkpoint paths are placeholders (`plan_run.Graph`):

- server, prepare: restore the state, `server_prepare`, save the broadcast and the
  intermediate state;
- client: restore the broadcast, iterate the client's examples (TFRecordDataset),
  `client_work`, save the update;
- server, aggregations: each intrinsic of `client_to_server_aggregation` over the
  clients' updates, its arguments selected from the intermediate state or the update (as
  FCP's server aggregates natively: sums, means, weighted means; secure sums as plain
  sums after a bounds check);
- server, result: restore the intermediate state, `server_result` on the aggregates,
  save the new state.
"""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf
from tensorflow_federated.python.common_libs import structure
from tensorflow_federated.python.core.backends.mapreduce import compiler
from tensorflow_federated.python.core.impl.compiler import building_blocks as bb
from tensorflow_federated.python.core.impl.types import computation_types as ct

from plan_run import ClientPhase, Graph, names, read_state, restore, save, write_state


def local(piece):
    """The piece's local processing as one TensorFlow computation proto."""
    block = compiler.consolidate_and_extract_local_processing(
        piece.to_building_block(), tf.compat.v1.ConfigProto())
    return block.proto


def _member(t):
    return getattr(t, "member", t)


def _path(selection) -> list:
    path = []
    while isinstance(selection, bb.Selection):
        path.append(selection.index)
        selection = selection.source
    return path[::-1]


def flat(t) -> list:
    """The tensor types of `t`, depth-first, federated types unwrapped at any level."""
    t = _member(t)
    if isinstance(t, ct.StructType):
        return [x for _, e in structure.iter_elements(t) for x in flat(e)]
    return [t]


def _flat_type_offsets(t) -> dict:
    """{path: (first leaf, leaf count)} for every element of `t` (federated unwrapped)."""
    out, counter = {}, [0]

    def walk(node, path):
        start = counter[0]
        node = _member(node)
        if isinstance(node, ct.StructType):
            for i, (_, e) in enumerate(structure.iter_elements(node)):
                walk(e, path + (i,))
        else:
            counter[0] += 1
        out[path] = (start, counter[0] - start)

    walk(t, ())
    return out


def _aggregate(uri: str, args: list, clients: int) -> list:
    """One intrinsic over the clients: `args` holds per argument a list of leaves, each a
    list over clients (an intermediate-state argument: the same value for all)."""
    value = args[0]
    if uri == "federated_sum":
        return [np.sum(v, axis=0) for v in value]
    if uri == "federated_mean":
        return [np.mean(v, axis=0).astype(v[0].dtype) for v in value]
    if uri == "federated_weighted_mean":
        w = np.asarray(args[1][0], np.float64)
        total = w.sum()
        return [(np.tensordot(w, np.asarray(v, np.float64), axes=1) / total).astype(v[0].dtype)
                for v in value]
    if uri in ("federated_secure_sum_bitwidth", "federated_secure_sum"):
        bounds = args[1]
        out = []
        for k, v in enumerate(value):
            b = np.asarray(bounds[min(k, len(bounds) - 1)][0])
            top = 2 ** int(b) - 1 if uri == "federated_secure_sum_bitwidth" else b
            stacked = np.asarray(v)
            if np.any(stacked < 0) or np.any(stacked > top):
                raise ValueError(f"a {uri} input lies outside [0, {top}]")
            out.append(np.sum(stacked, axis=0).astype(stacked.dtype))
        return out
    raise NotImplementedError(f"the DAF runner has no aggregation for {uri}")


class DafRunner:
    """The phases of one DistributeAggregateForm, built once; `round` runs one round."""

    def __init__(self, daf, folder: str):
        self.daf, self.folder = daf, folder
        os.makedirs(folder, exist_ok=True)
        prepare_t = daf.server_prepare.type_signature
        self.state_t = flat(prepare_t.parameter)
        self.bcast_t = flat(prepare_t.result[0])
        self.inter_t = flat(prepare_t.result[1])
        work_t = daf.client_work.type_signature
        self.update_t = flat(work_t.result)
        self.update_type = work_t.result
        self.inter_type = prepare_t.result[1]
        string = tf.string

        g = self.prepare = Graph()
        with g.graph.as_default():
            self.p_state, self.p_bcast, self.p_inter = (
                tf.compat.v1.placeholder(string, [], n)
                for n in ("state_in", "broadcast_out", "intermediate_out"))
            state = restore(self.p_state, names("server", len(self.state_t)), self.state_t)
            out = g.call(local(daf.server_prepare), state, "server_prepare")
            nb = len(self.bcast_t)
            self.p_save = [save(self.p_bcast, names("client", nb), out[:nb]),
                           save(self.p_inter, names("intermediate_state", len(out) - nb),
                                out[nb:])]
        g.session()

        self.client = ClientPhase(local(daf.client_work), self.bcast_t, "client_work")

        result_t = daf.server_result.type_signature
        self.agg_t = flat(result_t.parameter[1])
        g = self.result = Graph()
        with g.graph.as_default():
            self.r_inter, self.r_state = (tf.compat.v1.placeholder(string, [], n)
                                          for n in ("intermediate_in", "state_out"))
            inter = restore(self.r_inter, names("intermediate_state", len(self.inter_t)),
                            self.inter_t)
            self.r_agg = [tf.compat.v1.placeholder(tf.as_dtype(t.dtype), t.shape)
                          for t in self.agg_t]
            out = g.call(local(daf.server_result), inter + self.r_agg, "server_result")
            ns = len(flat(result_t.result[0]))
            self.r_save = save(self.r_state, names("server", ns), out[:ns])
            self.r_output = out[ns:]
        g.session()

    def _aggregations(self, inter: list, updates: list) -> list:
        comp = self.daf.client_to_server_aggregation.to_building_block()
        offsets = {0: _flat_type_offsets(self.inter_type), 1: _flat_type_offsets(
            self.update_type)}
        values = {}
        for name, call in comp.result.locals:
            args = []
            arg = call.argument
            for a in (structure.flatten(arg) if isinstance(arg, bb.Struct) else [arg]):
                path = _path(a)
                first, count = offsets[path[0]][tuple(path[1:])]
                if path[0] == 0:
                    args.append([[inter[i]] for i in range(first, first + count)])
                else:
                    args.append([[u[i] for u in updates] for i in range(first, first + count)])
            values[name] = _aggregate(call.function.uri, args, len(updates))

        def evaluate(node):
            if isinstance(node, bb.Reference):
                return values[node.name]
            if isinstance(node, bb.Struct):
                return [x for e in node for x in evaluate(e)]
            raise NotImplementedError(f"aggregation result holds a {type(node).__name__}")

        return evaluate(comp.result.result)

    def round(self, state_path: str, examples: list, out_path: str) -> list:
        f = self.folder
        bcast, inter = os.path.join(f, "broadcast.ckpt"), os.path.join(f, "inter.ckpt")
        self.prepare.sess.run(self.p_save, {self.p_state: state_path, self.p_bcast: bcast,
                                            self.p_inter: inter})
        inter_values = read_checkpoint(inter, "intermediate_state", self.inter_t)
        updates = []
        for j, path in enumerate(examples):
            update = os.path.join(f, f"update{j}.ckpt")
            self.client.run(bcast, path, update)
            updates.append(read_checkpoint(update, "update", self.update_t))
        aggregates = self._aggregations(inter_values, updates)
        feed = {self.r_inter: inter, self.r_state: out_path}
        feed.update({p: np.asarray(v, p.dtype.as_numpy_dtype)
                     for p, v in zip(self.r_agg, aggregates)})
        _, output = self.result.sess.run([self.r_save, self.r_output], feed)
        return [np.asarray(x) for x in output]

    def close(self) -> None:
        self.client.close()
        for g in (self.prepare, self.result):
            g.sess.close()


def read_checkpoint(path: str, prefix: str, types: list) -> list:
    if not types:
        return []
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        return [np.asarray(x) for x in sess.run(
            restore(tf.constant(path), names(prefix, len(types)), types))]


def run_rounds(daf, state: list, examples: list, rounds: int, folder: str) -> dict:
    """`rounds` rounds from `state` (flat, stored dtypes); {"state.R.I", "output.R.I"}."""
    runner = DafRunner(daf, folder)
    out = {}
    try:
        path = os.path.join(folder, "state0.ckpt")
        write_state(path, state)
        for r in range(rounds):
            nxt = os.path.join(folder, f"state{r + 1}.ckpt")
            output = runner.round(path, examples, nxt)
            for i, v in enumerate(read_state(nxt, runner.state_t)):
                out[f"state.{r}.{i}"] = v
            for i, v in enumerate(output):
                out[f"output.{r}.{i}"] = v
            path = nxt
    finally:
        runner.close()
    return out
