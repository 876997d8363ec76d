"""SuperNodes' populations (`flower.populations`): written whole or not at all, only
over populations fax_bridge wrote, other files in the folder kept."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from fax_bridge.system import output_folders
from fax_bridge.errors import FleetError, OutputError
from fax_bridge.flower.populations import plan, write_populations
from fax_bridge.fleet.protocol import partition
from fax_bridge.runtime import population


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shapes=st.dictionaries(st.sampled_from(["x", "y", "w"]),
                              st.sampled_from([(), (3,), (3, 2), (1,)]), min_size=1),
       clients=st.integers(1, 5), nodes=st.integers(1, 6))
def test_populations_are_written_whole_or_not_at_all(tmp_path_factory, shapes, clients,
                                                     nodes):
    """Every array needs an example axis after the clients axis; a value per client
    (shape (clients,), a per-client weight) or too many nodes is refused naming the
    array and the fix before anything is written; a folder of the user's where a
    population goes is refused by name, and kept."""
    folder = tmp_path_factory.mktemp("pops")
    earlier = folder / "node-0"
    earlier.mkdir()
    (earlier / "mark").write_text("earlier")
    data = {k: np.arange(clients * int(np.prod(s)), dtype=np.float32).reshape(
        (clients,) + s) for k, s in shapes.items()}
    per_client = [k for k, s in shapes.items() if not s]  # the first one is named
    uneven = len({s[0] for s in shapes.values() if s}) > 1
    if per_client or uneven or nodes > clients:
        match = (f"client data {per_client[0]!r} has shape \\[{clients}\\].*example axis"
                 if per_client else "different numbers of examples" if uneven else
                 f"{nodes} SuperNodes for {clients} example clients")
        with pytest.raises(FleetError, match=match):
            plan(data, str(folder), nodes)
        with pytest.raises(FleetError, match=match):
            write_populations(data, str(folder), nodes)
        assert sorted(os.listdir(folder)) == ["node-0"] and \
            os.listdir(earlier) == ["mark"]
        return
    with pytest.raises(OutputError, match=f"would replace '{earlier}'.*--force"):
        write_populations(data, str(folder), nodes)
    assert sorted(os.listdir(folder)) == ["node-0"] and os.listdir(earlier) == ["mark"]
    configs = write_populations(data, str(folder), nodes, force=True)
    assert configs == plan(data, str(folder), nodes)
    assert sorted(os.listdir(folder)) == sorted(
        [output_folders.RECORD] + [f"node-{k}" for k in range(nodes)])
    assert [c["first-client"] for c in configs] == \
        [b.start for b in partition(clients, nodes)]
    assert sum(population.open_store(c["population"]).num_clients for c in configs) \
        == clients


def test_a_rewrite_replaces_its_populations_and_keeps_the_users_files(tmp_path):
    data = {"x": np.arange(24, dtype=np.float32).reshape(6, 2, 2)}
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "node-5").mkdir()
    write_populations(data, str(tmp_path), 3)
    write_populations(data, str(tmp_path), 2)  # node-2 of the first write removed
    assert sorted(os.listdir(tmp_path)) == [output_folders.RECORD, "node-0", "node-1",
                                            "node-5", "notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "mine"
    with pytest.raises(OutputError, match="node-5"):
        write_populations(data, str(tmp_path), 6)
