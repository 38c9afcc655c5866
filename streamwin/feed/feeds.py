"""The passes a WindowLoader runs: one epoch's batches, from this process or from worker processes.

A feed is the one iterator that moves its loader's position (epoch, batches taken): it gets
the plan and the position when the pass begins and advances the position by one per batch it
hands out. The kinds, the same batches bit for bit for the same plan:

- ``LocalFeed``: the rank's one stream in this process; batches gathered into buffers
  reused once nothing refers to them (page-locked and fenced with ``pin_memory``).
- ``WorkerFeed``: round robin over worker processes' shared-memory slots (pool.py); a
  slot goes back to its worker once nothing refers to it and its queued CUDA copies are done.
- device feeds (device_feeds.py): blocks uploaded once, windows cut on the device.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from streamwin.batch import PER_CROP, BatchKeys, BufferPool
from streamwin.dataset import WindowDataset
from streamwin.feed.pool import WorkerPool
from streamwin.feed.stats import STAT_FIELDS, RunStats, read_counters
from streamwin.pipeline import open_stream
from streamwin.plan.epoch import Plan
from streamwin.plan.streams import worker_batches
from streamwin.state import Position


@dataclass
class FeedContext:
    """What a pass needs from its loader: the dataset, how to deliver, the run totals, and the pool."""

    dataset: WindowDataset
    stats: RunStats
    on_end: Callable[[], None]  # the loader ends the pass (and stops workers that do not persist)
    pool: WorkerPool | None = None
    device: torch.device | None = None
    pin_memory: bool = False
    num_workers: int = 0
    on_error: Callable[[], None] | None = None  # a pass that raised: the loader stops it and its workers


def to_batch(views: dict[str, np.ndarray], manifests: list, per_crop: tuple[str, ...] = PER_CROP) -> dict[str, Any]:
    """Tensors over a batch buffer's field views, and keys decoded on first use (by source when mixed).

    The keys keep a copy of ``seq`` (and ``source``), ~1 us: keys kept alone (a log of them) must not pin
    the buffer, nor be overwritten with it. Packed rows: the per-crop fields cut to the batch's ``crops``."""
    if "crops" in views:
        n = int(views["crops"][0])
        views = {k: v[:n] if k in per_crop else v for k, v in views.items() if k != "crops"}
    out: dict[str, Any] = {k: torch.from_numpy(v) for k, v in views.items() if k != "seq"}
    source = views["source"].copy() if "source" in views else None
    out["key"] = BatchKeys(manifests=manifests, seq=views["seq"].copy(), source=source)
    return out


class Feed:
    """One pass over an epoch: an iterator of batches that moves the position."""

    def __init__(self, ctx: FeedContext, plan: Plan, position: Position):
        self.ctx, self.plan, self.position = ctx, plan, position
        self.offset = position.offset  # batches of the epoch taken before this plan began (elastic resume)
        self.total = self.offset + plan.batches_per_rank
        self.manifests = ctx.dataset.manifests  # one per source (a mixed dataset's keys decode by source)
        self.closed = False

    def __iter__(self) -> "Feed":
        return self

    def __len__(self) -> int:
        return self.total

    def __next__(self) -> dict[str, Any]:
        if self.closed or self.position.taken >= self.total:
            if not self.closed:
                self.ctx.on_end()
            raise StopIteration
        t = time.perf_counter()
        try:
            batch = self._next()
        except BaseException:
            if self.ctx.on_error is not None:  # no worker of a failed pass waits for the next one
                self.ctx.on_error()
            raise
        stats = self.ctx.stats
        stats.wait_s += time.perf_counter() - t
        stats.batches += 1
        self.position.taken += 1
        return batch

    def _next(self) -> dict[str, Any]:
        raise NotImplementedError

    def first_batch(self) -> int:
        """Batches of this plan this rank has taken: the next one is batch ``first_batch()`` of the plan."""
        return self.position.taken - self.offset

    def read_counters(self) -> np.ndarray:
        """Read counters of this pass not yet in the run totals (those of in-process streams)."""
        return np.zeros(len(STAT_FIELDS), dtype=np.int64)

    def device_totals(self) -> dict[str, int]:
        """The run's device totals with this pass's uploads (device feeds only)."""
        return dict(self.ctx.stats.device)

    def close(self) -> None:
        """Stop the pass's threads; its totals become the run's."""
        self.closed = True


def pinned_allocator(pin: bool):
    """Batch buffers in page-locked memory when asked for and CUDA is there, else plain."""
    if pin and torch.cuda.is_available():
        return lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True).numpy()
    return None


class LocalFeed(Feed):
    """The rank's one stream, run in this process."""

    def __init__(self, ctx: FeedContext, plan: Plan, position: Position, stream: int):
        super().__init__(ctx, plan, position)
        layout = ctx.dataset.layout()
        pinned = pinned_allocator(ctx.pin_memory)
        self.buffers = BufferPool(layout.nbytes, allocate=pinned, fenced=pinned is not None)
        self.stream = open_stream(ctx.dataset, plan, stream, self.first_batch(),
                                  lambda: layout.views(self.buffers.get()))
        self.per_crop = layout.per_crop

    def _next(self) -> dict[str, Any]:
        return to_batch(next(self.stream), self.manifests, self.per_crop)

    def read_counters(self) -> np.ndarray:
        if self.stream is None:
            return super().read_counters()
        return read_counters(self.stream.stats())

    def close(self) -> None:
        if self.stream is None:  # closed already
            return
        self.stream.shutdown()
        self.ctx.stats.reads += self.read_counters()
        # let go of the stream: an iterator kept by the caller (or a reference cycle) must not keep its
        # last block, its read threads and its buffers until the garbage collector runs
        self.stream = None
        super().close()


class WorkerFeed(Feed):
    """Batches from worker processes' shared slots, round robin: batch j from worker j % N."""

    def __init__(self, ctx: FeedContext, plan: Plan, position: Position):
        super().__init__(ctx, plan, position)
        n = ctx.num_workers
        self.pool = pool = ctx.pool
        self.layout = ctx.dataset.layout()
        self.copies = BufferPool(self.layout.nbytes)  # pageable: a copy from it never outlives the call
        j = self.first_batch()
        pool.start(position.epoch, [worker_batches(j, n, w) for w in range(n)], position.rest)

    def _next(self) -> dict[str, Any]:
        pool = self.pool
        w = (self.position.taken - self.offset) % self.ctx.num_workers  # first_batch() % workers, one call fewer
        slot, batch, held = pool.hand_out(w)
        if batch is not None:  # the slot's tensors, made once: no torch or numpy call here
            return batch
        if held:  # packed rows: per-crop fields cut to this batch's crops
            return to_batch(pool.fields(w, slot), self.manifests, self.layout.per_crop)
        self._warn_keep()  # the worker would run out of slots: copy this one
        buf = self.copies.get()
        np.copyto(buf, pool.bases[w][slot][: self.layout.nbytes])
        pool.release(w, slot)
        return to_batch(self.layout.views(buf), self.manifests, self.layout.per_crop)

    def _warn_keep(self) -> None:
        stats = self.ctx.stats
        if not stats.warned_keep:
            stats.warned_keep = True
            warnings.warn("streamwin: batches are being kept while iterating; to keep worker slots free, later "
                          "batches are copied out of shared memory (one extra copy each). Clone what you keep, or "
                          "drop batches you no longer need, to avoid the copy.", RuntimeWarning, stacklevel=5)

    def close(self) -> None:
        self.pool.recycle()  # slots still held stay held, released by a later pass once dropped
        super().close()

