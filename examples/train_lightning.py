"""Train the forecaster of train_ddp.py with PyTorch Lightning, streaming windows with streamwin.

    python examples/train_lightning.py --data s3://bucket/ecg/ --ckpt-dir ckpt/ecg --devices 4 --accelerator gpu
    python examples/train_lightning.py --data demo_data/ds --ckpt-dir ckpt/demo --accelerator cpu --devices 2

Lightning's own DDP launches the processes (``strategy="ddp"``); the streamwin loader already
gives each rank its part of the data, with the same number of batches on every rank, so
``use_distributed_sampler=False``. Checkpoints hold model, optimizer, loops *and* the loaders'
position; the same command resumes from ``<ckpt-dir>/last.ckpt`` exactly where the
checkpoint was taken (``--stop-after N`` simulates a preemption after N steps of this run).

Lightning's own support for stateful dataloaders is all it takes (checked with Lightning 2.6):

1. Lightning saves ``train_dataloader().state_dict()`` in the checkpoint (rank 0's) and loads it
   into the loader of every rank on resume. A streamwin state says where *all* ranks are (they
   run in lockstep: epoch and batches taken), so rank 0's state is every rank's.
2. Lightning calls ``set_epoch`` on samplers, never on the loader; a WindowLoader moves on to
   the next epoch by itself after a complete pass (the same on every rank), and a checkpoint
   taken at the last batch of an epoch resumes with the next one.
3. Lightning may call ``iter()`` more than once before it iterates; a pass begins at its first
   batch, so that costs nothing.

The position is exact: the state taken at a checkpoint after step k resumes at batch k + 1.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings

import torch

try:
    import lightning.pytorch as pl
except ImportError:  # the standalone package
    import pytorch_lightning as pl

import streamwin as sw

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_ddp import WORKERS_HELP, Forecaster, features_of, forecast_loss  # noqa: E402  (one model for both examples)

log = logging.getLogger("train_lightning")


class WindowDataModule(pl.LightningDataModule):
    """Training windows from a streamwin dataset (Lightning checkpoints the loader's position itself)."""

    def __init__(self, url: str, *, window: int, stride: int, horizon: int, batch_size: int, seed: int = 0,
                 shuffle_buffer: int = 4096, num_workers: int = 0):
        super().__init__()
        self.url, self.num_workers = url, num_workers
        self.kwargs = dict(window=window, stride=stride, horizon=horizon, batch_size=batch_size, seed=seed,
                           shuffle_buffer=shuffle_buffer)
        self.loader: sw.WindowLoader | None = None

    def setup(self, stage: str) -> None:
        if self.loader is None:  # rank and world size come from torch.distributed, set up by Lightning by now
            ds = sw.WindowDataset(self.url, **self.kwargs)
            self.loader = sw.WindowLoader(ds, num_workers=self.num_workers,
                                          pin_memory=self.trainer.strategy.root_device.type == "cuda")

    @property
    def features(self) -> int:
        return features_of(sw.WindowDataset(self.url, **self.kwargs))

    def train_dataloader(self) -> sw.WindowLoader:
        return self.loader

    def batches_per_rank(self) -> int:
        """Batches each rank yields per epoch (0 when every sequence is shorter than a window)."""
        return len(self.loader) if self.loader is not None else len(sw.WindowDataset(self.url, **self.kwargs))


class LitForecaster(pl.LightningModule):
    def __init__(self, window: int, horizon: int, features: int, hidden: int = 128, lr: float = 1e-3,
                 record: str | None = None):
        super().__init__()
        self.save_hyperparameters(ignore=["record"])
        self.model = Forecaster(window, horizon, features, hidden)
        self.record = record

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = forecast_loss(self.model, batch, self.device)
        self.log("loss", loss, prog_bar=True)
        if self.record:  # what each rank trained on at each step (for the test)
            with open(os.path.join(self.record, f"rank{self.global_rank}.jsonl"), "a") as f:
                f.write(json.dumps({"step": self.global_step + 1, "epoch": self.current_epoch,
                                    "key": list(batch["key"]), "start": batch["start"].tolist(),
                                    "loss": loss.item()}) + "\n")
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class Progress(pl.Callback):
    """Loss and windows/s every few steps, loader.stats() at the end (rank 0 logs)."""

    def __init__(self, every: int, stop_after: int | None, ckpt_path: str):
        self.every, self.stop_after, self.ckpt_path = every, stop_after, ckpt_path
        self.steps = self.windows = 0
        self.t0 = time.perf_counter()

    def on_train_start(self, trainer, pl_module) -> None:
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps += 1
        self.windows += len(batch["key"]) * trainer.world_size
        if trainer.is_global_zero and trainer.global_step % self.every == 0:
            rate = self.windows / (time.perf_counter() - self.t0)
            log.info("epoch %d step %5d  loss %.4f  %s windows/s", trainer.current_epoch, trainer.global_step,
                     outputs["loss"].item(), f"{rate:,.0f}")
        if self.steps == self.stop_after:  # the "preemption": checkpoint (all ranks take part) and stop
            trainer.save_checkpoint(self.ckpt_path)
            trainer.should_stop = True
            if trainer.is_global_zero:
                log.info("stopping at step %d (--stop-after %d): saved %s; run again to resume",
                         trainer.global_step, self.stop_after, self.ckpt_path)

    def on_train_end(self, trainer, pl_module) -> None:
        stats = trainer.datamodule.loader.stats()
        if trainer.is_global_zero:
            log.info("%d steps in this run; rank 0 loader.stats(): %s", self.steps,
                     {k: (round(v, 1) if isinstance(v, float) else v) for k, v in stats.items()})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="dataset URL written by streamwin pack")
    p.add_argument("--ckpt-dir", required=True, help="checkpoints go here; resumes from last.ckpt when it exists")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--steps", type=int, default=-1, help="max_steps (default: no limit)")
    p.add_argument("--stop-after", type=int, default=None, help="simulate a preemption after N steps of this run")
    p.add_argument("--ckpt-every", type=int, default=50, help="checkpoint every K steps (default 50)")
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--stride", type=int, default=None, help="default: --window // 2")
    p.add_argument("--horizon", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--shuffle-buffer", type=int, default=4096)
    p.add_argument("--workers", type=int, default=0, help=WORKERS_HELP)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--devices", default="auto")
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--record", default=None, help="write each rank's (step, key, start, loss) to DIR/rank<r>.jsonl")
    return p.parse_args(argv)


def quiet_lightning() -> None:
    """Keep the output to this script's lines: Lightning's start-up banners and tips, and two
    warnings that do not apply here, go (every DDP process runs this)."""
    for name in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)  # GPU/TPU available, Tip, Initializing distributed, ...
    # Lightning 2.6 itself uses torch's deprecated LeafSpec: nothing a user of it can change
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    # about DataLoader workers that each iterate the whole dataset: each WindowLoader worker reads its own stream
    warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    quiet_lightning()
    if args.record:
        os.makedirs(args.record, exist_ok=True)
    dm = WindowDataModule(args.data, window=args.window, stride=args.stride or max(1, args.window // 2),
                          horizon=args.horizon, batch_size=args.batch_size, seed=args.seed,
                          shuffle_buffer=args.shuffle_buffer, num_workers=args.workers)
    torch.manual_seed(args.seed)
    model = LitForecaster(args.window, args.horizon, dm.features, args.hidden, args.lr, record=args.record)
    last = os.path.join(args.ckpt_dir, "last.ckpt")
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=int(args.devices) if args.devices.isdigit() else args.devices,
        num_nodes=args.num_nodes, strategy="ddp", max_epochs=args.epochs, max_steps=args.steps,
        use_distributed_sampler=False,  # streamwin shards the data per rank, with equal batch counts
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.ckpt_every,
                                                save_top_k=0, save_last=True),
                   Progress(args.log_every, args.stop_after, last)],
        logger=False, enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=args.log_every)
    resume = last if os.path.exists(last) else None
    if resume and trainer.is_global_zero:
        log.info("resuming from %s (model, optimizer, loops and every rank's data position)", resume)
    trainer.fit(model, datamodule=dm, ckpt_path=resume)
    if trainer.global_step == 0:  # not one optimizer step: say why instead of reporting success
        if trainer.is_global_zero:
            log.error("no step ran: %d batches per rank per epoch (window %d + horizon %d vs. the sequences' lengths, "
                      "batch size %d); use a smaller --window or --batch-size", dm.batches_per_rank(),
                      args.window, args.horizon, args.batch_size)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
