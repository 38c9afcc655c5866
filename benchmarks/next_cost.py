"""What one ``next()`` costs the trainer's thread after a training step, with workers: the pops and the runs apart.

A step that sleeps (no CPU of its own) leaves the trainer's caches cold, as a GPU step does. With
workers, ``next()`` pops a batch made ready, or, when none is, takes every batch the workers have
ready in one go (a run: the held slots looked at, the freed ones sent back, the ring read). This
times each ``next()`` with ``time.thread_time`` (the trainer's thread only), the previous batch
held during the call as in a ``for`` loop, and prints the median pop, the median run, the mean
run length and the mean per batch. ``benchmarks/gpu_feed.py --models idle`` measures the whole
trainer process instead.

Usage:
  python benchmarks/next_cost.py --data bench_data/full --workers 1 --batches 1200
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="bench_data/full", help="packed corpus")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--batches", type=int, default=1200, help="timed batches (after 30 untimed)")
    p.add_argument("--step-ms", type=float, default=4.0, help="the simulated step: asleep this long")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--stride", type=int, default=64)
    p.add_argument("--prefetch-factor", type=int, default=2)
    a = p.parse_args()
    if a.workers < 1:
        p.error("--workers must be >= 1 (in-process, next() gathers the batch itself)")
    warnings.simplefilter("ignore")
    import streamwin as sw  # noqa: PLC0415

    ds = sw.WindowDataset(a.data, window=a.window, stride=a.stride, batch_size=a.batch_size, shuffle_buffer=10_000,
                          seed=0)
    loader = sw.WindowLoader(ds, num_workers=a.workers, prefetch_factor=a.prefetch_factor)
    it = iter(loader)
    batch = None
    for _ in range(30):
        batch = next(it)
    pops, runs, lengths = [], [], []
    try:
        for _ in range(a.batches):
            time.sleep(a.step_ms / 1e3)
            ready = it.at_hand()
            t = time.thread_time()
            batch = next(it)  # the previous batch is held during the call, as in a for loop
            spent = (time.thread_time() - t) * 1e6
            if ready:
                pops.append(spent)
            else:
                runs.append(spent)
                lengths.append(it.at_hand() + 1)
    except StopIteration:
        pass
    finally:
        loader.close()
    n = len(pops) + len(runs)
    if not runs:
        raise SystemExit("no run was timed: use more --batches or a larger corpus")
    print(f"next_cost: {a.workers} worker(s), {n} batches of {a.batch_size}, a {a.step_ms:g} ms step asleep")
    print(f"  pop (a batch made ready):  median {statistics.median(pops) if pops else 0:.1f} us  ({len(pops)} batches)")
    print(f"  run (the batches at hand): median {statistics.median(runs):.1f} us, "
          f"{statistics.mean(lengths):.1f} batches a run ({len(runs)} runs)")
    print(f"  per batch: {(sum(pops) + sum(runs)) / n:.1f} us of the trainer thread's CPU")


if __name__ == "__main__":
    main()
