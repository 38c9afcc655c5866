"""CPU time per batch of the trainer process and of its workers: the per-batch cost the trainer pays.

Unlike wall time, CPU time barely moves when the machine is busy, so two versions (or two
settings) can be compared on a shared machine. The trainer's own CPU (RUSAGE_SELF, its
threads included) is what a training step competes with; the workers' (RUSAGE_CHILDREN) is
what the data costs elsewhere. One JSON line per run:

    .venv/bin/python benchmarks/trainer_cpu.py --data bench_data/full --workers 0 1 --batches 1500
"""
from __future__ import annotations

import argparse
import json
import resource
import time

import streamwin as sw


def cpu_s(usage: resource.struct_rusage) -> float:
    return usage.ru_utime + usage.ru_stime


def run(data: str, workers: int, batches: int, torch_threads: int | None) -> dict:
    """Take ``batches`` batches after 20 untimed ones; CPU microseconds per batch of the trainer and its workers."""
    import torch

    if torch_threads:
        torch.set_num_threads(torch_threads)
    ds = sw.WindowDataset(data, window=256, stride=64, batch_size=256, shuffle_buffer=10_000, seed=0, rank=0,
                          world_size=1)
    loader = sw.WindowLoader(ds, num_workers=workers)
    it = iter(loader)
    for _ in range(20):
        next(it)
    me, kids, t0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    for _ in range(batches):
        batch = next(it)
        float(batch["x"][0, 0, 0])
    me2, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    loader.close()  # the workers' CPU is counted once they have exited
    kids2 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"workers": workers, "torch_threads": torch.get_num_threads(),
            "trainer_us_per_batch": round(1e6 * (cpu_s(me2) - cpu_s(me)) / batches, 1),
            "workers_us_per_batch": round(1e6 * (cpu_s(kids2) - cpu_s(kids)) / batches, 1),
            "windows_per_s": round(batches * 256 / (t1 - t0))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="bench_data/full", help="packed corpus (benchmarks/data.py writes one)")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1])
    p.add_argument("--batches", type=int, default=1500)
    p.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads before the loader")
    a = p.parse_args()
    for w in a.workers:
        print(json.dumps(run(a.data, w, a.batches, a.torch_threads)), flush=True)


if __name__ == "__main__":
    main()
