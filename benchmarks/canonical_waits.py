"""Do canonical streams make a step wait for its workers? ms per step, canonical=None beside "auto", in one run.

With one phase (``canonical=(A, 1)``, what "auto" gives) a rank's n workers either share every
batch, each writing the rows of its share of the rank's slots into one shared slot (n <= A /
world, one source, no transform of whole batches), or serve whole chunks w, w + n, ... of Q =
shuffle_buffer / G steps, so the loader takes Q batches in a row from one worker while the others
can only fill their slots with their next chunk; with one stream per rank and worker
(``canonical=None``) the loader takes batches from the workers in turn. A step that one worker
cannot feed but several can shows the difference; the table says how "auto"'s workers served. Each case is a fresh process
(``--case``); cases alternate, ``--repeats`` rounds; the step sleeps ``--step-ms`` (a device
busy elsewhere), so the workers have the CPU (``--step-ms 0``: the loader drained alone). ``--mix``: a mix of two
sources (the corpus with itself, weights 0.7 and 0.3), whose workers take chunks of steps. PSS: the peak of the
trainer's and its workers' proportional set sizes summed (``children.run_child``, sampled every 0.1 s).

    python benchmarks/canonical_waits.py --data-dir bench_data/full --workers 2 --window 1024 --step-ms 1.0
    python benchmarks/canonical_waits.py --data-dir bench_data/full --workers 2 --window 256 --step-ms 0.1 --mix
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

try:  # imported as benchmarks.canonical_waits
    from .children import run_child
except ImportError:  # run as a script: benchmarks/ is on sys.path
    from children import run_child


def run_case(order: str, data_dir: str, workers: int, window: int, step_ms: float, steps: int,
             mix: bool = False) -> dict:
    """One loader of ``order`` ("none" or "auto") feeding ``steps`` sleeping steps after 20 warm-up ones."""
    import torch  # noqa: PLC0415 - in the child only

    import streamwin as sw  # noqa: PLC0415

    torch.set_num_threads(1)
    source = {"url": {"a": data_dir, "b": data_dir}, "mix": sw.Mix(weights={"a": 0.7, "b": 0.3})} if mix else \
        {"url": data_dir}
    ds = sw.WindowDataset(**source, window=window, stride=max(1, window // 4), batch_size=256, shuffle_buffer=10_000,
                          seed=0, rank=0, world_size=1, order=sw.Order(canonical=None if order == "none" else order))
    loader = sw.WindowLoader(ds, num_workers=workers)

    def forever():  # epoch after epoch (a small corpus)
        for epoch in itertools.count():
            loader.set_epoch(epoch)
            yield from loader

    try:
        it = forever()
        for _ in range(20):
            next(it)
        wait, t0 = 0.0, time.perf_counter()
        for _ in range(steps):
            a = time.perf_counter()
            next(it)
            wait += time.perf_counter() - a
            if step_ms:
                time.sleep(step_ms / 1e3)
        took = time.perf_counter() - t0
    finally:
        loader.close()
    plan = ds.plan(0, workers)
    serving = ("shared batches" if plan.shared else f"chunks of {plan.chunk} steps" if plan.config.aligned and
               workers > 1 else "one stream a worker" if workers > 1 else "one process")
    return {"order": order, "ms_per_step": took / steps * 1e3, "data_wait": wait / took,
            "batch_mb": ds.layout().nbytes / 2**20, "serving": serving}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", default="bench_data/full")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--window", type=int, default=1024, help="steps a window (batch bytes grow with it)")
    p.add_argument("--step-ms", type=float, default=1.0, help="the step's sleep")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mix", action="store_true", help="two sources: the corpus with itself, weights 0.7 and 0.3")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.case:
        print(json.dumps(run_case(a.case, a.data_dir, a.workers, a.window, a.step_ms, a.steps, a.mix)))
        return
    if not Path(a.data_dir, "index.json").exists():
        sys.exit(f"{a.data_dir} holds no dataset: write it with benchmarks/throughput.py (or pass --data-dir)")
    rows: dict[str, list[dict]] = {"none": [], "auto": []}
    for _ in range(a.repeats):
        for order in rows:
            out = run_child([sys.executable, __file__, "--case", order, "--data-dir", a.data_dir, "--workers",
                             str(a.workers), "--window", str(a.window), "--step-ms", str(a.step_ms), "--steps",
                             str(a.steps)] + (["--mix"] if a.mix else []), 900.0, cwd=os.getcwd(), sample_memory=True)
            if out.record is None:
                sys.exit(f"the {order} case failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
            rows[order].append({**out.record, "pss_mb": out.peak_pss_mb})
    first = rows["none"][0]
    print(f"workers={a.workers} window={a.window} step sleeps {a.step_ms} ms, batches of {first['batch_mb']:.1f} MB"
          f"{', a mix of two sources' if a.mix else ''}; medians of {a.repeats}:")
    print("| canonical | workers serve | ms per step | data-wait | peak PSS MB | runs (ms per step) |\n"
          "|---|---|---:|---:|---:|---|")
    med = {}
    for order, rs in rows.items():
        med[order] = statistics.median(r["ms_per_step"] for r in rs)
        each = ", ".join(f"{r['ms_per_step']:.3f}" for r in rs)
        print(f"| {order} | {rs[0]['serving']} | {med[order]:.3f} | "
              f"{100 * statistics.median(r['data_wait'] for r in rs):.1f}% | "
              f"{statistics.median(r['pss_mb'] for r in rs):,.0f} | {each} |")
    print(f"canonical=\"auto\" steps take {100 * (med['auto'] / med['none'] - 1):+.1f}% against canonical=None")


if __name__ == "__main__":
    main()
