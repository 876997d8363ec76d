"""Runs an FCP-shaped MapReduceForm the way a Federated Compute plan's phases run.

Imported by `build_forms.py` (a job's `"fcp": {"run": ...}`), inside the TFF 0.87
environment. Each phase is one TensorFlow graph built once (its pieces imported with
`import_graph_def`, checkpoint paths fed as placeholders, as a plan's graphs take them)
and run once per round or client, every value between phases going through a TF
(tensor-slice) checkpoint file:

- server, prepare: restore the state, `prepare`, save what is broadcast;
- client: restore the broadcast, iterate the client's examples (a TFRecord file of
  serialized `tf.Example`, `TFRecordDataset`), `work`, save the update;
- server, per client: restore the accumulator and the update,
  `merge(acc, accumulate(zero(), update))`; the secure sums are plain sums here (each
  input checked against its bound first), as a secure aggregator outputs them;
- server, finalize: `report`, the modulus applied, `update`, save the new state.

`run_rounds` returns the state after each round and the outputs. `plan_run_daf.py` does
the same for the DistributeAggregateForm (a plan's `server_phase_v2`).
"""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf
from tensorflow_federated.python.common_libs import structure
from tensorflow_federated.python.core.impl.types import computation_types as ct
from tensorflow_federated.python.tensorflow_libs import serialization_utils as ser


def leaves(t) -> list:
    if isinstance(t, ct.StructType):
        return [x for _, e in structure.iter_elements(t) for x in leaves(e)]
    return [t]


def binding_names(binding) -> list:
    kind = binding.WhichOneof("binding")
    if kind == "tensor":
        return [binding.tensor.tensor_name]
    if kind == "sequence":
        return [binding.sequence.variant_tensor_name]
    if kind == "struct":
        return [n for e in binding.struct.element for n in binding_names(e)]
    return []


class Graph:
    """One phase: a graph, its session, and the init ops of the pieces it imports."""

    def __init__(self):
        self.graph = tf.Graph()
        self.inits: list = []

    def call(self, comp, inputs: list, scope: str) -> list:
        """Imports the TF computation `comp` (a TFF ConcreteComputation) wired to
        `inputs` (flat, TFF's binding order); its flat results."""
        from build_forms import proto_of

        t = (comp if hasattr(comp, "tensorflow") else proto_of(comp)).tensorflow
        feeds = binding_names(t.parameter) if t.HasField("parameter") else []
        fetches = binding_names(t.result)
        if len(feeds) != len(inputs):
            raise ValueError(f"{scope} takes {len(feeds)} inputs, got {len(inputs)}")
        wanted = fetches + ([t.initialize_op] if t.initialize_op else [])
        got = tf.graph_util.import_graph_def(
            ser.unpack_graph_def(t.graph_def), input_map=dict(zip(feeds, inputs)),
            return_elements=wanted, name=scope)
        if t.initialize_op:
            self.inits.append(got[-1])
            got = got[:-1]
        return list(got)

    def session(self):
        self.sess = tf.compat.v1.Session(graph=self.graph)
        if self.inits:
            self.sess.run(self.inits)
        return self.sess


def restore(path, names: list, types: list) -> list:
    out = []
    for name, t in zip(names, types):
        x = tf.raw_ops.Restore(file_pattern=path, tensor_name=name,
                               dt=tf.as_dtype(t.dtype))
        x.set_shape(t.shape)
        out.append(x)
    return out


def save(path, names: list, tensors: list):
    if not tensors:
        return tf.no_op()
    return tf.raw_ops.Save(filename=path, tensor_names=names, data=tensors)


def names(prefix: str, n: int) -> list:
    return [f"{prefix}/{i}" for i in range(n)]


