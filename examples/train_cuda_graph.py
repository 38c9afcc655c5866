"""Train a small forecaster with its whole step captured in a CUDA graph, fed static batches by streamwin.

    python examples/train_cuda_graph.py --data demo_data/sines --window 64 --horizon 8 --steps 2000

A short, launch-bound step (a small MLP over windows: the data-hungry kind) spends more of its
time launching kernels from Python than running them. A CUDA graph records the step's kernels
once and replays them with one launch, but it reads and writes fixed memory: the batch must
arrive in the same tensors every step. ``WindowLoader(ds, device="cuda", static=True)`` does
exactly that: each ``next()`` refills the same device tensors (one copy on a side stream, then
one device-to-device copy ordered after the previous step; the CPU never waits for the GPU),
so the loop is

    batch = next(batches)      # the same tensors, new values
    graph.replay()             # forward, backward and optimizer step, one launch

The capture follows torch's whole-network recipe (torch.cuda.graphs): a few eager steps on a
side stream (warm-up), grads set to None, capture, then replay per batch; the optimizer is
created with ``capturable=True``. A static batch is valid until the next ``next()``: clone what
you keep. ``torch.compile(model, mode="reduce-overhead")`` works on static batches too (it
copies inputs into its own graph's buffers unless told their address is static:
``torch._dynamo.mark_static_address(batch["x"])``).

Without CUDA (``--device cpu``) the same loop runs eagerly on static CPU batches, without
capture: that is how CI runs it. The last line printed is a JSON summary.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Any, Iterator

import torch
import torch.nn as nn

import streamwin as sw


class Forecaster(nn.Module):
    """[B, W, F] window -> [B, H, F]: the next H steps, in the window's normalized units."""

    def __init__(self, window: int, horizon: int, features: int, hidden: int):
        super().__init__()
        self.horizon, self.features = horizon, features
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(window * features, hidden), nn.GELU(),
                                 nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, horizon * features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).view(-1, self.horizon, self.features)


def batches_forever(loader: sw.WindowLoader) -> Iterator[dict[str, Any]]:
    """Batches epoch after epoch (set_epoch before each): static ones stay in the same tensors throughout."""
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        count = 0
        for batch in loader:
            count += 1
            yield batch
        if not count:
            raise SystemExit("no batches: use a smaller --window or --batch-size for this data")
        epoch += 1


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="a packed dataset (streamwin pack)")
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--horizon", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--workers", type=int, default=1, help="worker processes gathering batches (0: in-process)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eager", action="store_true", help="no capture, even on CUDA (to compare)")
    p.add_argument("--log-every", type=int, default=100)
    args = p.parse_args(argv)

    device = torch.device(args.device)
    graphed = device.type == "cuda" and not args.eager
    ds = sw.WindowDataset(args.data, window=args.window, stride=max(1, args.window // 2), horizon=args.horizon,
                          batch_size=args.batch_size, shuffle_buffer=4096, seed=0)
    loader = sw.WindowLoader(ds, num_workers=args.workers, device=device, static=True)
    batches = batches_forever(loader)
    batch = next(batches)
    features = batch["x"][0, 0].numel()
    torch.manual_seed(0)
    model = Forecaster(args.window, args.horizon, features, args.hidden).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, capturable=graphed)

    def step() -> torch.Tensor:
        """One optimizer step on ``batch`` (always the same tensors): normalized next-steps MSE."""
        x = batch["x"].float().reshape(args.batch_size, args.window, -1)
        y = batch["y"].float().reshape(args.batch_size, args.horizon, -1)
        mu, sd = x.mean(1, keepdim=True), x.std(1, keepdim=True) + 1e-5
        loss = (model((x - mu) / sd) - (y - mu) / sd).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    warmup = 0
    if graphed:  # warm up on a side stream, then capture the step once
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for warmup in range(1, 4):
                opt.zero_grad(set_to_none=True)
                step()
                batch = next(batches)  # refilled in place, ordered on the side stream (the current one here)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)  # grads made in the graph's pool: each replay writes them anew
        with torch.cuda.graph(graph):
            loss = step()

    def eager() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        return step()

    started = time.perf_counter()
    for done in range(warmup + 1, args.steps + 1):
        if graphed:
            graph.replay()  # the whole step, on the batch now in the static tensors
        else:
            loss = eager()
        if done % args.log_every == 0:
            print(f"step {done}: loss {loss.item():.4f}", flush=True)
        if done < args.steps:
            batch = next(batches)  # the same tensors, refilled after the step that read them
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    stats = loader.stats()
    loader.close()
    print(json.dumps({"steps": args.steps, "captured": graphed, "loss": round(float(loss.item()), 6),
                      "ms_per_step": round(1000 * seconds / max(args.steps - warmup, 1), 3), "device": str(device),
                      "device_waits": stats.get("device_waits", 0), "wait_s": round(stats["wait_s"], 3)}))


if __name__ == "__main__":
    main()
