"""The client work of an FCP form as TensorFlow Lite, run the way a device runs it.

Imported by `build_forms.py` (a job's `"fcp": {"tflite": true}`), inside the TFF 0.87
environment. Federated Compute's devices run a plan's client graph as TFLite: TF's converter
(`tf.lite.TFLiteConverter`, TF 2.14) with TFLite builtins and the TensorFlow (Flex) ops of
`ALLOWED_TF_OPS` only, what the device's runtime provides for datasets, `tf.Example`
parsing and checkpoints. TF 2.14's Flex ops lack the dataset op that takes the client's
one example out (`DatasetToSingleElement`), so the model starts where the example store
hands over: `convert(work, broadcast_types)` converts the form's client work from its
parsed example on (its `XlaCallModule`s legalized into builtins) as one function
`(parsed example leaves..., broadcast leaves...) -> update leaves`, and refuses a model
with any other Flex or custom op, naming it. `ClientPhase` is `plan_run.ClientPhase`
with that part run by `tf.lite.Interpreter`: the broadcast restored from its checkpoint
and the client's examples read from its TFRecord file and parsed by the work's own
TensorFlow ops, the update saved to a checkpoint, so `plan_run.run_rounds(...,
client=ClientPhase)` runs whole rounds with TFLite clients.
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow_federated.python.tensorflow_libs import serialization_utils as ser

from plan_run import binding_names, names, restore, save

# TensorFlow ops a device's TFLite client may run as Flex ops: the client's data as a
# dataset of serialized tf.Examples and their parsing (FCP's example store), checkpoints.
ALLOWED_TF_OPS = frozenset({
    "TensorSliceDataset", "MapDataset", "ParallelMapDatasetV2", "DatasetToSingleElement",
    "ReduceDataset", "TakeDataset", "BatchDatasetV2", "PrefetchDataset",
    "TFRecordDataset", "ExternalDataset", "ParseExampleV2", "ParseSingleExample",
    "ParseExample", "Save", "SaveSlices", "SaveV2", "Restore", "RestoreSlice",
    "RestoreV2", "StringJoin", "DeleteFile"})


def _parsed(graph_def) -> tuple[str, list]:
    """(the node that takes the one parsed example out of the client's dataset, its
    output specs): where the device's example store hands over."""
    nodes = [n for n in graph_def.node if n.op == "DatasetToSingleElement"]
    if len(nodes) != 1:
        raise ValueError(f"the client work takes its examples out of {len(nodes)} datasets, "
                         "not one")
    node = nodes[0]
    types = [tf.as_dtype(t) for t in node.attr["output_types"].list.type]
    shapes = [tf.TensorShape(s) for s in node.attr["output_shapes"].list.shape]
    return node.name, [tf.TensorSpec(s, t) for s, t in zip(shapes, types)]


class _Work:
    """The form's client work: its graph, feeds, fetches and the parsed example's specs."""

    def __init__(self, work):
        from build_forms import proto_of

        t = proto_of(work).tensorflow
        self.feeds = binding_names(t.parameter)
        self.fetches = binding_names(t.result)
        self.graph_def = ser.unpack_graph_def(t.graph_def)
        self.node, self.parsed = _parsed(self.graph_def)

    def model_function(self, bcast_t: list):
        """(parsed example leaves..., broadcast leaves...) -> update leaves, the dataset
        and parsing cut off: a concrete function for the converter."""
        specs = self.parsed + [tf.TensorSpec(x.shape, tf.as_dtype(x.dtype)) for x in bcast_t]

        def client(*args):
            mapping = {f"{self.node}:{i}": a for i, a in enumerate(args[:len(self.parsed)])}
            mapping.update(zip(self.feeds[1:], args[len(self.parsed):]))
            return tf.graph_util.import_graph_def(self.graph_def, input_map=mapping,
                                                  return_elements=self.fetches, name="work")

        wrapped = tf.compat.v1.wrap_function(client, specs)
        inputs = [wrapped.graph.get_tensor_by_name(x.name) for x in wrapped.inputs]
        return wrapped.prune(inputs, wrapped.outputs)


