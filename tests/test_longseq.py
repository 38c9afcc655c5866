"""Long sequences: each shard byte is read about once per epoch, memory does not grow with a sequence.

Layouts mix one long sequence with many short ones. Bytes read are counted twice, by the
loader's stats() and by the loopback HTTP server (bytes it served), and compared with the
shard bytes on disk; windows are checked against naive slices of the original arrays.
"""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

import streamwin as sw
from streamwin.read import ReadOptions, ShardReader
from streamwin.read import inflate as inflate_mod

W, S, H, B = 16, 1, 2, 32
F = 4  # features: 16 bytes per step


def layout(name: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Sequences of a named layout; values encode (sequence, step) so a misplaced window never matches."""
    rng = np.random.default_rng(seed)
    lengths = {"giant": [150_000], "small": list(rng.integers(5, 400, size=600)),
               "mixed": [120_000] + list(rng.integers(5, 400, size=300))}[name]
    out = {}
    for i, t in enumerate(lengths):
        steps = np.arange(int(t), dtype=np.float32)[:, None] * 1000 + i
        out[f"s{i:04d}"] = np.repeat(steps, F, axis=1)
    return out


def shard_bytes(url: str) -> int:
    return sum(os.path.getsize(os.path.join(url, f)) for f in os.listdir(url) if f.endswith(".tar"))


def check_windows(loader, seqs) -> int:
    """Every yielded window equals the naive slice of its sequence; returns the windows seen."""
    n = 0
    for b in loader:
        x, y, keys, starts = b["x"].numpy(), b["y"].numpy(), np.array(b["key"]), b["start"].numpy()
        for k in np.unique(keys):  # the batch's windows of sequence k, sliced from it all at once
            mine = keys == k
            steps = starts[mine][:, None] + np.arange(W + H)
            assert steps.max() < len(seqs[k]), (k, starts[mine])
            want = seqs[k][steps]
            assert np.array_equal(x[mine], want[:, :W]), (k, starts[mine])
            assert np.array_equal(y[mine], want[:, W:]), (k, starts[mine])
        n += len(keys)
    return n


def make(url, num_workers=None, **kw):
    args = dict(window=W, stride=S, horizon=H, batch_size=B, shuffle_buffer=2048, seed=5) | kw
    return sw.WindowLoader(sw.WindowDataset(url, **args), num_workers=num_workers)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """packed(name, compression) -> (url, manifest): layout ``name`` packed in 1 MB shards, once per module.
    Read only: a test that changes the files works on a copy (``copied``)."""
    made = {}

    def get(name: str, compression: str | None):
        if (name, compression) not in made:
            url = str(tmp_path_factory.mktemp(f"{name}-{compression}") / "ds")
            m = sw.pack(list(layout(name).items()), url, shard_bytes=1 << 20, compression=compression, progress=False)
            made[name, compression] = url, m
        return made[name, compression]
    return get


def copied(url: str, dest) -> str:
    """A copy of the dataset at ``url`` in the folder ``dest`` (for a test that alters its files)."""
    return shutil.copytree(url, str(dest))


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("name", ["giant", "small", "mixed"])
def test_epoch_reads_each_byte_about_once_over_http(name, compression, http_server, packed):
    seqs = layout(name)
    url, _ = packed(name, compression)
    srv = http_server(os.path.dirname(url))
    loader = make(srv.url_for("ds"))
    assert check_windows(loader, seqs) > 0
    total = shard_bytes(url)
    assert srv.stats.bytes_served / total <= 1.25, (srv.stats.bytes_served, total)
    assert loader.stats()["bytes_read"] / total <= 1.25


@pytest.mark.parametrize("name", ["giant", "mixed"])
def test_epoch_reads_each_byte_about_once_locally(name, packed):
    seqs = layout(name)
    url, _ = packed(name, None)
    loader = make(url)
    assert check_windows(loader, seqs) > 0
    assert loader.stats()["bytes_read"] / shard_bytes(url) <= 1.25


# -- memory: an epoch's peak RSS does not grow with the longest sequence ----------------------------

EPOCH_RSS = """
import sys
import streamwin as sw


def rss(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith(field))


url, = sys.argv[1:]
# readahead_bytes=0: the blocks read ahead beyond the one each stream always reads are sized by rate x latency and
# bounded by readahead_bytes (tests/test_remote_reads.py), not by the data; this is about the blocks themselves
ds = sw.WindowDataset(url, window=16, stride=1, batch_size=64, shuffle_buffer=1024, seed=1,
                      read=sw.Read(readahead_bytes=0))
loader = sw.WindowLoader(ds, num_workers=0)  # read in this process, where RSS is measured
before = rss("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) restarts from the current RSS
n = sum(len(b["key"]) for b in loader)
print(n, rss("VmHWM:") - before)
"""


def epoch_rss_growth(url: str) -> int:
    """Bytes the peak RSS of a fresh process grows by over one epoch (measured in that process, Linux)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", EPOCH_RSS, url], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=os.getcwd()))
    n, grew = map(int, out.stdout.split())
    assert n > 0
    return grew


def long_and_short(long_mb: int, seed: int = 0) -> list[tuple[str, np.ndarray]]:
    """One sequence of ``long_mb`` MB (1 KB steps) beside 50 short ones."""
    rng = np.random.default_rng(seed)
    steps = long_mb << 10
    out = [("long", rng.standard_normal((steps, 256)).astype(np.float32))]
    out += [(f"short{i:03d}", rng.standard_normal((int(t), 256)).astype(np.float32))
            for i, t in enumerate(rng.integers(20, 300, size=50))]
    return out


@pytest.fixture(scope="module")
def long_and_short_packed(tmp_path_factory):
    """long_and_short_packed(compression) -> the folder holding ds16 and ds64 (``long_and_short`` of 16 and 64
    MB, in 4 MB shards), packed once per module for the local and the http case. Read only."""
    made = {}

    def get(compression: str | None):
        if compression not in made:
            root = tmp_path_factory.mktemp(f"long-and-short-{compression}")
            for mb in (16, 64):
                sw.pack(long_and_short(mb), str(root / f"ds{mb}"), shard_bytes=4 << 20, compression=compression,
                        progress=False)
            made[compression] = root
        return made[compression]
    return get


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="measures VmHWM (Linux)")
@pytest.mark.parametrize("where", ["local", "http"])
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_epoch_memory_does_not_grow_with_the_longest_sequence(compression, where, long_and_short_packed, http_server):
    """Over http too: streamed range reads allocate nothing per socket read (they once grew the heap with the epoch)."""
    root = long_and_short_packed(compression)
    srv = http_server(root) if where == "http" else None
    grew = {}
    for mb in (16, 64):
        url = str(root / f"ds{mb}")
        grew[mb] = epoch_rss_growth(url if srv is None else srv.url_for(f"ds{mb}"))
    print("GREW", compression, where, {k: v >> 20 for k, v in grew.items()})
    assert grew[64] <= 1.15 * grew[16] + (6 << 20), grew


# -- zstd: long members packed as frames, read frame by frame ---------------------------------------

def test_zstd_long_member_is_framed_and_windows_are_exact(packed):
    seqs = layout("mixed")  # 120,000 steps of 16 bytes: two frames and a bit
    url, m = packed("mixed", "zstd")
    long_seq = int(np.flatnonzero(m.length == 120_000)[0])
    assert m.frames is not None and m.frames.seq.tolist() == [long_seq]
    assert m.frames.rows * 16 <= 1 << 20 and len(m.frames.ends) == -(-120_000 // m.frames.rows)
    assert m.frames.ends[-1] == m.size[long_seq]  # the frames are the whole member
    again = sw.WindowDataset(url, window=W).manifest
    assert np.array_equal(again.frames.ends, m.frames.ends)  # the field survives index.json
    loader = make(url)
    assert check_windows(loader, seqs) == len(loader) * B > 100_000


@pytest.mark.parametrize("options", [{}, {"shuffle_buffer": 256}, {"order": sw.Order(slice_windows=64, shuffle=False)}],
                         ids=["default", "small-buffer", "small-slices-in-order"])
def test_zstd_frames_are_read_and_decompressed_about_once(options, http_server, tmp_path):
    """Slices of a few windows in 256 kB frames: each frame is still read and decompressed about once an epoch.

    A frame spans 16,384 steps (4,096 windows) here, a default slice was shuffle_buffer // 8
    windows, and each slice read and decompressed every frame it touched. The long member
    (10 MB) is larger than the reader's frame cache.
    """
    rng = np.random.default_rng(1)
    seqs = {"long": np.repeat(np.arange(640_000, dtype=np.float32)[:, None], F, axis=1)}
    seqs |= {f"s{i:03d}": rng.standard_normal((int(t), F)).astype(np.float32) for i, t in
             enumerate(rng.integers(5, 400, size=300))}
    url = str(tmp_path / "ds")
    m = sw.pack(list(seqs.items()), url, shard_bytes=4 << 20, compression="zstd", progress=False)
    assert m.frames is not None and m.length.max() * m.step_bytes > 2 * inflate_mod.FRAME_CACHE_BYTES
    srv = http_server(tmp_path)
    ds = sw.WindowDataset(srv.url_for("ds"), **(dict(window=W, stride=4, horizon=H, batch_size=B, seed=5) | options))
    schedule = ds.plan().schedule(0)  # the process's blocks: one stream's, or its canonical slots' as one
    plan, lane, source = schedule.plans[0], schedule.lanes[0][1], ShardReader(ds.url, ds.manifest, ReadOptions())
    seen = 0
    steps = np.arange(W + H)
    for k in range(plan.num_blocks(lane)):
        block = source.read_block(plan, lane, k)
        rows = block.buf[: len(block.buf) // 16 * 16].view(np.float32).reshape(-1, F)  # 16-byte steps
        got = rows[block.offs[:, None] // 16 + steps]
        for key_at, i in enumerate(block.seq_ids.tolist()):
            mine = block.key_index == key_at
            want = seqs[m.key(i)][block.start[mine][:, None] + steps]
            assert np.array_equal(got[mine], want), (m.key(i), k)
        seen += len(block)
        source.release(block)
    assert seen == plan.item_bounds(lane)[-1] > 150_000
    member_bytes = int((m.length.astype(np.int64) * m.step_bytes + m.hlen).sum())
    assert source.stats.bytes_decompressed / member_bytes <= 1.25, (source.stats.bytes_decompressed, member_bytes)
    assert srv.stats.bytes_served / shard_bytes(url) <= 1.25, (srv.stats.bytes_served, shard_bytes(url))


def test_zstd_frames_unlisted_in_the_manifest_still_read(packed, tmp_path):
    """A manifest without the frames field (older streamwin, or rebuilt elsewhere) reads framed members whole."""
    import json

    seqs = layout("giant")
    url = copied(packed("giant", "zstd")[0], tmp_path / "ds")
    path = os.path.join(url, "index.json")
    doc = json.loads(open(path).read())
    del doc["frames"]
    doc.pop("content_sha256", None)  # written before manifests were sealed, as manifests without frames were
    with open(path, "w") as f:
        f.write(json.dumps(doc))
    assert sw.WindowDataset(url, window=W).manifest.frames is None
    assert check_windows(make(url), seqs) > 0


def test_zstd_corrupt_frame_names_member_and_offset(packed, tmp_path):
    original, m = packed("giant", "zstd")
    url = copied(original, tmp_path / "ds")
    at = int(m.offset[0] + m.frames.ends[0])  # frame 1's magic number
    path = os.path.join(url, m.shards[0].name)
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(b"\0\0\0\0")
    with pytest.raises(sw.ShardError) as e:  # unverified: zstd's own checks name the frame's first byte
        for _ in make(url, num_workers=0, read=sw.Read(verify_checksums=False)):
            pass
    assert e.value.member == "s0000.npy.zst" and e.value.offset == at and m.shards[0].name in e.value.shard
    with pytest.raises(sw.ShardError, match="checksum mismatch") as e:  # verified: the chunk that holds it
        for _ in make(url, num_workers=0):
            pass
    assert e.value.member == "s0000.npy.zst" and e.value.offset <= at < e.value.offset + m.checks.chunk


def test_merge_keeps_each_parts_frames(tmp_path):
    seqs = list(layout("mixed").items())
    url = str(tmp_path / "ds")
    both = seqs[1:50] + [seqs[0]] + seqs[50:100] + [("second", seqs[0][1] + 0.5)]  # a long one in each part
    for i in range(2):
        sw.pack(both, url, shard_bytes=1 << 20, compression="zstd", part=f"{i}/2", progress=False)
    m = sw.merge(url)
    long_ones = np.flatnonzero(m.length == 120_000)
    assert m.frames is not None and m.frames.seq.tolist() == long_ones.tolist() and len(long_ones) == 2
    assert check_windows(make(url), dict(both)) > 0


# -- a sequence larger than memory would allow: packed from a memory map, read back -----------------

BIG_ROWS, BIG_COLS = (1 << 18) + 999, 1024  # int32: 1.004 GB

PACK_BIG = """
import sys
import numpy as np
import streamwin as sw
from test_longseq import peak_growth
src, url, compression = sys.argv[1:]
arr = np.load(src, mmap_mode="r")
grew = peak_growth(lambda: sw.pack([("big", arr), ("small", np.ones((100, arr.shape[1]), np.int32))], url,
                                   shard_bytes=256 << 20, compression=compression or None, progress=False))
print(grew)
"""

READ_BIG = """
import sys
import numpy as np
import streamwin as sw
from test_longseq import peak_growth, big_rows
url, = sys.argv[1:]
ds = sw.WindowDataset(url, window=16, stride=64, batch_size=64, shuffle_buffer=512, seed=2)
seen = []


def epoch():
    for b in sw.WindowLoader(ds, num_workers=0):
        x = b["x"].numpy()
        for i, (k, s) in enumerate(zip(b["key"], b["start"].tolist())):
            if k == "big":
                assert np.array_equal(x[i], big_rows(s, s + 16)), s
                seen.append(s)


grew = peak_growth(epoch)
assert len(seen) == len(set(seen)) > 4000
print(grew)
"""


def peak_growth(fn) -> int:
    """Bytes the peak RSS (VmHWM) of this process grows by while ``fn()`` runs (Linux)."""
    def rss(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith(field))
    before = rss("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak restarts from the current RSS
    fn()
    return rss("VmHWM:") - before


def big_rows(a: int, b: int) -> np.ndarray:
    """Rows [a, b) of the big sequence: row r, column c holds r * 1024 + c."""
    return (np.arange(a, b, dtype=np.int32)[:, None] * BIG_COLS + np.arange(BIG_COLS, dtype=np.int32)).astype(np.int32)


def run_script(script: str, *args: str) -> int:
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), here]))
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return int(out.stdout.split()[-1])


@pytest.fixture(scope="module")
def big_npy(tmp_path_factory):
    """The 1 GB sequence (``big_rows``) as a .npy file, written once for both compressions, removed after them."""
    folder = tmp_path_factory.mktemp("big")
    src = folder / "big.npy"
    try:
        arr = np.lib.format.open_memmap(src, mode="w+", dtype=np.int32, shape=(BIG_ROWS, BIG_COLS))
        for a in range(0, BIG_ROWS, 1 << 14):
            arr[a : a + (1 << 14)] = big_rows(a, min(a + (1 << 14), BIG_ROWS))
        arr.flush()
        del arr
        yield src
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="measures VmHWM (Linux)")
@pytest.mark.parametrize("compression", ["", "zstd"])
def test_gigabyte_sequence_packs_and_reads_in_little_memory(compression, big_npy, tmp_path):
    src, away = big_npy, big_npy.with_name("big.npy.away")
    try:
        size = os.path.getsize(src)
        assert size > 1 << 30
        url = str(tmp_path / "ds")
        packed = run_script(PACK_BIG, str(src), url, compression)
        assert packed < size // 8, (packed, size)
        os.rename(src, away)  # the reads below see only the shards (the source is back for the next case after)
        read = run_script(READ_BIG, url)
        # well under the sequence's size; 1/6, not 1/8: a clean-clone CI run read it in 137 MB of 1,078 (zstd)
        assert read < size // 6, (read, size)
    finally:
        if away.exists():
            os.rename(away, src)
        shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_streamed_packing_writes_the_same_shards(compression, tmp_path, monkeypatch):
    """Packed chunk by chunk (as a large or lazy array is), the shards and manifest are byte for byte the same."""
    import importlib

    pack_mod = importlib.import_module("streamwin.packing.encode")

    rng = np.random.default_rng(3)
    seqs = [("a", rng.standard_normal((70_000, 4)).astype(">f4")),  # big-endian, over a frame
            ("b", np.where(rng.random((300, 4)) < 0.01, np.nan, 1.0).astype(np.float32)),
            ("c", rng.standard_normal((5, 4)).astype(np.float32))]
    whole = sw.pack(seqs, str(tmp_path / "whole"), compression=compression, progress=False)
    monkeypatch.setattr(pack_mod, "STREAM_BYTES", 0)
    monkeypatch.setattr(pack_mod, "CHUNK_BYTES", 1000)
    streamed = sw.pack(seqs, str(tmp_path / "streamed"), compression=compression, progress=False)
    assert whole.to_json() == streamed.to_json()
    assert whole.nonfinite.nan > 0
    for s in whole.shards:
        assert (tmp_path / "whole" / s.name).read_bytes() == (tmp_path / "streamed" / s.name).read_bytes()
    with pytest.raises(sw.PackError, match="NaN"):
        sw.pack(seqs, str(tmp_path / "refused"), nan="raise", progress=False)


