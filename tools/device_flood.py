"""Hostile request floods against one device process on 127.0.0.1, with its memory,
descriptors and answer times measured before and after.

    python tools/device_flood.py                 # the `make fuzz` sizes
    python tools/device_flood.py --scale 0.05    # a quick run

Each attack starts a fresh device subprocess (`python -m fax_bridge.fleet.device_cli`) and
prints one JSON line: what was sent, how the device answered, its resident memory
(VmRSS) before and after and its peak (VmHWM), the descriptors it holds, and whether it
still answers Health. Everything is bounded (request counts, sizes, timeouts) and goes to
127.0.0.1 only. Exit status 0 when every attack was refused as the device's bounds say.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

import grpc
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # sample_computations

from fax_bridge.fleet import security  # noqa: E402
from fax_bridge.rounds import wire  # noqa: E402
from fax_bridge.runtime.local_eval import content_hash  # noqa: E402
from fax_bridge.v1 import device_pb2 as pb  # noqa: E402
from sample_computations import scaled_aggregate  # noqa: E402
from fax_bridge.v1 import device_pb2_grpc as pb_grpc  # noqa: E402

MB = 1 << 20


class Device:
    """A device subprocess on 127.0.0.1 with a fresh token; `flags` go to its command line."""

    def __init__(self, *flags: str):
        self.token = security.new_token()
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
                   **{security.TOKEN_ENV: self.token})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fax_bridge.fleet.device_cli", "--listen", "127.0.0.1:0",
             *flags], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the device did not start")
        self.port = json.loads(line)["port"]
        self.address = f"127.0.0.1:{self.port}"
        self.metadata = security.call_metadata(self.token)

    def status(self, key: str) -> int:
        """A /proc/PID/status field in bytes (VmRSS, VmHWM)."""
        for line in pathlib.Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        return 0

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def snapshot(self) -> dict:
        return {"rss_mb": round(self.status("VmRSS") / MB, 1), "fds": self.fds()}

    def stub(self, channel) -> pb_grpc.DeviceStub:
        return pb_grpc.DeviceStub(channel)

    def healthy(self) -> bool:
        with grpc.insecure_channel(self.address) as channel:
            try:
                answer = self.stub(channel).Health(pb.HealthRequest(), timeout=10,
                                                   metadata=self.metadata)
            except grpc.RpcError:
                return False
        return answer.status == "SERVING"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.proc.stdout.close()


def _channel(address: str, max_bytes: int = 1 << 30) -> grpc.Channel:
    return grpc.insecure_channel(address, options=[
        ("grpc.max_send_message_length", max_bytes),
        ("grpc.max_receive_message_length", max_bytes)])


def _parallel(count: int, call: Callable[[int], object]) -> list:
    results: list = [None] * count

    def run(i):
        try:
            results[i] = call(i)
        except Exception as e:  # recorded, judged by the caller
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


def _code(result) -> str:
    return result.code().name if isinstance(result, grpc.RpcError) else type(result).__name__


def unauthenticated_flood(size_mb: int = 600, concurrent: int = 4) -> dict:
    """`concurrent` Broadcasts of `size_mb` MB each without the token, all at once."""
    device = Device()
    try:
        before = device.snapshot()
        value = pb.Value(tensor=pb.Tensor(dtype="uint8", shape=[size_mb * MB],
                                          data=b"\0" * (size_mb * MB)))
        request = pb.BroadcastRequest(handle=1, value=value, client_ids=[0])
        with _channel(device.address) as channel:
            stub = device.stub(channel)

            def call(i):
                start = time.monotonic()
                try:
                    stub.Broadcast(request, timeout=60)
                except grpc.RpcError as e:
                    return e, time.monotonic() - start
                return None, time.monotonic() - start

            results = _parallel(concurrent, call)
        codes = [_code(r[0]) if isinstance(r, tuple) else _code(r) for r in results]
        seconds = [r[1] for r in results if isinstance(r, tuple)]
        after = device.snapshot()
        with _channel(device.address) as channel:  # a small one: the device's own time
            start = time.monotonic()
            try:
                device.stub(channel).Health(pb.HealthRequest(), timeout=10)
            except grpc.RpcError:
                pass
            small = time.monotonic() - start
        return {"attack": "unauthenticated Broadcast flood", "requests": concurrent,
                "request_mb": size_mb, "codes": sorted(set(codes)),
                "max_seconds_to_refuse": round(max(seconds), 3) if seconds else None,
                "seconds_to_refuse_a_small_call": round(small, 4),
                "before": before, "after": after,
                "peak_rss_mb": round(device.status("VmHWM") / MB, 1),
                "healthy_after": device.healthy(),
                "ok": set(codes) == {"UNAUTHENTICATED"}}
    finally:
        device.close()


def idle_connections(count: int = 20000, max_connections: int = 64) -> dict:
    """`count` TCP connections that never speak, while a coordinator's channel is open.

    The coordinator's established channel must keep working during the flood; new
    connections must be served again once the silent ones pass the handshake timeout.
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < count + 256 <= hard or (hard == resource.RLIM_INFINITY and soft < count + 256):
        resource.setrlimit(resource.RLIMIT_NOFILE, (count + 256, hard))
    count = min(count, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 256)
    device = Device("--max-connections", str(max_connections))
    sockets = []
    try:
        before = device.snapshot()
        with _channel(device.address) as channel:
            stub = device.stub(channel)
            stub.Health(pb.HealthRequest(), timeout=10, metadata=device.metadata)
            for _ in range(count):
                try:
                    sockets.append(socket.create_connection(("127.0.0.1", device.port),
                                                            timeout=5))
                except OSError:
                    break
            time.sleep(0.5)
            during = device.snapshot()
            try:
                established = stub.Health(pb.HealthRequest(), timeout=10,
                                          metadata=device.metadata).status == "SERVING"
            except grpc.RpcError:
                established = False
        start = time.monotonic()
        while not device.healthy() and time.monotonic() - start < 60:
            time.sleep(0.5)
        recovered = time.monotonic() - start
        return {"attack": "idle TCP connections", "opened": len(sockets),
                "max_connections": max_connections, "before": before, "during": during,
                "established_channel_served": established,
                "seconds_until_new_connections_served": round(recovered, 2),
                "ok": established and recovered < 60
                and during["fds"] <= before["fds"] + max_connections + 8}
    finally:
        for s in sockets:
            s.close()
        device.close()


