"""Scale: millions of short sequences in one dataset (issue 13), and checksums of a terabyte (issue 28).

For each size (1M and 10M sequences; ``--quick``: 1M only) it builds a synthetic corpus of
short sequences (float32, 8..56 steps, 1,024 bytes per tar member, 100,000 sequences per
shard; written directly with numpy, the same layout pack writes, with a columnar manifest;
kept in ``--root`` and reused), then measures, each in a fresh process:

  manifest     ``load_manifest``: seconds, and per sequence the memory it adds to the process: its
               resident set (VmRSS: the columns file's pages it touched to check them, and
               anything it allocated), its peak (VmHWM) and its private memory
  plan         the dataset's window index (built once per process that plans; with
               ``split="train"`` it hashes every key once), a plan of another epoch, ``len()``
               first and second call; 8 ranks x 8 workers
  fork/spawn/forkserver  ``WindowLoader(num_workers=8)`` as rank 0 of 8: seconds from the
               dataset's construction to the first batch (forkserver: including its server's
               start, which imports torch and streamwin once), then after 20 batches the private
               memory (USS) of the trainer (beyond what it had before the dataset) and of each
               worker (beyond an idle worker process of the same start method, which the same
               machine measures in the same run); the node estimate is 8 ranks x (trainer +
               fork server + 8 workers) of that, since the manifest's pages are shared by all

and, once, packing: ``streamwin.pack`` of ``--pack-seqs`` short sequences from 16 ``.npz``
files with each of ``--pack-workers`` (default 1 and 2; sequences/s, the speed-up over 1
worker, CPU microseconds per sequence spent in the writing process and in the worker
processes, and whether the shards are byte-identical). With N workers the writer needs
its own CPU per sequence and the workers theirs, so on a machine with more cores than 2 the
rate is bounded by about min(1 / writer, N / workers) sequences per second of CPU time.

and, with ``--sums-gb`` (e.g. 1 10 100 1000), checksum memory per process as the corpus grows:
a corpus of that many GB of sparse shards (256 MB each, one long member of zeros, written
with ``truncate``: no disk but the sums files, ~1 GB per TB) with real sums files and a manifest
naming their digests; a fresh process loads it and reads ``--sums-blocks`` shuffled blocks
(W=256, stride 65,536: sparse windows, so blocks touch many shards); reported are the
checksums the manifest holds, the sums its reader holds (``ShardReader.sums.nbytes``, bounded
by read.sums.SUMS_LIMIT), the sums bytes it read, the process's private memory added, and
what every process would hold with all chunk sums in memory (4 bytes per 4 KiB of shards).

Usage:
  python benchmarks/scale.py --quick    # 1M sequences (~2 min on 2 cores)
  python benchmarks/scale.py            # 1M and 10M (~10 min on 2 cores, 11 GB of disk)
  python benchmarks/scale.py --sizes 2000000 --sums-gb 1 10 100 1000 --no-loaders   # issue 28's numbers
  python benchmarks/scale.py --sizes 10000000 --no-loaders --fields   # issue 29: two int fields per sequence
Prints a markdown table and one JSON line.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
CHILD_TIMEOUT_S = 3600.0
PER_SHARD = 100_000
MEMBER = 1024  # tar header + npy header and data, padded
RANKS, WORKERS = 8, 8
METHODS = ("fork", "spawn", "forkserver")
LOADER = dict(window=8, stride=4, batch_size=256, world_size=RANKS, rank=0)


# -- the corpus --------------------------------------------------------------------------------

def _members(first: int, lengths: np.ndarray) -> np.ndarray:
    """[n, MEMBER] bytes: the tar members ``s<8 digits>.npy`` of sequences first.., as pack writes them."""
    from streamwin.formats import npy as npyfmt, tar as tarfmt

    n = len(lengths)
    out = np.zeros((n, MEMBER), dtype=np.uint8)
    digits = _digits(first, n)
    for t in np.unique(lengths):
        rows = np.flatnonzero(lengths == t)
        npy = npyfmt.npy_header_for(np.dtype("<f4"), (int(t),))
        head = np.frombuffer(tarfmt.tar_header("s00000000.npy", len(npy) + 4 * int(t)), dtype=np.uint8).copy()
        head[148:156] = ord(" ")
        base = int(head.sum()) - 8 * ord("0")
        block = np.concatenate([head, np.frombuffer(npy, dtype=np.uint8)])
        out[rows, : len(block)] = block
        out[rows, 1:9] = digits[rows]
        chk = base + digits[rows].astype(np.int64).sum(axis=1)  # the ustar checksum: "%06o\0 "
        for k in range(6):
            out[rows, 148 + k] = ord("0") + (chk >> (3 * (5 - k))) % 8
        out[rows, 154], out[rows, 155] = 0, ord(" ")
    data = out.view("<f4")[:, (512 + 128) // 4 :]
    steps = np.arange(data.shape[1], dtype=np.float32)
    values = (np.arange(first, first + n) % 1000).astype(np.float32)[:, None] + steps / 100
    data[:] = np.where(steps[None, :] < lengths[:, None], values, 0)
    return out


def _digits(first: int, n: int) -> np.ndarray:
    """[n, 8] ASCII digits of first..first+n-1."""
    i = np.arange(first, first + n, dtype=np.int64)[:, None] // (10 ** np.arange(7, -1, -1))
    return (ord("0") + i % 10).astype(np.uint8)


def make_corpus(root: Path, n: int) -> str:
    """A dataset of ``n`` short sequences at ``root`` (reused when its marker matches)."""
    from streamwin.formats.checks import SUFFIX, Checks
    from streamwin.formats.manifest import Manifest, NonFinite, ShardEntry
    from streamwin.formats.sums import ShardSumsWriter
    from streamwin.storage.manifests import write_manifest
    from streamwin.storage.urls import url_to_fs

    marker = root / "corpus.json"
    if marker.exists() and json.loads(marker.read_text()) == {"n": n, "sums": True}:
        return str(root)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    lengths = np.random.default_rng(n).integers(8, 57, size=n).astype(np.int64)
    shards, offsets, digests = [], np.empty(n, dtype=np.int64), []
    for k, lo in enumerate(range(0, n, PER_SHARD)):
        hi = min(lo + PER_SHARD, n)
        body = _members(lo, lengths[lo:hi]).tobytes() + bytes(1024)
        name = f"shard-{k:06d}.tar"
        (root / name).write_bytes(body)
        sums = ShardSumsWriter()  # its chunk checksums, beside it, as pack writes them
        sums.update(body)
        data, digest = sums.file()
        (root / (name + SUFFIX)).write_bytes(data)
        digests.append(digest)
        offsets[lo:hi] = np.arange(hi - lo) * MEMBER + 512
        shards.append(ShardEntry(name, len(body), hashlib.sha256(body).hexdigest(), hi - lo, int(lengths[lo:hi].sum())))
    keys = np.concatenate([np.full((n, 1), ord("s"), dtype=np.uint8), _digits(0, n)], axis=1)
    m = Manifest(dtype=np.dtype("<f4"), step_shape=(), compression=None, shards=tuple(shards), length=lengths,
                 offset=offsets, size=128 + 4 * lengths, hlen=np.full(n, 128, dtype=np.int32),
                 key_blob=keys.tobytes(), key_ends=np.arange(1, n + 1, dtype=np.int64) * 9,
                 nonfinite=NonFinite(0, 0, (0,) * len(shards)),
                 checks=Checks.of_shards(digests, [s.bytes for s in shards]))
    write_manifest(*url_to_fs(str(root)), m)
    marker.write_text(json.dumps({"n": n, "sums": True}))
    return str(root)


# -- measurements, each in a fresh process ------------------------------------------------------

def private_mb(pid: int | None = None) -> float:
    """Private_Dirty of a process (MB): the pages it wrote itself and shares with no one.

    USS would also count the clean file pages of the memory-mapped manifest while only one
    process maps it; those are page cache, one copy per node, reported as the file's size.
    """
    with open(f"/proc/{pid or 'self'}/smaps_rollup") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith("Private_Dirty:")) / 1024


def anon_mb(pid: int | None = None) -> float:
    """Anonymous memory of a process (MB), shared with forked children or not."""
    with open(f"/proc/{pid or 'self'}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024


def status_mb(field: str) -> float:
    """A /proc/self/status field (VmRSS, VmHWM, RssAnon, ...) in MB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def child_manifest(url: str) -> dict:
    import streamwin as sw

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM from here
    rss, peak, before = status_mb("VmRSS"), status_mb("VmHWM"), anon_mb()
    t = time.perf_counter()
    m = sw.load_manifest(url)
    load_s = time.perf_counter() - t
    per = 2**20 / m.num_sequences
    grew = {"rss_bytes_per_seq": (status_mb("VmRSS") - rss) * per, "peak_bytes_per_seq": (status_mb("VmHWM") - peak) * per,
            "anon_bytes_per_seq": (anon_mb() - before) * per}
    total = int(m.length.sum()) + int(m.offset.sum()) + int(m.size.sum()) + int(m.hlen.sum())
    total += int(m.key_ends.sum()) + len(m.keys(np.arange(0, m.num_sequences, 4096)))  # touch every page
    for col in (m.fields.columns.values() if m.fields is not None else ()):  # --fields: their columns too
        total += int(col.sum())
    private = anon_mb() - before
    shared = os.path.getsize(os.path.join(url, "index.columns")) + os.path.getsize(os.path.join(url, "index.json"))
    return {"load_s": load_s, "private_mb": private, "bytes_per_seq": private * 2**20 / m.num_sequences,
            "shared_mb": shared / 2**20, "check": total > 0, **grew}


