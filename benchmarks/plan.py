"""Planner scale and shuffle quality, from the plan alone (no I/O).

1. Time to plan one epoch for 1M and 10M sequences at 1, 64 and 4096 ranks x 8 workers.
2. Mixing: distinct sequences per batch (and the largest share of one sequence in a batch)
   for streamwin's block shuffle at several shuffle_buffer sizes, against a perfect global
   shuffle of all windows and against no shuffle, on the perf-notes corpus shape
   (10,963 sequences, lengths log-uniform 200..20,000, W=256, stride 64, batch 256).

    python benchmarks/plan.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from streamwin.plan import PlanConfig, WindowSpec, make_plan


def plan_timing(n_seqs: int, world: int, workers: int, repeats: int) -> float:
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 4000, size=n_seqs)
    shard_starts = np.arange(0, n_seqs + 1, max(1, n_seqs // 1000))
    if shard_starts[-1] != n_seqs:
        shard_starts = np.append(shard_starts, n_seqs)
    cfg = PlanConfig(WindowSpec(256, 64), batch_size=256, world_size=world, num_workers=workers)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        make_plan(lengths, shard_starts, cfg, epoch=1)
        best = min(best, time.perf_counter() - t)
    return best


def mixing(lengths: np.ndarray, shard_starts: np.ndarray, buffer: int | None, batches: int) -> dict:
    """Distinct sequences per batch over the first ``batches`` batches of stream 0."""
    b = 256
    spec = WindowSpec(256, 64)
    if buffer is None:  # perfect global shuffle of every window
        counts = spec.counts(lengths)
        seq_of_window = np.repeat(np.arange(len(lengths)), counts)
        order = np.random.default_rng(0).permutation(len(seq_of_window))
        seqs = seq_of_window[order][: batches * b].reshape(batches, b)
    else:
        shuffle = buffer > 0
        cfg = PlanConfig(spec, batch_size=b, shuffle=shuffle, block_windows=max(buffer, b),
                         slice_windows=max(1, buffer // 8) if shuffle else 1250)
        plan = make_plan(lengths, shard_starts, cfg, epoch=0).sources[0]
        rows, k = [], 0
        while sum(len(r) for r in rows) < batches * b and k < plan.num_blocks(0):
            g, _ = plan.block(0, k)
            rows.append(plan.locate(g)[0])
            k += 1
        seqs = np.concatenate(rows)[: batches * b].reshape(-1, b)
    distinct = [len(np.unique(r)) for r in seqs]
    top = [np.bincount(r).max() / b for r in seqs]
    return {"distinct_per_batch": float(np.mean(distinct)), "max_share_of_one_sequence": float(np.mean(top))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    repeats = 1 if a.quick else 3
    sizes = [1_000_000] if a.quick else [1_000_000, 10_000_000]
    print("| sequences | ranks x workers | plan time (s) |\n|---:|---:|---:|")
    timing = {}
    for n in sizes:
        for world in (1, 64, 4096):
            t = plan_timing(n, world, 8, repeats)
            timing[f"{n}x{world}"] = t
            print(f"| {n:,} | {world} x 8 | {t:.3f} |")

    rng = np.random.default_rng(0)
    lengths = np.exp(rng.uniform(np.log(200), np.log(20_000), size=10_963)).astype(np.int64)
    shard_starts = np.append(np.arange(0, 10_963, 400), 10_963)
    print("\n| shuffle | distinct sequences per batch of 256 | largest share of one sequence |\n|---|---:|---:|")
    mix = {}
    for name, buf in [("none", 0), ("streamwin buffer 1,000", 1_000), ("streamwin buffer 10,000", 10_000),
                      ("streamwin buffer 100,000", 100_000), ("perfect global shuffle", None)]:
        r = mixing(lengths, shard_starts, buf, batches=50)
        mix[name] = r
        print(f"| {name} | {r['distinct_per_batch']:.1f} | {r['max_share_of_one_sequence']:.2f} |")
    print(json.dumps({"plan_seconds": timing, "mixing": mix}))


if __name__ == "__main__":
    main()
