"""Transient storage faults: the epoch is exact anyway, streamwin's own retries are counted.

A dataset is served over loopback HTTP (tests/servers.py HTTPFileServer) and over S3 (moto
behind S3FaultProxy) with injected faults: connections dropped mid-shard, stalls, 503/500
answers. Each faulty epoch must yield the very same batches (keys, starts, x bytes) as a
fault-free local read of the same dataset, and that local read is itself checked window by
window against the original arrays. When the retries are spent, the ShardError names the
shard URL and the byte offset.
"""
from __future__ import annotations

import os
import tarfile
import time

import aiohttp
import numpy as np
import pytest

import streamwin as sw
import streamwin.read.remote as sw_remote
from conftest import make_sequences, reference_windows
from servers import FaultPlan

W, S, H, B = 16, 8, 4, 8
SHARDS = "shard-"  # FaultPlan.path_contains: fault the shard GETs, not index.json

pytestmark = pytest.mark.timeout(120)


LOADER_DEFAULTS: dict = {}  # more read options of every make_loader (fast_backoff sets one)


def make_loader(url, **read):
    """A loader of ``url`` reading with ``sw.Read(**read)`` (and LOADER_DEFAULTS)."""
    return sw.WindowLoader(sw.WindowDataset(url, window=W, stride=S, horizon=H, batch_size=B, shuffle_buffer=300,
                                            seed=1, read=sw.Read(**(LOADER_DEFAULTS | read))))


def epoch(loader):
    """(keys, starts, x bytes, y bytes) of every batch, in order."""
    return [(list(b["key"]), b["start"].tolist(), b["x"].numpy().tobytes(), b["y"].numpy().tobytes())
            for b in loader]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """(root dir holding ds/, sequences, reference epoch read from the local files)."""
    seqs = make_sequences(seed=3)
    root = tmp_path_factory.mktemp("faults")
    sw.pack(list(seqs.items()), str(root / "ds"), shard_bytes=40_000, progress=False)
    loader = make_loader(str(root / "ds"))
    ref = epoch(loader)
    # the local reference is itself exact: every window equals the naive slice of its sequence
    assert len(ref) == len(loader) > 20
    seen = []
    for keys, starts, xb, yb in ref:
        x = np.frombuffer(xb, np.float32).reshape(B, W, 3)
        y = np.frombuffer(yb, np.float32).reshape(B, H, 3)
        for i, (k, s) in enumerate(zip(keys, starts)):
            assert np.array_equal(x[i], seqs[k][s : s + W]) and np.array_equal(y[i], seqs[k][s + W : s + W + H])
            seen.append((k, s))
    assert len(set(seen)) == len(seen) and set(seen) <= reference_windows(seqs, W, S, H)
    return root, seqs, ref


def shard_members(path):
    """[(name, data offset, size)] of a tar shard, read with the standard library."""
    with tarfile.open(path) as tf:
        return [(m.name, m.offset_data, m.size) for m in tf.getmembers()]


def index_size(root):
    return os.path.getsize(root / "ds" / "index.json")


@pytest.fixture
def fast_backoff(monkeypatch):
    """Retries 1 ms apart instead of retry_backoff's 0.2 s, in every make_loader of the test."""
    monkeypatch.setitem(LOADER_DEFAULTS, "retry_backoff", 0.001)


# -- HTTP -----------------------------------------------------------------------------------------

def test_http_fault_free_is_exact_and_retry_free(dataset, http_server):
    root, _, ref = dataset
    srv = http_server(root)
    loader = make_loader(srv.url_for("ds"))
    assert epoch(loader) == ref
    st = loader.stats()
    assert st["retries"] == 0 and st["skipped_ranges"] == 0
    assert srv.stats.faults_injected == 0