def child_plan(url: str) -> dict:
    import streamwin as sw

    ds = sw.WindowDataset(url, **LOADER)
    ds.manifest
    before = anon_mb()
    t0 = time.perf_counter()
    ds.sources[0].space
    t1 = time.perf_counter()
    plan = ds.plan(1, WORKERS)
    t2 = time.perf_counter()
    n = len(ds)
    t3 = time.perf_counter()
    assert len(ds) == n
    t4 = time.perf_counter()
    private = anon_mb() - before
    split = sw.WindowDataset(url, **LOADER, select=sw.Select(split="train"))  # key hashes of every sequence, once
    t5 = time.perf_counter()
    split.sources[0].space
    t6 = time.perf_counter()
    return {"index_s": t1 - t0, "plan_s": t2 - t1, "len_first_s": t3 - t2, "len_again_s": t4 - t3,
            "split_index_s": t6 - t5, "plan_private_mb": private, "windows": plan.total_windows}


def _idle(conn) -> None:
    import streamwin  # noqa: F401  (what a worker imports: torch, numpy, streamwin)
    import torch  # noqa: F401

    conn.send(True)
    conn.recv()


def idle_workers(method: str, n: int) -> tuple[float, float]:
    """(private MB of one, seconds until all are up) for ``n`` idle processes of this start method
    that imported what a worker imports: the floor under a loader's own cost."""
    import multiprocessing as mp

    ctx = mp.get_context(method)
    t = time.perf_counter()
    pipes, procs = [], []
    for _ in range(n):
        mine, theirs = ctx.Pipe()
        procs.append(ctx.Process(target=_idle, args=(theirs,), daemon=True))
        procs[-1].start()
        pipes.append(mine)
    for mine in pipes:
        mine.recv()
    up = time.perf_counter() - t
    time.sleep(0.5)
    mb = max(private_mb(p.pid) for p in procs)
    for mine, p in zip(pipes, procs):
        mine.send(True)
        p.join()
    return mb, up


