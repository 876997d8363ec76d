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


@pytest.fixture(scope="module")
def small_round_split():
    """A small round's split (2 clients, a tanh layer, a mean): the round the LiteRT
    model-cache and carried-model tests convert and pack."""
    import jax.numpy as jnp
    import numpy as np

    import fax_bridge as fb
    from fax_bridge.rounds import round_split

    @fb.program(clients=2)
    def one_round(w, x):
        return fb.federated_mean(fb.federated_map_clients(
            lambda p, c: jnp.tanh(c @ p), (fb.federated_broadcast(w), x)))

    args = (np.ones((3, 2), np.float32), np.ones((2, 4, 3), np.float32))
    return round_split.split_round(fb.export_tff(one_round, *args,
                                                 placements=("server", "clients")))


@pytest.fixture
def empty_litert_cache(monkeypatch, tmp_path):
    """Nothing converted or loaded for LiteRT yet in this process, and an empty model
    cache (`FAX_BRIDGE_LITERT_CACHE`: the folder returned, not yet made)."""
    from fax_bridge.litert import convert, model_cache, runner

    folder = tmp_path / "litert-cache"
    monkeypatch.setenv("FAX_BRIDGE_LITERT_CACHE", str(folder))
    monkeypatch.setattr(convert, "_MADE", {})
    monkeypatch.setattr(model_cache, "_WARNED", set())
    monkeypatch.setattr(runner, "_RUNNERS", {})
    return folder


# The files that take longest (a Flower deployment, eager derivatives, chunked rounds'
# compiles, LiteRT conversions, device processes), slowest first, as measured on the
# shared 2-core machine (a whole run on two workers at a load of about 5):
# `make test` runs pytest-xdist's loadfile with --no-loadscope-reorder, which hands files
# to the workers in collection order, so the long ones start first and the short
# ones fill in behind them instead of one long file running alone at the end.
LONGEST_FIRST = (
    "test_flower.py", "test_runtime_device_sums.py", "test_litert_runner.py",
    "test_litert_convert.py", "test_algorithms_export.py", "test_secure.py",
    "test_benchmarks_accelerators.py", "test_chunking.py", "test_in_process.py",
    "test_litert_tensor_names.py", "test_runtime_client_map.py", "test_parity_rounding.py",
    "test_runtime_double_sums.py", "test_primitives.py", "test_litert_client_maps.py",
    "test_fleet_links.py", "test_algorithms_diloco.py", "test_runtime_hlo.py",
    "test_benchmarks_bench.py", "test_algorithms_dp_fedavg.py", "test_readme.py",
    "test_parity.py", "test_runtime_device_floats.py", "test_runtime_device_rounds.py",
    "test_forks.py", "test_benchmarks_local_overhead.py", "test_fleet_remote.py",
    "test_reliability_faults.py", "test_algorithms_e3m0.py", "test_tff_forms.py")


def pytest_addoption(parser):
    parser.addoption(
        "--peers", action="store_true", default=False,
        help="also run the comparisons with google-fax, TFF and Flower's own apps, each in "
             "its own venv, and the benchmarks' end-to-end runs of a minute or more (tests "
             "marked peers): "
             "`make test-peers` builds the venvs and runs these; without the option they "
             "are deselected, never skipped")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "peers: compares with a peer in its own venv (.venv-fax, .venv-tff, "
                   ".venv-flower), or runs a benchmark end to end for a minute or more (a "
                   "Flower deployment, LiteRT conversions); runs with --peers "
                   "(make test-peers)")


def pytest_collection_modifyitems(session, config, items):
    """Runs the files of `LONGEST_FIRST` first, in that order; the rest keep theirs.
    Without --peers the peer comparisons are deselected (`make test-peers` runs them)."""
    if not config.getoption("--peers"):
        peers = [item for item in items if item.get_closest_marker("peers")]
        if peers:
            config.hook.pytest_deselected(items=peers)
            items[:] = [item for item in items if not item.get_closest_marker("peers")]
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture
def peer_venv():
    """`peer_venv(name)`: the python of `.venv-<name>`; a test that needs a peer's venv
    fails, naming the command that builds it, when it is missing (never skipped)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def python(name: str) -> str:
        path = os.path.join(root, f".venv-{name}", "bin", "python")
        if not os.access(path, os.X_OK):
            pytest.fail(f".venv-{name} is not built: run benchmarks/peers/setup_venvs.sh "
                        f"{name} (make test-peers builds every peer's venv)")
        return path
    return python
