"""Tests of the loopback test servers in tests/servers.py (S3/moto, HTTP, fault injection).

They also pin down the exception types fsspec / s3fs raise for each injected fault, which
the reader's retry logic relies on (documented at the top of servers.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import aiohttp
import fsspec
import pytest
from fsspec.exceptions import FSTimeoutError

sys.path.insert(0, os.path.dirname(__file__))

from servers import LOOPBACK, FaultPlan, FaultStats, HTTPFileServer, S3Server  # noqa: E402

# The fixtures (s3_server, s3_bucket, s3_fault_proxy, http_server) come from tests/conftest.py
# (``from servers import *``); importing them here too would start a second moto server.

pytestmark = pytest.mark.timeout(60)

PAYLOAD = bytes(range(256)) * 1200  # 307_200 bytes, position-dependent content


def _raw(url: str, method: str = "GET", headers: dict | None = None, path: str | None = None):
    """One raw HTTP request (no client-side path normalisation). Returns (status, hdrs, body)."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    try:
        conn.request(method, path if path is not None else (u.path or "/"), headers=headers or {})
        r = conn.getresponse()
        body = r.read()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, body
    finally:
        conn.close()


def _http_fs(**client_kwargs):
    return fsspec.filesystem("http", skip_instance_cache=True, client_kwargs=client_kwargs)


@pytest.fixture
def served(tmp_path, http_server):
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "shard-000.tar").write_bytes(PAYLOAD)
    (root / "sub" / "small.bin").write_bytes(b"hello world")
    (tmp_path / "secret.txt").write_text("top secret")
    return http_server(root)


# ---------------------------------------------------------------------------------- S3


def test_s3_server_basics(s3_server: S3Server):
    u = urllib.parse.urlsplit(s3_server.endpoint_url)
    assert u.hostname == LOOPBACK and u.port
    opts = s3_server.storage_options()
    assert opts == {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": s3_server.endpoint_url, "region_name": "us-east-1"},
    }
    assert os.environ["AWS_ACCESS_KEY_ID"] == "testing"
    assert s3_server.filesystem() is not s3_server.filesystem()  # never a cached instance


def test_s3_roundtrip_range_list(s3_server: S3Server, s3_bucket: str):
    assert s3_bucket.startswith("s3://")
    fs = s3_server.filesystem()
    fs.pipe(f"{s3_bucket}/corpus/shard-000.tar", PAYLOAD)
    fs.pipe(f"{s3_bucket}/corpus/shard-001.tar", b"x" * 10)
    fs2 = s3_server.filesystem()  # fresh instance: no listing cache involved
    assert fs2.cat_file(f"{s3_bucket}/corpus/shard-000.tar") == PAYLOAD
    assert fs2.cat_file(f"{s3_bucket}/corpus/shard-000.tar", start=1000, end=1010) == PAYLOAD[1000:1010]
    assert fs2.size(f"{s3_bucket}/corpus/shard-000.tar") == len(PAYLOAD)
    name = s3_bucket[len("s3://"):]
    assert sorted(fs2.ls(f"{s3_bucket}/corpus/")) == [
        f"{name}/corpus/shard-000.tar",
        f"{name}/corpus/shard-001.tar",
    ]
    # fsspec.open with the plain storage_options dict
    with fsspec.open(f"{s3_bucket}/corpus/shard-000.tar", "rb", **s3_server.storage_options()) as f:
        f.seek(300_000)
        assert f.read(5) == PAYLOAD[300_000:300_005]


def test_s3_bucket_isolation(s3_server: S3Server, s3_bucket: str):
    other = s3_server.make_bucket()
    assert other != s3_bucket
    fs = s3_server.filesystem()
    fs.pipe(f"{s3_bucket}/corpus/a", b"a")
    assert fs.exists(f"{s3_bucket}/corpus/a")
    assert not fs.exists(f"{other}/corpus/a")
    assert fs.ls(other) == []
    named = s3_server.make_bucket("sw-fixed-name-test")
    assert named == "s3://sw-fixed-name-test"


