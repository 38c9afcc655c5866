"""Device mode's passes: each block's bytes go to the device once, and windows are cut there.

- ``DeviceFeed``: the rank's one stream in this process; each source's read-ahead thread
  uploads its blocks (its own Uploader, which gives the CPU block back to that source's reader).
- ``DeviceWorkerFeed``: workers read blocks and send them in chunks through their slots; this
  process uploads each chunk as it arrives (from its page-locked slot, on a side stream),
  files the finished block under its source (``Inbox``) and cuts the windows on the device.
  Streams are batched round robin, as with ``WorkerFeed``.
"""
from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import torch
from torchdata.nodes import BaseNode

from streamwin.feed.device import DeviceBlock, DeviceBytes, DeviceGatherer, Uploader, device_block, table_at
from streamwin.feed.feeds import Feed, FeedContext
from streamwin.feed.protocol import BLOCK
from streamwin.feed.stats import read_counters
from streamwin.nodes import BlockReader
from streamwin.packer import needs_cut
from streamwin.pipeline import batches_of, open_stream
from streamwin.plan.epoch import Plan
from streamwin.plan.streams import worker_batches
from streamwin.state import Position


def device_gatherer(ctx: FeedContext) -> DeviceGatherer:
    """The device gather of the context's dataset."""
    ds = ctx.dataset
    return DeviceGatherer(ds.manifests, ds.spec, ctx.device, with_weight=ds.layout().has("weight"),
                          batch_size=ds.batch_size, pack_length=ds.pack_length, missing=ds.missing)


class DeviceTotals:
    """What a device pass uploads, folded into the run totals when the pass closes."""

    def __init__(self, ctx: FeedContext):
        self.ctx, self.counter = ctx, DeviceBytes()

    def totals(self) -> dict[str, int]:
        c = self.counter
        return self.ctx.stats.add_device(c.blocks, c.uploaded_bytes, c.peak_bytes)

    def fold(self) -> None:
        self.ctx.stats.device = self.totals()


class DeviceFeed(Feed):
    """The rank's one stream in this process, its blocks uploaded once and windows cut on the device."""

    def __init__(self, ctx: FeedContext, plan: Plan, position: Position, stream: int):
        super().__init__(ctx, plan, position)
        self.uploads = DeviceTotals(ctx)  # every source's uploads (a late upload on a read-ahead thread counts too)
        self._uploaders: dict[int, Uploader] = {}
        self.stream = open_stream(ctx.dataset, plan, stream, self.first_batch(), lambda: None, prefetch=False,
                                  transform=self._upload, gatherer=device_gatherer(ctx))

    def _upload(self, block, source: int = 0) -> DeviceBlock:
        """On source ``source``'s read-ahead thread: upload a block (its Uploader is made there, where uploads run)."""
        up = self._uploaders.get(source)
        if up is None:
            up = self._uploaders[source] = Uploader(self.ctx.device, self.stream.readers[source], self.uploads.counter,
                                                    source)
        return up(block)

    def _next(self) -> dict[str, Any]:
        return next(self.stream)

    def read_counters(self) -> np.ndarray:
        if self.stream is None:
            return super().read_counters()
        return read_counters(self.stream.stats())

    def device_totals(self) -> dict[str, int]:
        return self.ctx.stats.device if self.closed else self.uploads.totals()

    def close(self) -> None:
        if self.stream is None:
            return
        self.stream.shutdown()
        self.ctx.stats.reads += self.read_counters()
        self.stream = None
        self.uploads.fold()
        super().close()


