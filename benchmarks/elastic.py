"""Elastic resume at scale: what a resume across worlds costs (time to the first batch) at 1M sequences.

A job of 8 ranks x 8 workers (batch 256, W=8, stride 4) is preempted halfway through epoch 0;
its rank-0 state is loaded by rank 0 of a job of 6 ranks x 4 workers (elastic resume), and
beside it, each in a fresh process: the same job starting epoch 0 afresh, and the old job
resuming in its own world (exact resume). Printed per case: seconds from the dataset's
construction to the first batch, of which planning (``loader.len()``: the plan of the rest of
the epoch, with its per-block bookkeeping), and the batches per rank left.

The corpus is benchmarks/scale.py's (synthetic short sequences, reused from ``--root``).

Usage:  python benchmarks/elastic.py [--sequences 1000000] [--workers 4]
Prints a markdown table and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
OLD, NEW = (8, 8), (6, 4)  # (ranks, workers) of the preempted job and of the requeued one
SPEC = dict(window=8, stride=4, batch_size=256, rank=0)
CHILD_TIMEOUT_S = 1800.0


def child(url: str, case: str, workers: int) -> dict:
    import streamwin as sw

    old_ds = sw.WindowDataset(url, world_size=OLD[0], **SPEC)
    half = len(sw.WindowLoader(old_ds, num_workers=OLD[1])) // 2
    state = {"version": 2, "epoch": 0, "batches": half, "inputs": old_ds.plan_inputs(OLD[1])}  # rank 0's, as saved
    world, nw = (OLD[0], OLD[1]) if case == "exact resume (8x8)" else (NEW[0], workers)
    t0 = time.perf_counter()
    ds = sw.WindowDataset(url, world_size=world, **SPEC)
    loader = sw.WindowLoader(ds, num_workers=nw)
    if case != "fresh epoch":
        loader.load_state_dict(state)
    t1 = time.perf_counter()
    total = len(loader)
    t2 = time.perf_counter()
    it = iter(loader)
    next(it)
    t3 = time.perf_counter()
    left = total - loader.state_dict()["batches"] + 1
    loader.close()
    return {"case": case, "world": f"{world}x{nw}", "load_s": t1 - t0, "plan_s": t2 - t1, "first_batch_s": t3 - t0,
            "batches_left": left}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sequences", type=int, default=1_000_000)
    p.add_argument("--workers", type=int, default=4, help="workers per rank of the requeued job")
    p.add_argument("--root", default=str(REPO / "bench_data" / "scale"))
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1], int(a.child[2]))))
        return
    from children import run_child
    from scale import make_corpus

    url = make_corpus(Path(a.root) / f"n{a.sequences}", a.sequences)
    rows = []
    for case in ("fresh epoch", "exact resume (8x8)", "elastic resume (8x8 -> 6x4)"):
        out = run_child([sys.executable, __file__, "--child", url, case, str(a.workers)], CHILD_TIMEOUT_S,
                        cwd=str(REPO), env={**os.environ, "PYTHONPATH": str(REPO)})
        if out.record is None:
            raise SystemExit(f"{case} failed:\n{out.stderr[-3000:]}")
        rows.append(out.record)
    print(f"\n{a.sequences:,} sequences; rank 0's first batch after load_state_dict, each case in a fresh process\n")
    print("| case | job | manifest + load_state_dict s | plan (len) s | to first batch s | batches left |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['world']} | {r['load_s']:.2f} | {r['plan_s']:.3f} | {r['first_batch_s']:.2f} "
              f"| {r['batches_left']:,} |")
    print(json.dumps({"sequences": a.sequences, "rows": rows}))


if __name__ == "__main__":
    main()
