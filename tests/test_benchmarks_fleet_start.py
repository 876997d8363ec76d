"""benchmarks/fleet_start.py: both ways of starting devices run and are reported."""

import json
import os
import sys

import pytest

from fax_bridge.system import forks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                "benchmarks"))
import fleet_start  # noqa: E402


@pytest.mark.skipif(not forks.available(), reason="needs Linux pidfds")
def test_one_fleet_each_way_is_timed_and_checked(tmp_path):
    out = tmp_path / "start.json"
    assert fleet_start.main(["--devices", "1", "--repeats", "1", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [(r["devices"], r["way"]) for r in results["rows"]] == [(1, "forked"),
                                                                   (1, "fresh")]
    for row in results["rows"]:
        assert row["start_s"] > 0 and row["first_round_s"] > 0 and row["cpu_s"] > 0
    assert results["first_forked_start_s"] > 0
