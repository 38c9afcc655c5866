"""storage.RangeReader against real loopback servers: answers, options, the cat_file fallback."""
from __future__ import annotations

import functools
import hashlib
import http.server
import os
import socket
import threading
import time

import aiohttp
import fsspec
import numpy as np
import pytest

import streamwin as sw
from servers import FaultPlan, s3_storage_options
from streamwin.storage import ranged as storage
from streamwin.read import ReadOptions, ShardReader
from streamwin.storage.ranged import BrokenRead, RangeReader
from streamwin.storage.urls import url_to_fs

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


# -- unreachable endpoints and missing credentials fail fast; transient errors are retried by us only ---

def closed_port() -> int:
    """A loopback port nobody listens on: connecting is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_s3_connection_refused_fails_fast_naming_url():
    endpoint = f"http://127.0.0.1:{closed_port()}"
    opts = s3_storage_options(endpoint)
    t0 = time.perf_counter()
    with pytest.raises(sw.ManifestError) as info:  # the dataset reads index.json, with the default retries and backoff
        sw.WindowDataset("s3://bucket/ds", window=8, batch_size=4, read=sw.Read(storage_options=opts))
    assert time.perf_counter() - t0 < 15  # before: ~51 s (botocore's retries inside each of ours)
    text = str(info.value)
    assert "s3://bucket/ds/index.json" in text and endpoint in text and "connection refused" in text
    t0 = time.perf_counter()  # not one retry: with a 10 s backoff a single one would show
    with pytest.raises(sw.ManifestError, match="connection refused"):
        sw.load_manifest("s3://bucket/ds", opts, retries=5, backoff=10)
    assert time.perf_counter() - t0 < 10


def test_s3_shard_read_connection_refused_fails_fast(tmp_path):
    """The manifest was read, then the endpoint went away: the first shard read fails at once, naming it."""
    seqs = {f"k{i}": np.arange(64, dtype=np.float32) for i in range(4)}
    sw.pack(list(seqs.items()), str(tmp_path / "ds"), progress=False)
    ds = sw.WindowDataset(str(tmp_path / "ds"), window=8, batch_size=4)
    opts = s3_storage_options(f"http://127.0.0.1:{closed_port()}")
    source = ShardReader("s3://bucket/ds", ds.manifest, ReadOptions(storage_options=opts, retries=5, retry_backoff=10))
    t0 = time.perf_counter()
    with pytest.raises(sw.ShardError, match="connection refused") as info:
        source.read_block(ds.plan().schedule(0).plans[0], 0, 0)
    assert time.perf_counter() - t0 < 10
    assert info.value.shard == f"s3://bucket/ds/{ds.manifest.shards[0].name}" and source.stats.retries == 0


@pytest.fixture
def no_aws_credentials(monkeypatch, tmp_path):
    """No credentials anywhere botocore looks (env, files, instance metadata)."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
                 "AWS_PROFILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                 "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def test_s3_missing_credentials_fail_fast_and_say_so(s3_server, no_aws_credentials):
    opts = {"client_kwargs": {"endpoint_url": s3_server.endpoint_url, "region_name": "us-east-1"}, "anon": False,
            "skip_instance_cache": True}
    t0 = time.perf_counter()
    with pytest.raises(sw.ManifestError) as info:
        sw.load_manifest("s3://bucket/ds", opts, retries=5, backoff=10)
    assert time.perf_counter() - t0 < 10  # before: retried (6 s with the default backoff, 310 s with this one)
    text = str(info.value)
    assert "s3://bucket/ds/index.json" in text and "no credentials" in text


