"""The committed gRPC modules under fax_bridge/v1/ match what protos/ generates."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_protos", REPO / "tools" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_modules_are_current(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("grpc_tools")
    generated = _load_generator().generate(tmp_path)
    assert pathlib.Path("fax_bridge/v1/device_pb2.py") in generated
    for path in generated:
        fresh = (tmp_path / path).read_bytes()
        committed = REPO / path
        assert committed.exists(), f"{path} is not committed; run `make protos`"
        assert committed.read_bytes() == fresh, f"{path} is stale; run `make protos`"


def test_service_lists_every_operation() -> None:
    from fax_bridge.v1 import device_pb2

    service = device_pb2.DESCRIPTOR.services_by_name["Device"]
    assert sorted(m.name for m in service.methods) == sorted(
        ["Health", "Load", "Put", "Broadcast", "Map", "Zip", "Aggregate", "Fetch", "Release",
         "Round", "RoundOnce"])
    assert device_pb2.DESCRIPTOR.package == "fax_bridge.v1"
