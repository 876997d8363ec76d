"""Computation protos on disk: written bytes read back equal, bad files get named errors."""

import jax.numpy as jnp
import pytest

import fax_bridge as fb


@fb.program(clients=3)
def _mean_of_scaled(w, x):
    return fb.federated_mean(fb.federated_map_clients(
        lambda a, b: a * b, (fb.federated_broadcast(w), x)))


def _proto():
    return fb.export_tff(_mean_of_scaled, jnp.ones(2), jnp.ones((3, 2)),
                         placements=("server", "clients"))


def test_save_and_load_round_trip(tmp_path):
    proto = _proto()
    path = tmp_path / "round.pb"
    fb.save_computation(proto, path)
    assert fb.load_computation(path) == proto


@pytest.mark.parametrize("content, match", [
    (b"\xff\x00garbage", "not a serialized Computation"),
    (b"", "holds no computation"),
])
def test_bad_files_are_named(tmp_path, content, match):
    path = tmp_path / "junk.pb"
    path.write_bytes(content)
    with pytest.raises(fb.ExportError, match=match) as info:
        fb.load_computation(path)
    assert "junk.pb" in str(info.value)


def test_saving_something_else_is_refused(tmp_path):
    with pytest.raises(TypeError, match="Computation proto, got dict"):
        fb.save_computation({"not": "a proto"}, tmp_path / "x.pb")
    assert not (tmp_path / "x.pb").exists()