def test_s3_proxy_passes_everything_but_get_object(s3_server, s3_bucket, s3_fault_proxy):
    proxy = s3_fault_proxy(FaultPlan(status_503_times=100))
    fs = proxy.filesystem(no_retries=True)
    fs.pipe(f"{s3_bucket}/corpus/via-proxy", b"abc")  # PUT through the proxy
    assert fs.ls(f"{s3_bucket}/corpus/", detail=False)  # ListObjectsV2 (a GET) untouched
    assert fs.size(f"{s3_bucket}/corpus/via-proxy") == 3  # HEAD untouched
    assert proxy.stats.status_errors == 0
    assert s3_server.filesystem().cat_file(f"{s3_bucket}/corpus/via-proxy") == b"abc"
    proxy.set_faults(None)
    assert fs.cat_file(f"{s3_bucket}/corpus/via-proxy") == b"abc"
    with fsspec.open(f"{s3_bucket}/corpus/via-proxy", **proxy.storage_options()) as f:
        assert f.read() == b"abc"


def test_s3_503_surfaces_without_retries_and_is_retried_by_default(
    s3_server, s3_bucket, s3_fault_proxy
):
    key = f"{s3_bucket}/corpus/shard.tar"
    s3_server.filesystem().pipe(key, PAYLOAD)
    proxy = s3_fault_proxy(FaultPlan(status_503_times=1))
    with pytest.raises(OSError) as ei:
        proxy.filesystem(no_retries=True).cat_file(key)
    assert "SlowDown" in repr(ei.value.__cause__) or "reduce your request rate" in str(ei.value)
    assert proxy.stats.status_errors == 1

    proxy.set_faults(FaultPlan(status_503_times=1, error_status=500))
    with pytest.raises(OSError) as ei:
        proxy.filesystem(no_retries=True).cat_file(key)
    assert "InternalError" in repr(ei.value.__cause__)

    # Default s3fs/botocore settings retry a 503 transparently.
    proxy.set_faults(FaultPlan(status_503_times=1))
    assert proxy.filesystem().cat_file(key) == PAYLOAD
    st = proxy.stats
    assert (st.status_errors, st.get_requests, st.completed_gets) == (1, 2, 1)


def test_s3_dropped_connection(s3_server, s3_bucket, s3_fault_proxy):
    key = f"{s3_bucket}/corpus/shard.tar"
    s3_server.filesystem().pipe(key, PAYLOAD)
    proxy = s3_fault_proxy(FaultPlan(drop_after_bytes=1000, drop_times=1))
    with pytest.raises(aiohttp.ClientPayloadError):
        proxy.filesystem(no_retries=True).cat_file(key)
    assert (proxy.stats.drops, proxy.stats.bytes_served) == (1, 1000)
    # s3fs retries a dropped GetObject by itself (ClientPayloadError is in its retry list).
    proxy.set_faults(FaultPlan(drop_after_bytes=1000, drop_times=2))
    assert proxy.filesystem().cat_file(key) == PAYLOAD
    assert (proxy.stats.drops, proxy.stats.completed_gets) == (2, 1)


def test_s3_stall_with_read_timeout(s3_server, s3_bucket, s3_fault_proxy):
    key = f"{s3_bucket}/corpus/shard.tar"
    s3_server.filesystem().pipe(key, b"z" * 1000)
    proxy = s3_fault_proxy(FaultPlan(stall_seconds=3.0, stall_times=1))
    fs = proxy.filesystem(no_retries=True, config_kwargs={"read_timeout": 0.5})
    assert fs.ls(s3_bucket)  # creates the botocore client (slow on a busy machine) unfaulted
    t0 = time.monotonic()
    with pytest.raises(FSTimeoutError):
        fs.cat_file(key)
    assert time.monotonic() - t0 < 2.5
    assert proxy.stats.stalls == 1
    assert fs.cat_file(key) == b"z" * 1000  # only the first GET stalls


def test_s3_server_fault_helpers(s3_server, s3_bucket):
    key = f"{s3_bucket}/corpus/x"
    s3_server.filesystem().pipe(key, b"data")
    proxy = s3_server.inject_errors(2, status=503)
    try:
        fs = proxy.filesystem(no_retries=True)
        for _ in range(2):
            with pytest.raises(OSError):
                fs.cat_file(key)
        assert fs.cat_file(key) == b"data"
        assert proxy.stats.status_errors == 2
    finally:
        proxy.close()
    endpoint = s3_server.faulty_endpoint(FaultPlan(status_503_times=1))
    assert endpoint.startswith(f"http://{LOOPBACK}:") and endpoint != s3_server.endpoint_url


