"""Run under torchrun: stream a dataset with DDP-style lockstep and record what each rank saw.

Every step does a real gloo all_reduce, so a rank with fewer batches would hang the others
(the test bounds that with a timeout). Writes <out>/rank<r>.json; optionally stops after
--stop-after batches saving <out>/state<r>.pt, saves <out>/at<S>/state<r>.pt at each --save-at step S
and goes on, or resumes from --resume <dir> (each rank its own state, or with --state-of-rank R
every rank rank R's: elastic resume into another world).
"""
import argparse
import datetime
import hashlib
import json
import os

import torch
import torch.distributed as dist

import streamwin as sw


def canonical(arg: str):
    """--canonical as WindowDataset takes it: "auto", None ("none") or (rank slots, step phases) ("8,8")."""
    return {"none": None, "auto": "auto"}[arg] if arg in ("none", "auto") else tuple(map(int, arg.split(",")))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--stride", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--equalize", default="drop")
    p.add_argument("--storage-options", default=None, help="JSON file")
    p.add_argument("--cache-dir", default=None, help="node-local shard cache")
    p.add_argument("--canonical", default="auto", help="rank slots,step phases of the canonical streams, none or auto")
    p.add_argument("--stop-after", type=int, default=None)
    p.add_argument("--save-at", type=int, nargs="*", default=[], help="save the state at these steps and go on")
    p.add_argument("--resume", default=None)
    p.add_argument("--state-of-rank", type=int, default=None, help="every rank loads this old rank's state")
    a = p.parse_args()
    so = json.load(open(a.storage_options)) if a.storage_options else None
    # built before init_process_group, as users often do: rank is resolved when iteration starts
    ds = sw.WindowDataset(a.url, window=a.window, stride=a.stride, batch_size=a.batch_size, shuffle_buffer=64,
                          seed=7, order=sw.Order(equalize=a.equalize, canonical=canonical(a.canonical)),
                          read=sw.Read(storage_options=so, cache_dir=a.cache_dir))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = sw.WindowLoader(ds, num_workers=a.workers)
    start_epoch = 0
    if a.resume:
        which = rank if a.state_of_rank is None else a.state_of_rank
        ckpt = torch.load(os.path.join(a.resume, f"state{which}.pt"), weights_only=False)
        loader.load_state_dict(ckpt["data"])
        start_epoch = ckpt["epoch"]
    records, steps = [], 0
    for epoch in range(start_epoch, a.epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            t = torch.ones(1)
            dist.all_reduce(t)  # lockstep: hangs if any rank has fewer batches
            assert t.item() == world
            records.append({"epoch": epoch, "key": list(batch["key"]), "start": batch["start"].tolist(),
                            "weight": batch["weight"].tolist() if "weight" in batch else None,
                            "x": hashlib.sha256(batch["x"].numpy().tobytes()).hexdigest()})
            steps += 1
            if steps in a.save_at:
                where = os.path.join(a.out, f"at{steps}")
                os.makedirs(where, exist_ok=True)
                torch.save({"data": loader.state_dict(), "epoch": epoch}, os.path.join(where, f"state{rank}.pt"))
            if a.stop_after is not None and steps == a.stop_after:
                torch.save({"data": loader.state_dict(), "epoch": epoch}, os.path.join(a.out, f"state{rank}.pt"))
                break
        else:
            continue
        break
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": world, "len": len(loader), "records": records}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
