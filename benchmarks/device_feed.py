"""What device mode costs the trainer per batch, measured without a GPU (device="cpu" runs the same code).

Per case, in a fresh child process: the trainer process's CPU per batch (RUSAGE_SELF: all its
threads, workers excluded) around a step that sleeps (uses no CPU), and the ops per batch that
compute or copy on the trainer's thread inside ``next()`` (each would be one kernel launch on a
GPU: views and allocations not counted). torch runs one intra-op thread (on busy cores its
threads spin in a copy, CPU time that is no work). On the CPU a copy or gather runs here and is part of
the CPU number; on a GPU it is an asynchronous launch, so the line ``copy alone`` (one batch
buffer copied by torch, the same bytes) says how much of each number is the copy itself.

Cases: ``device:N`` (WindowLoader(ds, num_workers=N, device="cpu")), ``static:N`` (the same with
static=True), ``cpu:N`` (CPU batches, for reference). ``--tree DIR`` runs the same cases against
another checkout's ``streamwin`` package (say, the code before a change), interleaved with this one.

    .venv/bin/python benchmarks/device_feed.py --data bench_data/quick --cases device:0 device:1 static:1 \\
        --tree /tmp/old --repeats 3
    .venv/bin/python benchmarks/device_feed.py --ops-by-layout bench_data/layouts --cases device:0 device:1 \\
        static:0 static:1 --tree /tmp/old --repeats 1      # launches per batch of each batch layout
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

try:  # imported as benchmarks.device_feed
    from .children import run_child
except ImportError:  # run as a script: benchmarks/ is on sys.path
    from children import run_child

WINDOW, BATCH = 256, 256  # stride: window / 4, as perf-notes
#: --ops-by-layout: the batch layouts whose launches are counted (W=128, stride 64, batch 64, F=8)
LAYOUTS = {  # each layout's WindowDataset arguments, made of streamwin (``sw``) once it is imported
    "windows": lambda sw: {},
    "horizon + pad": lambda sw: dict(horizon=16, crops=sw.Crops(pad=True), order=sw.Order(equalize="pad")),
    "mixed (two sources)": lambda sw: dict(mix=sw.Mix(weights=[0.7, 0.3])),
    "missing='mask'": lambda sw: dict(horizon=16, crops=sw.Crops(missing="mask")),
    "drawn lengths": lambda sw: dict(horizon=16, crops=sw.Crops(min_window=32, window_multiple=16, pad=True)),
    "packed rows": lambda sw: dict(crops=sw.Crops(pack_length=512, min_window=32, window_multiple=16, jitter=True)),
}


class Ops(TorchDispatchMode):
    """Counts the ops that compute or copy (a kernel launch each on a GPU): not views, not allocations."""

    FREE = ("empty", "view", "slice", "alias", "as_strided", "_reshape_alias", "reshape", "unsqueeze", "detach",
            "lift_fresh", "expand", "select", "split", "unbind", "t", "squeeze", "permute", "narrow")

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.overloadpacket.__name__.rstrip("_").startswith(self.FREE):
            self.n += 1
        return func(*args, **(kwargs or {}))


def loader_kwargs(kind: str) -> dict:
    """The WindowLoader arguments of a case's kind (cpu, device, static)."""
    return {} if kind == "cpu" else {"device": "cpu", "static": True} if kind == "static" else {"device": "cpu"}


def ops_by_layout(case: str, root: str) -> dict:
    """Launches per batch inside next() for each of LAYOUTS (a small corpus of two sources under ``root``)."""
    import streamwin as sw

    torch.set_num_threads(1)
    if not os.path.exists(os.path.join(root, "b", "index.json")):
        rng = np.random.default_rng(0)
        for name, n in (("a", 300), ("b", 100)):
            seqs = [(f"{name}{i:04d}", rng.standard_normal((int(t), 8)).astype(np.float32))
                    for i, t in enumerate(rng.integers(200, 3000, n))]
            sw.pack(seqs, os.path.join(root, name), shard_bytes=1 << 20, progress=False)
    kind, workers = case.split(":")
    out = {"case": case, "tree": os.path.dirname(os.path.dirname(sw.__file__))}
    for name, arguments in LAYOUTS.items():
        kw = arguments(sw)
        url = [os.path.join(root, "a"), os.path.join(root, "b")] if "mix" in kw else os.path.join(root, "a")
        ds = sw.WindowDataset(url, window=128, stride=64, batch_size=64, shuffle_buffer=2000, seed=0, rank=0,
                              world_size=1, **kw)
        loader = sw.WindowLoader(ds, num_workers=int(workers), **loader_kwargs(kind))
        it = iter(loader)
        next(it)
        ops, n = Ops(), min(20, len(loader) - 1)
        for _ in range(n):
            with ops:
                next(it)
        loader.close()
        out[name] = round(ops.n / n, 2)
    return out


