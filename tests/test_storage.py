"""storage.RangeReader against real loopback servers: answers, options, the cat_file fallback."""
from __future__ import annotations

import functools
import http.server
import os
import threading

import aiohttp
import fsspec
import pytest

from servers import FaultPlan
from streamwin import storage
from streamwin.storage import BrokenRead, RangeReader, url_to_fs

DATA = os.urandom(300_000)


@pytest.fixture
def served(tmp_path, http_server):
    (tmp_path / "f.bin").write_bytes(DATA)
    return http_server(tmp_path)


def read(reader: RangeReader, path: str, offset: int, n: int) -> bytes:
    out = bytearray(n)
    got = reader.read_into(path, offset, memoryview(out))
    return bytes(out[:got])


def test_http_ranges_streamed_on_one_pooled_connection(served):
    fs, path = url_to_fs(served.url_for("f.bin"))
    r = RangeReader(fs)
    assert r.kind == "http"
    assert read(r, path, 0, 1000) == DATA[:1000]
    assert read(r, path, 5000, 200_000) == DATA[5000:205_000]
    assert read(r, path, len(DATA) - 10, 100) == DATA[-10:]  # clipped at the object's end: short, no error
    assert read(r, path, len(DATA), 100) == b""  # 416: no byte there
    assert served.stats.requests == 4
    (pool,) = r._pool.pools._container.values()
    assert pool.num_connections == 1


def test_http_answers_missing_and_broken(served):
    fs, path = url_to_fs(served.url_for("f.bin"))
    r = RangeReader(fs)
    with pytest.raises(FileNotFoundError):
        read(r, served.url_for("missing.bin"), 0, 10)
    served.set_faults(FaultPlan(drop_after_bytes=70_000))
    with pytest.raises(BrokenRead) as info:
        read(r, path, 100, 200_000)
    assert info.value.delivered == 70_000 and info.value.__cause__ is not None
    served.set_faults(FaultPlan(status_503_times=1))
    with pytest.raises(BrokenRead, match="HTTP 503") as info:
        read(r, path, 100, 200_000)
    assert info.value.delivered == 0


def test_server_that_ignores_range(tmp_path):
    """A 200 with the whole object serves a read from offset 0; from elsewhere it is an error."""
    (tmp_path / "f.bin").write_bytes(DATA)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a: None
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        fs, path = url_to_fs(f"http://127.0.0.1:{srv.server_address[1]}/f.bin")
        r = RangeReader(fs)
        assert read(r, path, 0, 5000) == DATA[:5000]
        with pytest.raises(BrokenRead, match="ignored the Range header"):
            read(r, path, 10, 5000)
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.filterwarnings("ignore:BasicAuth is deprecated:DeprecationWarning")
def test_http_options_reach_the_request(served):
    opts = {"client_kwargs": {"headers": {"X-Token": "a"}, "timeout": aiohttp.ClientTimeout(sock_read=0.5)},
            "headers": {"X-Other": "b"}, "auth": aiohttp.BasicAuth("u", "p")}
    fs, _ = url_to_fs(served.url_for("f.bin"), opts)
    r = RangeReader(fs)
    assert r.kind == "http"
    assert r.headers["X-Token"] == "a" and r.headers["X-Other"] == "b"
    assert r.headers["Authorization"] == aiohttp.BasicAuth("u", "p").encode()
    assert r._pool.connection_pool_kw["timeout"].read_timeout == 0.5
    # an option a plain GET cannot honour: fsspec's own client reads the range, in chunks
    fs, path = url_to_fs(served.url_for("f.bin"), {"client_kwargs": {"trust_env": True}})
    assert RangeReader(fs).kind is None
    assert read(RangeReader(fs), path, 5, 100) == DATA[5:105]


def test_other_filesystems_read_in_chunks(monkeypatch):
    fs = fsspec.filesystem("memory")
    fs.pipe("/sw-storage-test/f.bin", DATA)
    monkeypatch.setattr(storage, "CHUNK", 4096)
    r = RangeReader(fs)
    assert r.kind is None
    assert read(r, "/sw-storage-test/f.bin", 100, 100_000) == DATA[100:4196]  # one chunk per call
    fs.rm("/sw-storage-test/f.bin")


def test_s3_reads_through_a_presigned_url(s3_server, s3_bucket):
    fs = s3_server.filesystem()
    path = f"{s3_bucket[5:]}/obj.bin"
    fs.pipe(path, DATA)
    r = RangeReader(fs)
    assert r.kind == "s3"
    assert read(r, path, 1234, 100_000) == DATA[1234:101_234]
    assert "Signature=" in r._signed[path][0]  # signed once, then reused
    assert read(r, path, 0, 10) == DATA[:10] and len(r._signed) == 1
    with pytest.raises(FileNotFoundError):
        read(r, f"{s3_bucket[5:]}/missing.bin", 0, 10)


@pytest.mark.parametrize("kind", ["end-before-start", "empty", "wrong-start", "garbage"])
def test_http_206_that_does_not_match_the_request_is_one_failed_attempt(served, kind):
    """A malformed 206 is a failed attempt (BrokenRead naming the answer), after exactly one GET."""
    fs, path = url_to_fs(served.url_for("f.bin"))
    r = RangeReader(fs)
    served.set_faults(FaultPlan(bad_content_range=kind, bad_range_times=1))
    with pytest.raises(BrokenRead, match="Content-Range") as info:
        read(r, path, 100, 1000)
    assert info.value.delivered == 0
    assert served.stats.get_requests == 1 and served.stats.bad_ranges == 1
    assert read(r, path, 100, 1000) == DATA[100:1100]  # the next attempt, answered right, reads the range
