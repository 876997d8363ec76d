"""fax_bridge.flower.security: a deployment's TLS files and SuperNode keys are written
anew in a folder of ours alone; a link planted under a key's name is refused, never
written through."""

from __future__ import annotations

import os
import stat

import pytest

pytest.importorskip("cryptography")

from fax_bridge.flower.security import local_credentials  # noqa: E402
from fax_bridge.system.private_files import UnsafePathError  # noqa: E402


def test_keys_are_private_and_certificates_readable(tmp_path):
    creds = local_credentials(str(tmp_path / "creds"), nodes=1)
    assert stat.S_IMODE(os.stat(creds.server_key).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(creds.node_keys[0][0]).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(creds.ca_cert).st_mode) == 0o644
    assert not stat.S_IMODE(os.stat(tmp_path / "creds").st_mode) & 0o022


@pytest.mark.parametrize("name", ["server.key", "ca.crt", "node-0.key"])
def test_a_link_planted_under_a_credentials_name_is_refused(tmp_path, name):
    precious = tmp_path / "precious"
    precious.write_bytes(b"kept\n")
    folder = tmp_path / "creds"
    folder.mkdir(mode=0o700)
    os.symlink(precious, folder / name)
    with pytest.raises(UnsafePathError, match=f"{folder / name} is a symbolic link"):
        local_credentials(str(folder), nodes=1)
    assert precious.read_bytes() == b"kept\n"


def test_a_credentials_folder_others_can_write_is_refused(tmp_path):
    folder = tmp_path / "creds"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(UnsafePathError, match=f"{folder} is writable by others"):
        local_credentials(str(folder))
    assert os.listdir(folder) == []
