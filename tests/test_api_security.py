"""Auth token on both servers (health stays open), TLS from a self-signed certificate, binding."""

from __future__ import annotations

import datetime
import ipaddress
import ssl

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from router.client import SplitServeClient
from router.frontdoor import FrontDoorConfig
from router.grpc_server import SERVICE_NAME
from tests.test_api_support import MODEL_NAME, backend, serving, text_model_path  # noqa: F401

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def authed(backend):
    with serving(backend, auth_token=TOKEN) as door:
        yield door


def make_self_signed(folder):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_grpc_refuses_calls_without_the_token(authed):
    address = f"127.0.0.1:{authed.grpc_port}"
    for token in ("", "wrong"):
        with SplitServeClient(address, auth_token=token) as client:
            for call in (client.model_info, client.status, lambda: client.generate("x", max_tokens=1),
                         lambda: client.abort("r")):
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with SplitServeClient(address, auth_token=TOKEN) as client:
        assert client.model_info().model_name == MODEL_NAME
        assert client.generate([5, 6], max_tokens=2, ignore_eos=True).usage.completion_tokens == 2
    with grpc.insecure_channel(address) as channel:  # reflection is not open either
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as e:
            list(reflect.ServerReflectionInfo(iter([ask]), timeout=5))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_grpc_health_stays_open(authed):
    with grpc.insecure_channel(f"127.0.0.1:{authed.grpc_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_http_refuses_requests_without_the_bearer_token(authed):
    base = f"http://127.0.0.1:{authed.http_port}"
    assert httpx.get(f"{base}/health").status_code == 200  # open
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions")):
            response = httpx.request(method, base + path, headers=headers, json={"prompt": "x"})
            assert response.status_code == 401, (headers, path)
            assert response.json()["error"]["type"] == "authentication_error"
    ok = httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200
    with openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN, max_retries=0) as client:
        done = client.completions.create(model=MODEL_NAME, prompt=[5], max_tokens=2,
                                         extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 2
    with openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0) as client, \
            pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_token_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_AUTH_TOKEN", "from-env")
    assert FrontDoorConfig().auth_token == "from-env"
    assert FrontDoorConfig(auth_token="").auth_token is None  # explicitly off
    monkeypatch.delenv("SPLITSERVE_AUTH_TOKEN")
    assert FrontDoorConfig().auth_token is None
    with pytest.raises(ValueError, match="auth_token"):
        FrontDoorConfig(auth_token="two words")


def test_auth_off_accepts_everyone(backend):
    with serving(backend) as door:
        assert httpx.get(f"http://127.0.0.1:{door.http_port}/v1/models").status_code == 200
        with SplitServeClient(f"127.0.0.1:{door.grpc_port}", auth_token="") as client:
            assert client.model_info().model_name == MODEL_NAME


def test_tls_on_both_servers(backend, tmp_path):
    cert, key = make_self_signed(tmp_path)
    with serving(backend, tls_cert=str(cert), tls_key=str(key), auth_token=TOKEN) as door:
        address = f"127.0.0.1:{door.grpc_port}"
        with SplitServeClient(address, auth_token=TOKEN, tls_ca=cert) as client:
            assert client.generate([5, 6], max_tokens=2, ignore_eos=True).usage.completion_tokens == 2
            assert client.health() is True
        with SplitServeClient(address, auth_token=TOKEN, timeout=2) as plaintext:
            with pytest.raises(grpc.RpcError) as e:
                plaintext.model_info()
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        base = f"https://127.0.0.1:{door.http_port}"
        trust = ssl.create_default_context(cafile=str(cert))
        assert httpx.get(f"{base}/health", verify=trust).status_code == 200
        with pytest.raises(httpx.ConnectError):  # an unknown certificate is refused
            httpx.get(f"{base}/health")
        with httpx.Client(verify=trust) as http, openai.OpenAI(
                base_url=f"{base}/v1", api_key=TOKEN, http_client=http, max_retries=0) as client:
            assert client.models.list().data[0].id == MODEL_NAME


def test_default_bind_is_loopback_and_config_is_checked(backend, tmp_path):
    assert FrontDoorConfig(auth_token="").host == "127.0.0.1"
    with serving(backend) as door:
        assert door._http.socket.getsockname()[0] == "127.0.0.1"
    for bad in (dict(grpc_port=-1), dict(http_port=70000), dict(grpc_port=None, http_port=None),
                dict(grpc_port=9000, http_port=9000), dict(host=""), dict(max_queued=0),
                dict(tls_cert=str(tmp_path / "missing.pem"), tls_key=str(tmp_path / "missing.key")),
                dict(tls_cert=str(tmp_path))):
        with pytest.raises(ValueError):
            FrontDoorConfig(auth_token="", **bad)
