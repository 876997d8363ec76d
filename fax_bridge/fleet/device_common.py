"""What the device service (`device`) and its round handler (`device_round`) share.

`RpcError`: an error a device reports with a specific gRPC status code (the service's
methods map it onto the call's status). `value_bytes`: the bytes a local value holds on
a device, the measure of its storage cap.
"""

from __future__ import annotations

import grpc

from fax_bridge.runtime.backend import leaves

ARRAY_OVERHEAD_BYTES = 128  # what python spends on an array beside its data


class RpcError(Exception):
    """An error to report with a specific gRPC status code."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def value_bytes(value) -> int:
    """Bytes a local value holds: its arrays' data plus their python overhead."""
    if value is None:
        return 0
    return sum(int(leaf.nbytes) + ARRAY_OVERHEAD_BYTES for leaf in leaves(value))