def child_loader(url: str, method: str) -> dict:
    import torch  # noqa: F401

    import streamwin as sw

    if method != "forkserver":
        idle, startup = idle_workers(method, WORKERS)
    before = anon_mb()
    t = time.perf_counter()
    ds = sw.WindowDataset(url, **LOADER)
    loader = sw.WindowLoader(ds, num_workers=WORKERS, multiprocessing_context=method)
    it = iter(loader)
    next(it)
    first = time.perf_counter() - t
    for _ in range(20):
        next(it)
    trainer = anon_mb() - before
    pids = [p.pid for p in loader._pool.procs]
    server = _parent(pids[0]) if method == "forkserver" else None
    if method == "forkserver":  # the server is up now, with its preload: idle workers fork from it too
        idle, startup = idle_workers(method, WORKERS)
    workers = [private_mb(pid) - idle for pid in pids]
    server_mb = private_mb(server) if server else 0.0
    loader.close()
    node = RANKS * (trainer + server_mb + sum(workers))
    return {"first_batch_s": first, "idle_startup_s": startup, "trainer_mb": trainer, "worker_mb": max(workers),
            "idle_worker_mb": idle, "server_mb": server_mb, "workers": len(workers), "node_gb": node / 1024}


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def run_child(*args: str) -> dict:
    """One measurement in a fresh process (children.run_child): its JSON record; RuntimeError if it failed."""
    from children import run_child as run_in_child

    out = run_in_child([sys.executable, __file__, "--child", *args], CHILD_TIMEOUT_S, cwd=str(REPO),
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    if out.record is None:
        raise RuntimeError(f"child {args} failed:\n{out.stderr[-3000:]}")
    return out.record


# -- packing -----------------------------------------------------------------------------------

def npz_source(src: Path, n: int, per_file: int) -> Path:
    """``n`` short float32 sequences (8..56 steps) in .npz files of ``per_file`` each (kept and reused)."""
    if (src / "done").exists():
        return src
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for f, lo in enumerate(range(0, n, per_file)):
        arrs = {f"s{i:08d}": rng.standard_normal(int(rng.integers(8, 57)), dtype=np.float32)
                for i in range(lo, min(lo + per_file, n))}
        np.savez(src / f"part{f:04d}.npz", **arrs)
    (src / "done").write_text("")
    return src


def pack_rates(root: Path, n: int, workers: list[int]) -> dict:
    """Sequences/s of streamwin.pack from 16 .npz files of short sequences, per worker count."""
    import streamwin as sw

    src = npz_source(root / f"npz-{n}", n, n // 16)
    out, cpu, digests = {}, {}, {}
    for w in workers:
        dest = root / f"packed-{w}"
        shutil.rmtree(dest, ignore_errors=True)
        before = _cpu_s()
        t = time.perf_counter()
        m = sw.pack(str(src), str(dest), workers=w, progress=False, shard_bytes=64 << 20)
        out[w] = m.num_sequences / (time.perf_counter() - t)
        cpu[w] = [(b - a) * 1e6 / m.num_sequences for a, b in zip(before, _cpu_s())]
        digests[w] = [s.sha256 for s in m.shards]
        shutil.rmtree(dest, ignore_errors=True)
    return {"seq_per_s": out, "cpu_us_per_seq": cpu, "identical": len({tuple(d) for d in digests.values()}) == 1,
            "cores": len(os.sched_getaffinity(0))}


def _cpu_s() -> tuple[float, float]:
    """CPU seconds (user + system) of this process (the writer, its hash thread included) and of
    its finished children (pack's worker processes)."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


def child_pack_memory(src: str, dest: str) -> dict:
    """Peak RSS (VmHWM) and peak anonymous memory (sampled every 5 ms) of one serial pack."""
    import threading

    import streamwin as sw

    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak[0] = max(peak[0], anon_mb())

    before = anon_mb()
    threading.Thread(target=sample, daemon=True).start()
    t = time.perf_counter()
    m = sw.pack(src, dest, progress=False, shard_bytes=256 << 20)
    seconds = time.perf_counter() - t
    done.set()
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    shutil.rmtree(dest, ignore_errors=True)
    return {"sequences": m.num_sequences, "peak_rss_mb": hwm, "peak_anon_mb": max(peak[0], anon_mb()) - before,
            "seq_per_s": m.num_sequences / seconds}


def pack_memory(root: Path, sizes: list[int]) -> list[dict]:
    """`child_pack_memory` at each size, from .npz files of 62,500 sequences each (so a file's
    memory is the same at every size and only the per-sequence index could grow)."""
    return [run_child("packmem", str(npz_source(root / f"npz-mem-{n}", n, 62_500)), str(root / f"packmem-{n}"))
            for n in sizes]


# -- checksums of a terabyte ---------------------------------------------------------------------

SPARSE_SHARD = 256 << 20  # bytes of each sparse shard
SUMS_WINDOW, SUMS_STRIDE = 256, 65_536


def make_sparse_corpus(root: Path, gb: int) -> str:
    """``gb`` GB of sparse shards of SPARSE_SHARD bytes, each one member ``s<k>.npy`` of float32 zeros, with
    real sums files (computed from the bytes they hold: a header, then zeros) and a manifest (reused)."""
    from streamwin.formats import npy as npyfmt, tar as tarfmt
    from streamwin.formats.checks import BLOCK, CHUNK, SUFFIX, Checks
    from streamwin.formats.manifest import Manifest, ShardEntry
    from streamwin.formats.sums import Layout, digest_of, sums_file, sums_of
    from streamwin.storage.manifests import write_manifest
    from streamwin.storage.urls import url_to_fs

    n = max(1, (gb << 30) // SPARSE_SHARD)
    marker = root / "corpus.json"
    if marker.exists() and json.loads(marker.read_text()) == {"shards": n, "bytes": SPARSE_SHARD}:
        return str(root)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    steps = (SPARSE_SHARD - 3 * 512 - 128) // 4
    head_npy = npyfmt.npy_header_for(np.dtype("<f4"), (steps,))
    content = len(head_npy) + 4 * steps
    size = 512 + content + (-content % 512) + 1024
    zero_chunk, zero_block = sums_of(bytes(CHUNK))[0], sums_of(bytes(BLOCK))[0]
    layout = Layout(size)
    shards, digests = [], []
    for k in range(n):
        name = f"shard-{k:06d}.tar"
        head = tarfmt.tar_header(f"s{k:06d}.npy", content) + head_npy
        with open(root / name, "wb") as f:
            f.write(head)
            f.truncate(size)  # the rest: zeros, not on disk
        fine = np.full(-(-size // CHUNK), zero_chunk, dtype=np.uint32)
        coarse = np.full(-(-size // BLOCK), zero_block, dtype=np.uint32)
        first = head + bytes(BLOCK - len(head))
        fine[: BLOCK // CHUNK], coarse[0] = sums_of(first, CHUNK), sums_of(first, BLOCK)[0]
        fine[-1], coarse[-1] = sums_of(bytes(size - (len(fine) - 1) * CHUNK))[0], \
            sums_of(bytes(size - (len(coarse) - 1) * BLOCK), BLOCK)[0]
        data = sums_file(fine, coarse, layout)
        (root / (name + SUFFIX)).write_bytes(data)
        digests.append((digest_of(data[: layout.table_bytes]), hashlib.sha256(data).hexdigest()))
        shards.append(ShardEntry(name, size, "0" * 64, 1, steps))
    keys = np.frombuffer(b"".join(f"s{k:06d}".encode() for k in range(n)), dtype=np.uint8)
    m = Manifest(dtype=np.dtype("<f4"), step_shape=(), compression=None, shards=tuple(shards),
                 length=np.full(n, steps, dtype=np.int64), offset=np.full(n, 512, dtype=np.int64),
                 size=np.full(n, content, dtype=np.int64), hlen=np.full(n, len(head_npy), dtype=np.int32),
                 key_blob=keys.tobytes(), key_ends=np.arange(1, n + 1, dtype=np.int64) * 7,
                 checks=Checks.of_shards(digests, [s.bytes for s in shards]))
    write_manifest(*url_to_fs(str(root)), m)
    marker.write_text(json.dumps({"shards": n, "bytes": SPARSE_SHARD}))
    return str(root)


def child_sums(url: str, blocks: str) -> dict:
    """Load the sparse corpus, read ``blocks`` shuffled blocks: the checksums held and the memory added."""
    import streamwin as sw
    from streamwin.read import ShardReader

    ds = sw.WindowDataset(url, window=SUMS_WINDOW, stride=SUMS_STRIDE, batch_size=256, seed=0, rank=0, world_size=1)
    m = ds.manifest
    plan = ds.plan(0, 0).schedule(0).plans[0]  # the process's blocks (lane 0)
    before, rss = anon_mb(), status_mb("VmRSS")  # what reading adds (the manifest's checks: manifest_checks_kb)
    reader = ShardReader(url, m, ds.read)
    touched, windows = set(), 0
    for b in range(min(int(blocks), plan.num_blocks(0))):
        block = reader.read_block(plan, 0, b)
        windows += len(block)
        touched |= {m.shard_of(int(i)) for i in block.seq_ids}
        reader.release(block)
    corpus = sum(s.bytes for s in m.shards)
    return {"corpus_gb": corpus / 2**30, "shards": len(m.shards), "index_json_kb": os.path.getsize(
                os.path.join(url, "index.json")) / 1024,
            "manifest_checks_kb": (m.checks.digests.nbytes + m.checks.sha256.nbytes + m.checks.sizes.nbytes) / 1024,
            "held_kb": reader.sums.nbytes / 1024, "held_shards": len(reader.sums.held()),
            "shards_read": len(touched), "windows": windows, "sums_read_kb": reader.stats.bytes_sums / 1024,
            "bytes_read_mb": reader.stats.bytes_read / 2**20, "private_mb": anon_mb() - before,
            "rss_mb": status_mb("VmRSS") - rss, "before_sums_files_mb": 4 * -(-corpus // 4096) / 2**20}


def sums_rows(root: Path, sizes_gb: list[int], blocks: int) -> list[dict]:
    """`child_sums` at each corpus size, each in a fresh process."""
    return [run_child("sums", make_sparse_corpus(root / f"sparse-{gb}gb", gb), str(blocks)) for gb in sizes_gb]


def print_sums(rows: list[dict], blocks: int) -> None:
    print(f"\nchecksums per process, {blocks} shuffled blocks read (W={SUMS_WINDOW}, stride {SUMS_STRIDE:,}):\n")
    print("| corpus | shards | shards read | checksums in the manifest | sums held by the reader (shards) | "
          "sums read | private memory reading added | all sums in memory (every process) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['corpus_gb']:,.0f} GB | {r['shards']:,} | {r['shards_read']:,} | {r['manifest_checks_kb']:,.1f} KB | "
              f"{r['held_kb']:,.0f} KB ({r['held_shards']}) | {r['sums_read_kb']:,.0f} KB | {r['private_mb']:,.1f} MB | "
              f"{r['before_sums_files_mb']:,.1f} MB |")


# -- main --------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=str(REPO / "bench_data" / "scale"))
    ap.add_argument("--quick", action="store_true", help="1M sequences only")
    ap.add_argument("--sizes", type=int, nargs="*", help="sequence counts (default 1M and 10M)")
    ap.add_argument("--pack-seqs", type=int, default=200_000)
    ap.add_argument("--pack-workers", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--pack-memory", type=int, nargs="*", default=[],
                    help="also measure pack's peak memory at these sequence counts (e.g. 1000000 4000000)")
    ap.add_argument("--pack-only", action="store_true", help="only the pack measurements")
    ap.add_argument("--no-loaders", action="store_true", help="skip the loaders' start-up and memory (and packing)")
    ap.add_argument("--sums-gb", type=int, nargs="*", default=[],
                    help="checksum memory at these corpus sizes in GB of sparse shards (e.g. 1 10 100 1000)")
    ap.add_argument("--sums-blocks", type=int, default=8, help="blocks each checksum measurement reads")
    ap.add_argument("--fields", action="store_true",
                    help="also the manifest with two int fields per sequence (a label, a store id): bytes and load")
    ap.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, url, *rest = args.child
        result = {"manifest": child_manifest, "plan": child_plan, "packmem": lambda u: child_pack_memory(u, *rest),
                  "sums": lambda u: child_sums(u, *rest)}.get(kind)
        print(json.dumps(result(url) if result else child_loader(url, *rest)))
        return
    root = Path(args.root)
    default = [1_000_000] if args.quick else [1_000_000, 10_000_000]
    sizes = [] if args.pack_only else default if args.sizes is None else args.sizes  # --sizes alone: none
    rows = []
    for n in sizes:
        t = time.perf_counter()
        url = make_corpus(root / f"n{n}", n)
        row = {"sequences": n, "corpus_s": time.perf_counter() - t, "manifest": run_child("manifest", url),
               "plan": run_child("plan", url)}
        if args.fields:
            row["fields_manifest"] = run_child("manifest", with_fields(url, root / f"n{n}-fields"))
        for method in [] if args.no_loaders else METHODS:
            row[method] = run_child("loader", url, method)
        rows.append(row)
        print(f"{n:,}: {json.dumps(row)}", file=sys.stderr)
    pack = {}
    if not args.no_loaders:
        pack = pack_rates(root, args.pack_seqs, args.pack_workers)
        pack["memory"] = pack_memory(root, args.pack_memory)
        print_table(rows, pack, args.pack_seqs)
    print_manifests(rows)
    sums = sums_rows(root, args.sums_gb, args.sums_blocks)
    if sums:
        print_sums(sums, args.sums_blocks)
    print(json.dumps({"rows": rows, "pack": pack, "sums": sums, "cores": len(os.sched_getaffinity(0))}))


def with_fields(url: str, dest: Path) -> str:
    """The corpus's manifest with two int fields per sequence (label 0..999, store 0..49), written (columnar)
    to ``dest`` beside no shards: what a manifest of labelled sequences costs to keep and to load."""
    import dataclasses

    import streamwin as sw
    from streamwin.formats.meta import SeqFields
    from streamwin.storage.manifests import write_manifest
    from streamwin.storage.urls import url_to_fs

    if (dest / "index.json").exists():
        return str(dest)
    m = sw.load_manifest(url)
    rng = np.random.default_rng(0)
    n = m.num_sequences
    fields = SeqFields({"label": "int", "store": "int"}, {"label": rng.integers(0, 1000, n),
                                                          "store": rng.integers(0, 50, n)}, {}, {})
    dest.mkdir(parents=True, exist_ok=True)
    fs, root = url_to_fs(str(dest))
    write_manifest(fs, root, dataclasses.replace(m, fields=fields), columnar=True)
    return str(dest)


def print_manifests(rows: list[dict]) -> None:
    """What loading each manifest added to a fresh process, per sequence (goal: <= 40 bytes)."""
    if not rows:
        return
    print("\n| sequences | manifest load s | resident B/seq (goal <= 40) | peak B/seq | private B/seq | columns file MB |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        m = r["manifest"]
        print(f"| {r['sequences']:,} | {m['load_s']:.3f} | {m['rss_bytes_per_seq']:.1f} | {m['peak_bytes_per_seq']:.1f} | "
              f"{m['anon_bytes_per_seq']:.1f} | {m['shared_mb']:.0f} |")
        f = r.get("fields_manifest")
        if f is not None:
            print(f"| {r['sequences']:,} + 2 int fields | {f['load_s']:.3f} | {f['rss_bytes_per_seq']:.1f} | "
                  f"{f['peak_bytes_per_seq']:.1f} | {f['anon_bytes_per_seq']:.1f} | {f['shared_mb']:.0f} "
                  f"({(f['shared_mb'] - m['shared_mb']) * 2**20 / r['sequences']:.1f} B/seq more) |")


def print_table(rows: list[dict], pack: dict, pack_seqs: int) -> None:
    methods = " / ".join(METHODS)
    print(f"| sequences | manifest load s | private B/seq | shared MB | window index s (split) | plan of an epoch s | "
          f"len() first / again s | first batch s {methods} (idle spawn start) | trainer MB {methods} | "
          f"worker MB {methods} | node GB (8x8) {methods} |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        m, p = r["manifest"], r["plan"]
        each = lambda key, fmt: " / ".join(format(r[x][key], fmt) for x in METHODS)  # noqa: E731
        print(f"| {r['sequences']:,} | {m['load_s']:.3f} | {m['bytes_per_seq']:.1f} | {m['shared_mb']:.0f} | "
              f"{p['index_s']:.2f} ({p['split_index_s']:.2f}) | {p['plan_s']:.3f} | {p['len_first_s']:.3f} / {p['len_again_s']:.6f} | "
              f"{each('first_batch_s', '.1f')} ({r['spawn']['idle_startup_s']:.1f}) | {each('trainer_mb', '.0f')} | "
              f"{each('worker_mb', '.0f')} | {each('node_gb', '.2f')} |")
    rates = pack["seq_per_s"]
    one = rates.get(1)
    shown = ", ".join(f"{w} worker{'s' * (w > 1)}: {v:,.0f}/s" + (f" ({v / one:.2f}x)" if one and w > 1 else "")
                      for w, v in rates.items())
    cpu = ", ".join(f"{w}: {a:.1f} in the writer + {b:.1f} in workers" for w, (a, b) in pack["cpu_us_per_seq"].items())
    print(f"\npack, {pack_seqs:,} short sequences from 16 .npz files on {pack['cores']} cores: {shown}; "
          f"CPU us per sequence by worker count: {cpu}; shards byte-identical across worker counts: {pack['identical']}")
    mem = pack["memory"]
    if len(mem) > 1:
        a, b = mem[0], mem[-1]
        grow = lambda key: (b[key] - a[key]) * 2**20 / (b["sequences"] - a["sequences"])  # noqa: E731
        print("pack memory, one process: " + ", ".join(
            f"{m['sequences']:,} sequences: peak RSS {m['peak_rss_mb']:.0f} MB, peak anonymous +{m['peak_anon_mb']:.0f} MB "
            f"({m['seq_per_s']:,.0f}/s)" for m in mem) + f"; growth per sequence: RSS {grow('peak_rss_mb'):.1f} B, "
            f"anonymous {grow('peak_anon_mb'):.1f} B")


if __name__ == "__main__":
    main()