# ---------------------------------------------------------------------------------- HTTP


def test_http_full_head_range(served: HTTPFileServer):
    url = served.url_for("shard-000.tar")
    assert url.startswith(f"http://{LOOPBACK}:")
    fs = _http_fs()
    assert fs.cat_file(url) == PAYLOAD
    assert fs.size(url) == len(PAYLOAD)
    assert fs.info(url)["size"] == len(PAYLOAD)
    assert fs.cat_file(url, start=100, end=356) == PAYLOAD[100:356]
    assert fs.cat_file(url, start=len(PAYLOAD) - 7) == PAYLOAD[-7:]
    with fs.open(url, "rb", block_size=4096) as f:
        f.seek(250_000)
        assert f.read(10_000) == PAYLOAD[250_000:260_000]
    with fs.open(url, "rb") as f:
        assert f.read() == PAYLOAD
    with fsspec.open(served.url_for("sub/small.bin"), "rb") as f:
        assert f.read() == b"hello world"

    status, h, body = _raw(url, "HEAD")
    assert status == 200 and body == b""
    assert h["content-length"] == str(len(PAYLOAD)) and h["accept-ranges"] == "bytes"
    status, h, body = _raw(url, headers={"Range": "bytes=10-19"})
    assert status == 206 and body == PAYLOAD[10:20]
    assert h["content-range"] == f"bytes 10-19/{len(PAYLOAD)}" and h["content-length"] == "10"
    status, h, body = _raw(url, headers={"Range": "bytes=-5"})
    assert status == 206 and body == PAYLOAD[-5:]
    status, h, body = _raw(url, headers={"Range": f"bytes={len(PAYLOAD) - 3}-99999999"})
    assert status == 206 and body == PAYLOAD[-3:]
    status, h, body = _raw(url, headers={"Range": f"bytes={len(PAYLOAD)}-"})
    assert status == 416 and h["content-range"] == f"bytes */{len(PAYLOAD)}"
    status, h, _ = _raw(url, "HEAD", headers={"Range": "bytes=0-9"})
    assert status == 206 and h["content-length"] == "10"


def test_http_listing_and_404(served: HTTPFileServer):
    fs = _http_fs()
    names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(served.url_for(""), detail=False))
    assert names == ["shard-000.tar", "sub"]
    with pytest.raises(FileNotFoundError):
        fs.cat_file(served.url_for("missing.tar"))
    assert _raw(served.url_for("missing.tar"))[0] == 404


def test_http_no_traversal(served: HTTPFileServer, tmp_path):
    os.symlink(tmp_path / "secret.txt", tmp_path / "root" / "link.txt")
    for path in (
        "/../secret.txt",
        "/%2e%2e/secret.txt",
        "/sub/../../secret.txt",
        "/sub/%2E%2E/%2e%2e/secret.txt",
        "/..%2fsecret.txt",
        "/link.txt",
        "/%00",
    ):
        for method in ("GET", "HEAD"):
            status, _, body = _raw(served.url, method, path=path)
            assert status == 404, (method, path)
            assert b"secret" not in body
    assert _raw(served.url, path="/sub/./small.bin")[2] == b"hello world"


# ---------------------------------------------------------------------------------- faults


def test_faultplan_validation():
    with pytest.raises(ValueError):
        FaultPlan(stall_seconds=60)
    with pytest.raises(ValueError):
        FaultPlan(drop_every_bytes=0)
    with pytest.raises(ValueError):
        FaultPlan(status_503_times=-1)
    with pytest.raises(ValueError):
        FaultPlan(error_status=200)
    with pytest.raises(ValueError):
        FaultPlan(bad_content_range="sideways")
    with pytest.raises(ValueError):
        FaultPlan(bad_content_range="empty", bad_range_times=-1)


@pytest.mark.parametrize("kind,expected", [
    ("end-before-start", "bytes 100-90/307200"), ("empty", "bytes 100-99/307200"),
    ("wrong-start", "bytes 101-199/307200"), ("garbage", "bytes x-y/307200")])
