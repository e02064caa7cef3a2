"""The direct lane for small S3 requests (storage/s3_direct.py), on the real SeaweedFS server:
it answers as s3fs does, hands over to s3fs where it cannot talk to the store, and survives a
kept-alive connection the server dropped."""

from __future__ import annotations

import socket
import uuid

import pytest

from paths.errors import NotFound, PreconditionFailed
from storage import s3_direct
from storage.url import open_store

KEYS = ["claims/p00.json", "claims/a b+c~d.json", "claims/é-ü.json", "claims/q%20r.json"]


def store_pair(seaweed, bucket, monkeypatch):
    """Two stores on one prefix: one with the lane, one through s3fs alone."""
    url = f"s3://{bucket}/direct-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("PATHS_S3_DIRECT", "1")
    direct = open_store(url, seaweed.storage_options)
    assert direct.direct() is not None  # made at its first use, where the switch is read
    monkeypatch.setenv("PATHS_S3_DIRECT", "0")
    plain = open_store(url, seaweed.storage_options)
    assert plain.direct() is None
    return direct, plain


def test_the_lane_answers_as_s3fs_does(seaweed, bucket, monkeypatch):
    direct, plain = store_pair(seaweed, bucket, monkeypatch)
    for i, key in enumerate(KEYS):
        writer, reader = (direct, plain) if i % 2 == 0 else (plain, direct)
        etag = writer.put_if_absent(key, f"record {i}".encode())
        assert reader.read_with_etag(key) == writer.read_with_etag(key) == (f"record {i}".encode(), etag)
        with pytest.raises(PreconditionFailed):
            reader.put_if_absent(key, b"theirs", confirm=False)
        new = reader.put_if_match(key, b"renewed", etag)
        with pytest.raises(PreconditionFailed):
            writer.put_if_match(key, b"stale", etag)
        assert writer.read_with_etag(key) == (b"renewed", new)
    with pytest.raises(NotFound):
        direct.read_with_etag("claims/nobody.json")
    with pytest.raises(PreconditionFailed):
        direct.put_if_match("claims/nobody.json", b"x", '"0123"')
    assert direct.list_page("claims") == plain.list_page("claims")
    assert sorted(direct.list_page("claims")[0]) == sorted(KEYS)
    first, after = direct.list_page("claims", "", 2)
    assert (first, after) == plain.list_page("claims", "", 2) and after == first[-1]
    assert direct.list_page("claims", after, 10) == plain.list_page("claims", after, 10)
    assert direct.list_page("claims", first[0], 1)[0] == [first[1]]


def test_a_store_the_lane_cannot_sign_for_goes_through_s3fs(seaweed, bucket, monkeypatch):
    """Until the lane's first success, a refusal of the lane itself (here a signature the server
    rejects) turns it off for good, and the same request is made through s3fs."""
    direct, _ = store_pair(seaweed, bucket, monkeypatch)
    lane = direct.direct()
    from botocore.credentials import ReadOnlyCredentials

    real = lane._frozen()
    lane._static = ReadOnlyCredentials(real.access_key, "not-the-secret", None)
    lane.credentials = type("Static", (), {})()  # not refreshable: the wrong secret above is used
    etag = direct.put_if_absent("claims/p00.json", b"mine")
    assert direct.direct() is None  # s3fs from now on
    assert direct.read_with_etag("claims/p00.json") == (b"mine", etag)


def test_a_connection_the_server_dropped_is_replaced(seaweed, bucket, monkeypatch):
    direct, _ = store_pair(seaweed, bucket, monkeypatch)
    lane = direct.direct()
    etag = direct.put_if_absent("claims/p00.json", b"one")
    kept = lane._local.conn
    kept.sock.shutdown(socket.SHUT_RDWR)  # as a server closing an idle kept-alive connection
    assert direct.put_if_match("claims/p00.json", b"two", etag) != etag
    assert lane._local.conn is not kept
    again = lane._local.conn
    monkeypatch.setattr(s3_direct, "IDLE_S", 0.0)  # idle too long: replaced before use
    assert direct.read_with_etag("claims/p00.json")[0] == b"two"
    assert lane._local.conn is not again


