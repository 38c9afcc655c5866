"""Fields and transforms (issue 29): what they cost the loader and the trainer, side by side, interleaved.

1. windows/s of a loader with two fields (``fields=["label", "store"]``) against none, over the
   same corpus and plan; the runs alternate (none, fields, fields, none, ...) so that load on a
   shared machine hits both alike. Reported: windows/s (median of the repeats) and CPU
   microseconds per batch in this process; target: within 5%.
2. a simulated training step (``--step-ms`` of CPU on the trainer's thread per batch) fed by one
   worker, with and without a transform that costs ``--transform-ms`` of CPU a batch (mean
   scaling and quantisation to tokens, then a spin to the cost): the data-wait per step
   (``loader.stats()["wait_s"]``) should stay where it was, since the transform runs in the
   worker while the trainer steps.

Usage: python benchmarks/fields.py [--quick]   (prints a markdown table and one JSON line)
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import streamwin as sw  # noqa: E402


def corpus(root: Path, n: int, steps: int) -> str:
    url = str(root / f"fields-{n}x{steps}")
    if not Path(url, "index.json").exists():
        rng = np.random.default_rng(0)
        sw.pack(((f"s{i}", rng.normal(size=(steps + int(rng.integers(0, steps)),)).astype(np.float32),
                  {"label": i % 10, "store": f"store{i % 50}"}) for i in range(n)), url, progress=False)
    return url


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def epoch_rate(url: str, fields: list[str] | None, workers: int, batch: int) -> dict:
    ds = sw.WindowDataset(url, window=64, stride=32, batch_size=batch, seed=1, select=sw.Select(fields=fields))
    loader = sw.WindowLoader(ds, num_workers=workers)
    t, c, n = time.perf_counter(), cpu_s(), 0
    for b in loader:
        n += len(b["x"])
    wall, cpu = time.perf_counter() - t, cpu_s() - c
    loader.close()
    return {"windows_per_s": n / wall, "cpu_us_per_batch": 1e6 * cpu / max(n // batch, 1)}


def fill_cost(url: str, batch: int) -> float:
    """CPU microseconds the two fields add to one batch's gather: FieldGather.fill alone, on real batches."""
    ds = sw.WindowDataset(url, window=64, stride=32, batch_size=batch, seed=1,
                          select=sw.Select(fields=["label", "store"]))
    layout, gather = ds.layout(), ds.field_gather()
    views = layout.views(np.zeros(layout.nbytes, dtype=np.uint8))
    views["seq"][:] = np.random.default_rng(0).integers(0, ds.manifest.num_sequences, len(views["seq"]))
    t = time.process_time()
    for _ in range(2000):
        gather.fill(views)
    return 1e6 * (time.process_time() - t) / 2000


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


TRANSFORM_S = 0.001


def tokens(batch: dict, rng: np.random.Generator) -> dict:
    """Chronos-style mean scaling and quantisation, then a spin to TRANSFORM_S of CPU in all."""
    t = time.perf_counter()
    x = batch["x"]
    scale = np.abs(x).mean(axis=1, keepdims=True) + 1e-3
    out = np.clip(np.round(x / scale * 32), -127, 127).astype(np.int64) + 128
    spin(TRANSFORM_S - (time.perf_counter() - t))
    return {"tokens": out, "label": batch["label"]}


def step_wait(url: str, transform, step_s: float, batch: int, steps: int) -> dict:
    ds = sw.WindowDataset(url, window=64, stride=32, batch_size=batch, seed=2, select=sw.Select(fields=["label"]))
    loader = sw.WindowLoader(ds, num_workers=1, transform=transform)
    it = iter(loader)
    next(it)  # the worker's start is not a step's wait
    w0, n = loader.stats()["wait_s"], 0
    for _ in range(steps):
        try:
            next(it)
        except StopIteration:
            break
        spin(step_s)
        n += 1
    wait = loader.stats()["wait_s"] - w0
    loader.close()
    return {"wait_ms_per_step": 1e3 * wait / max(n, 1), "steps": n}


def main() -> None:
    global TRANSFORM_S
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--root", default=str(REPO / "bench_data"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--transform-ms", type=float, default=1.0)
    args = ap.parse_args()
    TRANSFORM_S = args.transform_ms / 1e3
    warnings.simplefilter("ignore")
    n, steps = (400, 1000) if args.quick else (4000, 2000)
    repeats = args.repeats
    url = corpus(Path(args.root), n, steps)
    epoch_rate(url, ["label", "store"], 0, args.batch_size)  # warm: the page cache, the first mapping
    out: dict = {"cores": len(os.sched_getaffinity(0)), "load": os.getloadavg()[0], "rates": {}, "waits": {}}
    for workers in (0, 1):
        runs: dict = {"none": [], "fields": []}
        for r in range(repeats):
            for case in (("none", "fields") if r % 2 == 0 else ("fields", "none")):
                runs[case].append(epoch_rate(url, ["label", "store"] if case == "fields" else None, workers,
                                             args.batch_size))
        out["rates"][workers] = {case: {k: statistics.median(x[k] for x in rows) for k in rows[0]}
                                 for case, rows in runs.items()}
    out["fill_us_per_batch"] = fill_cost(url, args.batch_size)
    for r in range(repeats):
        for case in (("none", "transform") if r % 2 == 0 else ("transform", "none")):
            got = step_wait(url, tokens if case == "transform" else None, args.step_ms / 1e3, args.batch_size,
                            100 if args.quick else 300)
            out["waits"].setdefault(case, []).append(got["wait_ms_per_step"])
    print(f"corpus {n:,} sequences; batch {args.batch_size}; load {out['load']:.2f} on {out['cores']} cores\n")
    print("| workers | windows/s, no fields | windows/s, 2 fields | ratio | CPU us/batch (trainer), none / fields |")
    print("|---:|---:|---:|---:|---:|")
    for w, r in out["rates"].items():
        a, b = r["none"], r["fields"]
        print(f"| {w} | {a['windows_per_s']:,.0f} | {b['windows_per_s']:,.0f} | "
              f"{b['windows_per_s'] / a['windows_per_s']:.3f} | {a['cpu_us_per_batch']:.0f} / "
              f"{b['cpu_us_per_batch']:.0f} |")
    print(f"\nthe fields' own cost: {out['fill_us_per_batch']:.1f} CPU us per batch of {args.batch_size} "
          "(FieldGather.fill, timed alone)")
    med = {k: statistics.median(v) for k, v in out["waits"].items()}
    print(f"\nstep {args.step_ms} ms, 1 worker: data-wait per step {med['none']:.3f} ms without a transform, "
          f"{med['transform']:.3f} ms with a {args.transform_ms} ms transform")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
