"""The node-local shard cache: fetched once per node, verified, LRU-evicted, safe.

Shards are served by the loopback HTTP server, whose counters tell how many GETs for shard
data reached it: a warm cache must cause none, eight racing processes must cause as many
as one fetch does. Contents are compared with the served files and, through the loader,
with the original arrays.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import multiprocessing as mp
import os
import shutil
import tarfile
import time
from pathlib import Path

import fsspec
import numpy as np
import pytest

import streamwin as sw
from conftest import forbid_unpickling, make_sequences
from servers import FaultPlan
from streamwin.storage.cache import ShardCache
from streamwin.formats.manifest import INDEX_NAME, ShardEntry, build_manifest, parse_manifest

W, S, H, B = 16, 8, 4, 8
SHARDS = FaultPlan(path_contains="shard-")  # count shard GETs only (not index.json)

pytestmark = pytest.mark.timeout(120)


def make_loader(url, order=None, **read):
    """A loader of ``url`` reading with ``sw.Read(**read)``."""
    return sw.WindowLoader(sw.WindowDataset(str(url), window=W, stride=S, horizon=H, batch_size=B, shuffle_buffer=300,
                                            seed=4, order=order, read=sw.Read(**read)))


def epoch(loader):
    return [(list(b["key"]), b["start"].tolist(), b["x"].numpy().tobytes()) for b in loader]


def check_exact(batches, seqs):
    """Every window equals the naive slice of its original sequence."""
    n = 0
    for keys, starts, xb in batches:
        x = np.frombuffer(xb, np.float32).reshape(len(keys), W, 3)
        for i, (k, s) in enumerate(zip(keys, starts)):
            assert np.array_equal(x[i], seqs[k][s : s + W]), (k, s)
            n += 1
    assert n > 0


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def cache_files(cache_dir) -> list[str]:
    """Shard copies in the cache (lock files and the shards' sums files aside)."""
    return sorted(n for n in os.listdir(cache_dir) if not n.endswith((".lock", "_sums")))


def all_files(root) -> set[str]:
    return {os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(root dir holding ds/, sequences, manifest): a small dataset of 5 shards."""
    seqs = make_sequences(seed=7)
    root = tmp_path_factory.mktemp("cache")
    sw.pack(list(seqs.items()), str(root / "ds"), shard_bytes=40_000, progress=False)
    m = sw.load_manifest(str(root / "ds"))
    assert len(m.shards) >= 4
    return root, seqs, m


def shard_gets(srv) -> int:
    return srv.stats.get_requests


# -- second epoch from the cache ---------------------------------------------------------------

def test_second_epoch_reads_from_cache(served, http_server, tmp_path):
    root, seqs, m = served
    srv = http_server(root, SHARDS)
    cache_dir = tmp_path / "cache"
    loader = make_loader(srv.url_for("ds"), cache_dir=str(cache_dir))
    first = epoch(loader)
    check_exact(first, seqs)
    assert first == epoch(make_loader(root / "ds"))  # same batches as a plain local read
    cold = shard_gets(srv)
    assert cold >= len(m.shards)
    # one verified copy per shard, byte-identical to the served file
    assert len(cache_files(cache_dir)) == len(m.shards)
    cache = ShardCache(str(cache_dir))
    for s in m.shards:
        assert sha256(cache.local_path(f"{srv.url_for('ds')}/{s.name}", s)) == sha256(root / "ds" / s.name) == s.sha256

    loader.set_epoch(1)
    second = epoch(loader)
    check_exact(second, seqs)
    assert second != first  # a new order, read from the cache
    assert shard_gets(srv) == cold  # not one GET for shard data
    assert loader.stats()["cache_hits"] > 0
    # a fresh loader (another process on the node, a restarted job) uses the same cache
    again = make_loader(srv.url_for("ds"), cache_dir=str(cache_dir))
    assert epoch(again) == first and shard_gets(srv) == cold
    assert again.stats()["cache_hits"] > 0


# -- eight processes racing for one shard ----------------------------------------------------------

def _race(url, cache_dir, entry, barrier, results):
    try:
        fs = fsspec.filesystem("http", skip_instance_cache=True)
        cache = ShardCache(cache_dir)
        barrier.wait(timeout=60)
        local = cache.fetch(url, fs, url, entry)
        results.put((os.getpid(), cache.misses, cache.hits, sha256(local), local))
    except BaseException as e:  # report, never hang the parent
        results.put((os.getpid(), repr(e), None, None, None))


def test_eight_processes_fetch_a_shard_once(served, http_server, tmp_path):
    root, _, m = served
    entry = m.shards[1]
    srv = http_server(root, SHARDS)
    url = srv.url_for(f"ds/{entry.name}")
    # what one fetch costs, alone
    ShardCache(str(tmp_path / "alone")).fetch(url, fsspec.filesystem("http", skip_instance_cache=True), url, entry)
    one_fetch = shard_gets(srv)
    assert one_fetch >= 1
    # the first GET stalls, so that the seven others are surely waiting while it downloads
    srv.set_faults(FaultPlan(stall_seconds=0.5, stall_times=1, path_contains="shard-"))
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(8), ctx.Queue()
    cache_dir = str(tmp_path / "cache")
    procs = [ctx.Process(target=_race, args=(url, cache_dir, entry, barrier, results)) for _ in range(8)]
    for p in procs:
        p.start()
    got = [results.get(timeout=90) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert all(isinstance(g[1], int) for g in got), got
    assert sum(g[1] for g in got) == 1  # one miss on the node
    assert sum(g[2] for g in got) == 7  # seven found it there
    assert shard_gets(srv) == one_fetch  # the server saw one download
    assert srv.stats.stalls == 1
    assert {g[3] for g in got} == {entry.sha256} and sha256(root / "ds" / entry.name) == entry.sha256
    assert len({g[4] for g in got}) == 1
    assert cache_files(cache_dir) == [os.path.basename(got[0][4])]  # no temporaries left


# -- verification -------------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_remote_shard_is_refused_and_not_cached(served, http_server, tmp_path, damage):
    root, _, m = served
    bad_root = tmp_path / "srv"
    shutil.copytree(root / "ds", bad_root / "ds")
    entry = m.shards[2]
    path = bad_root / "ds" / entry.name
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01  # one bit, same size: only the checksum can tell
    else:
        del data[-1000:]
    path.write_bytes(bytes(data))
    srv = http_server(bad_root)
    url = srv.url_for(f"ds/{entry.name}")
    cache_dir = tmp_path / "cache"
    cache = ShardCache(str(cache_dir))
    with pytest.raises(sw.ShardError) as info:
        cache.fetch(url, fsspec.filesystem("http"), url, entry)
    assert info.value.shard == url and url in str(info.value)
    assert "sha256" in str(info.value) or "checksum" in str(info.value)
    assert cache_files(cache_dir) == []  # nothing half-written or unverified is left
    assert not os.path.exists(cache.local_path(url, entry))
    # end to end: the loader refuses it too, naming the shard
    with pytest.raises(sw.ShardError) as info:
        epoch(make_loader(srv.url_for("ds"), cache_dir=str(cache_dir)))
    assert info.value.shard == url
    assert not os.path.exists(cache.local_path(url, entry))
    assert len(cache_files(cache_dir)) < len(m.shards)


# -- LRU ----------------------------------------------------------------------------------------

def test_lru_eviction_keeps_the_most_recently_used(served, http_server, tmp_path):
    root, _, m = served
    srv = http_server(root, SHARDS)
    fs = fsspec.filesystem("http")
    a, b, c = m.shards[0], m.shards[1], m.shards[2]
    url = {s.name: srv.url_for(f"ds/{s.name}") for s in m.shards}
    cache = ShardCache(str(tmp_path / "cache"), limit_bytes=a.bytes + b.bytes + c.bytes - 1)  # any two fit, not three

    def fetch(s):
        local = cache.fetch(url[s.name], fs, url[s.name], s)
        time.sleep(0.05)  # keep mtimes apart on file systems with coarse timestamps
        return local

    fetch(a)
    fetch(b)
    hits = cache.hits
    la = fetch(a)  # a again, a hit: now the most recent
    assert cache.hits == hits + 1
    lc = fetch(c)  # over the limit: the least recently used (b) goes
    present = set(cache_files(cache.dir))
    assert os.path.basename(la) in present and os.path.basename(lc) in present
    assert os.path.basename(cache.local_path(url[b.name], b)) not in present
    assert sum(os.path.getsize(os.path.join(cache.dir, n)) for n in present) <= cache.limit_bytes
    assert sha256(la) == a.sha256 and sha256(lc) == c.sha256
    # a hit refreshes recency: touch c, then fetch b: a is now the oldest and is evicted
    before = shard_gets(srv)
    fetch(c)
    assert shard_gets(srv) == before and cache.hits >= hits + 1
    fetch(b)
    present = set(cache_files(cache.dir))
    assert present == {os.path.basename(cache.local_path(url[s.name], s)) for s in (b, c)}


def test_limit_smaller_than_a_shard_still_serves_exact_epoch(served, http_server, tmp_path):
    root, seqs, m = served
    srv = http_server(root, SHARDS)
    cache_dir = tmp_path / "cache"
    limit = max(s.bytes for s in m.shards) // 2
    batches = epoch(make_loader(srv.url_for("ds"), cache_dir=str(cache_dir), cache_limit=limit))
    check_exact(batches, seqs)
    assert batches == epoch(make_loader(root / "ds"))
    assert len(cache_files(cache_dir)) <= 1  # only the shard in use is kept


# -- prefetch -------------------------------------------------------------------------------------

def test_prefetch_splits_the_shards_between_local_ranks(served, http_server, tmp_path, monkeypatch):
    root, seqs, m = served
    srv = http_server(root, SHARDS)
    url = srv.url_for("ds")
    cache_dir = str(tmp_path / "cache")
    cache = ShardCache(cache_dir)
    n = len(m.shards)
    fetched = [sw.prefetch(url, cache_dir, local_rank=0, local_world_size=3)]
    mine = {k for k in range(n) if os.path.exists(cache.local_path(f"{url}/{m.shards[k].name}", m.shards[k]))}
    assert mine == set(range(0, n, 3)) and fetched[0] == len(mine)
    monkeypatch.setenv("LOCAL_RANK", "1")  # the torchrun way
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    fetched.append(sw.prefetch(url, cache_dir))
    fetched.append(sw.prefetch(url, cache_dir, local_rank=2, local_world_size=3))
    assert sum(fetched) == n and fetched == [len(range(r, n, 3)) for r in range(3)]
    gets = shard_gets(srv)
    for s in m.shards:
        assert sha256(cache.local_path(f"{url}/{s.name}", s)) == s.sha256
    assert sw.prefetch(url, cache_dir, local_rank=0, local_world_size=1) == 0  # warm: nothing to fetch
    loader = make_loader(url, cache_dir=cache_dir)
    batches = epoch(loader)
    check_exact(batches, seqs)
    assert shard_gets(srv) == gets  # training reads only the cache
    assert loader.stats()["cache_hits"] > 0


# -- safety -------------------------------------------------------------------------------------

EVIL_NAMES = ["../../evil.tar", "/abs/evil.tar", "..", "../", "a/../../../evil.tar", "/", "",
              "..\\..\\evil.tar", "~/evil.tar", "evil\x00.tar", "%2e%2e/%2e%2e/evil.tar", "." * 300]


@pytest.mark.parametrize("name", EVIL_NAMES)
def test_local_path_stays_in_the_cache_dir(tmp_path, name):
    cache = ShardCache(str(tmp_path / "cache"))
    for url in (name, f"http://host/ds/{name}", f"s3://bucket/{name}", f"file:///data/{name}"):
        for sha in ("ab" * 32, name):  # a manifest's checksum field is untrusted too
            path = cache.local_path(url, ShardEntry("x.tar", 1, sha, 1, 1))
            assert os.path.dirname(path) == cache.dir
            assert os.path.realpath(path).startswith(cache.dir + os.sep)
            assert os.path.basename(path) not in ("", ".", "..")


def rewrite_manifest(ds: Path, **fields) -> None:
    m = parse_manifest((ds / INDEX_NAME).read_text())
    (ds / INDEX_NAME).write_text(dataclasses.replace(m, **fields).to_json())


@pytest.mark.parametrize("evil", ["dotdot", "absolute", "keys"])
def test_malicious_manifest_never_writes_outside_the_cache(served, tmp_path, evil):
    root, seqs, m = served
    base = tmp_path / "job"
    ds = base / "a" / "b" / "ds"
    shutil.copytree(root / "ds", ds)
    first = m.shards[0].name
    if evil == "dotdot":  # shard 0 moved to where "../../evil.tar" points
        os.replace(ds / first, base / "a" / "evil.tar")
        new_name = "../../evil.tar"
    elif evil == "absolute":
        (base / "abs").mkdir()
        os.replace(ds / first, base / "abs" / "evil.tar")
        new_name = str(base / "abs" / "evil.tar")
    if evil in ("dotdot", "absolute"):
        shards = (dataclasses.replace(m.shards[0], name=new_name),) + m.shards[1:]
        rewrite_manifest(ds, shards=shards)
    else:  # keys that look like paths: a key is a label, never a file name
        keys = [m.key(i) for i in range(m.num_sequences)]
        evil_keys = [("../../../" if i % 3 == 0 else "/abs/" if i % 3 == 1 else "a/../") + k
                     for i, k in enumerate(keys)]
        blob = "".join(evil_keys).encode()
        rewrite_manifest(ds, key_blob=blob, key_ends=np.cumsum([len(k) for k in evil_keys]))
        seqs = {e: seqs[k] for e, k in zip(evil_keys, keys)}
    cache_dir = base / "a" / "b" / "cache"
    before = all_files(tmp_path)
    try:
        batches = epoch(make_loader(ds, cache_dir=str(cache_dir)))
    except (sw.ManifestError, sw.ShardError):  # refusing such a manifest is fine too
        refused = True
    else:
        refused = False
        check_exact(batches, seqs)
    new = all_files(tmp_path) - before
    assert refused or new, "the cache was not used"
    outside = [p for p in new if not p.startswith(str(cache_dir) + os.sep)]
    assert outside == []
    assert all(os.path.dirname(p) == str(cache_dir) for p in new)


def object_npy(marker: Path, n: int) -> bytes:
    """An object-dtype .npy whose pickle, if ever loaded, creates ``marker``."""

    class Boom:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    arr = np.empty(n, dtype=object)
    arr[:] = [Boom() for _ in range(n)]
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=True)
    return buf.getvalue()


@pytest.mark.parametrize("cached", [False, True])
def test_object_dtype_member_is_refused_without_unpickling(tmp_path, monkeypatch, cached):
    marker = tmp_path / "pwned"
    ds = tmp_path / "ds"
    ds.mkdir()
    good = make_sequences(4, seed=1, max_len=60)
    good = {k: v for k, v in good.items() if len(v) >= W + H}
    # one shard: a good member, then the object array posing as float32 [T, 3]
    members = [(k + ".npy", _npy(v)) for k, v in good.items()] + [("evil.npy", object_npy(marker, 50))]
    buf = io.BytesIO()
    offsets = []
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            offsets.append(buf.tell() + 512)
            tf.addfile(info, io.BytesIO(data))
    shard = buf.getvalue()
    (ds / "shard-000000.tar").write_bytes(shard)
    with tarfile.open(ds / "shard-000000.tar") as tf:  # the offsets really are the data offsets
        assert [t.offset_data for t in tf.getmembers()] == offsets
    head = object_npy(marker, 50)
    evil_hlen = 10 + int.from_bytes(head[8:10], "little")
    assert b"'|O'" in head[:evil_hlen]
    keys = list(good) + ["evil"]
    lengths = [len(v) for v in good.values()] + [50]
    hlens = [10 + int.from_bytes(d[8:10], "little") for _, d in members]
    assert hlens[-1] == evil_hlen
    manifest = build_manifest(
        np.dtype("<f4"), (3,), None,
        [ShardEntry("shard-000000.tar", len(shard), hashlib.sha256(shard).hexdigest(), len(keys), sum(lengths))],
        keys, {"length": lengths, "offset": offsets, "hlen": hlens,  # sizes as float32 [T, 3] members would have
               "size": [h + n * 12 for h, n in zip(hlens, lengths)]})
    (ds / INDEX_NAME).write_text(manifest.to_json())

    forbid_unpickling(monkeypatch)
    kw = {"cache_dir": str(tmp_path / "cache")} if cached else {}
    loader = make_loader(ds, order=sw.Order(shuffle=False), **kw)
    with pytest.raises(sw.ShardError) as info:
        epoch(loader)
    err = info.value
    assert err.member == "evil.npy" and err.offset == offsets[-1]
    assert err.shard == f"{ds}/shard-000000.tar"
    assert "object" in str(err) or "dtype" in str(err)
    assert not marker.exists()


def _npy(arr) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


# -- a dataset re-packed in place ------------------------------------------------------------------

def test_repacked_in_place_is_fetched_again(tmp_path, http_server):
    """Same shard sizes, other bytes (a new generation of shards): the cache serves the new shards, never the old copies."""
    old = make_sequences(seed=9)
    new = {k: v + np.float32(0.5) for k, v in old.items()}  # same keys and lengths: same sizes, other values
    root = tmp_path / "srv"
    sw.pack(list(old.items()), str(root / "ds"), shard_bytes=40_000, progress=False)
    before = sw.load_manifest(str(root / "ds"))
    srv = http_server(root, SHARDS)
    url = srv.url_for("ds")
    cache_dir = str(tmp_path / "cache")
    check_exact(epoch(make_loader(url, cache_dir=cache_dir)), old)
    assert sw.prefetch(url, cache_dir) == 0  # warm

    sw.pack(list(new.items()), str(root / "ds"), shard_bytes=40_000, progress=False)  # in place
    after = sw.load_manifest(str(root / "ds"))
    # a re-pack writes a new generation of shards (other names; the old ones stay for their readers)
    assert [s.bytes for s in after.shards] == [s.bytes for s in before.shards]
    assert all(a.sha256 != b.sha256 for a, b in zip(after.shards, before.shards))
    cache = ShardCache(cache_dir)
    assert not any(cache.has(f"{url}/{s.name}", s) for s in after.shards)
    assert sw.prefetch(url, cache_dir, local_rank=0, local_world_size=2) == len(range(0, len(after.shards), 2))
    gets = shard_gets(srv)
    loader = make_loader(url, cache_dir=cache_dir)
    batches = epoch(loader)
    check_exact(batches, new)
    assert shard_gets(srv) == gets + 2 * len(range(1, len(after.shards), 2))  # the rest and their sums files, once
    for s in after.shards:
        assert cache.has(f"{url}/{s.name}", s) and sha256(cache.local_path(f"{url}/{s.name}", s)) == s.sha256


def test_repacked_shards_evict_the_old_copies(tmp_path, http_server):
    """With a limit, the copies of the old shards are the least recently used: they go first."""
    old = make_sequences(seed=9)
    root = tmp_path / "srv"
    sw.pack(list(old.items()), str(root / "ds"), shard_bytes=40_000, progress=False)
    srv = http_server(root, SHARDS)
    url = srv.url_for("ds")
    cache_dir = str(tmp_path / "cache")
    m = sw.load_manifest(str(root / "ds"))
    limit = sum(s.bytes for s in m.shards)  # room for one copy of the dataset
    check_exact(epoch(make_loader(url, cache_dir=cache_dir, cache_limit=limit)), old)
    time.sleep(0.05)
    new = {k: v * np.float32(2) for k, v in old.items()}
    sw.pack(list(new.items()), str(root / "ds"), shard_bytes=40_000, progress=False)
    check_exact(epoch(make_loader(url, cache_dir=cache_dir, cache_limit=limit)), new)
    m = sw.load_manifest(str(root / "ds"))
    cache = ShardCache(cache_dir)
    assert cache_files(cache_dir) == sorted(os.path.basename(cache.local_path(f"{url}/{s.name}", s)) for s in m.shards)


def test_skip_a_shard_that_fails_verification_fetches_it_once_per_block(served, http_server, tmp_path):
    """on_error="skip": a corrupt shard loses its windows only, and is not fetched again member by member."""
    root, seqs, m = served
    bad_root = tmp_path / "srv"
    shutil.copytree(root / "ds", bad_root / "ds")
    entry = m.shards[1]
    path = bad_root / "ds" / entry.name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    srv = http_server(bad_root, FaultPlan(path_contains=entry.name))  # counts this shard's GETs only
    loader = make_loader(srv.url_for("ds"), cache_dir=str(tmp_path / "cache"), on_error="skip")
    with pytest.warns(RuntimeWarning, match="checksum"):
        batches = [(list(b["key"]), b["start"].tolist(), b["x"].numpy().copy(), b["weight"].tolist()) for b in loader]
    assert len(batches) == len(loader)
    in_bad = {m.key(i) for i in range(int(m.shard_starts[1]), int(m.shard_starts[2]))}
    lost = 0
    for keys, starts, x, weights in batches:
        for i, (k, s, w) in enumerate(zip(keys, starts, weights)):
            if k in in_bad:
                assert w == 0 and not x[i].any()
                lost += 1
            else:
                assert w == 1 and np.array_equal(x[i], seqs[k][s : s + W]), (k, s)
    assert lost == loader.stats()["skipped_windows"] > 0
    plan = loader.dataset.plan()
    assert 0 < srv.stats.get_requests <= plan.sources[0].num_blocks(0)  # one fetch per block that needs it


# -- a download killed midway leaves nothing behind -----------------------------------------------------

KILLED_FETCH = """
import sys, fsspec
from streamwin.storage.cache import ShardCache
from streamwin.storage.manifests import load_manifest
url, cache_dir = sys.argv[1:]
m = load_manifest(url)
entry = m.shards[0]
print("fetching", flush=True)
ShardCache(cache_dir).fetch(f"{url}/{entry.name}", fsspec.filesystem("http", skip_instance_cache=True),
                            f"{url}/{entry.name}", entry)
"""


def test_a_download_killed_midway_leaves_no_temporary_file(served, http_server, tmp_path):
    """SIGKILL a process while it downloads a shard into the cache: its temporary file stays until the next
    download or eviction on the node, which removes it (before: eviction skipped it, for ever)."""
    import subprocess
    import sys
    import time

    root, _, m = served
    srv = http_server(root, FaultPlan(stall_seconds=5.0, stall_times=1, path_contains="shard-"))
    cache_dir = tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_FETCH, srv.url_for("ds"), str(cache_dir)],
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert proc.stdout.readline().strip() == "fetching"
    t0 = time.monotonic()
    while not [p for p in cache_dir.glob("*") if ".tmp-" in p.name] and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    left = [p.name for p in cache_dir.glob("*") if ".tmp-" in p.name]
    assert left, "the download had not started"
    srv.clear_faults()
    cache = ShardCache(str(cache_dir), limit_bytes=1 << 30)
    entry = m.shards[1]
    cache.fetch(f"{srv.url_for('ds')}/{entry.name}", fsspec.filesystem("http", skip_instance_cache=True),
                f"{srv.url_for('ds')}/{entry.name}", entry)
    assert not [p.name for p in cache_dir.glob("*") if ".tmp-" in p.name]
    assert len(cache_files(cache_dir)) == 1