def broadcast_ids(count: int = 20_000_000) -> dict:
    """An authenticated Broadcast naming `count` client ids."""
    device = Device()
    try:
        before = device.snapshot()
        request = pb.BroadcastRequest(handle=1, value=wire.to_message(np.float32(1)),
                                      client_ids=range(count))
        with _channel(device.address) as channel:
            start = time.monotonic()
            try:
                device.stub(channel).Broadcast(request, timeout=60, metadata=device.metadata)
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
            seconds = time.monotonic() - start
        return {"attack": "Broadcast to many client ids", "client_ids": count, "code": code,
                "seconds_to_refuse": round(seconds, 3), "before": before,
                "after": device.snapshot(), "healthy_after": device.healthy(),
                "ok": code == "RESOURCE_EXHAUSTED"}
    finally:
        device.close()


def map_outputs(clients: int = 200_000, max_stored_mb: int = 20) -> dict:
    """A Map whose results (12 bytes per client) outgrow `--max-stored-bytes`."""
    device = Device("--max-stored-bytes", str(max_stored_mb * MB))
    try:
        fn = _first_xla(scaled_aggregate((3,), "sum"))  # its per-client part
        data = fn.SerializeToString(deterministic=True)
        before = device.snapshot()
        with _channel(device.address) as channel:
            stub = device.stub(channel)
            md = device.metadata
            stub.Load(pb.LoadRequest(computation_hash=content_hash(fn), computation=data),
                      timeout=60, metadata=md)
            arg = wire.to_message(_arg_of(fn))
            stub.Broadcast(pb.BroadcastRequest(handle=1, value=arg, client_ids=range(clients)),
                           timeout=60, metadata=md)
            start = time.monotonic()
            try:
                stub.Map(pb.MapRequest(computation_hash=content_hash(fn), arg=1, result=2),
                         timeout=600, metadata=md)
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
            seconds = time.monotonic() - start
        return {"attack": "Map outgrowing --max-stored-bytes", "clients": clients,
                "max_stored_mb": max_stored_mb, "code": code, "seconds": round(seconds, 3),
                "before": before, "after": device.snapshot(),
                "peak_rss_mb": round(device.status("VmHWM") / MB, 1),
                "healthy_after": device.healthy(), "ok": code == "RESOURCE_EXHAUSTED"}
    finally:
        device.close()


