"""Pretrain a small patch transformer on packed rows of two datasets mixed, under DDP, resumable.

    torchrun --nproc_per_node=2 examples/pretrain.py --data data/ecg,data/eeg --weights 0.7,0.3 \
        --ckpt ckpt/pretrain.pt --epochs 2 --stop-after 20      # "preempted" after 20 steps
    torchrun --nproc_per_node=2 examples/pretrain.py ... (the same command)   # resumes mid-epoch

What streamwin gives a time-series foundation model (Moirai, Chronos, TimesFM style):

- ``jitter=True``, ``min_window``, ``window_multiple=patch``: each epoch every series gives new
  crops, at new offsets, of lengths drawn in whole patches;
- ``pack_length``: rows of whole crops, side by side; ``batch["segment_ids"]`` tells them
  apart (0 = padding) and ``batch["positions"]`` counts steps within each crop, so attention is
  block-diagonal and no patch attends across two series (here: ``attention_mask``, passed to
  ``scaled_dot_product_attention``);
- ``missing="mask"``: NaN/inf become 0 with ``batch["observed"]`` saying where data was real;
- two datasets mixed by weight, equal steps on every rank, and a checkpoint that is a cursor:
  a preempted run resumes with exactly the rows it would have trained on.

The model embeds each patch of ``--patch`` steps, adds an embedding of the patch's position in
its crop, and predicts every next patch of the same crop (causal within a crop), on values
normalized by their crop's mean and standard deviation (floored at half the batch's). gloo on CPU, nccl on GPUs.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import streamwin as sw
from train_ddp import (USER_ERRORS, WORKERS_HELP, Recorder, failed, features_of, init_distributed, load_checkpoint,
                       restore_loader, save_checkpoint)

log = logging.getLogger("pretrain")


# ---- model ---------------------------------------------------------------------------------------

def attention_mask(segment_ids: torch.Tensor, patch: int) -> torch.Tensor:
    """[B, 1, P, P] bool: patch i may attend to patch j of the same crop at or before it (block-diagonal, causal).

    Crops start on patch boundaries (``window_multiple=patch``), so a patch's segment is its
    first step's. A padding patch attends to itself only, so that no row of the mask is empty.
    """
    seg = segment_ids[:, ::patch]
    n = seg.shape[1]
    allowed = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
    allowed &= torch.ones(n, n, dtype=torch.bool, device=seg.device).tril()
    allowed |= torch.eye(n, dtype=torch.bool, device=seg.device)
    return allowed[:, None]


class Block(nn.Module):
    """Pre-norm attention (scaled_dot_product_attention under a mask) and MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, h: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        b, n, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        h = h + self.proj(a.transpose(1, 2).reshape(b, n, d))
        return h + self.mlp(self.norm2(h))