def test_a_stride_far_larger_than_the_window_reads_only_the_windows(packed):
    seqs = layout("giant")  # 150,000 steps of 16 bytes
    url, _ = packed("giant", None)
    loader = make(url, stride=8192, batch_size=2, shuffle_buffer=8)  # 130 kB unread between windows
    n = check_windows(loader, seqs)
    assert n == 18
    assert loader.stats()["bytes_read"] <= n * (4096 + 2 * 4096)  # each window's pages, not the steps between


def test_epoch_reads_each_byte_about_once_from_s3(s3_server, s3_bucket, s3_fault_proxy):
    seqs = layout("mixed")
    url = f"{s3_bucket}/ds"
    m = sw.pack(list(seqs.items()), url, shard_bytes=1 << 20, progress=False,
                storage_options=s3_server.storage_options())
    proxy = s3_fault_proxy()  # no faults: counts the GetObject body bytes it relays
    loader = make(url, read=sw.Read(storage_options=proxy.storage_options()))
    assert check_windows(loader, seqs) > 0
    total = sum(s.bytes for s in m.shards)
    assert proxy.stats.bytes_served / total <= 1.25, (proxy.stats.bytes_served, total)
    assert loader.stats()["bytes_read"] / total <= 1.25


def test_epoch_reads_each_byte_about_once_through_the_cache(http_server, packed, tmp_path):
    seqs = layout("mixed")
    url, _ = packed("mixed", None)
    srv = http_server(os.path.dirname(url))
    loader = make(srv.url_for("ds"), read=sw.Read(cache_dir=str(tmp_path / "cache")))
    assert check_windows(loader, seqs) > 0
    total = shard_bytes(url)
    assert srv.stats.bytes_served / total <= 1.25  # whole shards, fetched once
    assert loader.stats()["cache_hits"] > 0 and loader.stats()["bytes_read"] / total <= 1.25