def _first_xla(proto):
    """The first Xla computation inside `proto` (a per-client function)."""
    from google.protobuf import message

    stack = [proto]
    while stack:
        m = stack.pop()
        if getattr(m, "DESCRIPTOR", None) is not None and m.DESCRIPTOR.name == "Computation" \
                and m.WhichOneof("computation") == "xla":
            return m
        for field, value in m.ListFields():
            if field.message_type is None:
                continue
            stack.extend([value] if isinstance(value, message.Message) else list(value))
    raise RuntimeError("no Xla part")


def _arg_of(fn):
    from fax_bridge.runtime import local_eval

    t = local_eval.parse_type(fn.type).parameter
    return local_eval.zeros_of_type(t)


def sigterm_during_delays(workers: int = 4) -> dict:
    """`workers` Maps asking for the longest delay, then SIGTERM: how long until exit."""
    device = Device("--max-workers", str(workers))
    try:
        proto = scaled_aggregate((3,), "sum")
        fn = _first_xla(proto)
        with _channel(device.address) as channel:
            stub = device.stub(channel)
            md = device.metadata
            stub.Load(pb.LoadRequest(computation_hash=content_hash(fn),
                                     computation=fn.SerializeToString(deterministic=True)),
                      timeout=60, metadata=md)
            stub.Broadcast(pb.BroadcastRequest(handle=1, value=wire.to_message(_arg_of(fn)),
                                               client_ids=[0]), timeout=60, metadata=md)
            key = content_hash(fn)
            calls = [stub.Map.future(pb.MapRequest(computation_hash=key, arg=1, result=10 + i,
                                                   delay_seconds=600.0),
                                     timeout=900, metadata=md) for i in range(workers)]
            time.sleep(1.0)
            start = time.monotonic()
            device.proc.terminate()
            try:
                device.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
            seconds = time.monotonic() - start
            for c in calls:
                c.cancel()
        exited = device.proc.poll() is not None
        return {"attack": "SIGTERM while every worker sleeps in a Map delay",
                "workers": workers, "exited": exited, "seconds_to_exit": round(seconds, 3),
                "ok": exited}
    finally:
        device.close()


ATTACKS = {
    "unauthenticated": lambda s: unauthenticated_flood(max(1, int(600 * s)), 4),
    "connections": lambda s: idle_connections(max(64, int(20000 * s)), 64),
    "broadcast_ids": lambda s: broadcast_ids(max(2_000_000, int(20_000_000 * s))),
    "map_outputs": lambda s: map_outputs(max(10_000, int(200_000 * s)),
                                         max(1, int(20 * s))),
    "sigterm": lambda s: sigterm_during_delays(4),
}


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0,
                        help="size factor of every attack (1: the recorded sizes)")
    parser.add_argument("--only", choices=sorted(ATTACKS), action="append")
    args = parser.parse_args(argv)
    ok = True
    for name in args.only or list(ATTACKS):
        result = ATTACKS[name](args.scale)
        ok &= bool(result["ok"])
        print(json.dumps(result), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
