"""Checked command-line arguments: a bad value is refused by name before any work starts;
finished results are never lost to a bad output path; input files give named errors."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from fax_bridge import cli, cli_args
from fax_bridge.errors import ComputationError
from fax_bridge.fleet import security

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TFF_DATA = os.path.join(ROOT, "tests", "data", "tff087")
COMP = os.path.join(TFF_DATA, "zip_map_struct.pb")
INPUTS = os.path.join(TFF_DATA, "zip_map_struct.inputs.npz")
QUICKSTART = os.path.join(ROOT, "examples", "quickstart.py")

# (command line before the flag, flag, a valid value, whether the flag is an integer >= low)
_COMMANDS = {
    "run": ["run", COMP],
    "parity": ["parity", f"{QUICKSTART}:fedavg_round", "--clients", "2"],
    "export": ["export", f"{QUICKSTART}:fedavg_round", "--clients", "2"],
    "device": ["device"],
    "forms": ["forms", f"{QUICKSTART}:fedavg_round", "--form", "daf", "-o", "out"],
}
_FLAGS = [  # (command, flag, lowest valid, highest valid or None)
    ("run", "--devices", 1, 1024), ("run", "--clients", 1, None),
    ("parity", "--clients", 1, None), ("parity", "--devices", 1, 1024),
    ("export", "--clients", 1, None), ("forms", "--clients", 1, None),
    ("device", "--parent-pid", 1, None),
    ("device", "--max-workers", 1, 256), ("device", "--max-message-bytes", 1, (1 << 31) - 1),
    ("device", "--max-stored-bytes", 1, None),
]


def _refused(argv, flag, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err or f"/{flag}:" in err, err
    return err


_WITH_CAPSYS = settings(max_examples=60, deadline=None, database=None,
                        suppress_health_check=[HealthCheck.function_scoped_fixture])


@_WITH_CAPSYS
@given(case=st.sampled_from(_FLAGS), value=st.integers(-(1 << 40), 1 << 40) | st.sampled_from(
    ["", "x", "1.5", "0x10", " ", "1e3"]))
def test_integer_flags_accept_their_range_and_name_themselves_otherwise(capsys, case, value):
    command, flag, low, high = case
    argv = _COMMANDS[command] + [flag, str(value)]
    valid = isinstance(value, int) and value >= low and (high is None or value <= high)
    if valid:
        assert getattr(cli.build_parser().parse_args(argv),
                       flag.lstrip("-").replace("-", "_")) == value
    else:
        _refused(argv, flag, capsys)


@_WITH_CAPSYS
@given(flag=st.sampled_from(["--rtol", "--atol"]),
       value=st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(["x", ""]))
def test_tolerances_must_be_finite_and_not_negative(capsys, flag, value):
    argv = _COMMANDS["parity"] + [flag, str(value)]
    if isinstance(value, float) and np.isfinite(value) and value >= 0:
        assert getattr(cli.build_parser().parse_args(argv), flag[2:]) == value
    else:
        _refused(argv, flag, capsys)


@_WITH_CAPSYS
@given(host=st.sampled_from(["127.0.0.1", "localhost", "[::1]", "", "::1"]),
       port=st.integers(-5, 1 << 20) | st.sampled_from(["", "x", "08"]))
def test_listen_takes_a_port_in_range_only(capsys, host, port):
    address = f"{host}:{port}"
    argv = ["device", "--listen", address]
    ok = host not in ("", "::1") and str(port).isdigit() and int(port) <= 65535
    if ok:
        assert cli.build_parser().parse_args(argv).listen == address
    else:
        _refused(argv, "--listen", capsys)


def test_output_paths_are_checked_first_and_name_the_real_file(tmp_path, capsys):
    _refused(["run", COMP, "--output", str(tmp_path / "missing" / "x")], "--output", capsys)
    _refused(["export", f"{QUICKSTART}:fedavg_round", "--clients", "2", "-o",
              str(tmp_path)], "--output", capsys)
    args = cli.build_parser().parse_args(["run", COMP, "--output", str(tmp_path / "x")])
    assert args.output == str(tmp_path / "x.npz")
    code = cli.main(["run", COMP, "--inputs", INPUTS, "--devices", "1", "--output",
                     str(tmp_path / "x")])
    assert code == 0
    assert f"wrote {tmp_path / 'x.npz'}" in capsys.readouterr().out
    assert (tmp_path / "x.npz").exists() and not (tmp_path / "x").exists()


def test_a_result_that_cannot_be_written_is_saved_elsewhere_and_said_so(tmp_path):
    arrays = {"result": np.arange(3.0)}
    written, failed = cli_args.save_result(str(tmp_path / "gone" / "r.npz"), arrays)
    try:
        assert failed and "gone" in failed and written != str(tmp_path / "gone" / "r.npz")
        np.testing.assert_array_equal(np.load(written)["result"], arrays["result"])
    finally:
        os.unlink(written)


def _npz_bytes() -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, a=np.arange(6, dtype=np.float32), b=np.ones((2, 2), np.int32))
    return buffer.getvalue()


@settings(max_examples=60, deadline=None, database=None)
@given(st.data())
def test_truncated_empty_or_garbage_inputs_give_a_named_error(tmp_path_factory, data):
    raw = bytearray(_npz_bytes())
    kind = data.draw(st.sampled_from(["truncate", "flip", "garbage", "pickle", "objects"]))
    if kind == "truncate":
        raw = raw[:data.draw(st.integers(0, len(raw) - 1))]
    elif kind == "flip":
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] ^= data.draw(st.integers(1, 255))
    elif kind == "garbage":
        raw = bytearray(data.draw(st.binary(max_size=300)))
    elif kind == "pickle":
        raw = bytearray(b"\x80\x04\x95" + data.draw(st.binary(max_size=40)))
    else:
        buffer = io.BytesIO()
        np.savez(buffer, a=np.array([{"x": 1}], dtype=object))
        raw = bytearray(buffer.getvalue())
    path = tmp_path_factory.mktemp("npz") / "in.npz"
    path.write_bytes(bytes(raw))
    try:
        loaded = cli_args.load_npz(str(path))
    except ComputationError as e:
        assert str(e).startswith(f"--inputs {path}") and "allow_pickle" not in str(e)
        return
    assert kind in ("flip", "truncate")  # a change the format does not notice
    assert set(loaded) <= {"a", "b"}


def test_an_archive_flagged_encrypted_gives_a_named_error(tmp_path, flag_encrypted):
    """zipfile refuses an entry flagged encrypted with a RuntimeError; like every other way
    damaged bytes fail to parse, it is reported naming the flag and the file."""
    path = tmp_path / "in.npz"
    path.write_bytes(flag_encrypted(_npz_bytes()))
    with pytest.raises(ComputationError, match=f"--inputs {path} is not a readable npz"):
        cli_args.load_npz(str(path))


def test_the_run_command_reports_bad_inputs_without_a_traceback(tmp_path, capsys):
    bad = tmp_path / "in.npz"
    bad.write_bytes(b"")
    assert cli.main(["run", COMP, "--inputs", str(bad)]) == 2
    assert f"--inputs {bad}" in capsys.readouterr().err


@pytest.mark.parametrize("token", ["", "x", "a" * (security.MIN_TOKEN_CHARS - 1)])
def test_short_tokens_are_refused_by_name(token):
    if not token:
        assert security.resolve_token(environ={}) is None  # no token at all: none is used
        return
    with pytest.raises(Exception, match="at least 16"):
        security.resolve_token(environ={security.TOKEN_ENV: token})
    assert security.resolve_token(environ={security.TOKEN_ENV: "a" * 16}) == "a" * 16


def test_a_dead_device_fails_fast_with_a_clear_error():
    from fax_bridge.errors import FleetError
    from fax_bridge.fleet.coordinator import GrpcClientsBackend

    with pytest.raises(FleetError, match="127.0.0.1:1 did not become healthy: nothing answers"):
        GrpcClientsBackend(["127.0.0.1:1"], token=security.new_token(),
                           connect_timeout_s=600)


def test_examples_refuse_zero_rounds_and_more_clients_than_the_data(capsys):
    import sys

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import _digits
    finally:
        sys.path.pop(0)
    for argv, flag in ((["--rounds", "0"], "--rounds"),
                       (["--clients", str(_digits.POPULATION + 1)], "--clients"),
                       (["--clients", "0"], "--clients")):
        with pytest.raises(SystemExit):
            _digits.parse_args("x", argv=argv)
        assert f"argument {flag}" in capsys.readouterr().err
    assert _digits.parse_args("x", argv=["--clients", str(_digits.POPULATION)]).clients == 100


def test_the_device_log_level_is_one_of_the_known_ones(capsys):
    assert cli.build_parser().parse_args(["device", "--log-level", "INFO"]).log_level == "info"
    _refused(["device", "--log-level", "loud"], "--log-level", capsys)


def test_an_npz_claiming_an_unknown_zip_version_gives_a_named_error(tmp_path):
    buf = io.BytesIO()
    np.savez(buf, a=np.ones(2))
    data = bytearray(buf.getvalue())
    at = data.find(b"PK\x01\x02")  # central directory: 'version needed' at offset 6
    data[at + 6:at + 8] = bytes([109, 0])
    path = tmp_path / "odd.npz"
    path.write_bytes(bytes(data))
    with pytest.raises(ComputationError, match="not a readable npz archive"):
        cli_args.load_npz(str(path))
