"""Device mode's passes: batches delivered on the device, never making the trainer wait for it.

- ``DeviceFeed`` (``num_workers=0``): the rank's one stream in this process; each source's
  read-ahead thread uploads its blocks once (its own Uploader, device.py), and the trainer's
  thread cuts each batch's windows on the device: a few kernel launches, no CPU gather on the
  thread that launches the model's kernels.
- ``WorkerDeviceFeed`` (workers): the workers gather batches into their page-locked slots as
  for CPU batches, and each batch goes to the device in one copy on a side stream
  (to_device.py); the slot goes back to its worker once that copy has completed.

Given ``fixed`` (static batches), both deliver every batch in those device tensors (to_device.Fixed).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from streamwin.feed.device import DeviceBlock, DeviceBytes, DeviceGatherer, Uploader
from streamwin.feed.device_fields import DeviceFields
from streamwin.feed.feeds import Feed, FeedContext
from streamwin.feed.stats import read_counters
from streamwin.feed.to_device import Fixed, ToDevice
from streamwin.pipeline import open_stream
from streamwin.plan.epoch import Plan
from streamwin.state import Position


def device_gatherer(ctx: FeedContext) -> DeviceGatherer:
    """The device gather of the context's dataset."""
    ds = ctx.dataset
    gather = ds.field_gather()
    fields = None if gather is None else DeviceFields(gather, [m.num_sequences for m in ds.manifests], ctx.device)
    return DeviceGatherer(ds.manifests, ds.spec, ctx.device, with_weight=ds.layout().has("weight"),
                          batch_size=ds.batch_size, pack_length=ds.pack_length, missing=ds.missing, fields=fields)


def device_totals(ctx: FeedContext, blocks: int, uploaded: int, peak: int, waits: int) -> dict[str, int]:
    """The run's device totals with a pass's: blocks and bytes uploaded, peak device bytes of blocks, and
    the times a thread of this process waited for the device (none in steady state)."""
    out = ctx.stats.add_device(blocks, uploaded, peak)
    out["device_waits"] = ctx.stats.device.get("device_waits", 0) + waits
    return out


class DeviceFeed(Feed):
    """The rank's one stream in this process, its blocks uploaded once and windows cut on the device."""

    def __init__(self, ctx: FeedContext, plan: Plan, position: Position, stream: int, fixed: Fixed | None = None):
        super().__init__(ctx, plan, position)
        self.counter = DeviceBytes()  # every source's uploads (a late upload on a read-ahead thread counts too)
        self._uploaders: dict[int, Uploader] = {}
        self.fixed = fixed
        self.stream = open_stream(ctx.dataset, plan, stream, self.first_batch(), lambda: None, prefetch=False,
                                  transform=self._upload, gatherer=device_gatherer(ctx))

    def _upload(self, block, source: int = 0) -> DeviceBlock:
        """On source ``source``'s read-ahead thread: upload a block (its Uploader is made there, where uploads run)."""
        up = self._uploaders.get(source)
        if up is None:
            up = self._uploaders[source] = Uploader(self.ctx.device, self.stream.readers[source], self.counter, source)
        return up(block)

    def _next(self) -> dict[str, Any]:
        batch = next(self.stream)
        return batch if self.fixed is None else self.fixed.put(batch)

    def read_counters(self) -> np.ndarray:
        if self.stream is None:
            return super().read_counters()
        return read_counters(self.stream.stats())

    def device_totals(self) -> dict[str, int]:
        if self.closed:
            return self.ctx.stats.device
        c = self.counter
        return device_totals(self.ctx, c.blocks, c.uploaded_bytes, c.peak_bytes, c.waits)

    def close(self) -> None:
        if self.stream is None:
            return
        self.stream.shutdown()
        self.ctx.stats.reads += self.read_counters()
        self.stream = None
        self.ctx.stats.device = self.device_totals()
        super().close()


class WorkerDeviceFeed(Feed):
    """Device mode with workers: batches from their page-locked slots, round robin, each in one copy to the device."""

    def __init__(self, ctx: FeedContext, plan: Plan, position: Position, fixed: Fixed | None = None):
        super().__init__(ctx, plan, position)
        n = ctx.num_workers
        self.pool = pool = ctx.pool
        self.copy = ToDevice(ctx.dataset.layout(), ctx.device, self.manifests, fixed=fixed, pinned=pool.pinned)
        j = self.first_batch()
        pool.start(position.epoch, [plan.worker_taken(j, n, w) for w in range(n)], position.rest, plan.shared)

    def _next(self) -> dict[str, Any]:
        pool = self.pool
        w = self.plan.worker_of(self.first_batch(), self.ctx.num_workers)
        pool.recycle()
        slot = pool.take(w)
        batch, done = self.copy(pool.bases[w][slot])
        if done is None:  # copied already (on the CPU)
            pool.release(w, slot)
        else:  # back to the worker once the copy has completed (pool.recycle asks the event, never waits)
            pool.hold(w, slot, done)
        return batch

    def device_totals(self) -> dict[str, int]:
        if self.closed:
            return self.ctx.stats.device
        return device_totals(self.ctx, 0, self.copy.copied_bytes, 0, self.copy.waits)

    def close(self) -> None:
        if self.closed:
            return
        self.copy.settle()  # the workers' memory may be unmapped next (workers that do not persist)
        self.pool.recycle()  # every copy is done: every slot goes back
        self.ctx.stats.device = self.device_totals()
        super().close()
