"""Packing throughput against the raw write bandwidth of the same bytes, and the manifest at scale.

Part 1, packing. A directory of ``.npy`` files (one sequence each, so there are many units
for the workers) is packed with ``streamwin.pack`` at 1 and 2 workers, next to two limits
measured on the same bytes in the same run:

  raw write   the .npy bytes, already in memory, written with plain file writes into files of
              ``--shard-size`` bytes, each fsync'ed (pack fsyncs every shard too): the disk's limit
  raw copy    the same, but reading the .npy files first: the limit for a pack that must read them

MB/s are bytes written per second (shard bytes for pack). Repeats are interleaved, so drift on
a shared machine hits every system alike; the median is reported.

Part 2, the manifest at 1M sequences. A manifest of ``--sequences`` sequences (lengths
log-uniform, keys like ``seq0000042``, 100 shards) is built with ``build_manifest`` (no shard
data is needed to measure it), written as index.json, and loaded with
``streamwin.load_manifest``: its size on disk and its load time (median of repeats).

Part 3, engines side by side. The same input of many short sequences (``--engine-files``
``.npz`` files, ``--engine-seqs`` sequences in all: one unit per file) is packed on this
machine with 1 and 2 worker processes, as Ray tasks on a local Ray cluster and as Dask
tasks on a ``LocalCluster`` of as many processes as CPUs, interleaved: sequences/s and MB/s
of shards written, and that every engine wrote the same index. Each engine's overhead per
unit is measured on ``--tiny-units`` files of one short sequence each (seconds / units, the
cost of a task, its fragment and its share of the merge); the clusters' start-up is
reported apart (paid once per job). Finally the merge alone: ``FragmentMerger`` over 10,000
fragments of 100 sequences each, as a driver merges a corpus of 10,000 units.

Usage:
  python benchmarks/pack.py --quick     # ~64 MB, 200k sequences, 1 repeat (~1 min)
  python benchmarks/pack.py             # ~512 MB, 1M sequences, 3 repeats
  python benchmarks/pack.py --only-engines  # part 3 alone
Prints markdown tables and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent


def make_source(root: Path, total_bytes: int, files: int, seed: int = 0) -> int:
    """``files`` .npy files of float32 [T, 8] adding up to about ``total_bytes``; returns their bytes."""
    marker = root / "source.json"
    spec = {"total_bytes": total_bytes, "files": files, "seed": seed}
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return sum(p.stat().st_size for p in root.glob("*.npy"))
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    weights = rng.lognormal(0, 0.7, size=files)
    steps = np.maximum(1, (weights / weights.sum() * total_bytes / 32).astype(np.int64))  # 32 bytes per step
    for i, t in enumerate(steps):
        np.save(root / f"seq{i:05d}.npy", rng.standard_normal((int(t), 8), dtype=np.float32))
    marker.write_text(json.dumps(spec))
    return sum(p.stat().st_size for p in root.glob("*.npy"))


def raw_write(files: list[Path], out: Path, shard_bytes: int, blobs: list[bytes] | None) -> int:
    """Write the files' bytes (``blobs`` if given, else read from disk) into fsync'ed files of ~shard_bytes."""
    out.mkdir(parents=True)
    written, current, k = 0, None, 0
    for i, path in enumerate(files):
        data = blobs[i] if blobs is not None else path.read_bytes()
        if current is None:
            current = open(out / f"raw-{k:06d}.bin", "wb", buffering=1 << 20)
            size = 0
        current.write(data)
        size += len(data)
        written += len(data)
        if size >= shard_bytes:
            current.flush()
            os.fsync(current.fileno())
            current.close()
            current, k = None, k + 1
    if current is not None:
        current.flush()
        os.fsync(current.fileno())
        current.close()
    return written


def run_case(case: str, src: Path, work: Path, shard_bytes: int, blobs: list[bytes]) -> dict:
    import streamwin as sw

    dest = work / f"out-{case}"
    shutil.rmtree(dest, ignore_errors=True)
    files = sorted(src.glob("*.npy"))
    os.sync()
    start = time.perf_counter()
    if case == "raw write":
        nbytes = raw_write(files, dest, shard_bytes, blobs)
    elif case == "raw copy":
        nbytes = raw_write(files, dest, shard_bytes, None)
    else:
        workers = int(case.split()[1])
        m = sw.pack(str(src), str(dest), shard_bytes=shard_bytes, workers=workers, progress=False)
        nbytes = sum(s.bytes for s in m.shards)
    seconds = time.perf_counter() - start
    shutil.rmtree(dest, ignore_errors=True)
    return {"bytes": nbytes, "seconds": seconds, "mb_per_s": nbytes / 1e6 / seconds}


def bench_pack(args: argparse.Namespace, work: Path) -> dict:
    src = work / "source"
    source_bytes = make_source(src, args.source_mb * 10**6, args.files)
    files = sorted(src.glob("*.npy"))
    blobs = [p.read_bytes() for p in files]  # the raw-write limit writes from memory
    cases = ["raw write", "raw copy", "pack 1", "pack 2"]
    results: dict[str, list[dict]] = {c: [] for c in cases}
    for r in range(args.repeats):
        for case in cases:
            results[case].append(run_case(case, src, work, args.shard_size, blobs))
            print(f"  repeat {r + 1}/{args.repeats} {case:10s} {results[case][-1]['mb_per_s']:8.1f} MB/s",
                  file=sys.stderr)
    med = {c: statistics.median(x["mb_per_s"] for x in runs) for c, runs in results.items()}
    return {"source_bytes": source_bytes, "files": len(files), "shard_bytes": args.shard_size,
            "mb_per_s": med, "runs": results}


def bench_manifest(n: int, repeats: int, work: Path) -> dict:
    import streamwin as sw
    from streamwin.formats.manifest import ShardEntry, build_manifest

    rng = np.random.default_rng(0)
    lengths = np.exp(rng.uniform(np.log(10), np.log(10_000), size=n)).astype(np.int64)
    hlen = np.full(n, 128, dtype=np.int64)
    size = hlen + lengths * 32  # float32 [T, 8]
    shards_n = 100
    bounds = np.linspace(0, n, shards_n + 1).astype(np.int64)
    offset = np.empty(n, dtype=np.int64)
    shards = []
    for k in range(shards_n):  # lay the members out as pack would: 512-byte header, content, padding
        lo, hi = bounds[k], bounds[k + 1]
        blocks = 512 + (size[lo:hi] + 511) // 512 * 512
        ends = np.cumsum(blocks)
        offset[lo:hi] = ends - blocks + 512
        shards.append(ShardEntry(f"shard-{k:06d}.tar", int(ends[-1]) + 1024, "0" * 64, int(hi - lo),
                                 int(lengths[lo:hi].sum())))
    keys = [f"seq{i:07d}" for i in range(n)]
    start = time.perf_counter()
    m = build_manifest(np.dtype("<f4"), (8,), None, shards, keys,
                       {"length": lengths, "offset": offset, "size": size, "hlen": hlen})
    text = m.to_json().encode()
    build_s = time.perf_counter() - start
    root = work / "manifest"
    root.mkdir(parents=True, exist_ok=True)
    (root / "index.json").write_bytes(text)
    loads = []
    for _ in range(repeats):
        start = time.perf_counter()
        loaded = sw.load_manifest(str(root))
        loads.append(time.perf_counter() - start)
    assert loaded.num_sequences == n and loaded.key(n - 1) == keys[-1] and (loaded.offset == offset).all()
    return {"sequences": n, "index_bytes": len(text), "bytes_per_sequence": len(text) / n,
            "build_and_serialize_s": build_s, "load_s": statistics.median(loads)}


def make_npz_source(root: Path, files: int, seqs: int, seed: int = 1) -> int:
    """``files`` .npz files holding ``seqs`` short float32 [T, 4] sequences in all (T 8..56); returns their bytes."""
    marker = root / "source.json"
    spec = {"files": files, "seqs": seqs, "seed": seed}
    if not (marker.exists() and json.loads(marker.read_text()) == spec):
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        rng = np.random.default_rng(seed)
        per = np.diff(np.linspace(0, seqs, files + 1).astype(np.int64))
        for f, n in enumerate(per):
            np.savez(root / f"part{f:05d}.npz", **{f"s{f}_{i}": rng.standard_normal((int(rng.integers(8, 57)), 4),
                                                                                 dtype=np.float32) for i in range(n)})
        marker.write_text(json.dumps(spec))
    return sum(p.stat().st_size for p in root.glob("*.npz"))


ENGINE_CASES = ("local 1", "local 2", "ray", "dask")


def pack_with(case: str, src: Path, dest: Path, shard_bytes: int):
    import streamwin as sw

    shutil.rmtree(dest, ignore_errors=True)
    engine = None if case.startswith("local") else case
    workers = int(case.split()[1]) if case.startswith("local") else 1
    start = time.perf_counter()
    m = sw.pack(str(src), str(dest), shard_bytes=shard_bytes, workers=workers, engine=engine, progress=False)
    return m, time.perf_counter() - start


def bench_engines(args: argparse.Namespace, work: Path) -> dict:
    """Part 3: the same input packed by every engine, interleaved; per-unit overhead on tiny units; the merge alone."""
    import distributed
    import ray

    src, tiny = work / "engines-source", work / "engines-tiny"
    source_bytes = make_npz_source(src, args.engine_files, args.engine_seqs)
    make_npz_source(tiny, args.tiny_units, args.tiny_units, seed=2)
    cpus = os.cpu_count() or 2
    start = time.perf_counter()
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ray_start = time.perf_counter() - start
    start = time.perf_counter()
    cluster = distributed.LocalCluster(n_workers=cpus, threads_per_worker=1, processes=True, dashboard_address=None)
    client = distributed.Client(cluster)
    dask_start = time.perf_counter() - start
    runs: dict[str, list[dict]] = {c: [] for c in ENGINE_CASES}
    indexes = {}
    try:
        for case in ENGINE_CASES:  # warm-up: workers started, modules imported
            pack_with(case, tiny, work / "engines-out", 1 << 20)
        for r in range(args.repeats):
            for case in ENGINE_CASES:
                m, seconds = pack_with(case, src, work / "engines-out", args.engine_shard_size)
                indexes[case] = (work / "engines-out" / "index.json").read_bytes()
                _, tiny_s = pack_with(case, tiny, work / "engines-out", 1 << 20)
                nbytes = sum(s.bytes for s in m.shards)
                runs[case].append({"seconds": seconds, "seqs_per_s": m.num_sequences / seconds,
                                   "mb_per_s": nbytes / 1e6 / seconds, "unit_ms": tiny_s / args.tiny_units * 1e3})
                print(f"  repeat {r + 1}/{args.repeats} {case:8s} {runs[case][-1]['seqs_per_s']:10,.0f} seq/s "
                      f"{runs[case][-1]['unit_ms']:7.1f} ms/unit", file=sys.stderr)
    finally:
        client.close()
        cluster.close()
        ray.shutdown()
    med = {c: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for c, rs in runs.items()}
    identical = len(set(indexes.values())) == 1
    return {"source_bytes": source_bytes, "files": args.engine_files, "sequences": args.engine_seqs, "cpus": cpus,
            "tiny_units": args.tiny_units, "ray_start_s": ray_start, "dask_start_s": dask_start,
            "identical_index": identical, "median": med, "merge": bench_merge(10_000, 100)}


def bench_merge(units: int, per_unit: int) -> dict:
    """FragmentMerger over ``units`` fragments of ``per_unit`` sequences each, as they arrive from tasks (index text)."""
    from streamwin.formats.manifest import ShardEntry, build_manifest
    from streamwin.packing.fragments import Fragment, FragmentMerger

    lengths = np.full(per_unit, 32, dtype=np.int64)
    cols = {"length": lengths, "offset": np.arange(per_unit) * 1536 + 512, "size": np.full(per_unit, 640),
            "hlen": np.full(per_unit, 128)}
    texts = []
    for u in range(units):
        shard = ShardEntry(f"shard-g000001-u{u:06d}-000000.tar", per_unit * 1536 + 1024, "0" * 64, per_unit, 32 * per_unit)
        m = build_manifest(np.dtype("<f4"), (4,), None, [shard], [f"u{u}_{i}" for i in range(per_unit)], cols)
        texts.append(m.to_json())
    start = time.perf_counter()
    merger = FragmentMerger()
    for u, text in enumerate(texts):
        merger.add_fragment(Fragment(u, text, 0, None, f"unit {u}"))
    merged = merger.finish()
    seconds = time.perf_counter() - start
    assert merged.num_sequences == units * per_unit
    return {"units": units, "sequences": units * per_unit, "seconds": seconds, "ms_per_unit": seconds / units * 1e3}


def print_engines(en: dict, repeats: int) -> None:
    med = en["median"]
    print(f"\n### Engines: {en['sequences']:,} short sequences in {en['files']} .npz files "
          f"({en['source_bytes'] / 1e6:,.0f} MB; {en['cpus']} CPUs; median of {repeats}, interleaved)\n")
    print("| engine | sequences/s | MB/s | overhead per unit (ms) | vs local, 1 worker |")
    print("|---|---:|---:|---:|---:|")
    base = med["local 1"]["seqs_per_s"]
    labels = {"local 1": "this machine, 1 process", "local 2": "this machine, 2 worker processes",
              "ray": f"Ray, local cluster of {en['cpus']} CPUs", "dask": f"Dask, LocalCluster of {en['cpus']} processes"}
    for case in ENGINE_CASES:
        r = med[case]
        print(f"| {labels[case]} | {r['seqs_per_s']:,.0f} | {r['mb_per_s']:,.1f} | {r['unit_ms']:.1f} | "
              f"{r['seqs_per_s'] / base:.2f} |")
    mg = en["merge"]
    print(f"\nSame index.json from every engine: {'yes' if en['identical_index'] else 'NO'}. Cluster start-up, once per "
          f"job: Ray {en['ray_start_s']:.1f} s, Dask {en['dask_start_s']:.1f} s. Overhead per unit: {en['tiny_units']} "
          f"files of one sequence each, seconds / units. Merge of {mg['units']:,} fragments ({mg['sequences']:,} "
          f"sequences): {mg['seconds']:.2f} s ({mg['ms_per_unit']:.3f} ms per unit).")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 MB, 200k-sequence manifest, 1 repeat")
    parser.add_argument("--source-mb", type=int, help="MB of .npy source (default 512; quick 64)")
    parser.add_argument("--files", type=int, help="number of .npy files (default 512; quick 128)")
    parser.add_argument("--shard-size", type=int, default=64 << 20, help="shard bytes (default 64 MiB)")
    parser.add_argument("--sequences", type=int, help="sequences in the manifest test (default 1M; quick 200k)")
    parser.add_argument("--repeats", type=int, help="interleaved repeats (default 3; quick 1)")
    parser.add_argument("--dir", type=Path, default=REPO / "bench_data" / "pack", help="work directory")
    parser.add_argument("--engine-seqs", type=int, help="sequences of the engines' input (default 400k; quick 100k)")
    parser.add_argument("--engine-files", type=int, default=32, help=".npz files (units) of the engines' input")
    parser.add_argument("--engine-shard-size", type=int, default=16 << 20, help="shard bytes of the engines' packs")
    parser.add_argument("--tiny-units", type=int, help="one-sequence files to measure per-unit overhead (default 400; quick 200)")
    parser.add_argument("--only-engines", action="store_true", help="part 3 alone")
    parser.add_argument("--no-engines", action="store_true", help="parts 1 and 2 only (no Ray or Dask needed)")
    args = parser.parse_args(argv)
    q = args.quick
    args.source_mb = args.source_mb or (64 if q else 512)
    args.files = args.files or (128 if q else 512)
    args.sequences = args.sequences or (200_000 if q else 1_000_000)
    args.repeats = args.repeats or (1 if q else 3)
    args.engine_seqs = args.engine_seqs or (100_000 if q else 400_000)
    args.tiny_units = args.tiny_units or (200 if q else 400)
    args.dir.mkdir(parents=True, exist_ok=True)
    en = None if args.no_engines else bench_engines(args, args.dir)
    if en is not None:
        print_engines(en, args.repeats)
    if args.only_engines:
        print("\n" + json.dumps({"bench": "pack", "quick": q, "cpus": os.cpu_count(), "engines": en}))
        return 0

    pk = bench_pack(args, args.dir)
    mf = bench_manifest(args.sequences, max(3, args.repeats), args.dir)
    mbs = pk["mb_per_s"]
    limit = mbs["raw write"]
    print(f"\n### Packing {pk['source_bytes'] / 1e6:,.0f} MB in {pk['files']} .npy files "
          f"(shards of {args.shard_size / 2**20:.0f} MiB; {os.cpu_count()} CPUs; median of {args.repeats})\n")
    print("| case | MB/s | vs raw write |")
    print("|---|---:|---:|")
    for case in ("raw write", "raw copy", "pack 1", "pack 2"):
        label = {"pack 1": "streamwin.pack, 1 worker", "pack 2": "streamwin.pack, 2 workers"}.get(case, case)
        print(f"| {label} | {mbs[case]:,.1f} | {mbs[case] / limit:.2f} |")
    print(f"\n### Manifest at {mf['sequences']:,} sequences\n")
    print("| index.json size | bytes / sequence | build + serialize | load_manifest |")
    print("|---:|---:|---:|---:|")
    print(f"| {mf['index_bytes'] / 1e6:,.1f} MB | {mf['bytes_per_sequence']:.1f} | {mf['build_and_serialize_s']:.2f} s "
          f"| {mf['load_s']:.3f} s |")
    summary = {"bench": "pack", "quick": q, "python": platform.python_version(), "cpus": os.cpu_count(),
               "source_bytes": pk["source_bytes"], "files": pk["files"], "shard_bytes": args.shard_size,
               "repeats": args.repeats, "mb_per_s": {k.replace(" ", "_"): round(v, 1) for k, v in mbs.items()},
               "manifest": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in mf.items()}, "engines": en}
    print("\n" + json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
