"""TLS (server CA, mutual TLS) and bearer tokens against real kvq-server processes, with
certificates made by openssl in the test (as tests/server MakeTestCertificates does)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

import kvq

KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def make_certificates(d: Path) -> Path:
    """ca.pem; server.pem/key for localhost and 127.0.0.1 signed by the CA; client.pem/key
    signed by it; other.pem/key self-signed (trusted by nobody)."""
    openssl = shutil.which("openssl")
    assert openssl, "openssl is needed (scripts/install-deps.sh installs it)"

    def run(*args):
        subprocess.run([openssl, *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", *KEY, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=kvq-test-ca")
    run("req", *KEY, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.pem", "-days", "1", "-extfile", "san.ext")
    run("req", *KEY, "-keyout", "client.key", "-out", "client.csr", "-subj", "/CN=kvq-client")
    run("x509", "-req", "-in", "client.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "client.pem", "-days", "1")
    run("req", "-x509", *KEY, "-keyout", "other.key", "-out", "other.pem", "-days", "1", "-subj", "/CN=untrusted")
    return d


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    d = tmp_path / "certs"
    d.mkdir()
    return make_certificates(d)


def test_tls_with_the_servers_ca(kvq_server_factory, certs):
    ca = (certs / "ca.pem").read_bytes()
    s = kvq_server_factory("--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key"),
                           client_kwargs={"tls": True, "root_certificates": ca})
    with kvq.Client(s.address, tls=True, root_certificates=ca) as c:
        assert c.echo(b"over tls") == b"over tls"
    # The CA as a file path, and a name override (dialling "localhost" names in the cert).
    with kvq.Client(f"localhost:{s.port}", tls=True, root_certificates=str(certs / "ca.pem"),
                    tls_server_name="localhost") as c:
        assert c.stats().tenant == "default"
    # A CA that did not sign the server's certificate: the handshake fails.
    with kvq.Client(s.address, tls=True, root_certificates=(certs / "other.pem").read_bytes(),
                    max_attempts=1, deadline=5) as c:
        with pytest.raises(kvq.KvqError) as e:
            c.echo(b"x")
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    # Plaintext to a TLS server fails too.
    with kvq.Client(s.address, max_attempts=1, deadline=5) as c:
        with pytest.raises(kvq.KvqError) as e:
            c.echo(b"x")
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_needs_the_client_certificate(kvq_server_factory, certs):
    ca = (certs / "ca.pem").read_bytes()
    mtls = {"tls": True, "root_certificates": ca,
            "private_key": (certs / "client.key").read_bytes(),
            "certificate_chain": (certs / "client.pem").read_bytes()}
    s = kvq_server_factory("--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key"),
                           "--tls-client-ca", str(certs / "ca.pem"), client_kwargs=mtls)
    with kvq.Client(s.address, **mtls) as c:
        assert c.echo(b"mtls") == b"mtls"
    with kvq.Client(s.address, tls=True, root_certificates=ca, max_attempts=1, deadline=5) as c:
        with pytest.raises(kvq.KvqError) as e:
            c.echo(b"x")
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    with kvq.Client(s.address, tls=True, root_certificates=ca, max_attempts=1, deadline=5,
                    private_key=str(certs / "other.key"), certificate_chain=str(certs / "other.pem")) as c:
        with pytest.raises(kvq.KvqError) as e:
            c.echo(b"x")
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_bearer_tokens_name_the_tenant_and_bad_ones_are_unauthenticated(kvq_server_factory, certs, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("tok-alice-0123456789 alice\ntok-bob-0123456789ab bob\n")
    ca = (certs / "ca.pem").read_bytes()
    s = kvq_server_factory("--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key"),
                           "--auth-tokens", str(tokens),
                           client_kwargs={"tls": True, "root_certificates": ca, "token": "tok-alice-0123456789"})
    with kvq.Client(s.address, tls=True, root_certificates=ca, token="tok-alice-0123456789") as c:
        assert c.stats().tenant == "alice"
    with kvq.Client(s.address, tls=True, root_certificates=ca, token="tok-bob-0123456789ab") as c:
        assert c.stats().tenant == "bob"
    # Unknown token: UNAUTHENTICATED with the server's message; not retried.
    attempts = []
    with kvq.Client(s.address, tls=True, root_certificates=ca, token="tok-eve-0123456789ab",
                    on_attempt=lambda *a: attempts.append(a)) as c:
        with pytest.raises(kvq.KvqError) as e:
            c.stats()
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert e.value.method == "Stats" and "unknown token" in e.value.details
    assert len(attempts) == 1
    # No token at all (the tenant header is not trusted with auth on).
    with kvq.Client(s.address, tls=True, root_certificates=ca, tenant="alice") as c:
        with pytest.raises(kvq.KvqError) as e:
            c.echo(b"x")
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert "authorization" in e.value.details, e.value.details


def test_token_over_plaintext_only_when_allowed(kvq_server_factory, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("tok-alice-0123456789 alice\n")
    with pytest.raises(kvq.KvqError) as e:
        kvq.Client("127.0.0.1:1", token="tok-alice-0123456789")
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "plaintext" in e.value.details
    s = kvq_server_factory("--auth-tokens", str(tokens),
                           client_kwargs={"token": "tok-alice-0123456789", "allow_insecure_token": True})
    with kvq.Client(s.address, token="tok-alice-0123456789", allow_insecure_token=True) as c:
        assert c.stats().tenant == "alice"
