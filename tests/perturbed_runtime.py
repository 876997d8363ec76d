"""Wrong answers for parity checks to catch (`tests/test_parity_mutations.py`,
`tests/test_litert_convert.py`, `tests/test_rounds_faults.py`): `Perturbed` is the public
`fax_bridge.rounds.faults.Fault` (one element of one client's result changed), and
`InProcessFleet` runs a round with such a runtime in this process, with no devices.
"""

from __future__ import annotations

from fax_bridge.rounds.faults import Fault as Perturbed

__all__ = ["InProcessFleet", "Perturbed"]


class InProcessFleet:
    """A fleet of no devices: the round engine in this process with `client_runtime`
    (a round that splits; its clients are its arguments')."""

    num_devices = 0

    def __init__(self, client_runtime):
        self.client_runtime = client_runtime

    def run(self, proto, *args, num_clients=None):
        from fax_bridge.runtime import run_computation

        del num_clients  # given, it would interpret the proto phase by phase
        self.last = run_computation(proto, *args, client_runtime=self.client_runtime)
        return self.last
