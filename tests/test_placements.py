"""placements: naming placements per argument, and the aggregation dtype rule."""

import numpy as np
import pytest

from fax_bridge.placements import (Placement, aggregate_refusal, broadcast_placements,
                                   parse_placement)

S, C = Placement.SERVER, Placement.CLIENTS


def test_parse_placement_accepts_names_in_any_case_and_members():
    assert parse_placement("Server") is S and parse_placement("CLIENTS") is C
    assert parse_placement(C) is C
    for bad in ("unplaced", Placement.UNPLACED, 3, None):
        with pytest.raises(ValueError, match="must be 'server' or 'clients'"):
            parse_placement(bad, "x")
    assert str(S) == "SERVER" and repr(C) == "Placement.CLIENTS"


def test_broadcast_placements_expands_prefixes_to_leaves():
    args = ({"w": np.ones(2), "b": np.ones(1)}, (np.ones(3), np.ones(3)))
    assert broadcast_placements(None, args) == [S] * 4
    assert broadcast_placements("clients", args) == [C] * 4
    assert broadcast_placements(("server", "clients"), args) == [S, S, C, C]
    assert broadcast_placements(({"w": "server", "b": "clients"}, ("clients", "server")),
                                args) == [C, S, C, S]  # leaves in jax's (sorted-key) order
    with pytest.raises(ValueError, match="one entry per argument"):
        broadcast_placements(("server",), args)
    with pytest.raises(ValueError, match="not a pytree prefix"):
        broadcast_placements((("server", "server"), "clients"), args)


def test_one_dtype_rule_for_aggregations():
    assert "truncate" in aggregate_refusal("federated_mean", np.int32)
    assert "truncate" in aggregate_refusal("federated_weighted_mean", np.int64)
    assert "count is not a bool" in aggregate_refusal("federated_sum", np.bool_)
    for name, dtype in (("federated_mean", np.float32), ("federated_sum", np.int32),
                        ("federated_sum", np.float16)):
        assert aggregate_refusal(name, dtype) is None