class PatchTransformer(nn.Module):
    """[B, P, patch * F] patches and their positions in their crops -> a prediction of each next patch."""

    def __init__(self, patch: int, features: int, max_patches: int, d: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.embed, self.pos = nn.Linear(patch * features, d), nn.Embedding(max_patches, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, patch * features)

    def forward(self, patches: torch.Tensor, pos: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        h = self.embed(patches) + self.pos(pos)
        for block in self.blocks:
            h = block(h, allowed)
        return self.head(h)


def crop_normalized(x: torch.Tensor, seg: torch.Tensor, observed: torch.Tensor) -> torch.Tensor:
    """x [B, L, F] scaled by the mean and standard deviation of its crop's observed values (0 on padding); the
    deviation floored at half the batch's, as train_ddp.window_scale does, so that a flat crop is not divided by ~0."""
    b, length, f = x.shape
    slot = (seg + torch.arange(b, device=x.device)[:, None] * (length + 1)).reshape(-1)  # one slot per crop
    w = observed.float().reshape(b * length, f)
    flat = x.reshape(b * length, f) * w
    count = torch.zeros(b * (length + 1), f, device=x.device).index_add_(0, slot, w).clamp_min(1)
    mean = torch.zeros_like(count).index_add_(0, slot, flat) / count
    var = torch.zeros_like(count).index_add_(0, slot, (flat - mean[slot] * w) ** 2) / count
    seen = w.sum(0).clamp_min(1)  # per feature: the batch's observed values
    batch_var = ((flat - (flat.sum(0) / seen) * w) ** 2).sum(0) / seen
    sd = torch.maximum(var.sqrt(), 0.5 * batch_var.sqrt())
    sd = torch.where(sd > 1e-6, sd, torch.ones_like(sd))
    out = (x.reshape(b * length, f) - mean[slot]) / sd[slot]
    return (out * w).reshape(b, length, f)


def packed_loss(model: nn.Module, batch: dict, patch: int, device: torch.device) -> torch.Tensor:
    """MSE of every next patch of the same crop (observed steps only), values normalized per crop."""
    x = batch["x"].to(device).float()
    x = x.reshape(x.shape[0], x.shape[1], -1)
    seg = batch["segment_ids"].to(device).long()
    observed = batch["observed"].to(device).reshape(x.shape)
    xn = crop_normalized(x, seg, observed)
    b, length, f = x.shape
    patches = xn.view(b, length // patch, patch * f)
    pred = model(patches, batch["positions"].to(device)[:, ::patch].long() // patch, attention_mask(seg, patch))
    seg_p = seg[:, ::patch]
    same = (seg_p[:, 1:] == seg_p[:, :-1]) & (seg_p[:, 1:] > 0)  # the next patch is of the same crop
    seen = observed.float().view(b, length // patch, patch * f)[:, 1:] * same[..., None]
    err = (pred[:, :-1] - patches[:, 1:]) ** 2 * seen
    return err.sum() / seen.sum().clamp_min(1)


# ---- training ------------------------------------------------------------------------------------

def dataset(args: argparse.Namespace, **world) -> sw.WindowDataset:
    """Packed rows of crops of ``--min-window``..``--window`` steps (whole patches), the datasets mixed
    (``world``: rank and world_size, to replay a job's ranks in one process)."""
    mix = sw.Mix(weights=args.weights) if len(args.data) > 1 else None
    crops = sw.Crops(pad=args.pad, jitter=True, min_window=args.min_window, window_multiple=args.patch,
                     pack_length=args.pack_length, missing="mask")
    return sw.WindowDataset(args.data if len(args.data) > 1 else args.data[0], window=args.window,
                            stride=args.window // 2, batch_size=args.batch_size, shuffle_buffer=args.shuffle_buffer,
                            seed=args.seed, crops=crops, mix=mix, **world)


def model_of(args: argparse.Namespace, ds: sw.WindowDataset) -> PatchTransformer:
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP broadcasts them anyway)
    return PatchTransformer(args.patch, features_of(ds), args.window // args.patch, d=args.width)


PLAN_OPTIONS = ("data", "weights", "window", "min_window", "patch", "pad", "pack_length", "batch_size",
                "shuffle_buffer", "seed")  # a checkpoint taken under other values of these cannot resume exactly


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, type=lambda text: [u for u in text.split(",") if u],
                   help="dataset URLs written by streamwin pack, comma-separated (several are mixed)")
    p.add_argument("--weights", type=lambda text: [float(w) for w in text.split(",")], default=None)
    p.add_argument("--ckpt", required=True, help="checkpoint file: resumed from if it exists")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--stop-after", type=int, default=None, help="simulate a preemption: save and exit after N steps")
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--patch", type=int, default=8, help="steps per patch (crops are whole patches)")
    p.add_argument("--window", type=int, default=64, help="longest crop, in steps")
    p.add_argument("--min-window", type=int, default=16, help="shortest crop, in steps")
    p.add_argument("--pad", action="store_true",
                   help="a sequence shorter than --window gives one crop of at most its length (else none)")
    p.add_argument("--pack-length", type=int, default=256, help="steps per packed row")
    p.add_argument("--batch-size", type=int, default=8, help="rows per batch per rank")
    p.add_argument("--shuffle-buffer", type=int, default=4096)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=0, help=WORKERS_HELP)
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    p.add_argument("--record", default=None, help="write each rank's (step, key, start, loss) to DIR/rank<r>.jsonl")
    return p.parse_args(argv)


def resume(args: argparse.Namespace, net: nn.Module, opt: torch.optim.Optimizer, loader: sw.WindowLoader
           ) -> tuple[int, int]:
    """(step, epoch) of the checkpoint at ``--ckpt`` with model, optimizer and loader restored; (0, 0) without one."""
    path = args.ckpt
    if not os.path.exists(path):
        return 0, 0
    ckpt = load_checkpoint(path)
    net.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    restore_loader(loader, ckpt, args, PLAN_OPTIONS)  # a cursor: every rank's rows, from where they stopped
    if dist.get_rank() == 0:
        log.info("resumed from %s: step %d, epoch %d", path, ckpt["step"], ckpt["epoch"])
    return ckpt["step"], ckpt["epoch"]


def train(args: argparse.Namespace, model: nn.Module, opt: torch.optim.Optimizer, loader: sw.WindowLoader,
          step: int, start_epoch: int, device: torch.device) -> tuple[int, float, float]:
    """The epochs from ``start_epoch`` (its restored position kept); (steps run, summed row fill, start time)."""
    net, rank = model.module, dist.get_rank()
    recorder = Recorder(args.record, rank, step)
    run_steps, filled, t0 = 0, 0.0, time.perf_counter()
    for epoch in range(start_epoch, args.epochs):
        loader.set_epoch(epoch)  # the checkpoint's epoch keeps the restored position
        for batch in loader:
            loss = packed_loss(model, batch, args.patch, device)
            opt.zero_grad(set_to_none=True)
            loss.backward()  # DDP averages gradients: every rank has as many batches, nothing hangs
            opt.step()
            step, run_steps = step + 1, run_steps + 1
            filled += (batch["segment_ids"] > 0).float().mean().item()
            recorder.write(step, epoch, batch, loss.item())
            if rank == 0 and step % 10 == 0:
                log.info("epoch %d step %d loss %.4f", epoch, step, loss.item())
            if run_steps == args.stop_after or step % args.ckpt_every == 0:
                save_checkpoint(args.ckpt, model=net, opt=opt, loader=loader, epoch=epoch, step=step, args=args)
            if run_steps == args.stop_after:
                if rank == 0:
                    log.info("stopping at step %d (--stop-after %d); run the same command again to resume", step,
                             run_steps)
                return run_steps, filled, t0
    if run_steps:  # every epoch done: the checkpoint names the next epoch, so a rerun has nothing left to do
        save_checkpoint(args.ckpt, model=net, opt=opt, loader=loader, epoch=args.epochs, step=step, args=args)
    return run_steps, filled, t0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world, local_rank, device = init_distributed(args.backend)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank {rank}] %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    try:  # no data at --data, options the data or the checkpoint cannot take: one line, exit 2
        ds = dataset(args)
        loader = sw.WindowLoader(ds, num_workers=args.workers, pin_memory=device.type == "cuda")
        net = model_of(args, ds).to(device)
        model = nn.parallel.DistributedDataParallel(net, device_ids=[local_rank] if device.type == "cuda" else None)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        step, start_epoch = resume(args, net, opt, loader)
        s = ds.summary(start_epoch)  # plans the epoch: a dataset of the mix without windows is said here
    except USER_ERRORS as e:
        return failed(e, args, log)
    if rank == 0:
        log.info("%d ranks x %d batches of %d rows of %d steps; %d crops per epoch (%s)", world, len(loader),
                 args.batch_size, args.pack_length, s["windows_per_epoch"],
                 ", ".join(f"{src['name']}: {src['share']}" for src in s.get("sources", [])))
    run_steps, filled, t0 = train(args, model, opt, loader, step, start_epoch, device)
    if rank == 0:
        log.info("%d steps in %.1fs, rows %.1f%% full; loader.stats(): %s", run_steps, time.perf_counter() - t0,
                 100 * filled / max(run_steps, 1), loader.stats())
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