def child(data: str, case: str, batches: int, sleep_ms: float, window: int = WINDOW, batch_size: int = BATCH) -> dict:
    import torch

    import streamwin as sw

    torch.set_num_threads(1)  # on a busy machine torch's intra-op threads spin in a copy: CPU time, not work
    kind, workers = case.split(":")
    workers = int(workers)
    ds = sw.WindowDataset(data, window=window, stride=max(1, window // 4), batch_size=batch_size,
                          shuffle_buffer=10_000, seed=0, rank=0, world_size=1)
    loader = sw.WindowLoader(ds, num_workers=workers, persistent_workers=workers > 0, **loader_kwargs(kind))

    def forever():
        epoch = 0
        while True:
            loader.set_epoch(epoch)
            if not len(loader):
                raise SystemExit(f"{data}: no batch of {batch_size} windows of {window}: a smaller --window or --batch-size")
            yield from loader
            epoch += 1

    it = forever()
    for _ in range(20):
        next(it)
    ops = Ops()
    counted = 50
    for _ in range(counted):
        with ops:
            b = next(it)
        float(b["x"][0, 0, 0])
    me = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(batches):
        b = next(it)
        float(b["x"][0, 0, 0])
        time.sleep(sleep_ms / 1000)
    me2 = resource.getrusage(resource.RUSAGE_SELF)
    nbytes = ds.layout().nbytes
    loader.close()
    src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    t = time.process_time()
    for _ in range(200):
        dst.copy_(src)
    copy_us = 1e6 * (time.process_time() - t) / 200
    cpu = me2.ru_utime + me2.ru_stime - me.ru_utime - me.ru_stime
    return {"case": case, "tree": os.path.dirname(os.path.dirname(sw.__file__)), "batches": batches,
            "trainer_us_per_batch": round(1e6 * cpu / batches, 1), "ops_per_batch": ops.n / counted,
            "copy_alone_us": round(copy_us, 1), "batch_bytes": nbytes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="bench_data/quick")
    p.add_argument("--cases", nargs="+", default=["cpu:1", "device:0", "device:1", "static:0", "static:1"])
    p.add_argument("--tree", default=None, help="another checkout whose streamwin/ to run the cases against too")
    p.add_argument("--batches", type=int, default=600)
    p.add_argument("--window", type=int, default=WINDOW, help="stride: window / 4")
    p.add_argument("--batch-size", type=int, default=BATCH)
    p.add_argument("--sleep-ms", type=float, default=2.0, help="the step: asleep, using no CPU")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ops-by-layout", metavar="DIR", help="instead: launches per batch of each batch layout, on a "
                   "small corpus written to DIR once (once per case and tree)")
    p.add_argument("--child", nargs=2, metavar=("CASE", "TREE"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        rec = ops_by_layout(a.child[0], a.ops_by_layout) if a.ops_by_layout else \
            child(a.data, a.child[0], a.batches, a.sleep_ms, a.window, a.batch_size)
        print(json.dumps(rec), flush=True)
        return
    trees = ["."] + ([a.tree] if a.tree else [])
    rows: dict[tuple[str, str], list[dict]] = {}
    for r in range(a.repeats):  # interleaved: drift hits every case alike
        for case in a.cases:
            for tree in trees:
                env = dict(os.environ)
                if tree != ".":
                    env["PYTHONPATH"] = os.path.abspath(tree)
                extra = ["--ops-by-layout", os.path.abspath(a.ops_by_layout)] if a.ops_by_layout else []
                res = run_child([sys.executable, __file__, "--data", a.data, "--batches", str(a.batches),
                                 "--sleep-ms", str(a.sleep_ms), "--window", str(a.window), "--batch-size",
                                 str(a.batch_size), *extra, "--child", case, tree], 900, cwd=os.getcwd(), env=env)
                if res.record is None:
                    print(json.dumps({"case": case, "tree": tree, "error": res.stderr.strip().splitlines()[-1:]}))
                    continue
                rec = {**res.record, "other_cpu_cores": round(res.other_cpu_cores, 2)}
                print(json.dumps({"repeat": r, **rec}), flush=True)
                rows.setdefault((case, tree), []).append(rec)
    if a.ops_by_layout:
        return
    print("| case | tree | trainer CPU us/batch (median) | ops per batch | copy alone us |")
    print("|---|---|---:|---:|---:|")
    for (case, tree), recs in rows.items():
        med = statistics.median(x["trainer_us_per_batch"] for x in recs)
        print(f"| {case} | {tree} | {med:.1f} | {recs[0]['ops_per_batch']:.2f} | {recs[0]['copy_alone_us']:.1f} |")


if __name__ == "__main__":
    main()
