"""Builds TFF's production forms from round protos, inside the TFF 0.87 environment.

    .venv-tff/bin/python tools/tff087/build_forms.py JOBS.json

`JOBS.json` (written by `fax_bridge.tff.forms`) lists jobs:

    {"jobs": [{"name": "fed_avg", "proto": "round.pb", "forms": ["daf", "mrf"],
               "out": "DIR", "artifacts": {"<sha256 of HLO bytes>": "part.mlirbc"},
               "run_mrf": {"inputs": "in.npz", "outputs": "out.npz"}}]}

For each job the round proto (typed `(<state@SERVER, data@CLIENTS> -> <state@SERVER,
output@SERVER>)`) is read with TFF's own proto and building blocks, and:

- `daf`: `get_distribute_aggregate_form_for_computation` (Xla parts kept); each piece is
  written to `OUT/daf.PIECE.pb`, `get_computation_for_distribute_aggregate_form`
  re-derives the round (`OUT/daf.round.pb`) and its type must equal the original's;
- `mrf`: every Xla part is replaced by a TensorFlow computation of the same type that
  holds one `XlaCallModule` op (version 8, the newest TF 2.14 loads) calling the part's
  portable StableHLO artifact; `get_map_reduce_form_for_computation` then builds the
  form, its pieces go to `OUT/mrf.PIECE.pb`, `get_computation_for_map_reduce_form`
  re-derives the round (type checked as above), and with `run_mrf` the form is run
  piece by piece in TensorFlow sessions on the given inputs (flat leaves `state.I` and
  `client.J.I` in the npz; results `state.I`, `output.I`).

With `"fcp": {"forms": [...], "run": {...}, "tf_examples": PATH}` a job also gets the
forms Federated Compute's plan builder takes (`fcp_forms.py`: client data as serialized
`tf.Example`s, TensorFlow parts, checkpoint dtypes, secure-sum bounds in the server
state), written to `OUT/fcp_KIND.PIECE.pb`; `run` (`{"state": npz, "examples": [one
TFRecord file per client], "rounds": R, "outputs": npz}`) runs the MRF's phases as a
plan does (`plan_run.py`), with `"tflite": true` also with the client work converted by
TF's TFLite converter and run in `tf.lite.Interpreter` (`tflite_client.py`), and `tf_examples` writes one record with TensorFlow's own
writer. Every form also reports `fcp_contract`: what FCP's builder would refuse in it.

stdout receives one JSON object {name: {form: {...} or {"error": "..."}}}; all other
printing goes to stderr. Exit status 2 means TFF could not be imported.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
warnings.filterwarnings("ignore")
# Run as a script, this module is `__main__`; `fcp_forms` and `plan_run` import its
# helpers (and the TF / TFF modules `_imports` binds) as `build_forms`.
sys.modules.setdefault("build_forms", sys.modules[__name__])

DAF_PIECES = ("server_prepare", "server_to_client_broadcast", "client_work",
              "client_to_server_aggregation", "server_result")
MRF_PIECES = ("prepare", "work", "zero", "accumulate", "merge", "report",
              "secure_sum_bitwidth", "secure_sum_max_input", "secure_modular_sum_modulus",
              "update")


def _imports():
    """Loads TF and TFF (after stdout is redirected, so their logs stay off the JSON)."""
    global np, tf, tfxla, pb, bb, ctypes_, tu, structure, ser, ts, impl, ctx, fu
    import numpy as np
    import tensorflow as tf
    from tensorflow.compiler.tf2xla.python import xla as tfxla
    from tensorflow_federated.proto.v0 import computation_pb2 as pb
    from tensorflow_federated.python.common_libs import structure
    from tensorflow_federated.python.core.backends.mapreduce import form_utils as fu
    from tensorflow_federated.python.core.impl.compiler import building_blocks as bb
    from tensorflow_federated.python.core.impl.computation import computation_impl as impl
    from tensorflow_federated.python.core.impl.context_stack import context_stack_impl as ctx
    from tensorflow_federated.python.core.impl.types import computation_types as ctypes_
    from tensorflow_federated.python.core.impl.types import type_serialization as ts
    from tensorflow_federated.python.core.impl.utils import tensorflow_utils as tu
    from tensorflow_federated.python.tensorflow_libs import serialization_utils as ser


# ------------------------------------------------------------------------ types


def tensor_leaves(t) -> list:
    """The TensorTypes of `t`, depth-first (TFF's binding order)."""
    if isinstance(t, ctypes_.StructType):
        return [leaf for _, e in structure.iter_elements(t) for leaf in tensor_leaves(e)]
    if isinstance(t, ctypes_.TensorType):
        return [t]
    raise TypeError(f"a local computation's type holds {t}; only tensors and structs are "
                    "supported")


def pack(t, flat: list):
    """`flat` tensors as a `structure.Struct` shaped like the type `t`."""
    it = iter(flat)

    def build(node):
        if isinstance(node, ctypes_.StructType):
            return structure.Struct([(name, build(e)) for name, e in structure.iter_elements(node)])
        return next(it)

    return build(t)


def concrete(proto):
    return impl.ConcreteComputation(computation_proto=proto, context_stack=ctx.context_stack)


def proto_of(comp):
    return impl.ConcreteComputation.get_proto(comp)


# ------------------------------------------------------------------------ Xla -> TF


def xla_call_module_computation(fn_type, artifact: bytes):
    """A TensorFlow computation of type `fn_type` holding one XlaCallModule op."""
    results = tensor_leaves(fn_type.result)
    graph = tf.Graph()
    with graph.as_default():
        if fn_type.parameter is not None:
            value, param_binding = tu.stamp_parameter_in_graph("arg", fn_type.parameter, graph)
            args = structure.flatten(value) if isinstance(
                fn_type.parameter, ctypes_.StructType) else [value]
        else:
            param_binding, args = None, []
        outs = tfxla.call_module(
            list(args), version=8, module=artifact,
            Tout=[tf.as_dtype(r.dtype) for r in results],
            Sout=[tf.TensorShape(r.shape) for r in results], platforms=["CPU"])
        outs = list(outs)
        result = pack(fn_type.result, outs) if isinstance(
            fn_type.result, ctypes_.StructType) else outs[0]
        _, result_binding = tu.capture_result_from_graph(result, graph)
    tf_proto = pb.TensorFlow(graph_def=ser.pack_graph_def(graph.as_graph_def()),
                             result=result_binding)
    if param_binding is not None:
        tf_proto.parameter.CopyFrom(param_binding)
    return pb.Computation(type=ts.serialize_type(fn_type), tensorflow=tf_proto)


def xla_to_tensorflow(comp_proto, artifacts: dict):
    """The round with every Xla part replaced by its XlaCallModule TF computation."""
    import hashlib

    from tensorflow_federated.python.core.impl.compiler import transformation_utils

    missing = []

    def replace(block):
        if isinstance(block, bb.CompiledComputation) and \
                block.proto.WhichOneof("computation") == "xla":
            key = hashlib.sha256(block.proto.xla.hlo_module.value).hexdigest()
            if key not in artifacts:
                missing.append(key)
                return block, False
            with open(artifacts[key], "rb") as f:
                tf_comp = xla_call_module_computation(block.type_signature, f.read())
            return bb.CompiledComputation(tf_comp, type_signature=block.type_signature), True
        return block, False

    tree = bb.ComputationBuildingBlock.from_proto(comp_proto)
    tree, _ = transformation_utils.transform_postorder(tree, replace)
    if missing:
        raise KeyError(f"no StableHLO artifact for Xla parts {missing}")
    return tree.proto


# ------------------------------------------------------------------------ TF sessions


class TensorFlowPiece:
    """A TensorFlow computation proto imported once into its own graph and session;
    call it with flat tensors, get flat tensors (TFF's binding order)."""

    def __init__(self, comp_proto):
        t = comp_proto.tensorflow
        self.feeds = self._names(t.parameter) if t.HasField("parameter") else []
        self.fetches = self._names(t.result)
        self.graph = tf.Graph()
        with self.graph.as_default():
            tf.graph_util.import_graph_def(ser.unpack_graph_def(t.graph_def), name="")
        self.session = tf.compat.v1.Session(graph=self.graph)
        if t.initialize_op:
            self.session.run(t.initialize_op)

    @classmethod
    def _names(cls, binding) -> list:
        kind = binding.WhichOneof("binding")
        if kind == "tensor":
            return [binding.tensor.tensor_name]
        if kind == "struct":
            return [n for e in binding.struct.element for n in cls._names(e)]
        if kind is None:
            return []
        raise TypeError(f"unsupported TensorFlow binding {kind}")

    def __call__(self, flat_args: list) -> list:
        if len(self.feeds) != len(flat_args):
            raise ValueError(f"the computation takes {len(self.feeds)} tensors, got "
                             f"{len(flat_args)}")
        if not self.fetches:
            return []
        return list(self.session.run(self.fetches,
                                     feed_dict=dict(zip(self.feeds, flat_args))))

    def close(self) -> None:
        self.session.close()


def count(t) -> int:
    return len(tensor_leaves(t))


def run_mrf(mrf, state: list, clients: list) -> tuple[list, list]:
    """One round of a MapReduceForm, each piece in a TF session (the order
    `get_computation_for_map_reduce_form` composes them in). The secure sums are summed
    in the clear here (their bounds are checked), as a secure aggregator would output."""
    p = {name: TensorFlowPiece(proto_of(getattr(mrf, name))) for name in MRF_PIECES}
    try:
        broadcast = p["prepare"](state)
        work_type = mrf.work.type_signature.result
        sizes = [count(e) for _, e in structure.iter_elements(work_type)]
        bounds = [p[name]([]) for name in ("secure_sum_bitwidth", "secure_sum_max_input",
                                            "secure_modular_sum_modulus")]
        acc = p["zero"]([])
        secure = [None, None, None]
        for data in clients:
            out = p["work"](list(data) + list(broadcast))
            parts, start = [], 0
            for size in sizes:
                parts.append(out[start:start + size])
                start += size
            # One accumulator per client, merged in order: both halves of the form run.
            acc = p["merge"](acc + p["accumulate"](p["zero"]([]) + parts[0]))
            for k, values in enumerate(parts[1:]):
                check_secure_bounds(k, values, bounds[k])
                secure[k] = values if secure[k] is None else [
                    a + b for a, b in zip(secure[k], values)]
        aggregate = p["report"](acc)
        for k in range(3):
            secure[k] = secure[k] or []
            if k == 2:
                secure[k] = [np.mod(v, m) for v, m in zip(secure[k], bounds[k])]
        out = p["update"](list(state) + aggregate + [x for s in secure for x in s])
    finally:
        for piece in p.values():
            piece.close()
    n_state = count(mrf.update.type_signature.result[0])
    return out[:n_state], out[n_state:]


def check_secure_bounds(kind: int, values: list, bounds: list) -> None:
    """A client's secure-sum inputs lie in [0, 2**bitwidth - 1] / [0, max_input]."""
    for v, b in zip(values, bounds):
        top = (2 ** int(b) - 1) if kind == 0 else b
        if kind < 2 and (np.any(v < 0) or np.any(v > top)):
            raise ValueError(f"a secure-sum input lies outside [0, {top}]")


# ------------------------------------------------------------------------ jobs


def write(path: str, proto) -> dict:
    data = proto.SerializeToString()
    with open(path, "wb") as f:
        f.write(data)
    return {"path": path, "bytes": len(data)}


def write_pieces(job: dict, form, prefix: str, names) -> dict:
    """Writes each named piece of `form` as `<prefix>.<name>.pb`; path, bytes and type."""
    pieces = {}
    for name in names:
        piece = getattr(form, name)
        pieces[name] = dict(write(os.path.join(job["out"], f"{prefix}.{name}.pb"),
                                  proto_of(piece)), type=str(piece.type_signature))
    return pieces


def fcp_contract(kind: str, form) -> list:
    """What FCP's plan builder would refuse in this (plain) form."""
    import fcp_forms

    return fcp_forms.contract(kind, form)


def build_daf(job: dict, comp) -> dict:
    t0 = time.perf_counter()
    daf = fu.get_distribute_aggregate_form_for_computation(comp)
    seconds = time.perf_counter() - t0
    pieces = write_pieces(job, daf, "daf", DAF_PIECES)
    back = fu.get_computation_for_distribute_aggregate_form(daf)
    rederived = write(os.path.join(job["out"], "daf.round.pb"), proto_of(back))
    return {"seconds": seconds, "pieces": pieces, "round": rederived,
            "round_type": str(back.type_signature),
            "same_type": back.type_signature.is_equivalent_to(comp.type_signature),
            "fcp_contract": fcp_contract("daf", daf)}


def build_mrf(job: dict, proto) -> dict:
    t0 = time.perf_counter()
    tf_round = job["tf_round"] = concrete(xla_to_tensorflow(proto, job.get("artifacts", {})))
    t1 = time.perf_counter()
    mrf = fu.get_map_reduce_form_for_computation(tf_round)
    t2 = time.perf_counter()
    pieces = write_pieces(job, mrf, "mrf", MRF_PIECES)
    back = fu.get_computation_for_map_reduce_form(mrf)
    rederived = write(os.path.join(job["out"], "mrf.round.pb"), proto_of(back))
    result = {"xla_to_tf_seconds": t1 - t0, "seconds": t2 - t1, "pieces": pieces,
              "round": rederived, "round_type": str(back.type_signature),
              "same_type": back.type_signature.is_equivalent_to(tf_round.type_signature),
              "fcp_contract": fcp_contract("mrf", mrf)}
    run = job.get("run_mrf")
    if run:
        with np.load(run["inputs"]) as z:
            state = [z[f"state.{i}"] for i in range(int(z["num_state"]))]
            clients = [[z[f"client.{j}.{i}"] for i in range(int(z["num_client_leaves"]))]
                       for j in range(int(z["num_clients"]))]
        t3 = time.perf_counter()
        new_state, output = run_mrf(mrf, state, clients)
        result["run_seconds"] = time.perf_counter() - t3
        np.savez(run["outputs"], **{f"state.{i}": v for i, v in enumerate(new_state)},
                 **{f"output.{i}": v for i, v in enumerate(output)})
        result["outputs"] = run["outputs"]
    return result


def build_fcp(job: dict, proto) -> dict:
    """The FCP forms (`fcp_forms`): per form its pieces (`OUT/fcp_KIND.PIECE.pb`), the
    re-derived round, what FCP's builder would refuse (`contract`, empty when built
    right); with `run`, the MRF's plan-shaped rounds (`plan_run`)."""
    import fcp_forms
    import plan_run
    import plan_run_daf

    spec = job["fcp"]
    t0 = time.perf_counter()
    # The client parts lowered for TFLite (`spec["artifacts"]`) replace the plain ones.
    artifacts = dict(job.get("artifacts", {}), **spec.get("artifacts", {}))
    tf_round = concrete(xla_to_tensorflow(proto, artifacts)) if spec.get("artifacts") \
        else job.get("tf_round") or concrete(xla_to_tensorflow(proto, artifacts))
    round_fn, info = fcp_forms.fcp_round(tf_round, spec.get("aggregated_as"))
    result = {"info": info, "type": str(round_fn.type_signature),
              "wrap_seconds": time.perf_counter() - t0}
    for kind in spec.get("forms", ("mrf", "daf")):
        try:
            t0 = time.perf_counter()
            if kind == "mrf":
                form = fu.get_map_reduce_form_for_computation(round_fn)
                back = fu.get_computation_for_map_reduce_form(form)
            else:
                form = fcp_forms.encode_intermediate(
                    fu.get_distribute_aggregate_form_for_computation(round_fn))
                back = fu.get_computation_for_distribute_aggregate_form(form)
            entry = {"seconds": time.perf_counter() - t0,
                     "pieces": write_pieces(job, form, f"fcp_{kind}",
                                            MRF_PIECES if kind == "mrf" else DAF_PIECES),
                     "round": write(os.path.join(job["out"], f"fcp_{kind}.round.pb"),
                                    proto_of(back)),
                     "round_type": str(back.type_signature),
                     "same_type": back.type_signature.is_equivalent_to(
                         round_fn.type_signature),
                     "contract": fcp_forms.contract(kind, form)}
            run = spec.get("run")
            if run:
                with np.load(run["state"]) as z:
                    state = [z[f"state.{i}"] for i in range(int(z["num_state"]))]
                t1 = time.perf_counter()
                runner = plan_run if kind == "mrf" else plan_run_daf
                values = runner.run_rounds(form, state, run["examples"], run["rounds"],
                                           os.path.join(job["out"], f"plan_{kind}"))
                entry["run_seconds"] = time.perf_counter() - t1
                outputs = run["outputs"].replace(".npz", f"_{kind}.npz")
                np.savez(outputs, **values)
                entry["outputs"] = outputs
            if run and kind == "mrf" and spec.get("tflite"):
                entry["tflite"] = run_tflite(form, state, run, job["out"])
            result[kind] = entry
        except Exception as e:  # reported per job and form, never raised
            result[kind] = {"error": f"{type(e).__name__}: {e}",
                            "traceback": traceback.format_exc()[-3000:]}
    if spec.get("tf_examples"):
        result["tf_examples"] = write_tf_examples(spec["tf_examples"], info["features"])
    return result


def run_tflite(mrf, state: list, run: dict, out: str) -> dict:
    """The FCP MRF's plan-shaped rounds with the client work converted by TF's TFLite
    converter and run by `tf.lite.Interpreter` (`tflite_client`); never raises."""
    import plan_run
    import tflite_client

    made = []

    def client(work, bcast_t, scope):
        t0 = time.perf_counter()
        phase = tflite_client.ClientPhase(work, bcast_t, scope)
        made.append((phase, time.perf_counter() - t0))
        return phase

    try:
        t0 = time.perf_counter()
        values = plan_run.run_rounds(mrf, state, run["examples"], run["rounds"],
                                     os.path.join(out, "plan_tflite"), client=client)
        outputs = run["outputs"].replace(".npz", "_mrf_tflite.npz")
        np.savez(outputs, **values)
        phase, convert_seconds = made[0]
        return {"outputs": outputs, "ops": phase.ops, "bytes": len(phase.model),
                "convert_seconds": convert_seconds,
                "run_seconds": time.perf_counter() - t0 - convert_seconds}
    except Exception as e:  # the client work does not convert or run: named, not raised
        return {"error": f"{type(e).__name__}: {e}"[-3000:],
                "traceback": traceback.format_exc()[-3000:]}


def write_tf_examples(path: str, features: list) -> dict:
    """One record written by TensorFlow's own writer (`tf.train.Example`), each feature
    counting up from 0 (as floats or int64; an integer or bool feature's count wraps at
    its dtype's range, which the reader holds values to), for the main side to read
    back."""
    feature = {}
    for f in features:
        n = int(np.prod(f["shape"], dtype=np.int64))
        if f["kind"] == "float":
            feature[f["name"]] = tf.train.Feature(float_list=tf.train.FloatList(
                value=np.arange(n, dtype=np.float32) / 4))
        else:
            dtype = np.dtype(f["dtype"])
            top = 1 if dtype == np.bool_ else int(np.iinfo(dtype).max)
            feature[f["name"]] = tf.train.Feature(int64_list=tf.train.Int64List(
                value=np.arange(n, dtype=np.int64) % (top + 1) if top < n else
                np.arange(n, dtype=np.int64)))
    example = tf.train.Example(features=tf.train.Features(feature=feature))
    with tf.io.TFRecordWriter(path) as w:
        w.write(example.SerializeToString())
    return {"path": path}


def run_job(job: dict) -> dict:
    os.makedirs(job["out"], exist_ok=True)
    with open(job["proto"], "rb") as f:
        proto = pb.Computation.FromString(f.read())
    comp = concrete(proto)
    results = {"type": str(comp.type_signature)}
    for form, build in (("daf", lambda: build_daf(job, comp)),
                        ("mrf", lambda: build_mrf(job, proto))):
        if form not in job.get("forms", ()):
            continue
        try:
            results[form] = build()
        except Exception as e:  # reported per job and form, never raised
            results[form] = {"error": f"{type(e).__name__}: {e}",
                             "traceback": traceback.format_exc()[-3000:]}
    if job.get("fcp"):
        try:
            results["fcp"] = build_fcp(job, proto)
        except Exception as e:  # the round has no FCP form: named, never raised
            results["fcp"] = {"error": f"{type(e).__name__}: {e}",
                              "traceback": traceback.format_exc()[-3000:]}
    return results


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__, file=sys.stderr)
        return 0 if argv else 2
    real_stdout = os.dup(1)
    os.dup2(2, 1)  # whatever TF or TFF print goes to stderr
    try:
        try:
            _imports()
        except Exception as e:
            print(f"build_forms.py: cannot import TFF 0.87 ({e}); build .venv-tff with "
                  "tools/tff087/setup.sh.", file=sys.stderr)
            return 2
        with open(argv[0]) as f:
            jobs = json.load(f)["jobs"]
        out = {job["name"]: run_job(job) for job in jobs}
    finally:
        sys.stdout.flush()
        os.dup2(real_stdout, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