class ClientPhase:
    """A plan's client phase, built once for both forms: restore the broadcast from its
    checkpoint, iterate the client's TFRecord examples as `work` (the MRF's work, the
    DAF's client_work) takes them, save the update; `run` runs it for one client."""

    def __init__(self, work, bcast_t: list, scope: str):
        g = self.graph = Graph()
        with g.graph.as_default():
            self.bcast, self.examples, self.out = (
                tf.compat.v1.placeholder(tf.string, [], n)
                for n in ("broadcast_in", "examples", "update_out"))
            bcast = restore(self.bcast, names("client", len(bcast_t)), bcast_t)
            data = tf.data.experimental.to_variant(tf.data.TFRecordDataset(self.examples))
            update = g.call(work, [data] + bcast, scope)
            self.save = save(self.out, names("update", len(update)), update)
        g.session()

    def run(self, bcast_path: str, examples_path: str, out_path: str) -> None:
        self.graph.sess.run(self.save, {self.bcast: bcast_path,
                                        self.examples: examples_path, self.out: out_path})

    def close(self) -> None:
        self.graph.sess.close()


class PlanRunner:
    """The phases of one MapReduceForm, built once; `round` runs one round."""

    def __init__(self, mrf, folder: str, client=None):
        self.folder = folder
        os.makedirs(folder, exist_ok=True)
        state_t = leaves(mrf.prepare.type_signature.parameter)
        bcast_t = leaves(mrf.prepare.type_signature.result)
        work_out = mrf.work.type_signature.result
        parts = [leaves(e) for _, e in structure.iter_elements(work_out)]
        acc_t = leaves(mrf.zero.type_signature.result)
        self.n_state = len(state_t)
        secure_t = parts[1] + parts[2] + parts[3]
        self.bounds = self._bounds(mrf, parts)
        string = tf.string

        # server, prepare
        g = self.prepare = Graph()
        with g.graph.as_default():
            self.p_state, self.p_out = (tf.compat.v1.placeholder(string, [], n)
                                        for n in ("state_in", "broadcast_out"))
            state = restore(self.p_state, names("server", len(state_t)), state_t)
            self.p_save = save(self.p_out, names("client", len(bcast_t)),
                               g.call(mrf.prepare, state, "prepare"))
        g.session()

        self.client = (client or ClientPhase)(mrf.work, bcast_t, "work")

        # server, accumulate one client's update
        update_t = [x for p in parts for x in p]
        g = self.accumulate = Graph()
        with g.graph.as_default():
            self.a_acc, self.a_update, self.a_out = (
                tf.compat.v1.placeholder(string, [], n)
                for n in ("accumulator_in", "update_in", "accumulator_out"))
            acc = restore(self.a_acc, names("acc", len(acc_t)), acc_t)
            secure = restore(self.a_acc, names("secure", len(secure_t)), secure_t)
            upd = restore(self.a_update, names("update", len(update_t)), update_t)
            simple, secure_in = upd[:len(parts[0])], upd[len(parts[0]):]
            kinds = (["bitwidth"] * len(parts[1]) + ["max_input"] * len(parts[2])
                     + ["modulus"] * len(parts[3]))
            checks = [self._check(x, b, k) for x, b, k in zip(secure_in, self.bounds, kinds)]
            with tf.control_dependencies(checks):
                zero = g.call(mrf.zero, [], "zero")
                one = g.call(mrf.accumulate, zero + simple, "accumulate")
                merged = g.call(mrf.merge, acc + one, "merge")
                total = [a + b for a, b in zip(secure, secure_in)]
            self.a_save = save(self.a_out, names("acc", len(acc_t))
                               + names("secure", len(secure_t)), merged + total)
        g.session()

        # server, the initial accumulator
        g = self.zero = Graph()
        with g.graph.as_default():
            self.z_out = tf.compat.v1.placeholder(string, [], "accumulator_out")
            zeros = [tf.zeros(t.shape, tf.as_dtype(t.dtype)) for t in secure_t]
            self.z_save = save(self.z_out, names("acc", len(acc_t))
                               + names("secure", len(secure_t)),
                               g.call(mrf.zero, [], "zero") + zeros)
        g.session()

        # server, finalize and update
        n_modular = len(parts[3])
        g = self.finalize = Graph()
        with g.graph.as_default():
            self.f_state, self.f_acc, self.f_out = (
                tf.compat.v1.placeholder(string, [], n)
                for n in ("state_in", "accumulator_in", "state_out"))
            state = restore(self.f_state, names("server", len(state_t)), state_t)
            acc = restore(self.f_acc, names("acc", len(acc_t)), acc_t)
            secure = restore(self.f_acc, names("secure", len(secure_t)), secure_t)
            moduli = self.bounds[len(secure) - n_modular:]
            secure = secure[:len(secure) - n_modular] + [
                tf.math.floormod(x, tf.constant(m, x.dtype))
                for x, m in zip(secure[len(secure) - n_modular:], moduli)]
            report = g.call(mrf.report, acc, "report")
            out = g.call(mrf.update, state + report + secure, "update")
            self.f_save = save(self.f_out, names("server", self.n_state),
                               out[:self.n_state])
            self.f_output = out[self.n_state:]
        g.session()

    @staticmethod
    def _bounds(mrf, parts) -> list:
        """Per secure input tensor: its bitwidth, max_input or modulus (numpy)."""
        from build_forms import TensorFlowPiece, proto_of

        out = []
        for name, part in zip(("secure_sum_bitwidth", "secure_sum_max_input",
                               "secure_modular_sum_modulus"), parts[1:]):
            piece = TensorFlowPiece(proto_of(getattr(mrf, name)))
            try:
                values = piece([]) if part else []
            finally:
                piece.close()
            out += [np.asarray(v) for v in values]
        return out

    @staticmethod
    def _check(x, bound, kind: str):
        """In [0, 2**bitwidth - 1] / [0, max_input] (modular sums: any value)."""
        if kind == "modulus":
            return tf.no_op()
        top = (2 ** int(bound) - 1) if kind == "bitwidth" else bound
        return tf.debugging.assert_equal(
            tf.reduce_all((x >= 0) & (x <= tf.constant(top, x.dtype))), True,
            message=f"a secure-sum input lies outside [0, {top}]")

    def round(self, state_path: str, examples: list, out_path: str) -> list:
        """One round from the state checkpoint `state_path` over the clients' example
        files; writes the new state to `out_path`, returns the output values."""
        f = self.folder
        bcast, acc = os.path.join(f, "broadcast.ckpt"), os.path.join(f, "acc0.ckpt")
        self.prepare.sess.run(self.p_save, {self.p_state: state_path, self.p_out: bcast})
        self.zero.sess.run(self.z_save, {self.z_out: acc})
        for j, path in enumerate(examples):
            update = os.path.join(f, f"update{j}.ckpt")
            self.client.run(bcast, path, update)
            nxt = os.path.join(f, f"acc{(j + 1) % 2}.ckpt")
            self.accumulate.sess.run(self.a_save, {self.a_acc: acc, self.a_update: update,
                                                   self.a_out: nxt})
            acc = nxt
        _, output = self.finalize.sess.run(
            [self.f_save, self.f_output],
            {self.f_state: state_path, self.f_acc: acc, self.f_out: out_path})
        return [np.asarray(x) for x in output]

    def close(self) -> None:
        self.client.close()
        for g in (self.prepare, self.accumulate, self.zero, self.finalize):
            g.sess.close()


