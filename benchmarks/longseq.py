"""One long sequence beside many short ones: bytes read, peak memory and windows/s of an epoch.

Each dataset holds one long sequence (64 MB, 256 MB, 1 GB by default) and 500 short ones
(200 to 5,000 steps), F=8 float32, packed plain and with zstd. One shuffled epoch (W=256,
stride 64, batch 256, shuffle pool 10,000 windows) is run per case, each in a fresh process,
in that process (num_workers=0) so that its peak RSS is the loader's:

  streamwin  local | http (the loopback server of tests/servers.py), plain | zstd
  webdataset local | http (plain shards: webdataset does not decode .npy.zst), the pipeline of
             benchmarks/baselines.py

Columns: shard bytes; bytes read / shard bytes (streamwin: ``stats()["bytes_read"]``; over
http: the body bytes the server sent, index.json left out; webdataset reads every shard
whole, once); peak RSS growth over the epoch (VmHWM from the epoch's start, Linux); windows/s.

    .venv/bin/python benchmarks/longseq.py [--sizes 64 256 1024] [--quick] [--out bench_data/longseq]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the loopback HTTP server
sys.path.insert(0, str(REPO / "benchmarks"))  # children.run_child

W, S, B, POOL, F = 256, 64, 256, 10_000, 8


def write_dataset(root: Path, long_mb: int, short: int = 500, seed: int = 0) -> dict[str, Path]:
    """Pack one long sequence of ``long_mb`` MB and ``short`` short ones, plain and zstd (reused if there)."""
    import streamwin as sw

    out = {c: root / f"{long_mb}mb-{c}" for c in ("plain", "zstd")}
    if all((p / "index.json").exists() for p in out.values()):
        return out
    root.mkdir(parents=True, exist_ok=True)
    src = root / f"long-{long_mb}mb.npy"
    rows = (long_mb << 20) // (4 * F)
    arr = np.lib.format.open_memmap(src, mode="w+", dtype=np.float32, shape=(rows, F))
    rng = np.random.default_rng(seed)
    for a in range(0, rows, 1 << 20):
        arr[a : a + (1 << 20)] = rng.standard_normal((min(1 << 20, rows - a), F), dtype=np.float32)
    arr.flush()
    del arr
    lengths = np.exp(rng.uniform(np.log(200), np.log(5000), size=short)).astype(int)
    shorts = [(f"short{i:04d}", rng.standard_normal((int(t), F), dtype=np.float32)) for i, t in enumerate(lengths)]
    for c, path in out.items():
        items = [(f"short{i:04d}", a) for i, (_, a) in enumerate(shorts[: short // 2])]
        items += [("long", np.load(src, mmap_mode="r"))] + shorts[short // 2 :]  # the long one in the middle
        sw.pack(items, str(path), shard_bytes=64 << 20, compression=None if c == "plain" else "zstd", progress=False)
    src.unlink()
    return out


def shard_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.tar"))


# ------------------------------------------------------------------------ one epoch, in a child process

def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith(field))


def child(system: str, url: str) -> dict:
    """Run one epoch of ``system`` over ``url`` in this process; what it measured."""
    if system == "streamwin":
        import streamwin as sw
        ds = sw.WindowDataset(url, window=W, stride=S, batch_size=B, shuffle_buffer=POOL, seed=0)
        loader = sw.WindowLoader(ds, num_workers=0)
    else:
        from benchmarks import baselines
        import webdataset  # noqa: F401  (imported before the measurement, as streamwin is)
        names = sorted(json.load(_open(url + "/index.json"))["shards"], key=lambda s: s["name"])
        loader = baselines.webdataset_pipeline([f"{url}/{s['name']}" for s in names], window=W, stride=S,
                                               batch_size=B, shuffle_buffer=POOL)
    before = _rss("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak restarts here
    t0 = time.perf_counter()
    n = 0
    for batch in loader:
        n += len(batch["x"])
    secs = time.perf_counter() - t0
    out = {"windows": n, "seconds": secs, "peak_growth": _rss("VmHWM:") - before}
    if system == "streamwin":
        out["bytes_read"] = loader.stats()["bytes_read"]
    return out


def _open(url: str):
    if "://" in url:
        import urllib.request
        return urllib.request.urlopen(url)
    return open(url)


def run_case(system: str, url: str) -> dict:
    from children import run_child

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    run = run_child([sys.executable, __file__, "--child", system, url], 1800.0, cwd=str(REPO), env=env)
    if run.record is None:
        return {"error": run.stderr.strip().splitlines()[-1] if run.stderr.strip() else f"exit {run.returncode}"}
    return run.record


# ------------------------------------------------------------------------ the table

def measure(sizes: list[int], root: Path) -> list[dict]:
    from servers import HTTPFileServer

    results = []
    for mb in sizes:
        paths = write_dataset(root, mb)
        with HTTPFileServer(root) as srv:
            for system, comp in (("streamwin", "plain"), ("streamwin", "zstd"), ("webdataset", "plain")):
                path = paths[comp]
                total = shard_bytes(path)
                for where in ("local", "http"):
                    url = str(path) if where == "local" else srv.url_for(path.name)
                    srv.reset_stats()
                    r = run_case(system, url)
                    if where == "http":  # both read index.json once over http too
                        r["read_ratio"] = (srv.stats.bytes_served - (path / "index.json").stat().st_size) / total
                    elif "bytes_read" in r:
                        r["read_ratio"] = r["bytes_read"] / total
                    elif "error" not in r:
                        r["read_ratio"] = 1.0  # webdataset streams each shard file once
                    results.append(dict(r, long_mb=mb, system=system, compression=comp, where=where,
                                        shard_mb=total / 1e6))
                    print(row(results[-1]), flush=True)
    return results


HEADER = ("| long sequence | system | shards | transport | shard MB | read / shard bytes | peak RSS growth MB "
          "| windows/s |\n|---:|---|---|---|---:|---:|---:|---:|")


def row(r: dict) -> str:
    head = f"| {r['long_mb']} MB | {r['system']} | {r['compression']} | {r['where']} | {r['shard_mb']:,.0f} |"
    if "error" in r:
        return head + f" error: {r['error'][:60]} | | |"
    return head + (f" {r['read_ratio']:.2f} | {r['peak_growth'] / 1e6:,.0f} | {r['windows'] / r['seconds']:,.0f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024], help="long sequence sizes, MB")
    ap.add_argument("--quick", action="store_true", help="sizes 16 and 64 MB")
    ap.add_argument("--out", default=str(REPO / "bench_data" / "longseq"), help="where the datasets go")
    ap.add_argument("--keep", action="store_true", help="keep the datasets (default: removed at the end)")
    ap.add_argument("--child", nargs=2, metavar=("SYSTEM", "URL"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    sizes = [16, 64] if args.quick else args.sizes
    root = Path(args.out)
    print(HEADER, flush=True)
    try:
        results = measure(sizes, root)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    (root.parent / "longseq.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