@pytest.mark.parametrize("why", ["proxy", "switch", "sse", "anonymous"])
def test_what_the_lane_leaves_to_s3fs(seaweed, bucket, monkeypatch, why):
    options = dict(seaweed.storage_options)
    if why == "sse":
        options["s3_additional_kwargs"] = {"ServerSideEncryption": "AES256"}
    store = open_store(f"s3://{bucket}/direct-{uuid.uuid4().hex[:8]}", options)
    if why == "proxy":  # s3fs would send it through the proxy: so must the lane, which has none
        monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
        monkeypatch.setenv("NO_PROXY", "")
    elif why == "switch":
        monkeypatch.setenv("PATHS_S3_DIRECT", "0")
    elif why == "anonymous":
        store.fs.anon = True
    assert store.direct() is None


@pytest.fixture
def tls_endpoint(seaweed, tmp_path):
    """https://127.0.0.1:<port> in front of the SeaweedFS server (a TLS-terminating relay, as a
    load balancer is), with a self-signed certificate: (endpoint, CA bundle)."""
    import datetime
    import ipaddress
    import ssl
    import threading

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(key, hashes.SHA256()))
    pem, key_pem = tmp_path / "cert.pem", tmp_path / "key.pem"
    pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_pem.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(pem, key_pem)
    target = seaweed.endpoint.split("//")[1].split(":")
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def pump(src, dst):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def serve():
        while not stop.is_set():
            try:
                raw, _ = listener.accept()
                conn = context.wrap_socket(raw, server_side=True)
            except OSError:
                continue
            upstream = socket.create_connection((target[0], int(target[1])))
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=pump, args=(a, b), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield f"https://127.0.0.1:{listener.getsockname()[1]}", str(pem)
    stop.set()
    listener.close()


def test_the_lane_over_tls(seaweed, bucket, tls_endpoint, monkeypatch):
    endpoint, bundle = tls_endpoint
    options = {**seaweed.storage_options, "endpoint_url": endpoint, "client_kwargs": {"verify": bundle}}
    url = f"s3://{bucket}/tls-{uuid.uuid4().hex[:8]}"
    direct = open_store(url, options)
    lane = direct.direct()
    assert lane is not None and lane.https
    etag = direct.put_if_absent("claims/p00.json", b"mine")
    monkeypatch.setenv("PATHS_S3_DIRECT", "0")
    plain = open_store(url, options)
    assert plain.direct() is None
    assert plain.read_with_etag("claims/p00.json") == direct.read_with_etag("claims/p00.json") == (b"mine", etag)
    assert direct.list_page("claims") == plain.list_page("claims") == (["claims/p00.json"], None)
    assert lane.proven


def test_network_failures_are_transient(seaweed, bucket, monkeypatch):
    """A refused connection and a garbled reply are retried as botocore's connection errors are,
    and given up on with the store's one-line error; the lane is not turned off by them."""
    import threading

    from paths.errors import TransientStorageError
    from storage.retry import RetryPolicy

    monkeypatch.setenv("PATHS_S3_DIRECT", "1")
    store = open_store(f"s3://{bucket}/direct-{uuid.uuid4().hex[:8]}", seaweed.storage_options, retry=RetryPolicy(attempts=3, base_s=0.001, cap_s=0.01))
    lane = store.direct()
    store.put_if_absent("claims/p00.json", b"one")  # proven
    garbled = socket.create_server(("127.0.0.1", 0))

    def answer():
        while True:
            try:
                conn, _ = garbled.accept()
            except OSError:
                return
            conn.recv(65536)
            conn.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            conn.close()

    threading.Thread(target=answer, daemon=True).start()
    closed = socket.create_server(("127.0.0.1", 0))
    refused_port = closed.getsockname()[1]
    closed.close()
    try:
        for port in (refused_port, garbled.getsockname()[1]):
            lane.port, lane._local.conn = port, None
            with pytest.raises(TransientStorageError, match=r"claims/p01.json: still failing after 3 attempts"):
                store.put_if_absent("claims/p01.json", b"two")
            assert store.direct() is lane
    finally:
        garbled.close()


def test_large_bodies_go_through_s3fs(seaweed, bucket, monkeypatch):
    direct, _ = store_pair(seaweed, bucket, monkeypatch)
    calls = []
    real = direct.fs.call_s3
    direct.fs.call_s3 = lambda method, *a, **k: calls.append(method) or real(method, *a, **k)
    direct.put_if_absent("claims/small.json", b"x" * s3_direct.MAX_BODY)
    assert calls == []
    big = b"y" * (s3_direct.MAX_BODY + 1)
    etag = direct.put_if_absent("rollouts/big.safetensors", big)
    assert calls == ["put_object"] and direct.read_with_etag("rollouts/big.safetensors") == (big, etag)
