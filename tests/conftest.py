"""Shared test setup: keep jax on the CPU and quiet."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


import pytest  # noqa: E402


def _flag_encrypted(raw: bytes) -> bytes:
    """A zip archive's bytes with every entry flagged encrypted (general-purpose bit 0,
    in the central directory and the local headers): zipfile then refuses to read them
    with a RuntimeError, as a single flipped bit of a damaged file can make it do."""
    out = bytearray(raw)
    for signature, flags_at in ((b"PK\x01\x02", 8), (b"PK\x03\x04", 6)):
        at = out.find(signature)
        while at >= 0:
            out[at + flags_at] |= 1
            at = out.find(signature, at + 4)
    return bytes(out)


@pytest.fixture
def flag_encrypted():
    """`_flag_encrypted`, for tests of readers of untrusted zip (npz) files."""
    return _flag_encrypted
