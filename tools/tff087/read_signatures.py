"""Prints the TFF 0.87 type signature of serialized `Computation` protos, as one JSON object.

Runs inside `.venv-tff` (build it with tools/tff087/setup.sh):

    .venv-tff/bin/python tools/tff087/read_signatures.py A.pb [B.pb ...]

Each file is deserialized with TFF's own proto class and building blocks
(`ComputationBuildingBlock.from_proto`, which type-checks every call and intrinsic), and
stdout receives exactly one JSON object:

    {"A.pb": {"type_signature": "(... -> ...)", "error": null}, "B.pb": {..., "error": "..."}}

A file that cannot be read or deserialized gets `type_signature: null` and its error;
the exit status is then still 0. Status 2 means TFF itself could not be imported.
Everything TensorFlow or jax print goes to stderr, so stdout stays parseable.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
warnings.filterwarnings("ignore")


def read_signature(path: str) -> dict:
    """Returns {"type_signature": str|None, "error": str|None} for one .pb file."""
    from tensorflow_federated.proto.v0 import computation_pb2
    from tensorflow_federated.python.core.impl.compiler import building_blocks

    try:
        with open(path, "rb") as f:
            data = f.read()
        proto = computation_pb2.Computation.FromString(data)
        block = building_blocks.ComputationBuildingBlock.from_proto(proto)
        return {"type_signature": str(block.type_signature), "error": None}
    except Exception as e:  # every failure is reported per file, never raised
        return {"type_signature": None, "error": f"{type(e).__name__}: {e}"}


def main(argv: list[str]) -> int:
    """Reads each path in argv and writes the JSON object to the real stdout."""
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__, file=sys.stderr)
        return 0 if argv else 2
    # Anything printed while importing or reading (C++ logs included) goes to stderr.
    real_stdout = os.dup(1)
    os.dup2(2, 1)
    try:
        try:
            import tensorflow_federated  # noqa: F401
        except Exception as e:
            print(f"read_signatures.py: cannot import tensorflow_federated ({e}). Run this "
                  "script with .venv-tff/bin/python, built by tools/tff087/setup.sh.",
                  file=sys.stderr)
            return 2
        result = {path: read_signature(path) for path in argv}
        sys.stdout.flush()
    finally:
        os.dup2(real_stdout, 1)
        os.close(real_stdout)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