def test_s3_transient_errors_are_retried_by_streamwin_only(s3_server, s3_bucket, s3_fault_proxy):
    """With s3fs' default options, a 503 on index.json is retried by streamwin alone, one GET per attempt."""
    url = f"{s3_bucket}/ds"
    sw.pack([("k", np.arange(64, dtype=np.float32))], url, progress=False, storage_options=s3_server.storage_options())
    proxy = s3_fault_proxy(FaultPlan(status_503_times=2, path_contains="index.json"))
    opts = proxy.storage_options(skip_instance_cache=True)
    with pytest.raises(sw.ManifestError, match="503|SlowDown|reduce your request rate"):
        sw.load_manifest(url, opts, retries=1, backoff=0.01)
    assert proxy.stats.get_requests == 2  # botocore and s3fs did not retry inside our attempts
    proxy.set_faults(FaultPlan(status_503_times=2, path_contains="index.json"))
    assert sw.load_manifest(url, opts, retries=2, backoff=0.01).num_sequences == 1
    assert proxy.stats.get_requests == 3



def test_shutdown_stops_the_readers_get_threads_and_a_later_read_starts_them_again(tmp_path, http_server):
    """A block of runs in several shards is read by concurrent GETs; ``shutdown`` ends those threads."""
    seqs = {f"k{i:02d}": np.arange(i * 1000, i * 1000 + 900, dtype=np.float32) for i in range(40)}
    sw.pack(list(seqs.items()), str(tmp_path / "ds"), shard_bytes=8_000, progress=False)
    ds = sw.WindowDataset(http_server(tmp_path).url_for("ds"), window=100, batch_size=4,
                          order=sw.Order(slice_windows=2))
    plan, reader = ds.plan().schedule(0).plans[0], ShardReader(ds.url, ds.manifest, ReadOptions())
    before = set(threading.enumerate())
    block = reader.read_block(plan, 0, 0)
    gets = [t for t in set(threading.enumerate()) - before if t.name.startswith("streamwin-get")]
    assert len(ds.manifest.shards) > 2 and len(gets) > 1
    first = [block.buf[o : o + 400].tobytes() for o in block.offs]
    reader.shutdown()
    for t in gets:  # idle threads end as soon as they see the pool shut (shutdown does not wait on a GET)
        t.join(2.0)
    assert not any(t.is_alive() for t in gets)
    again = reader.read_block(plan, 0, 0)
    assert [again.buf[o : o + 400].tobytes() for o in again.offs] == first
    keys = ds.manifest.keys(block.seq_ids[block.key_index])  # each window is its sequence's slice (4-byte steps)
    assert first == [seqs[k][s : s + 100].tobytes() for k, s in zip(keys, block.start)]
    reader.shutdown()


READ_TRACED = """
import hashlib, sys, tracemalloc
from streamwin.storage.ranged import RangeReader
from streamwin.storage.urls import url_to_fs
url, size = sys.argv[1], int(sys.argv[2])
fs, path = url_to_fs(url)
r = RangeReader(fs)
out = bytearray(size)
r.read_into(path, 0, memoryview(out)[:10])  # the connection and its buffers exist before the measurement
tracemalloc.start()
before = tracemalloc.get_traced_memory()[0]
got = r.read_into(path, 1000, memoryview(out))
print(got, tracemalloc.get_traced_memory()[1] - before, hashlib.sha256(out).hexdigest())
"""


def test_streamed_range_is_read_into_the_callers_buffer(tmp_path, http_server):
    """A ranged GET fills the caller's buffer from the socket: no bytes object per socket read.

    Read as bytes objects (1 MB asked for each socket read, shrunk to what had arrived), the
    concurrent GETs of a block fragmented glibc's heaps, and over http a process's memory grew
    with the bytes it had read (+40 MB over a 1 GB epoch, benchmarks/longseq.py). Measured in a
    subprocess: the server's own buffers are not counted.
    """
    import subprocess
    import sys

    data = os.urandom(4 << 20)
    (tmp_path / "big.bin").write_bytes(data)
    srv = http_server(tmp_path)
    size = len(data) - 1000
    run = subprocess.run([sys.executable, "-c", READ_TRACED, srv.url_for("big.bin"), str(size)], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=os.getcwd()), check=True)
    got, peak, digest = run.stdout.split()
    assert int(got) == size and digest == hashlib.sha256(data[1000:]).hexdigest()
    peak = int(peak)
    assert peak < 32 << 10, peak  # a few small objects (the answer's headers), never a piece of the body