def test_http_bad_content_range(served: HTTPFileServer, kind, expected):
    """A 206 whose Content-Range does not match the request; the body is still the range's bytes."""
    url = served.url_for("shard-000.tar")
    served.set_faults(FaultPlan(bad_content_range=kind, bad_range_times=2))
    for _ in range(2):
        status, hdrs, body = _raw(url, headers={"Range": "bytes=100-199"})
        assert (status, hdrs["content-range"], body) == (206, expected, PAYLOAD[100:200])
    status, hdrs, body = _raw(url, headers={"Range": "bytes=100-199"})  # budget spent: a right answer
    assert (status, hdrs["content-range"], body) == (206, "bytes 100-199/307200", PAYLOAD[100:200])
    status, hdrs, body = _raw(url)  # not a range request: never faulted
    assert status == 200 and body == PAYLOAD
    assert served.stats.bad_ranges == 2 == served.stats.faults_injected


def test_http_503_then_success(served: HTTPFileServer):
    url = served.url_for("shard-000.tar")
    served.set_faults(FaultPlan(status_503_times=2))
    for _ in range(2):
        with pytest.raises(urllib.error.HTTPError) as ei:
            urllib.request.urlopen(url, timeout=10)
        assert ei.value.code == 503
        ei.value.close()
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.read() == PAYLOAD
    # (the most in flight may count a 503's handler still returning as the next GET arrives: 1 or 2)
    assert dataclasses.replace(served.stats, most_in_flight=1) == FaultStats(
        requests=3, get_requests=3, faults_injected=2, status_errors=2,
        bytes_served=len(PAYLOAD), completed_gets=1, most_in_flight=1,
    ) and served.stats.most_in_flight in (1, 2)
    # Through fsspec: aiohttp.ClientResponseError with .status 503; fsspec does not retry.
    served.set_faults(FaultPlan(status_503_times=1))
    fs = _http_fs()
    with pytest.raises(aiohttp.ClientResponseError) as ei:
        fs.cat_file(url, start=0, end=10)
    assert ei.value.status == 503
    assert fs.cat_file(url, start=0, end=10) == PAYLOAD[:10]
    # HEAD is never faulted
    served.set_faults(FaultPlan(status_503_times=5))
    assert fs.size(url) == len(PAYLOAD)


def test_http_drop_after_bytes(served: HTTPFileServer):
    url = served.url_for("shard-000.tar")
    served.set_faults(FaultPlan(drop_after_bytes=5000, drop_times=2))
    # raw client: a short read
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    conn.request("GET", u.path)
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("Content-Length") == str(len(PAYLOAD))
    with pytest.raises(http.client.IncompleteRead) as ei:
        r.read()
    assert ei.value.partial == PAYLOAD[:5000]
    conn.close()
    # fsspec/aiohttp: ClientPayloadError (a ClientError), for cat_file and open().read()
    fs = _http_fs()
    with pytest.raises(aiohttp.ClientPayloadError):
        fs.cat_file(url)
    assert fs.cat_file(url) == PAYLOAD  # drop_times used up
    st = served.stats
    assert (st.drops, st.completed_gets, st.bytes_served) == (2, 1, 10_000 + len(PAYLOAD))
    # a response no longer than the limit is not cut and does not use up a drop
    served.set_faults(FaultPlan(drop_after_bytes=5000, drop_times=1))
    assert fs.cat_file(url, start=0, end=5000) == PAYLOAD[:5000]
    with fs.open(url, "rb", block_size=2**20) as f, pytest.raises(aiohttp.ClientPayloadError):
        f.read()
    assert served.stats.drops == 1


def test_http_drop_times_holds_under_concurrency(served: HTTPFileServer):
    url = served.url_for("shard-000.tar")
    served.set_faults(FaultPlan(drop_after_bytes=1000, drop_times=2))
    results = _http_fs().cat_ranges([url] * 8, [0] * 8, [50_000] * 8, on_error="return")
    errors = [r for r in results if isinstance(r, Exception)]
    assert len(errors) == 2 and all(isinstance(e, aiohttp.ClientPayloadError) for e in errors)
    assert all(r == PAYLOAD[:50_000] for r in results if not isinstance(r, Exception))
    assert (served.stats.drops, served.stats.completed_gets) == (2, 6)


def test_http_drop_with_reset(served: HTTPFileServer):
    url = served.url_for("shard-000.tar")
    served.set_faults(FaultPlan(drop_after_bytes=100_000, drop_with_reset=True))
    with pytest.raises((aiohttp.ClientPayloadError, aiohttp.ClientOSError)):
        _http_fs().cat_file(url)
    assert served.stats.drops == 1