class DeviceWorkerFeed(Feed):
    """Device mode with workers: blocks arrive in chunks from the workers, batches are cut on the device."""

    def __init__(self, ctx: FeedContext, plan: Plan, position: Position, rank: int):
        super().__init__(ctx, plan, position)
        n = ctx.num_workers
        self.pool = pool = ctx.pool
        self.device = ctx.device
        self.cuda = self.device.type == "cuda"
        self.side = torch.cuda.Stream(self.device) if self.cuda else None
        self.uploads = DeviceTotals(ctx)
        sources = len(plan.sources)
        # blocks uploaded ahead per worker, counted in the order they are read: device memory stays bounded
        self.ahead = max(1, ctx.dataset.readahead) * sources
        gatherer = device_gatherer(ctx)
        self.crops = any(needs_cut(p) for p in plan.sources)  # blocks arrive with crop tables (packer.py)
        self.inboxes = [Inbox(self, w, sources) for w in range(n)]
        first = [worker_batches(self.first_batch(), n, w) for w in range(n)]
        self.batchers = [batches_of([RemoteBlocks(inbox, i, p, rank * n + w) for i, p in enumerate(plan.sources)],
                                    plan, gatherer, j) for w, (inbox, j) in enumerate(zip(self.inboxes, first))]
        pool.start(position.epoch, first, position.rest)

    def _next(self) -> dict[str, Any]:
        self.pool.recycle()
        for inbox in self.inboxes:  # take in what has arrived: uploads overlap the training step
            inbox.pump()
        return next(self.batchers[self.first_batch() % self.ctx.num_workers])

    def begin_block(self, nbytes: int, table_bytes: int, source: int) -> dict[str, Any]:
        """A device buffer for a block of ``source`` about to arrive: its bytes, then its window table."""
        total = table_at(nbytes) + table_bytes
        if self.cuda:
            with torch.cuda.stream(self.side):
                dev = torch.empty(total, dtype=torch.uint8, device=self.device)
        else:
            dev = torch.empty(total, dtype=torch.uint8, device=self.device)
        self.uploads.counter.count(dev, total)
        return {"dev": dev, "nbytes": nbytes, "table": np.empty(table_bytes, dtype=np.uint8), "got": 0,
                "ready": None, "source": source}

    def add_chunk(self, block: dict[str, Any], w: int, slot: int, k: int) -> bool:
        """Upload one chunk (the table comes first, then the bytes); True when the block is complete."""
        src, got, tlen = self.pool.bases[w][slot][:k], block["got"], len(block["table"])
        if got < tlen:
            block["table"][got : got + k] = src
            at = table_at(block["nbytes"]) + got
        else:
            at = got - tlen
        dest = block["dev"][at : at + k]
        if self.cuda:
            with torch.cuda.stream(self.side):
                dest.copy_(torch.from_numpy(src), non_blocking=True)
                block["ready"] = event = torch.cuda.Event()
                event.record(self.side)
            self.pool.hold(w, slot, event)  # back to the worker once the copy is done
        else:
            dest.copy_(torch.from_numpy(src))
            self.pool.release(w, slot)
        block["got"] = got + k
        return block["got"] == tlen + block["nbytes"]

    def device_totals(self) -> dict[str, int]:
        return self.ctx.stats.device if self.closed else self.uploads.totals()

    def close(self) -> None:
        if self.closed:
            return
        self.pool.recycle()  # slots still held stay held, released by a later pass once dropped
        self.uploads.fold()
        super().close()


class Inbox:
    """Worker ``w``'s blocks as they arrive: each assembled on the device, then filed under its source."""

    def __init__(self, feed: DeviceWorkerFeed, w: int, sources: int):
        self.feed, self.w = feed, w
        self.ready: list[deque] = [deque() for _ in range(sources)]
        self.partial: dict[str, Any] | None = None

    def take(self, source: int) -> DeviceBlock:
        """Source ``source``'s next block, waiting for it (blocks arrive in the order they are taken)."""
        while not self.ready[source]:
            self.pump(wait=True)
        return self.ready[source].popleft()

    def pump(self, wait: bool = False) -> None:
        """Upload what has arrived, up to ``feed.ahead`` blocks; with ``wait``, until one more whole block is in."""
        feed = self.feed
        while wait or self.partial is not None or sum(map(len, self.ready)) < feed.ahead:
            msg = feed.pool.receive(self.w, wait=wait)
            if msg is None:
                return
            kind, a, b, c = msg
            if kind == BLOCK:
                self.partial = feed.begin_block(a, b, c)
            elif feed.add_chunk(self.partial, self.w, a, b):
                p, self.partial = self.partial, None
                self.ready[p["source"]].append(device_block(p["dev"], p["nbytes"], p["table"], p["ready"], p["source"],
                                                            crops=feed.crops))
                if wait:
                    return


class RemoteBlocks(BaseNode):
    """Source ``source``'s blocks of a worker's stream, from its Inbox (a reader of the Batcher)."""

    def __init__(self, inbox: Inbox, source: int, plan, stream: int):
        super().__init__()
        self.inbox, self.source, self.plan, self.stream = inbox, source, plan, stream
        self.k = 0

    @property
    def bounds(self) -> np.ndarray:
        """[blocks + 1]: items (windows, or packed rows) of the stream before each block."""
        return self.plan.item_bounds(self.stream)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.k = int(initial_state[BlockReader.BLOCK_KEY]) if initial_state else 0
        self.inbox.ready[self.source].clear()

    def next(self) -> DeviceBlock:
        if self.k >= self.plan.num_blocks(self.stream):
            raise StopIteration
        self.k += 1
        return self.inbox.take(self.source)

    def release(self, block) -> None:
        pass  # the device buffer goes when its last batch does

    def get_state(self) -> dict[str, Any]:
        return {BlockReader.BLOCK_KEY: self.k}

    def shutdown(self) -> None:
        pass  # nothing of its own runs: the worker reads
