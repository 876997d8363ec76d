"""Fleet security: the token on every call, token files, loopback binding, mutual TLS."""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import stat

import federated_language as fl
import grpc
import numpy as np
import pytest

from fax_bridge.errors import FleetError
import sample_computations as sc
from fax_bridge.fleet import device, device_process, security
from fax_bridge.fleet.coordinator import GrpcClientsBackend
from fax_bridge.fleet.launcher import LocalFleet
from fax_bridge.v1 import device_pb2 as pb
from fax_bridge.v1 import device_pb2_grpc as pb_grpc

TOKEN = security.new_token()


@pytest.fixture(scope="module")
def server():
    srv, port = device_process.start_server("127.0.0.1:0", device.DeviceServicer("sec"),
                                             token=TOKEN)
    yield f"127.0.0.1:{port}"
    srv.stop(None)


def _health(address: str, metadata=()) -> pb.HealthResponse:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.DeviceStub(channel).Health(pb.HealthRequest(), timeout=10,
                                                  metadata=metadata)


def test_calls_without_the_right_token_are_refused_and_the_device_keeps_serving(server):
    for metadata in ((), ((security.TOKEN_HEADER, "0" * 64),),
                     ((security.TOKEN_HEADER, TOKEN[:-1]),),
                     ((security.TOKEN_HEADER, TOKEN), (security.TOKEN_HEADER, TOKEN))):
        with pytest.raises(grpc.RpcError) as info:
            _health(server, metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(server) as channel:  # streaming methods are guarded too
        stub = pb_grpc.DeviceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Put(iter([pb.PutRequest(handle=1)]), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Fetch(pb.FetchRequest(handle=1), timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _health(server, security.call_metadata(TOKEN)).status == "SERVING"


def test_backend_with_a_wrong_token_fails_clearly(server):
    with pytest.raises(FleetError, match="refused the fleet token"):
        GrpcClientsBackend([server], token="wrong", connect_timeout_s=5)
    with GrpcClientsBackend([server], token=TOKEN, connect_timeout_s=10) as backend:
        value = backend.put(fl.TensorType(np.float32, [2]), [np.ones(2, np.float32)] * 3)
        np.testing.assert_array_equal(backend.aggregate(value, "sum"), [3.0, 3.0])


def test_token_files_must_be_private(tmp_path):
    path = tmp_path / "fleet.token"
    security.write_token_file(path, TOKEN)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert security.read_token_file(path) == TOKEN
    os.chmod(path, 0o644)
    with pytest.raises(FleetError, match="chmod 600"):
        security.read_token_file(path)
    assert security.resolve_token(environ={security.TOKEN_ENV: "abc" * 6}) == "abc" * 6


def test_a_token_file_that_is_a_link_or_another_users_is_refused(tmp_path):
    secret = tmp_path / "secret"
    security.write_token_file(secret, TOKEN)
    link = tmp_path / "fleet.token"
    os.symlink(secret, link)
    with pytest.raises(FleetError, match=f"{link} is a symbolic link"):
        security.read_token_file(link)
    with pytest.raises(FileExistsError):  # O_EXCL: never written through a link
        security.write_token_file(link, "x" * 32)
    assert security.read_token_file(secret) == TOKEN
    if os.geteuid() == 0:
        import pwd

        os.chown(secret, pwd.getpwnam("nobody").pw_uid, -1)
        with pytest.raises(FleetError, match=f"{secret} belongs to nobody"):
            security.read_token_file(secret)


def test_devices_bind_loopback_unless_told_otherwise(caplog):
    with pytest.raises(FleetError, match="not a loopback address"):
        device_process.start_server("0.0.0.0:0", device.DeviceServicer(), token=TOKEN)
    with caplog.at_level(logging.WARNING, logger="fax_bridge.fleet.security"):
        security.check_address("192.0.2.7", True, None, "device listen address")
    assert "without TLS" in caplog.text and "other machines" in caplog.text
    assert security.is_loopback("127.0.0.1") and security.is_loopback("[::1]")
    with pytest.raises(FleetError, match="no fleet token"):
        device_process.serve("127.0.0.1:0", token=None)


# ---------------------------------------------------------------------------------------
# Mutual TLS with throwaway certificates.


def _certificates(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def issue(cn, issuer_key, issuer_name, key, ca=False, san=None):
        builder = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(issuer_name)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None),
                                  critical=True))
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    def write(stem, cert, key=None):
        (tmp_path / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        if key is not None:
            (tmp_path / f"{stem}.key").write_bytes(key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption()))

    out = {}
    for ca_name in ("ca", "other-ca"):
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = issue(ca_name, ca_key, name(ca_name), ca_key, ca=True)
        write(ca_name, ca_cert)
        san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        for role in ("device", "coordinator"):
            key = ec.generate_private_key(ec.SECP256R1())
            write(f"{ca_name}-{role}", issue(role, ca_key, name(ca_name), key, san=san), key)
        out[ca_name] = security.TlsConfig(
            str(tmp_path / f"{ca_name}.pem"), str(tmp_path / f"{ca_name}-coordinator.pem"),
            str(tmp_path / f"{ca_name}-coordinator.key"))
        out[f"{ca_name}-device"] = security.TlsConfig(
            str(tmp_path / f"{ca_name}.pem"), str(tmp_path / f"{ca_name}-device.pem"),
            str(tmp_path / f"{ca_name}-device.key"))
    return out


def test_mutual_tls_accepts_only_certificates_of_the_fleet_ca(tmp_path):
    tls = _certificates(tmp_path)
    srv, port = device_process.start_server("127.0.0.1:0", device.DeviceServicer("tls"),
                                    token=TOKEN, tls=tls["ca-device"])
    address = f"127.0.0.1:{port}"
    try:
        with GrpcClientsBackend([address], token=TOKEN, tls=tls["ca"],
                                connect_timeout_s=10) as backend:
            value = backend.put(fl.TensorType(np.int32), [np.int32(i) for i in range(4)])
            assert int(backend.aggregate(value, "sum")) == 6
        for wrong in (tls["other-ca"], None):  # a foreign certificate, or plaintext
            with pytest.raises(FleetError, match="did not become healthy"):
                GrpcClientsBackend([address], token=TOKEN, tls=wrong, connect_timeout_s=2)
    finally:
        srv.stop(None)


def test_local_fleet_keeps_the_token_off_the_command_line_and_runs_over_tls(tmp_path):
    tls = _certificates(tmp_path)
    proto = sc.scaled_aggregate((2,), "sum")
    with LocalFleet(devices=1, device_tls=tls["ca-device"], coordinator_tls=tls["ca"]) as f:
        token = f._token
        assert len(token) == 2 * security.TOKEN_BYTES
        with open(f"/proc/{f.pids[0]}/cmdline", "rb") as cmdline:
            assert token.encode() not in cmdline.read()
        got = f.run(proto, np.ones((3, 2), np.float32), np.full(2, 2.0, np.float32))
        np.testing.assert_array_equal(got, [6.0, 6.0])
    with pytest.raises(FleetError, match="both device_tls and coordinator_tls"):
        LocalFleet(devices=1, device_tls=tls["ca-device"])