@pytest.mark.parametrize("plan", [
    FaultPlan(drop_after_bytes=1000, drop_times=3, path_contains=SHARDS),
    FaultPlan(drop_after_bytes=700, drop_times=3, drop_with_reset=True, path_contains=SHARDS),
    FaultPlan(drop_every_bytes=40_000, path_contains=SHARDS),  # an epoch reads ~150 kB
], ids=["drop-fin", "drop-rst", "drop-every-40k"])
def test_http_dropped_connections_mid_shard(dataset, http_server, fast_backoff, plan):
    root, _, ref = dataset
    srv = http_server(root, plan)
    loader = make_loader(srv.url_for("ds"), retries=6)
    assert epoch(loader) == ref
    drops = srv.stats.drops
    assert drops >= 3
    st = loader.stats()
    assert st["retries"] == drops  # every broken body was retried by streamwin itself (fsspec http never retries)
    assert st["skipped_ranges"] == 0


def test_http_retry_resumes_at_the_byte_that_broke(dataset, http_server, fast_backoff):
    """A drop costs no body byte: each retry asks for exactly the bytes not delivered yet.

    Every body byte the server sent (it counts them, the cut responses' partial bodies too)
    is a byte the loader needed: what it served equals index.json plus the loader's
    ``bytes_read`` and ``bytes_sums`` (the shards' checksums). Only the retried requests'
    headers are extra.
    """
    root, _, ref = dataset
    srv = http_server(root, FaultPlan(drop_every_bytes=6_000, path_contains=SHARDS))  # ~30 drops in ~180 kB read
    loader = make_loader(srv.url_for("ds"), retries=30)
    assert epoch(loader) == ref
    st, fs = loader.stats(), srv.stats
    assert fs.drops >= 20
    assert st["retries"] == fs.drops
    assert fs.bytes_served - index_size(root) == st["bytes_read"] + st["bytes_sums"], (fs.bytes_served, st)


def test_http_every_response_cut_after_a_few_kb_still_completes(dataset, http_server, fast_backoff):
    """Every shard GET breaks after 6,000 body bytes, however long its range.

    Each attempt keeps its 6,000 bytes and the next asks for the rest, so a read never fails
    twice in a row and ``retries=1`` suffices. (A reader that drops the bytes it buffered
    before the break, as aiohttp's does, never gets past the first 6,000.)
    """
    root, _, ref = dataset
    srv = http_server(root, FaultPlan(drop_after_bytes=6_000, drop_times=None, path_contains=SHARDS))
    loader = make_loader(srv.url_for("ds"), retries=1)
    assert epoch(loader) == ref
    st, fs = loader.stats(), srv.stats
    assert fs.drops > 2 * len(loader.dataset.manifest.shards)
    assert st["retries"] == fs.drops
    assert fs.bytes_served - index_size(root) == st["bytes_read"] + st["bytes_sums"]  # shards' and sums files' bytes


def test_http_retries_count_failures_in_a_row_not_per_range(dataset, http_server, monkeypatch, fast_backoff):
    """A long range that keeps making progress between drops is read, however many drops it takes.

    ``retries`` bounds the attempts that make no progress; a stream that breaks every few
    KB but always advances (a flaky link under a 256 MB shard) must not run out of them.
    """
    root, _, ref = dataset
    monkeypatch.setattr(sw_remote, "CONNECTIONS", 1)  # one GET at a time: each breaks once per 6,000 bytes
    srv = http_server(root, FaultPlan(drop_every_bytes=6_000, path_contains=SHARDS))
    loader = make_loader(srv.url_for("ds"), retries=1)
    assert epoch(loader) == ref
    assert loader.stats()["retries"] == srv.stats.drops > 2 * len(loader.dataset.manifest.shards)


def test_http_stall_shorter_than_timeout_only_delays(dataset, http_server):
    root, _, ref = dataset
    srv = http_server(root, FaultPlan(stall_seconds=0.3, stall_times=3, path_contains=SHARDS))
    loader = make_loader(srv.url_for("ds"))
    assert epoch(loader) == ref
    assert srv.stats.stalls == 3
    assert loader.stats()["retries"] == 0