def test_array_likes_that_slice_are_encoded_chunk_by_chunk(monkeypatch):
    """A large lazy array-like (what h5py and zarr datasets offer) is encoded by slices; a torch tensor still packs."""
    import importlib

    import torch

    class Lazy:
        def __init__(self, arr):
            self.arr, self.shape, self.dtype, self.sliced = arr, arr.shape, arr.dtype, 0

        def __getitem__(self, index):
            self.sliced += 1
            return self.arr[index]

    pack_mod = importlib.import_module("streamwin.packing.encode")
    monkeypatch.setattr(pack_mod, "STREAM_BYTES", 1000)
    monkeypatch.setattr(pack_mod, "CHUNK_BYTES", 4000)
    arr = np.arange(6000, dtype=np.float32).reshape(3000, 2)
    lazy = Lazy(arr)

    def content(enc):
        return enc.head + b"".join(bytes(c) for c in (enc.body if isinstance(enc.body, pack_mod.Streamed)
                                                       else [enc.body]))
    streamed = pack_mod.encode_sequence("lazy", lazy)
    assert isinstance(streamed.body, pack_mod.Streamed) and lazy.sliced == 6  # 500 rows at a time, counted
    whole = pack_mod.encode_sequence("t", torch.from_numpy(arr.copy()))
    monkeypatch.setattr(pack_mod, "STREAM_BYTES", 1 << 40)
    assert content(streamed) == content(whole) == content(pack_mod.encode_sequence("np", arr))
    assert lazy.sliced == 12  # and read again when written