def model_ops(model: bytes) -> list:
    """The op names of a TFLite model, every subgraph's (a WHILE's body too): builtins
    by name, Flex and custom ops by their custom code (`FlexOpName`)."""
    from tensorflow.lite.python import schema_py_generated as schema

    root = schema.Model.GetRootAsModel(model, 0)
    builtins = {v: k for k, v in vars(schema.BuiltinOperator).items() if not k.startswith("_")}
    codes = []
    for i in range(root.OperatorCodesLength()):
        code = root.OperatorCodes(i)
        number = max(code.BuiltinCode(), code.DeprecatedBuiltinCode())
        codes.append(code.CustomCode().decode() if code.CustomCode()
                     else builtins.get(number, str(number)))
    return sorted({codes[graph.Operators(j).OpcodeIndex()]
                   for graph in (root.Subgraphs(k) for k in range(root.SubgraphsLength()))
                   for j in range(graph.OperatorsLength())})


def convert(work, bcast_t: list) -> tuple[bytes, list, list, list]:
    """(the client work from its parsed example on as a TFLite model, its op names, its
    input and output tensor names in the function's order); raises naming any Flex or
    custom op outside `ALLOWED_TF_OPS`."""
    fn = _Work(work).model_function(bcast_t)
    converter = tf.lite.TFLiteConverter.from_concrete_functions([fn])
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS,
                                           tf.lite.OpsSet.SELECT_TF_OPS]
    model = converter.convert()
    ops = model_ops(model)
    from tensorflow.lite.python import schema_py_generated as schema

    builtins = {k for k in vars(schema.BuiltinOperator) if not k.startswith("_")}
    extra = [op for op in ops if op not in builtins
             and not (op.startswith("Flex") and op[4:] in ALLOWED_TF_OPS)]
    if extra:
        raise ValueError(f"the client work's TFLite model needs TensorFlow ops {extra}, "
                         f"which an FCP device's TFLite client does not provide")
    return model, ops, [t.name.split(":")[0] for t in fn.inputs], \
        [t.name.split(":")[0] for t in fn.outputs]


class ClientPhase:
    """`plan_run.ClientPhase` with the client work run as TFLite (module docstring)."""

    def __init__(self, work, bcast_t: list, scope: str):
        self.work = _Work(work)
        self.model, self.ops, ins, outs = convert(work, bcast_t)
        self.interpreter = tf.lite.Interpreter(model_content=self.model)
        # The interpreter lists inputs and outputs in the function's order (an output
        # that is another one's tensor listed twice).
        inputs = self.interpreter.get_input_details()
        details = self.interpreter.get_output_details()
        if [d["name"] for d in inputs] != ins or len(details) != len(outs):
            raise ValueError(f"the TFLite model's inputs {[d['name'] for d in inputs]} "
                             f"and {len(details)} outputs are not the function's {ins}, "
                             f"{len(outs)}")
        self.inputs = [d["index"] for d in inputs]
        self.outputs = [d["index"] for d in details]
        self.graph = tf.Graph()
        with self.graph.as_default():
            self.bcast, self.examples, self.out = (
                tf.compat.v1.placeholder(tf.string, [], n)
                for n in ("broadcast_in", "examples", "update_out"))
            self.restored = restore(self.bcast, names("client", len(bcast_t)), bcast_t)
            data = tf.data.experimental.to_variant(tf.data.TFRecordDataset(self.examples))
            self.parse = tf.graph_util.import_graph_def(
                self.work.graph_def, input_map={self.work.feeds[0]: data},
                return_elements=[f"{self.work.node}:{i}"
                                 for i in range(len(self.work.parsed))], name="parse")
            self.values = [tf.compat.v1.placeholder(d["dtype"], d["shape"])
                           for d in details]
            self.save = save(self.out, names("update", len(self.values)), self.values)
        self.sess = tf.compat.v1.Session(graph=self.graph)

    def run(self, bcast_path: str, examples_path: str, out_path: str) -> None:
        broadcast, parsed = self.sess.run(
            [self.restored, list(self.parse)],
            {self.bcast: bcast_path, self.examples: examples_path})
        it = self.interpreter
        it.allocate_tensors()
        for index, value in zip(self.inputs, list(parsed) + list(broadcast)):
            it.set_tensor(index, value)
        it.invoke()
        update = [it.get_tensor(i) for i in self.outputs]
        self.sess.run(self.save, {self.out: out_path, **dict(zip(self.values, update))})

    def close(self) -> None:
        self.sess.close()
