"""What verifying costs the reading thread: CPU per window of reading blocks, verified beside unverified.

The throughput benchmark's windows/s of ``streamwin`` against ``streamwin-unverified`` say what
verification costs a whole loader; on a shared 2-core machine that ratio is mostly noise. This
measures the part verification adds to: ``ShardReader.read_block`` over the blocks of one
stream of the benchmark's plan (the work of the read-ahead thread or of a worker's), its CPU time
on the calling thread (``time.thread_time``, so other processes' load changes it little), with
and without ``verify_checksums``. Each measurement is a fresh child process; the two are
interleaved, and the medians (and the extra per window, pair by pair) are printed.

Usage:
  python benchmarks/verify_cost.py --data-dir bench_data/full --repeats 6 --max-windows 300000
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings


def child(data_dir: str, verify: bool, max_windows: int, seed: int) -> dict:
    """Read the blocks of stream 0 up to ``max_windows`` windows; the reading thread's CPU per window."""
    warnings.simplefilter("ignore")  # an unsealed index says so once
    import streamwin as sw  # noqa: PLC0415
    from streamwin.read import ReadOptions, ShardReader  # noqa: PLC0415

    ds = sw.WindowDataset(data_dir, window=256, stride=64, batch_size=256, shuffle_buffer=10_000, seed=seed,
                          read=sw.Read(verify_checksums=verify))
    source = ds.plan(0).sources[0]
    reader = ShardReader(data_dir, ds.manifest, ReadOptions(verify_checksums=verify))
    reader.release(reader.read_block(source, 0, 0))  # first use: imports, the first sums pages
    windows, cpu, k = 0, 0.0, 1
    while windows < max_windows and k < source.num_blocks(0):
        t = time.thread_time()
        block = reader.read_block(source, 0, k)
        cpu += time.thread_time() - t
        windows += len(block)
        reader.release(block)
        k += 1
    reader.shutdown()
    return {"us_per_window": cpu / max(windows, 1) * 1e6, "windows": windows,
            "bytes_verified": reader.stats.bytes_verified}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="bench_data/full")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--max-windows", type=int, default=300_000)
    p.add_argument("--child", choices=["verified", "unverified"], help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.data_dir, a.child == "verified", a.max_windows, a.seed)))
        return
    got: dict[str, list[dict]] = {"verified": [], "unverified": []}
    for r in range(a.repeats):
        for case in ("verified", "unverified") if r % 2 == 0 else ("unverified", "verified"):
            out = subprocess.run([sys.executable, __file__, "--child", case, "--data-dir", a.data_dir,
                                  "--max-windows", str(a.max_windows), "--seed", str(r % 3)],
                                 capture_output=True, text=True, check=True)
            got[case].append(json.loads(out.stdout.strip().splitlines()[-1]))
        v, u = got["verified"][-1], got["unverified"][-1]
        print(f"repeat {r}: load {os.getloadavg()[0]:.1f}; reading CPU per window verified "
              f"{v['us_per_window']:.3f} us, unverified {u['us_per_window']:.3f} us", flush=True)
    v, u = ([d["us_per_window"] for d in got[c]] for c in ("verified", "unverified"))
    extra = [x - y for x, y in zip(v, u)]
    per = got["verified"][0]["bytes_verified"] / got["verified"][0]["windows"]
    print(f"median reading CPU per window: verified {statistics.median(v):.3f} us, unverified "
          f"{statistics.median(u):.3f} us; verifying adds {statistics.median(extra):.3f} us a window "
          f"(pairs: {', '.join(f'{x:.3f}' for x in extra)}), {per:,.0f} bytes hashed a window")


if __name__ == "__main__":
    main()
