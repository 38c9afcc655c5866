"""Packed rows against fixed windows carrying the same steps per batch, side by side in one run (issue 21).

Cases, on the perf-notes corpus (benchmarks/data.py: lengths log-uniform 200..20,000, F = 8
float32), every batch ``--steps-per-batch`` steps (32,768 by default):

  fixed     WindowDataset(window=512, stride=256, batch_size=64): 64 windows of 512 steps
  packed    WindowDataset(window=512, stride=256, batch_size=16, crops=sw.Crops(jitter=True, min_window=64,
            window_multiple=16, pack_length=2048)): 16 rows of 2048 steps, each holding whole crops of
            64..512 steps in patches of 16 (on average 288 steps: 1.8x the items per batch, each
            drawn, placed, packed and cut)
  packed-p1 the same with Crops(window_multiple=1) (lengths of any step; loader alone only)

Measured (each case and repeat a fresh child process, repeats interleaved, medians):
  loader alone, workers 0 and 1: steps/s of data delivered (padding excluded), batches/s,
          and for packed the row fill (steps of crops / steps of rows)
  the simulated trainer of benchmarks/gpu_feed.py (hold the interpreter 4 ms, touch the batch,
          sleep 1 ms) fed by each with one worker, and by preallocated batches (the floor):
          training steps/s, ms/step, data-wait = 1 - floor / step

Targets (issue 21), printed as met / NOT MET with the numbers:
  training steps/s fed packed rows >= 0.8 x fed fixed windows (simulated step, one worker)
  row fill >= 97% (crops of 64..512 steps into rows of 2048)
  packed data-wait with one worker <= 5% (as gpu_feed.py measures it)
The loader-alone ratio (packed / fixed steps/s) is printed too: it is the CPU a step of packed
rows costs the loader, beside fixed windows.

Usage:
  python benchmarks/pretrain.py --quick     # small corpus, few steps, 1 repeat (~1 minute)
  python benchmarks/pretrain.py             # perf-notes corpus, 3 interleaved repeats
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch

try:  # imported as benchmarks.pretrain
    from . import data, gpu_feed
    from .children import run_child as run_in_child
except ImportError:  # run as a script: benchmarks/ is on sys.path
    import data
    import gpu_feed
    from children import run_child as run_in_child

REPO = Path(__file__).resolve().parent.parent
WINDOW, STRIDE, SHORTEST, ROW, PATCH = 512, 256, 64, 2048, 16
TARGET_RATIO, TARGET_FILL, TARGET_WAIT = 0.8, 0.97, 0.05
LOADER_CASES = ("fixed:0", "packed:0", "packed-p1:0", "fixed:1", "packed:1", "packed-p1:1")
STEP_CASES = ("floor", "fixed:1", "packed:1")


def make_loader(case: str, data_dir: str, steps_per_batch: int):
    """The case's WindowLoader (persistent workers, so that epochs roll over without a restart)."""
    import streamwin as sw  # noqa: PLC0415

    kind, workers = case.split(":")
    common = dict(window=WINDOW, stride=STRIDE, seed=0)
    if kind == "fixed":
        ds = sw.WindowDataset(data_dir, batch_size=steps_per_batch // WINDOW, **common)
    else:
        crops = sw.Crops(jitter=True, min_window=SHORTEST, window_multiple=PATCH if kind == "packed" else 1,
                         pack_length=ROW)
        ds = sw.WindowDataset(data_dir, batch_size=steps_per_batch // ROW, **common, crops=crops)
    return sw.WindowLoader(ds, num_workers=int(workers), persistent_workers=int(workers) > 0)


def batches_forever(loader) -> Iterator[dict]:
    """The loader's batches, epoch after epoch."""
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        count = 0
        for batch in loader:
            count += 1
            yield batch
        if not count:
            raise RuntimeError("an epoch yielded no batches: the corpus is too small")
        epoch += 1


def delivered(batch: dict) -> tuple[int, int]:
    """(steps of data, steps of the batch): padding of packed rows is not data."""
    x = batch["x"]
    steps = int(x.shape[0] * x.shape[1])
    return (int((batch["segment_ids"] > 0).sum()) if "segment_ids" in batch else steps), steps


def time_loader(source: Iterator[dict], batches: int, warmup: int) -> dict[str, float]:
    """Steps/s (data and capacity) of the loader alone after ``warmup`` batches."""
    for _ in range(warmup):
        next(source)
    data_steps = all_steps = 0
    t0 = time.perf_counter()
    for _ in range(batches):
        b = next(source)
        float(b["x"][0, 0, 0])
        got, of = delivered(b)
        data_steps, all_steps = data_steps + got, all_steps + of
    seconds = time.perf_counter() - t0
    return {"steps_per_s": data_steps / seconds, "batches_per_s": batches / seconds, "fill": data_steps / all_steps}


def time_steps(source: Iterator[Any], steps: int, warmup: int) -> dict[str, float]:
    """ms per simulated step (gpu_feed.simulated_step) and the wait inside next(), after ``warmup`` steps."""
    for _ in range(warmup):
        gpu_feed.simulated_step(next(source))
    waited = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        before = time.perf_counter()
        x = next(source)
        waited += time.perf_counter() - before
        gpu_feed.simulated_step(x)
    seconds = time.perf_counter() - t0
    return {"step_ms": 1000 * seconds / steps, "next_wait_ms": 1000 * waited / steps}


def run_child(job: dict[str, Any]) -> dict[str, Any]:
    """Measure one (kind, case) in this process."""
    torch.set_num_threads(1)
    record = {k: job[k] for k in ("kind", "case", "repeat")}
    if job["case"] == "floor":
        pool = [torch.randn(job["steps_per_batch"] // ROW, ROW, 8) for _ in range(8)]
        source: Iterator[Any] = iter(lambda: pool[0], None)
    else:
        loader = make_loader(job["case"], job["data"], job["steps_per_batch"])
        source = batches_forever(loader)
        if job["kind"] == "step":
            source = (b["x"] for b in source)
    if job["kind"] == "loader":
        return {**record, **time_loader(source, job["batches"], job["warmup"])}
    return {**record, **time_steps(source, job["batches"], job["warmup"])}


def run_job(job: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One job in a fresh child process (a crash gives a record with ``error``), with the cores other processes
    of the machine used meanwhile (``other_cpu_cores``: on a shared machine, what a timing competed with)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(job)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    run = run_in_child(cmd, timeout, cwd=str(REPO), env=env)
    if run.record is None:
        return {**{k: job[k] for k in ("kind", "case", "repeat")}, "error": run.stderr[-2000:]}
    return {**run.record, "other_cpu_cores": run.other_cpu_cores}


def medians(records: list[dict], kind: str, case: str, key: str) -> float | None:
    values = [r[key] for r in records if r["kind"] == kind and r["case"] == case and key in r]
    return statistics.median(values) if values else None


def report(records: list[dict]) -> list[str]:
    """The tables and the target verdicts, as printed."""
    out = ["| case | workers | steps/s (data) | batches/s | row fill | others' CPU (cores) |",
           "|---|---:|---:|---:|---:|---:|"]
    for case in LOADER_CASES:
        kind, workers = case.split(":")
        sps, bps, fill, others = (medians(records, "loader", case, k) for k in
                                  ("steps_per_s", "batches_per_s", "fill", "other_cpu_cores"))
        out.append(f"| {kind} | {workers} | {sps or 0:,.0f} | {bps or 0:.1f} | {100 * (fill or 0):.1f}% | "
                   f"{others or 0:.2f} |")
    floor = medians(records, "step", "floor", "step_ms") or float("nan")
    out += ["", "| simulated step fed by | training steps/s | ms/step | data-wait | next() wait ms/step | "
            "others' CPU |", "|---|---:|---:|---:|---:|---:|"]
    for case in STEP_CASES:
        ms, wait, others = (medians(records, "step", case, k) for k in ("step_ms", "next_wait_ms", "other_cpu_cores"))
        share = "(floor)" if case == "floor" else f"{100 * (1 - floor / ms):.1f}%" if ms else "n/a"
        out.append(f"| {case} | {1000 / ms if ms else 0:.1f} | {ms or float('nan'):.2f} | {share} | {wait or 0:.2f} | "
                   f"{others or 0:.2f} |")
    out.append("")
    fixed, packed = (medians(records, "step", c, "step_ms") for c in ("fixed:1", "packed:1"))
    ratio = fixed / packed if fixed and packed else 0.0
    out.append(f"training steps/s fed packed rows / fed fixed windows (one worker): {ratio:.2f} "
               f"(target >= {TARGET_RATIO}: {'met' if ratio >= TARGET_RATIO else 'NOT MET'})")
    fill = min(medians(records, "loader", c, "fill") or 0 for c in ("packed:0", "packed:1"))
    out.append(f"row fill: {100 * fill:.1f}% (target >= {100 * TARGET_FILL:.0f}%: "
               f"{'met' if fill >= TARGET_FILL else 'NOT MET'})")
    wait = 1 - floor / packed if packed else float("nan")
    out.append(f"packed data-wait with one worker: {100 * wait:.1f}% (target <= {100 * TARGET_WAIT:.0f}%: "
               f"{'met' if wait <= TARGET_WAIT else 'NOT MET'})")
    for kind in ("packed", "packed-p1"):
        parts = []
        for workers in ("0", "1"):
            a, b = (medians(records, "loader", f"{k}:{workers}", "steps_per_s") for k in (kind, "fixed"))
            parts.append(f"workers {workers}: {(a or 0) / b if b else 0:.2f}")
        out.append(f"loader alone, {kind} / fixed steps/s: {', '.join(parts)}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small corpus, fewer batches, 1 repeat")
    ap.add_argument("--data", help="corpus directory (written by benchmarks/data.py if missing)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--batches", type=int, default=None, help="batches (and simulated steps) measured per run")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--steps-per-batch", type=int, default=32_768)
    ap.add_argument("--out", default=str(REPO / "bench_data" / "results"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(run_child(json.loads(a.child))), flush=True)
        os._exit(0)  # persistent workers need no orderly shutdown here
    spec = data.CorpusSpec(n_seqs=data.FULL_N_SEQS // 20, shard_bytes=8 << 20) if a.quick else data.CorpusSpec()
    directory = Path(a.data) if a.data else data.default_dir(spec)
    data.write_corpus(directory, spec)
    repeats, batches = a.repeats or (1 if a.quick else 3), a.batches or (100 if a.quick else 400)
    jobs = [{"kind": kind, "case": c, "repeat": r} for r in range(repeats)
            for kind, cases in (("loader", LOADER_CASES), ("step", STEP_CASES)) for c in cases]
    records = []
    for job in jobs:
        job.update(data=str(directory), batches=batches, warmup=a.warmup, steps_per_batch=a.steps_per_batch)
        records.append(run_job(job, timeout=600))
        if "error" in records[-1]:
            print(f"{job['kind']} {job['case']}: {records[-1]['error']}", file=sys.stderr)
    lines = report(records)
    print(f"corpus {directory} ({spec.n_seqs} sequences), {a.steps_per_batch} steps per batch, {batches} batches "
          f"after {a.warmup}, median of {repeats}, {os.cpu_count()} cores\n")
    print("\n".join(lines))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"pretrain{'-quick' if a.quick else ''}.json").write_text(json.dumps(records, indent=1))
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
