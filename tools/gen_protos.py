"""Generates the Python gRPC modules of protos/ (run as `make protos`).

Runs grpc_tools.protoc with `-I protos` so that protos/fax_bridge/v1/device.proto
becomes fax_bridge/v1/device_pb2.py, device_pb2.pyi and device_pb2_grpc.py under the
output root (the repository root unless --out says otherwise). The generated files are
committed; tests/test_fleet_protos.py checks they match the .proto sources.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Optional, Sequence

REPO = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "protos"


def proto_sources(root: pathlib.Path = PROTO_ROOT) -> list[pathlib.Path]:
    """Every .proto file under `root`, sorted, relative to it."""
    return sorted(p.relative_to(root) for p in root.rglob("*.proto"))


def generate(out: pathlib.Path) -> list[pathlib.Path]:
    """Writes the generated modules under `out`; returns their paths relative to it."""
    from grpc_tools import protoc  # imported here: only needed to (re)generate

    import importlib.resources

    sources = proto_sources()
    if not sources:
        raise SystemExit(f"no .proto files under {PROTO_ROOT}")
    out.mkdir(parents=True, exist_ok=True)
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *(str(s) for s in sources),
    ]
    code = protoc.main(args)
    if code != 0:
        raise SystemExit(f"grpc_tools.protoc failed (exit {code}) on {sources}")
    generated = []
    for source in sources:
        stem = source.with_suffix("")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            path = stem.parent / (stem.name + suffix)
            if (out / path).exists():
                generated.append(path)
    return generated


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line: `python tools/gen_protos.py [--out DIR]`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=REPO,
                        help="output root (default: the repository root)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
