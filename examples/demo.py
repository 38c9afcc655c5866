"""`make demo`: pack a real corpus, then train on it with DDP on 2 CPU processes, with a resume.

1. Packs the Python standard library's .py files (every machine has them) as uint8 byte
   sequences into data/demo/stdlib (``--data``; data/ is ignored by git), and prints what was written.
2. Trains a small byte-level next-token model with DistributedDataParallel on 2 processes
   (gloo on loopback; nccl when 2 GPUs are present), streaming windows from the shards.
3. Stops half-way through the run as a preemption would, saving model + loader state,
   then starts fresh processes that resume from the checkpoint mid-epoch.
Loss, windows/s and the per-rank step counts are printed as it goes; at the end, where the data
and the checkpoint are and how much room they take (about 170 MB; `make clean` removes them).
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import sysconfig
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import streamwin as sw

WINDOW = 128


class ByteModel(nn.Module):
    """Embedding -> GRU -> next-byte logits: small enough to train for real on 2 CPU cores."""

    def __init__(self, dim: int = 96):
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.rnn = nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.embed(tokens))
        return self.head(h)


def pack_corpus(dest: str) -> str:
    src = sysconfig.get_paths()["stdlib"]
    if not os.path.exists(os.path.join(dest, "index.json")):
        print(f"packing the .py files of {src} as byte sequences -> {dest}")
        t = time.perf_counter()
        m = sw.pack(src, dest, format="text", suffixes=[".py"], shard_bytes=8 << 20)
        dt = time.perf_counter() - t
        mb = sum(s.bytes for s in m.shards) / 1e6
        print(f"wrote {len(m.shards)} shards, {m.num_sequences} sequences, {m.num_steps / 1e6:.1f}M bytes of text, "
              f"{mb:.1f} MB in {dt:.1f}s ({mb / dt:.0f} MB/s); skipped {m.dropped_empty} empty files")
    m = sw.load_manifest(dest)
    print(f"dataset {dest}: {m.num_sequences} sequences, dtype {m.dtype}, shards {len(m.shards)}")
    return dest


def train(rank: int, world: int, port: int, url: str, steps: int, ckpt: str, phase: str) -> None:
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.parallel.DistributedDataParallel(ByteModel().to(device))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    ds = sw.WindowDataset(url, window=WINDOW + 1, stride=WINDOW, batch_size=32, shuffle_buffer=4096, seed=0)
    loader = sw.WindowLoader(ds, num_workers=0, pin_memory=device.type == "cuda")
    step, epoch = 0, 0
    if phase == "resume":
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        loader.load_state_dict(state["loader"][rank])
        step, epoch = state["step"], state["epoch"]
        if rank == 0:
            print(f"[resume] restored step {step}, epoch {epoch}; the loader continues mid-epoch")
    if rank == 0:
        s = ds.summary()
        print(f"[{phase}] {world} ranks x {len(loader)} batches per epoch; {s['windows_per_epoch']} windows per epoch, "
              f"{s['dropped_windows']} dropped for equal steps, {s['short_sequences']} files shorter than a window")
    if len(loader) == 0:  # every rank alike: nothing to train on; say why instead of looping for ever
        raise SystemExit(f"no step can run: 0 batches per rank ({ds.summary()['windows_per_epoch']} windows for "
                         f"{world} ranks in batches of {ds.batch_size})")
    stop = steps // 2 if phase == "first" else steps
    t0, windows, losses = time.perf_counter(), 0, []
    while step < stop:
        loader.set_epoch(epoch)
        for batch in loader:
            tokens = batch["x"].to(device, non_blocking=True).long()
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()  # DDP all_reduces the gradients: a rank with fewer batches would hang here
            opt.step()
            step += 1
            windows += tokens.shape[0]
            losses.append(loss.item())
            if rank == 0 and step % 10 == 0:
                rate = windows * world / (time.perf_counter() - t0)
                print(f"[{phase}] epoch {epoch} step {step:4d}  loss {sum(losses[-10:]) / len(losses[-10:]):.3f}  "
                      f"{rate:,.0f} windows/s", flush=True)
            if step >= stop:
                break
        else:
            epoch += 1
            continue
        break
    if phase == "first":  # the "preemption": every rank's loader state goes into one checkpoint
        states = [None] * world
        dist.all_gather_object(states, loader.state_dict())
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "loader": states,
                        "step": step, "epoch": epoch}, ckpt)
            print(f"[first] preempted at step {step}: saved model + loader state to {ckpt}")
    loader.close()  # its threads end before the process group and the interpreter do
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="data/demo/stdlib", help="where the packed corpus goes (its checkpoint beside "
                                                                   "it); default data/demo/stdlib, under the ignored data/")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--world", type=int, default=2)
    a = p.parse_args(argv)
    url = pack_corpus(a.data)
    ckpt = os.path.join(os.path.dirname(a.data) or ".", "demo_ckpt.pt")
    batches = len(sw.WindowDataset(url, window=WINDOW + 1, stride=WINDOW, batch_size=32, rank=0, world_size=a.world))
    if batches == 0 or a.steps < 2:
        print(f"demo: no step can run: {batches} batches per rank for {a.world} ranks, --steps {a.steps}",
              file=sys.stderr)
        return 1
    for phase in ("first", "resume"):
        mp.spawn(train, args=(a.world, free_port(), url, a.steps, ckpt, phase), nprocs=a.world, join=True)
    print("demo done: packed, trained with DDP, preempted, resumed mid-epoch")
    folder = os.path.relpath(os.path.dirname(os.path.abspath(a.data)))
    print(f"the demo's data: {url} and {ckpt}, {_megabytes([url, ckpt]):.0f} MB in {folder}/ (`rm -r {folder}`"
          + (", or `make clean`, removes it)" if folder == os.path.join("data", "demo") else " removes it)"))
    return 0


def _megabytes(paths: list[str]) -> float:
    """The size of the files at (and under) ``paths``, in MB."""
    total = 0
    for path in paths:
        if os.path.isfile(path):
            total += os.path.getsize(path)
        for root, _, files in os.walk(path):
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total / 1e6


if __name__ == "__main__":
    sys.exit(main())