def test_http_stall_past_read_timeout_is_retried(dataset, http_server):
    root, _, ref = dataset
    srv = http_server(root, FaultPlan(stall_seconds=2.0, stall_times=2, path_contains=SHARDS))
    opts = {"client_kwargs": {"timeout": aiohttp.ClientTimeout(total=None, sock_read=0.5)}}
    loader = make_loader(srv.url_for("ds"), storage_options=opts, retries=4)
    assert epoch(loader) == ref
    assert srv.stats.stalls == 2
    assert loader.stats()["retries"] >= 2  # each stalled GET timed out and was retried (a slow CI box may add one)


@pytest.mark.parametrize("status", [503, 500])
def test_http_error_status_for_the_first_k_shard_gets(dataset, http_server, fast_backoff, status):
    root, _, ref = dataset
    srv = http_server(root, FaultPlan(status_503_times=4, error_status=status, path_contains=SHARDS))
    loader = make_loader(srv.url_for("ds"), retries=5)
    assert epoch(loader) == ref
    assert srv.stats.status_errors == 4
    assert loader.stats()["retries"] == 4


def test_http_503_for_the_first_k_requests_of_any_kind(dataset, http_server):
    """The first GETs a job makes are for index.json: a transient 503 there must be retried too."""
    root, _, ref = dataset
    srv = http_server(root, FaultPlan(status_503_times=2))
    loader = make_loader(srv.url_for("ds"), retries=5)
    assert epoch(loader) == ref
    assert srv.stats.status_errors == 2


def test_http_permanent_503_names_url_and_offset(dataset, http_server):
    root, _, _ = dataset
    srv = http_server(root, FaultPlan(status_503_times=10**6, path_contains=SHARDS))
    loader = make_loader(srv.url_for("ds"), retries=2)
    t0 = time.perf_counter()
    with pytest.raises(sw.ShardError) as info:
        epoch(loader)
    assert time.perf_counter() - t0 < 20  # backoff 0.2 + 0.4 s (the default), not a hang
    err = info.value
    name = err.shard.rsplit("/", 1)[-1]
    assert err.shard == srv.url_for(f"ds/{name}") and name.startswith("shard-") and name.endswith(".tar")
    assert isinstance(err.offset, int)
    # the offset is where a member's bytes are read from: inside a member (its tar header, which is checked, or data)
    members = shard_members(root / "ds" / name)
    assert any(off - 512 <= err.offset < off + size for _, off, size in members), (err.offset, members)
    text = str(err)
    assert err.shard in text and f"byte offset {err.offset}" in text and "503" in text
    assert srv.stats.status_errors >= 3  # the first try and its 2 retries


# -- S3 (moto behind the fault proxy) -----------------------------------------------------------------

@pytest.fixture(scope="module")
def s3_dataset(dataset, s3_server):
    """The same sequences packed to S3 (same shard size, so the same plan and batches)."""
    _, seqs, ref = dataset
    url = f"{s3_server.make_bucket()}/ds"
    sw.pack(list(seqs.items()), url, shard_bytes=40_000, progress=False, storage_options=s3_server.storage_options())
    return url, ref


def few_retries(proxy, monkeypatch):
    """Storage options with botocore's retries off, and s3fs' own retry loop cut to one attempt."""
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    return proxy.storage_options(config_kwargs={"retries": {"total_max_attempts": 1, "mode": "standard"}},
                                 skip_instance_cache=True)


@pytest.mark.parametrize("plan", [
    FaultPlan(status_503_times=3, error_status=503, path_contains=SHARDS),
    FaultPlan(status_503_times=3, error_status=500, path_contains=SHARDS),
    FaultPlan(drop_after_bytes=1000, drop_times=3, path_contains=SHARDS),
], ids=["SlowDown-503", "InternalError-500", "drop"])
def test_s3_errors_are_retried_by_streamwin(s3_dataset, s3_fault_proxy, monkeypatch, fast_backoff, plan):
    url, ref = s3_dataset
    proxy = s3_fault_proxy(plan)
    loader = make_loader(url, storage_options=few_retries(proxy, monkeypatch), retries=5)
    assert epoch(loader) == ref
    assert proxy.stats.faults_injected == 3
    assert loader.stats()["retries"] == 3


