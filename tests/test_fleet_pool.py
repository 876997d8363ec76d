"""DevicePool's errors: a call past its deadline names the call and the deadline it had."""

from __future__ import annotations

import types

import grpc
import pytest

from fax_bridge.errors import FleetError
from fax_bridge.fleet.pool import DeviceLostError, DevicePool


class _Status(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return "the call's status"


@pytest.mark.parametrize("timeout_s, wanted", [
    (None, "within its deadline of 2s (rpc_timeout_s=2)"),
    (2.0, "within its deadline of 2s (rpc_timeout_s=2)"),
    (3.5, "within its deadline of 3.5s (rpc_timeout_s=2 plus the round's emulated delays)"),
])
def test_a_missed_deadline_names_the_call_and_its_deadline(timeout_s, wanted):
    pool = types.SimpleNamespace(rpc_timeout_s=2.0)
    device = types.SimpleNamespace(index=1, address="127.0.0.1:5")
    error = DevicePool._fail(pool, device, "Round",
                             _Status(grpc.StatusCode.DEADLINE_EXCEEDED), timeout_s)
    assert isinstance(error, DeviceLostError) and error.devices == [1]
    assert f"did not answer Round {wanted}" in str(error)
    assert "None" not in str(error)
    other = DevicePool._fail(pool, device, "Put", _Status(grpc.StatusCode.INVALID_ARGUMENT))
    assert type(other) is FleetError and "deadline" not in str(other)