def test_http_drop_every_bytes_is_cumulative(served: HTTPFileServer):
    url = served.url_for("shard-000.tar")
    served.set_faults(FaultPlan(drop_every_bytes=25_000))
    fs = _http_fs()
    assert fs.cat_file(url, start=0, end=10_000) == PAYLOAD[:10_000]
    assert fs.cat_file(url, start=0, end=10_000) == PAYLOAD[:10_000]
    with pytest.raises(aiohttp.ClientPayloadError):  # 5_000 more, then the cut
        fs.cat_file(url, start=0, end=10_000)
    assert served.stats.bytes_served == 25_000 and served.stats.drops == 1
    # counting restarts after a drop; a resuming reader makes progress each time
    got = b""
    for _ in range(len(PAYLOAD) // 25_000 + 3):  # bounded
        if len(got) == len(PAYLOAD):
            break
        u = urllib.parse.urlsplit(url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
        conn.request("GET", u.path, headers={"Range": f"bytes={len(got)}-"})
        r = conn.getresponse()
        try:
            got += r.read()
        except http.client.IncompleteRead as e:
            got += e.partial
        conn.close()
    assert got == PAYLOAD
    assert served.stats.drops == 1 + len(PAYLOAD) // 25_000


def test_http_path_filter_and_swap(served: HTTPFileServer):
    fs = _http_fs()
    served.set_faults(FaultPlan(status_503_times=10, path_contains="shard-"))
    assert fs.cat_file(served.url_for("sub/small.bin")) == b"hello world"
    with pytest.raises(aiohttp.ClientResponseError):
        fs.cat_file(served.url_for("shard-000.tar"))
    assert served.stats.get_requests == 1  # only the matching GET counts
    served.set_faults(FaultPlan())  # swapped at runtime; counters reset
    assert served.stats == FaultStats()
    assert fs.cat_file(served.url_for("shard-000.tar")) == PAYLOAD
    served.set_faults(FaultPlan(status_503_times=1))
    served.clear_faults()
    assert served.stats.requests == 0 and fs.cat_file(served.url_for("sub/small.bin"))


def test_http_stall(served: HTTPFileServer):
    url = served.url_for("sub/small.bin")
    fs = _http_fs(timeout=aiohttp.ClientTimeout(sock_read=0.4))
    served.set_faults(FaultPlan(stall_seconds=1.0, stall_times=1))
    t0 = time.monotonic()
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.read() == b"hello world"
    assert 0.95 <= time.monotonic() - t0 < 3.0
    t0 = time.monotonic()
    # stall_times used up: no delay (a generous read timeout, so a busy CI machine cannot fail it;
    # a stall would take the full 1.0 s)
    assert _http_fs(timeout=aiohttp.ClientTimeout(sock_read=10)).cat_file(url) == b"hello world"
    assert time.monotonic() - t0 < 0.95
    # stall beyond the client's read timeout: FSTimeoutError (an asyncio/builtin TimeoutError)
    for before_headers in (False, True):
        served.set_faults(FaultPlan(stall_seconds=2.0, stall_before_headers=before_headers))
        t0 = time.monotonic()
        with pytest.raises(FSTimeoutError) as ei:
            fs.cat_file(url)
        assert isinstance(ei.value, asyncio.TimeoutError)
        assert time.monotonic() - t0 < 1.8
        assert served.stats.stalls == 1


def test_close_is_prompt_with_open_connections_and_stalls(tmp_path):
    (tmp_path / "f").write_bytes(b"x" * 100)
    srv = HTTPFileServer(tmp_path, FaultPlan(stall_seconds=5.0, stall_times=None))
    # an idle keep-alive connection and a request stuck in a stall
    idle = http.client.HTTPConnection(LOOPBACK, srv.port, timeout=10)
    idle.request("HEAD", "/f")
    idle.getresponse().read()
    stuck = http.client.HTTPConnection(LOOPBACK, srv.port, timeout=10)
    stuck.request("GET", "/f")
    time.sleep(0.1)
    t0 = time.monotonic()
    srv.close()
    assert time.monotonic() - t0 < 2.0
    with pytest.raises((http.client.HTTPException, OSError)):
        stuck.getresponse().read()
    idle.close()
    stuck.close()
