"""Remote reads under faults, the node cache, and resume latency, over a loopback HTTP server.

Cases (one epoch each, num_workers=0, the perf-notes window/batch/shuffle setup):

  local            the corpus read from local files: the ceiling for the rest
  http             the same epoch through the loopback HTTP server (tests/servers.py), no faults
  http drop/N MB   the server cuts the connection each time N MB of body bytes went out
                   (FaultPlan.drop_every_bytes); streamwin resumes at the byte where the
                   stream broke, after its default backoff (0.2 s, doubling); "re-sent MB"
                   counts the body bytes the server sent beyond index.json and the bytes read
  cache cold       http with ``cache_dir`` set, cache empty: whole shards are fetched, verified
                   (sha256) and read locally
  cache warm       the same, cache already full: no shard GET reaches the server

Resume latency: a loader is iterated for half an epoch, its ``state_dict()`` taken; a new
loader is built, and the time from ``load_state_dict(state)`` to the first batch in hand is
compared with the time from ``iter()`` to the first batch of a fresh epoch (both over http
and local). Resuming re-reads the current shuffle block and skips to the position, so both
cost about one block read.

Every faulty or cached epoch is checked against the fault-free one: the same (key, start)
sequence (a digest), the same number of batches.

Usage:
  python benchmarks/faults.py --quick                  # 72 MB corpus, 1 repeat (~20 s)
  python benchmarks/faults.py                          # 295 MB corpus, median of 3 (~1 minute)
  python benchmarks/faults.py --drop-every-mb 8 32 --repeats 5

Prints a markdown table, then one JSON line with every number.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the loopback servers
sys.path.insert(0, str(Path(__file__).resolve().parent))

import data  # noqa: E402

WINDOW, STRIDE, BATCH, POOL, SEED = 256, 64, 256, 10_000, 0


def make_loader(url: str, cache_dir: str | None = None):
    import streamwin as sw

    ds = sw.WindowDataset(url, window=WINDOW, stride=STRIDE, batch_size=BATCH, shuffle_buffer=POOL, seed=SEED,
                          read=sw.Read(cache_dir=cache_dir))
    return sw.WindowLoader(ds)


def run_epoch(loader, limit: int | None = None) -> dict[str, Any]:
    """Iterate (up to ``limit`` batches); windows/s over the epoch, first-batch time, order digest."""
    h = hashlib.sha256()
    windows = nbytes = batches = 0
    t0 = time.perf_counter()
    first = None
    for batch in loader:
        if first is None:
            first = time.perf_counter() - t0
        x = batch["x"]
        windows += x.shape[0]
        nbytes += x.numel() * x.element_size()
        h.update(batch["start"].numpy().tobytes())
        h.update("\0".join(batch["key"]).encode())
        batches += 1
        if limit is not None and batches >= limit:
            break
    elapsed = time.perf_counter() - t0
    st = loader.stats()
    return {"batches": batches, "windows": windows, "seconds": elapsed, "windows_per_s": windows / elapsed,
            "mb_per_s": nbytes / elapsed / 1e6, "first_batch_s": first, "digest": h.hexdigest()[:16],
            "retries": st.get("retries", 0), "cache_hits": st.get("cache_hits", 0), "bytes_read": st.get("bytes_read", 0)}


def measure(corpus: Path, drop_every_mb: list[float], repeats: int, resume_repeats: int) -> dict[str, Any]:
    from servers import FaultPlan, HTTPFileServer

    results: dict[str, list[dict[str, Any]]] = {}
    local_url = str(corpus)
    srv = HTTPFileServer(corpus.parent)
    url = srv.url_for(corpus.name)
    index_bytes = (corpus / "index.json").stat().st_size
    cache_root = Path(tempfile.mkdtemp(prefix="streamwin-faults-cache-"))
    cases = [("local", None), ("http", None)] + [(f"http drop/{n:g} MB", n) for n in drop_every_mb] + \
            [("cache cold", None), ("cache warm", None)]
    try:
        run_epoch(make_loader(local_url))  # warm-up: page cache, manifest, fsspec's session, allocator
        run_epoch(make_loader(url))
        for rep in range(repeats):  # interleaved, so drift on a shared machine hits every case alike
            for name, drop_mb in cases:
                plan = FaultPlan(path_contains="shard-", drop_every_bytes=int(drop_mb * (1 << 20)) if drop_mb else None)
                srv.set_faults(plan)  # also resets the counters
                cache_dir = cache_root / f"r{rep}"
                if name == "cache cold":
                    shutil.rmtree(cache_dir, ignore_errors=True)
                kw = {"cache_dir": str(cache_dir)} if name.startswith("cache") else {}
                r = run_epoch(make_loader(local_url if name == "local" else url, **kw))
                fs = srv.stats
                r.update(shard_gets=fs.get_requests, drops=fs.drops, served_mb=fs.bytes_served / 1e6,
                         resent_mb=(fs.bytes_served - index_bytes - r["bytes_read"]) / 1e6 if name.startswith("http") else None)
                results.setdefault(name, []).append(r)
        # resume latency, over http and local
        resume: dict[str, list[float]] = {}
        for rep in range(resume_repeats):
            for where, u in (("http", url), ("local", local_url)):
                srv.set_faults(FaultPlan())
                loader = make_loader(u)
                half = len(loader) // 2
                run_epoch(loader, limit=half)
                state = loader.state_dict()
                fresh = make_loader(u)
                t0 = time.perf_counter()
                it = iter(fresh)
                next(it)
                resume.setdefault(f"fresh epoch, {where}", []).append(time.perf_counter() - t0)
                restored = make_loader(u)
                t0 = time.perf_counter()
                restored.load_state_dict(state)
                it = iter(restored)
                next(it)
                resume.setdefault(f"resume at batch {half}, {where}", []).append(time.perf_counter() - t0)
                resume.setdefault(f"state bytes, {where}", []).append(len(json.dumps(state)))
    finally:
        srv.close()
        shutil.rmtree(cache_root, ignore_errors=True)
    return {"epochs": results, "resume": resume}


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    epochs = raw["epochs"]
    ref = epochs["local"][0]
    rows = {}
    for name, runs in epochs.items():
        rows[name] = {
            "windows_per_s": statistics.median(r["windows_per_s"] for r in runs),
            "mb_per_s": statistics.median(r["mb_per_s"] for r in runs),
            "epoch_s": statistics.median(r["seconds"] for r in runs),
            "first_batch_s": statistics.median(r["first_batch_s"] for r in runs),
            "retries": max(r["retries"] for r in runs),
            "resent_mb": None if runs[0]["resent_mb"] is None else max(r["resent_mb"] for r in runs),
            "drops": max(r["drops"] for r in runs),
            "shard_gets": max(r["shard_gets"] for r in runs) if name != "local" else 0,
            "cache_hits": max(r["cache_hits"] for r in runs),
            "same_batches": all(r["digest"] == ref["digest"] and r["batches"] == ref["batches"] for r in runs),
        }
    resume = {k: statistics.median(v) for k, v in raw["resume"].items()}
    return {"epochs": rows, "resume": resume, "batches": ref["batches"], "windows": ref["windows"]}


def table(s: dict[str, Any]) -> str:
    http = s["epochs"]["http"]["windows_per_s"]
    lines = ["| case | windows/s | MB/s | vs http | epoch s | first batch s | shard GETs | drops | retries | re-sent MB "
             "| cache hits | same batches |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:-:|"]
    for name, r in s["epochs"].items():
        resent = "-" if r["resent_mb"] is None else f"{r['resent_mb']:.1f}"
        lines.append(f"| {name} | {r['windows_per_s']:,.0f} | {r['mb_per_s']:,.0f} | {r['windows_per_s'] / http:.2f}x | "
                     f"{r['epoch_s']:.2f} | {r['first_batch_s']:.3f} | {r['shard_gets']} | {r['drops']} | "
                     f"{r['retries']} | {resent} | {r['cache_hits']} | {'yes' if r['same_batches'] else 'NO'} |")
    lines += ["", "| first batch after | seconds |", "|---|---:|"]
    for k, v in s["resume"].items():
        if not k.startswith("state bytes"):
            lines.append(f"| {k} | {v:.3f} |")
    states = {k: v for k, v in s["resume"].items() if k.startswith("state bytes")}
    if states:
        lines += ["", "loader state (JSON): " + ", ".join(f"{int(v)} bytes ({k.split(', ')[1]})" for k, v in states.items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--quick", action="store_true", help="72 MB corpus, 1 repeat")
    parser.add_argument("--scale", type=float, help="corpus size as a multiple of the quick corpus (default 4; --quick: 1)")
    parser.add_argument("--corpus", help="an existing corpus directory (default: bench_data/<by spec>)")
    parser.add_argument("--drop-every-mb", type=float, nargs="+", default=[16.0, 64.0],
                        help="fault cases: cut the connection every N MB served")
    parser.add_argument("--repeats", type=int, help="epochs per case, median reported (default 3; --quick: 1)")
    parser.add_argument("--resume-repeats", type=int, help="resume measurements (default 5; --quick: 3)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    scale = args.scale if args.scale is not None else (1.0 if args.quick else 4.0)
    repeats = args.repeats or (1 if args.quick else 3)
    resume_repeats = args.resume_repeats or (3 if args.quick else 5)
    if any(n <= 0 for n in args.drop_every_mb):
        parser.error("--drop-every-mb must be positive")
    spec = data.CorpusSpec.quick() if scale == 1 else data.CorpusSpec.quick().scaled(scale)
    corpus = Path(args.corpus) if args.corpus else data.write_corpus(data.default_dir(spec), spec)
    started = time.perf_counter()
    raw = measure(corpus.resolve(), args.drop_every_mb, repeats, resume_repeats)
    s = summarize(raw)
    size_mb = sum(p.stat().st_size for p in corpus.glob("*.tar")) / 1e6
    print(f"corpus {corpus} ({size_mb:.0f} MB, {s['windows']:,} windows, {s['batches']} batches per epoch); "
          f"W={WINDOW} stride={STRIDE} batch={BATCH} pool={POOL}; num_workers=0; {platform.node()}, {os.cpu_count()} cpus; "
          f"median of {repeats} (resume: {resume_repeats}); {time.perf_counter() - started:.0f} s\n")
    print(table(s))
    out = {"benchmark": "faults", "corpus": str(corpus), "corpus_mb": round(size_mb, 1), "repeats": repeats,
           "params": {"window": WINDOW, "stride": STRIDE, "batch_size": BATCH, "shuffle_buffer": POOL},
           "drop_every_mb": args.drop_every_mb, **s}
    if args.json:  # the file also holds every run
        Path(args.json).write_text(json.dumps({**out, "raw": raw}, separators=(",", ":"), default=float) + "\n")
    print(json.dumps(out, separators=(",", ":"), default=float))
    ok = all(r["same_batches"] for r in s["epochs"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