def write_state(path: str, values: list) -> None:
    """The initial state checkpoint (names `server/I`)."""
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        sess.run(save(tf.constant(path), names("server", len(values)),
                      [tf.constant(v) for v in values]))


def read_state(path: str, types: list) -> list:
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        return [np.asarray(x) for x in sess.run(
            restore(tf.constant(path), names("server", len(types)), types))]


def run_rounds(mrf, state: list, examples: list, rounds: int, folder: str,
               client=None) -> dict:
    """`rounds` rounds from `state` (flat, stored dtypes); {"state.R.I", "output.R.I"}.
    `client`: the client phase's class (`ClientPhase`, or `tflite_client.ClientPhase`)."""
    runner = PlanRunner(mrf, folder, client)
    state_t = leaves(mrf.prepare.type_signature.parameter)
    out = {}
    try:
        path = os.path.join(folder, "state0.ckpt")
        write_state(path, state)
        for r in range(rounds):
            nxt = os.path.join(folder, f"state{r + 1}.ckpt")
            output = runner.round(path, examples, nxt)
            for i, v in enumerate(read_state(nxt, state_t)):
                out[f"state.{r}.{i}"] = v
            for i, v in enumerate(output):
                out[f"output.{r}.{i}"] = v
            path = nxt
    finally:
        runner.close()
    return out
