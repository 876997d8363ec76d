"""Writes federated computations authored by TensorFlow Federated 0.87 into tests/data/tff087/.

Runs inside `.venv-tff` (build it with tools/tff087/setup.sh):

    .venv-tff/bin/python tools/tff087/make_testdata.py [--out DIR]

Local parts are `tff.jax.computation`s (serialized as `Xla` computations holding an
`xla.HloModuleProto`), the federated structure is a `tff.federated_computation`. For each
case NAME it writes:

- `NAME.pb`: the serialized `Computation` proto;
- `NAME.json`: its TFF type signature, the number of clients the sample data uses, the
  intrinsic URIs the proto holds and a one-line description;
- `NAME.inputs.npz` / `NAME.expected.npz`: concrete inputs and the result, the latter
  computed independently in numpy (TFF's C++ runtime cannot execute Xla computations,
  so nothing here is executed by TFF).

npz keys are the dotted paths of the element names of the parameter (the element index
where unnamed; `arg` when the parameter is not a struct) and likewise of the result
(`result` when it is not a struct). CLIENTS-placed values carry a leading clients axis.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import warnings
from typing import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "tests" / "data" / "tff087"


@dataclasses.dataclass
class Case:
    """One test computation: how to build it and its sample data."""

    name: str
    description: str
    clients: int
    build: Callable[[], object]  # returns a TFF computation
    inputs: dict[str, np.ndarray]
    expected: dict[str, np.ndarray]


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _f32(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32)


def _cases() -> list[Case]:
    """Defines every case; TFF and jax are imported here, after the quiet settings."""
    import jax.numpy as jnp
    import tensorflow_federated as tff

    cases: list[Case] = []

    # 1. broadcast -> map -> sum (the parameter is a single SERVER tensor: key `arg`).
    v3 = tff.TensorType(np.float32, [3])

    def build_broadcast_map_sum():
        @tff.jax.computation(v3)
        def affine(x):
            return 2.0 * x + 1.0

        @tff.federated_computation(tff.FederatedType(v3, tff.SERVER))
        def broadcast_map_sum(x):
            return tff.federated_sum(tff.federated_map(affine, tff.federated_broadcast(x)))

        return broadcast_map_sum

    x = _f32([0.5, -1.0, 2.0])
    n = 4
    cases.append(Case(
        name="broadcast_map_sum",
        description="broadcast a server vector, map 2x+1 at each client, sum at the server",
        clients=n,
        build=build_broadcast_map_sum,
        inputs={"arg": x},
        expected={"result": _f32(n * (2.0 * x + 1.0))},
    ))

    # 2. map -> federated_mean.
    v2 = tff.TensorType(np.float32, [2])

    def build_federated_mean():
        @tff.jax.computation(v2)
        def shift_scale(x):
            return 3.0 * x - 1.0

        @tff.federated_computation(tff.FederatedType(v2, tff.CLIENTS))
        def map_mean(x):
            return tff.federated_mean(tff.federated_map(shift_scale, x))

        return map_mean

    xc = _f32(_rng(1).normal(size=(3, 2)))
    cases.append(Case(
        name="federated_mean",
        description="map 3x-1 at each client, then the unweighted federated_mean",
        clients=3,
        build=build_federated_mean,
        inputs={"arg": xc},
        expected={"result": _f32(np.mean(3.0 * xc.astype(np.float64) - 1.0, axis=0))},
    ))

    # 3. federated_weighted_mean with a named struct parameter.
    def build_weighted_mean():
        @tff.federated_computation(
            tff.FederatedType(v2, tff.CLIENTS), tff.FederatedType(np.float32, tff.CLIENTS))
        def weighted_mean(values, weights):
            return tff.federated_mean(values, weights)

        return weighted_mean

    vals = _f32(_rng(2).normal(size=(5, 2)))
    wts = _f32([1.0, 2.0, 0.5, 4.0, 2.5])
    wm = (vals.astype(np.float64) * wts[:, None]).sum(axis=0) / wts.sum()
    cases.append(Case(
        name="federated_weighted_mean",
        description="federated_weighted_mean of client vectors by client scalar weights",
        clients=5,
        build=build_weighted_mean,
        inputs={"values": vals, "weights": wts},
        expected={"result": _f32(wm)},
    ))

    # 4. map over a zip of two client values; the local part takes a named struct.
    i3 = tff.TensorType(np.int32, [3])

    def build_zip_map_struct():
        @tff.jax.computation(tff.StructType([("a", v3), ("b", i3)]))
        def combine(a, b):
            return a * b.astype(jnp.float32) + 1.0

        @tff.federated_computation(tff.FederatedType(v3, tff.CLIENTS),
                                   tff.FederatedType(i3, tff.CLIENTS))
        def zip_map_struct(a, b):
            zipped = tff.federated_zip(tff.structure.Struct([("a", a), ("b", b)]))
            return tff.federated_sum(tff.federated_map(combine, zipped))

        return zip_map_struct

    za = _f32(_rng(3).normal(size=(3, 3)))
    zb = np.asarray([[1, 2, 3], [0, -1, 4], [2, 2, -2]], dtype=np.int32)
    cases.append(Case(
        name="zip_map_struct",
        description="federated_zip of a float and an int client value into <a,b>, map a*b+1, sum",
        clients=3,
        build=build_zip_map_struct,
        inputs={"a": za, "b": zb},
        expected={"result": _f32((za.astype(np.float64) * zb + 1.0).sum(axis=0))},
    ))

    # 5. Server-side work: sum at the server, then federated_apply of a local update.
    # The parameter is an unnamed struct, so its npz keys are element indices.
    def build_server_apply():
        @tff.jax.computation(v2, v2)
        def update(state, total):
            return state - 0.25 * total

        @tff.federated_computation(tff.StructType([
            tff.FederatedType(v2, tff.SERVER), tff.FederatedType(v2, tff.CLIENTS)]))
        def server_apply(arg):
            total = tff.federated_sum(arg[1])
            return tff.federated_map(update, tff.federated_zip((arg[0], total)))

        return server_apply

    s0 = _f32([1.0, -2.0])
    cs = _f32(_rng(5).normal(size=(4, 2)))
    cases.append(Case(
        name="server_apply",
        description=("federated_sum of client vectors, then federated_apply of "
                     "state - total/4 at the server"),
        clients=4,
        build=build_server_apply,
        inputs={"0": s0, "1": cs},
        expected={"result": _f32(s0 - 0.25 * cs.astype(np.float64).sum(axis=0))},
    ))

    # 6. federated_aggregate with jax zero/accumulate/merge/report.
    def build_aggregate():
        @tff.jax.computation
        def zero():
            return jnp.zeros([2], jnp.float32)

        @tff.jax.computation(v2, v2)
        def accumulate(acc, value):
            return acc + jnp.abs(value)

        @tff.jax.computation(v2, v2)
        def merge(a, b):
            return a + b

        @tff.jax.computation(v2)
        def report(acc):
            return 0.5 * acc

        @tff.federated_computation(tff.FederatedType(v2, tff.CLIENTS))
        def aggregate_abs(x):
            return tff.federated_aggregate(x, zero(), accumulate, merge, report)

        return aggregate_abs

    ax = _f32(_rng(6).normal(size=(3, 2)))
    cases.append(Case(
        name="federated_aggregate",
        description="federated_aggregate: zero 0, accumulate acc+|v|, merge a+b, report acc/2",
        clients=3,
        build=build_aggregate,
        inputs={"arg": ax},
        expected={"result": _f32(0.5 * np.abs(ax.astype(np.float64)).sum(axis=0))},
    ))

    # 7. federated_secure_sum_bitwidth (bitwidth 8, a literal in the proto).
    def build_secure_sum():
        @tff.federated_computation(tff.FederatedType(tff.TensorType(np.int32, [2]), tff.CLIENTS))
        def secure_sum_bitwidth(x):
            return tff.federated_secure_sum_bitwidth(x, 8)

        return secure_sum_bitwidth

    sx = np.asarray([[1, 7], [3, 0], [2, 5], [4, 1]], dtype=np.int32)
    cases.append(Case(
        name="secure_sum_bitwidth",
        description="federated_secure_sum_bitwidth of small client int vectors, bitwidth 8",
        clients=4,
        build=build_secure_sum,
        inputs={"arg": sx},
        expected={"result": sx.sum(axis=0).astype(np.int32)},
    ))

    # 8. Several outputs: a named (and nested) struct result, one element at CLIENTS.
    def build_multi_output():
        @tff.jax.computation(v2)
        def square(x):
            return x * x

        @tff.jax.computation(np.float32, v2)
        def scale(lr, m):
            return lr * m

        @tff.federated_computation(
            tff.FederatedType(v2, tff.CLIENTS),
            tff.FederatedType(np.float32, tff.CLIENTS),
            tff.FederatedType(np.float32, tff.SERVER))
        def multi_output(x, w, lr):
            squares = tff.federated_map(square, x)
            mean = tff.federated_mean(x)
            step = tff.federated_map(scale, tff.federated_zip((lr, mean)))
            return tff.structure.Struct([
                ("mean", mean),
                ("weighted", tff.federated_mean(squares, w)),
                ("stats", tff.structure.Struct([
                    ("total_weight", tff.federated_sum(w)),
                    ("step", step),
                ])),
                ("squares", squares),
            ])

        return multi_output

    mx = _f32(_rng(8).normal(size=(3, 2)))
    mw = _f32([1.0, 3.0, 2.0])
    mlr = _f32(0.1)
    mx64 = mx.astype(np.float64)
    cases.append(Case(
        name="multi_output",
        description=("named nested struct result: mean, weighted mean of squares, "
                     "<total_weight, lr*mean>, client squares"),
        clients=3,
        build=build_multi_output,
        inputs={"x": mx, "w": mw, "lr": mlr},
        expected={
            "mean": _f32(mx64.mean(axis=0)),
            "weighted": _f32((mx64 ** 2 * mw[:, None]).sum(axis=0) / mw.sum()),
            "stats.total_weight": _f32(mw.sum()),
            "stats.step": _f32(0.1 * mx64.mean(axis=0)),
            "squares": _f32(mx64 ** 2),
        },
    ))
    return cases


def _intrinsic_uris(message) -> list[str]:
    """Returns the sorted distinct intrinsic URIs anywhere in a Computation proto."""
    found: set[str] = set()

    def walk(msg):
        for field, value in msg.ListFields():
            if field.message_type is None:
                continue
            items = value if field.label == field.LABEL_REPEATED else [value]
            for item in items:
                if field.name == "intrinsic":
                    found.add(item.uri)
                walk(item)

    walk(message)
    return sorted(found)


def write_case(case: Case, out: pathlib.Path) -> str:
    """Builds, serializes and round-trips one case; returns its type signature string."""
    from tensorflow_federated.proto.v0 import computation_pb2
    from tensorflow_federated.python.core.impl.compiler import building_blocks
    from tensorflow_federated.python.core.impl.computation import computation_impl

    comp = case.build()
    data = computation_impl.ConcreteComputation.get_proto(comp).SerializeToString()
    proto = computation_pb2.Computation.FromString(data)
    signature = str(building_blocks.ComputationBuildingBlock.from_proto(proto).type_signature)
    if signature != str(comp.type_signature):
        raise RuntimeError(
            f"{case.name}: the deserialized signature {signature} differs from the traced "
            f"one {comp.type_signature}")
    (out / f"{case.name}.pb").write_bytes(data)
    meta = {
        "name": case.name,
        "type_signature": signature,
        "clients": case.clients,
        "intrinsics": _intrinsic_uris(proto),
        "description": case.description,
        "authored_by": "tensorflow-federated 0.87.0 (jax 0.4.13)",
    }
    (out / f"{case.name}.json").write_text(json.dumps(meta, indent=2) + "\n")
    np.savez(out / f"{case.name}.inputs.npz", **case.inputs)
    np.savez(out / f"{case.name}.expected.npz", **case.expected)
    return signature


def main(argv: list[str] | None = None) -> int:
    """Writes every case (or the ones named with --only) into the output folder."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT,
                        help=f"output folder (default: {DEFAULT_OUT.relative_to(REPO)})")
    parser.add_argument("--only", nargs="*", default=None, help="names of the cases to write")
    args = parser.parse_args(argv)
    try:
        import tensorflow_federated  # noqa: F401
    except ImportError as e:
        print(f"make_testdata.py: cannot import tensorflow_federated ({e}); run it with "
              ".venv-tff/bin/python after tools/tff087/setup.sh", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    cases = _cases()
    unknown = set(args.only or ()) - {c.name for c in cases}
    if unknown:
        print(f"make_testdata.py: unknown case(s) {sorted(unknown)}; known: "
              f"{[c.name for c in cases]}", file=sys.stderr)
        return 2
    for case in cases:
        if args.only and case.name not in args.only:
            continue
        signature = write_case(case, args.out)
        size = (args.out / f"{case.name}.pb").stat().st_size
        print(f"{case.name:24s} {size:6d} B  {signature}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