def test_s3_drops_with_s3fs_defaults_still_exact(s3_dataset, s3_fault_proxy):
    """With s3fs' default options too, shard bytes come from streamwin's own GETs: it resumes each drop."""
    url, ref = s3_dataset
    proxy = s3_fault_proxy(FaultPlan(drop_after_bytes=500, drop_times=2, path_contains=SHARDS))
    loader = make_loader(url, storage_options=proxy.storage_options())
    assert epoch(loader) == ref
    assert proxy.stats.drops == 2
    assert loader.stats()["retries"] == 2


def test_s3_drop_mid_body_resumes_at_the_byte(s3_dataset, s3_fault_proxy, s3_server, monkeypatch, fast_backoff):
    """Every GetObject of a shard breaks after 6,000 bytes; each retry asks for the rest only."""
    url, ref = s3_dataset
    proxy = s3_fault_proxy(FaultPlan(drop_after_bytes=6_000, drop_times=None, path_contains=SHARDS))
    loader = make_loader(url, storage_options=few_retries(proxy, monkeypatch), retries=1)
    assert epoch(loader) == ref
    st, fs = loader.stats(), proxy.stats
    assert fs.drops > 2 * len(loader.dataset.manifest.shards)
    assert st["retries"] == fs.drops
    index = s3_server.filesystem().size(f"{url}/index.json")
    assert fs.bytes_served - index == st["bytes_read"] + st["bytes_sums"], (fs.bytes_served, index, st)


def test_s3_permanent_error_names_url_and_offset(s3_dataset, s3_fault_proxy, monkeypatch, fast_backoff, dataset):
    url, _ = s3_dataset
    root = dataset[0]
    proxy = s3_fault_proxy(FaultPlan(status_503_times=10**6, error_status=503, path_contains=SHARDS))
    loader = make_loader(url, storage_options=few_retries(proxy, monkeypatch), retries=2)
    with pytest.raises(sw.ShardError) as info:
        epoch(loader)
    err = info.value
    name = err.shard.rsplit("/", 1)[-1]
    assert err.shard == f"{url}/{name}" and err.shard.startswith("s3://")
    members = shard_members(root / "ds" / name)  # the local copy has the same bytes
    assert any(off - 512 <= err.offset < off + size for _, off, size in members)  # its tar header, or data
    assert err.shard in str(err) and f"byte offset {err.offset}" in str(err)
    assert proxy.stats.status_errors >= 3


# -- answers that do not match the request ------------------------------------------------------------

def test_http_malformed_206_is_a_bounded_counted_failure(dataset, http_server, fast_backoff):
    """A 206 whose Content-Range ends before it starts: each GET is one failed attempt, then a ShardError."""
    root, _, ref = dataset
    retries = 2
    srv = http_server(root, FaultPlan(bad_content_range="end-before-start", path_contains=SHARDS))
    loader = make_loader(srv.url_for("ds"), retries=retries)
    with pytest.raises(sw.ShardError, match="Content-Range") as info:
        epoch(loader)
    runs = len(sw.load_manifest(str(root / "ds")).length)  # a block reads at most one run per sequence
    gets = srv.stats.get_requests
    assert 0 < gets <= (retries + 1) * runs, gets  # before: ~980 GETs per attempt, until a RecursionError
    assert srv.stats.bad_ranges == gets
    assert info.value.shard.startswith(srv.url_for("ds/shard-")) and isinstance(info.value.offset, int)


def test_http_malformed_206_now_and_then_is_retried(dataset, http_server, fast_backoff):
    root, _, ref = dataset
    srv = http_server(root, FaultPlan(bad_content_range="empty", bad_range_times=3, path_contains=SHARDS))
    loader = make_loader(srv.url_for("ds"), retries=3)
    assert epoch(loader) == ref
    assert srv.stats.bad_ranges == 3 == loader.stats()["retries"]
