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
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

WINDOW, STRIDE, BATCH = 256, 64, 256


def child(data: str, case: str, batches: int, sleep_ms: float) -> dict:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import streamwin as sw

    class Ops(TorchDispatchMode):
        """Ops that compute or copy (a kernel each on a GPU)."""

        FREE = ("empty", "view", "slice", "alias", "as_strided", "_reshape_alias", "reshape", "unsqueeze", "detach",
                "lift_fresh", "expand", "select", "split", "unbind", "t", "squeeze", "permute", "narrow")

        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__.rstrip("_")
            if not name.startswith(self.FREE):
                self.n += 1
            return func(*args, **(kwargs or {}))

    torch.set_num_threads(1)  # on a busy machine torch's intra-op threads spin in a copy: CPU time, not work
    kind, workers = case.split(":")
    workers = int(workers)
    ds = sw.WindowDataset(data, window=WINDOW, stride=STRIDE, batch_size=BATCH, shuffle_buffer=10_000, seed=0,
                          rank=0, world_size=1)
    kw = {} if kind == "cpu" else {"device": "cpu"}
    if kind == "static":
        kw["static"] = True
    loader = sw.WindowLoader(ds, num_workers=workers, persistent_workers=workers > 0, **kw)

    def forever():
        epoch = 0
        while True:
            loader.set_epoch(epoch)
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
    p.add_argument("--sleep-ms", type=float, default=2.0, help="the step: asleep, using no CPU")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", nargs=2, metavar=("CASE", "TREE"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.data, a.child[0], a.batches, a.sleep_ms)), flush=True)
        return
    trees = ["."] + ([a.tree] if a.tree else [])
    rows: dict[tuple[str, str], list[dict]] = {}
    for r in range(a.repeats):  # interleaved: drift hits every case alike
        for case in a.cases:
            for tree in trees:
                env = dict(os.environ)
                if tree != ".":
                    env["PYTHONPATH"] = os.path.abspath(tree)
                out = subprocess.run([sys.executable, __file__, "--data", a.data, "--batches", str(a.batches),
                                      "--sleep-ms", str(a.sleep_ms), "--child", case, tree], env=env,
                                     capture_output=True, text=True, timeout=900)
                if out.returncode:
                    print(json.dumps({"case": case, "tree": tree, "error": out.stderr.strip().splitlines()[-1:]}))
                    continue
                rec = json.loads(out.stdout.strip().splitlines()[-1])
                print(json.dumps({"repeat": r, **rec}), flush=True)
                rows.setdefault((case, tree), []).append(rec)
    print("| case | tree | trainer CPU us/batch (median) | ops per batch | copy alone us |")
    print("|---|---|---:|---:|---:|")
    for (case, tree), recs in rows.items():
        med = statistics.median(x["trainer_us_per_batch"] for x in recs)
        print(f"| {case} | {tree} | {med:.1f} | {recs[0]['ops_per_batch']:.2f} | {recs[0]['copy_alone_us']:.1f} |")


if __name__ == "__main__":
    main()
