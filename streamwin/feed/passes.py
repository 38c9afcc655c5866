"""The passes a WindowLoader runs: one epoch's batches, from this process, workers or a device.

A pass is the one iterator that moves its loader's cursor (epoch, batches taken). Three
kinds, the same batches bit for bit for the same plan:

- ``LocalPass``: the rank's one stream in this process; batches gathered into buffers
  reused once nothing refers to them (page-locked and fenced with ``pin_memory``).
- ``WorkerPass``: round robin over worker processes' shared-memory slots (workers.py); a
  slot goes back to its worker once nothing refers to it and its queued CUDA copies are done.
- ``DevicePass``: blocks uploaded once by the read-ahead thread, windows cut on the device.
"""
from __future__ import annotations

import sys
import time
import warnings
from collections import deque
from typing import Any

import numpy as np
import torch
from torchdata.nodes import BaseNode

from streamwin.batch import BatchKeys, BufferPool
from streamwin.dataset import close_stream, open_stream
from streamwin.feed.device import TABLE_BYTES, DeviceBlock, DeviceBytes, DeviceGatherer, Uploader, device_block, table_at
from streamwin.nodes import Batcher, BlockReader, MixBatcher
from streamwin.plan.epoch import worker_batches
from streamwin.feed.workers import BLOCK, STAT_FIELDS

WindowLoader = Any  # the loader.WindowLoader driving a pass (it imports this module, not the other way)


def to_batch(views: dict[str, np.ndarray], manifests: list) -> dict[str, Any]:
    """Tensors over a batch buffer's field views, and keys decoded on first use (by source when mixed)."""
    out: dict[str, Any] = {k: torch.from_numpy(v) for k, v in views.items() if k != "seq"}
    if "source" in views:
        out["key"] = BatchKeys(manifest=manifests, seq=views["seq"].copy(), source=views["source"].copy())
    else:
        out["key"] = BatchKeys(manifest=manifests[0], seq=views["seq"].copy())
    return out


class PassIterator:
    """What ``iter(loader)`` returns: the pass begins at the first ``next()``.

    Frameworks (Lightning) may call ``iter()`` more than once before iterating one of the
    results; the epoch, the position and the streams are settled when batches are asked for.
    """

    def __init__(self, loader: WindowLoader):
        self.loader, self._pass = loader, None

    def __iter__(self) -> "PassIterator":
        return self

    def __next__(self) -> dict[str, Any]:
        if self._pass is None:
            self._pass = self.loader._begin()
        return next(self._pass)

    def __len__(self) -> int:
        return len(self.loader)


class Pass:
    """One pass over an epoch: an iterator of batches that keeps the loader's cursor."""

    def __init__(self, loader: WindowLoader, plan, world: tuple[int, int]):
        self.loader, self.plan, self.world = loader, plan, world
        self.offset = loader._offset()  # batches of the epoch taken before this plan began (elastic resume)
        self.total = self.offset + plan.batches_per_rank
        self.manifests = loader.dataset.manifests  # one per source (a mixed dataset's keys decode by source)
        self.device_bytes: DeviceBytes | None = None  # device modes: what this pass uploaded

    def __iter__(self) -> "Pass":
        return self

    def __len__(self) -> int:
        return self.total

    def __next__(self) -> dict[str, Any]:
        loader = self.loader
        if loader._pass is not self or loader._taken >= self.total:
            if loader._pass is self:
                loader.close_pass()
            raise StopIteration
        t = time.perf_counter()
        batch = self._next()
        loader._wait += time.perf_counter() - t
        loader._taken += 1
        loader._yielded += 1
        return batch

    def _next(self) -> dict[str, Any]:
        raise NotImplementedError

    def position(self) -> int:
        """Batches of this plan this rank has taken: the next one is batch ``position()`` of the plan."""
        return self.loader._taken - self.offset

    def local_stats(self) -> np.ndarray:
        return np.zeros(len(STAT_FIELDS), dtype=np.int64)

    def extra_stats(self) -> dict[str, Any]:
        """Run totals of device mode: this pass's uploads added to the earlier passes'."""
        before, counter = self.loader._device_stats, self.device_bytes
        if counter is None:
            return dict(before)
        return {"device_blocks": before.get("device_blocks", 0) + counter.blocks,
                "device_uploaded_bytes": before.get("device_uploaded_bytes", 0) + counter.uploaded_bytes,
                "device_peak_bytes": max(before.get("device_peak_bytes", 0), counter.peak_bytes)}

    def close(self) -> None:
        """Stop the pass's threads; its device totals become the loader's."""
        self.loader._device_stats = self.extra_stats()
        self.device_bytes = None


class LocalPass(Pass):
    """The rank's one stream, run in this process."""

    def __init__(self, loader: WindowLoader, plan, world: tuple[int, int]):
        super().__init__(loader, plan, world)
        ds = loader.dataset
        layout = ds.layout()
        pinned = _allocator(loader.pin_memory)
        self.buffers = BufferPool(layout.nbytes, allocate=pinned, fenced=pinned is not None)
        self.node, self.source = open_stream(ds, plan, world[0], self.position(), lambda: layout.views(self.buffers.get()))

    def _next(self) -> dict[str, Any]:
        return to_batch(next(self.node), self.manifests)

    def local_stats(self) -> np.ndarray:
        if self.source is None:
            return super().local_stats()
        s = self.source.stats
        return np.array([getattr(s, f) for f in STAT_FIELDS], dtype=np.int64)

    def close(self) -> None:
        if self.source is None:  # closed already
            return
        close_stream(self.node)
        self.loader._totals += self.local_stats()
        # let go of the stream: an iterator kept by the caller (or a reference cycle) must not keep its
        # last block, its read threads and its buffers until the garbage collector runs
        self.node = self.source = None
        super().close()


def _allocator(pin: bool):
    """Batch buffers in page-locked memory when asked for and CUDA is there, else plain."""
    if pin and torch.cuda.is_available():
        return lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True).numpy()
    return None


class WorkerPass(Pass):
    """Batches from worker processes' shared slots, round robin: batch j from worker j % N."""

    def __init__(self, loader: WindowLoader, plan, world: tuple[int, int]):
        super().__init__(loader, plan, world)
        n = loader.num_workers
        self.pool = pool = loader._worker_pool(world)
        self.layout = loader.dataset.layout()
        self.copies = BufferPool(self.layout.nbytes)  # pageable: a copy from it never outlives the call
        self.refs = 2  # references to a slot's array when nobody holds it: pool.bases and getrefcount's argument
        self.events = pool.pinned and torch.cuda.is_available()
        j = self.position()
        pool.start(loader._epoch, [worker_batches(j, n, w) for w in range(n)], loader._rest)

    def _next(self) -> dict[str, Any]:
        pool, n = self.pool, self.loader.num_workers
        w = self.position() % n
        self._recycle()
        slot = pool.take(w, self._recycle)
        held_by_user = sum(1 for h in pool.held if h[0] == w)
        if held_by_user >= pool.slot_layout.slots - 2:  # the worker would run out of slots: copy this one out
            self._warn_keep()
            buf = self.copies.get()
            np.copyto(buf, pool.bases[w][slot][: self.layout.nbytes])
            pool.release(w, slot)
        else:
            buf = pool.bases[w][slot]
            pool.held.append([w, slot, None])
        return to_batch(self.layout.views(buf), self.manifests)

    def _recycle(self) -> None:
        """Give back every slot no one holds any more (and whose queued CUDA copies are done)."""
        pool = self.pool
        if not pool.held:
            return
        bases, keep = pool.bases, []
        for h in pool.held:
            w, slot, event = h
            if event is None:
                if sys.getrefcount(bases[w][slot]) > self.refs:  # every view of a slot refers to its array
                    keep.append(h)
                    continue
                if self.events:  # a non_blocking copy from this slot may still be queued: wait for it
                    h[2] = event = torch.cuda.Event()
                    event.record()
            if event is not None and not event.query():
                keep.append(h)
                continue
            pool.release(w, slot)
        pool.held = keep

    def _warn_keep(self) -> None:
        if not self.loader._warned_keep:
            self.loader._warned_keep = True
            warnings.warn("streamwin: batches are being kept while iterating; to keep worker slots free, later "
                          "batches are copied out of shared memory (one extra copy each). Clone what you keep, or "
                          "drop batches you no longer need, to avoid the copy.", RuntimeWarning, stacklevel=4)

    def close(self) -> None:
        self._recycle()  # slots still held stay in pool.held, released by a later pass once dropped
        super().close()



class DevicePass(LocalPass):
    """The rank's one stream in this process, its blocks uploaded once and windows cut on the device.

    A mixed stream has one reader per source, each uploading on its own read-ahead thread with
    its own Uploader (which releases the CPU block to that source's reader).
    """

    def __init__(self, loader: WindowLoader, plan, world: tuple[int, int]):
        Pass.__init__(self, loader, plan, world)
        self.device_bytes = self._counter = DeviceBytes()  # every source's uploads (kept by uploads after close)
        self._uploaders: dict[int, Uploader] = {}
        self.node, self.source = open_stream(loader.dataset, plan, world[0], self.position(), None, prefetch=False,
                                             transform=self._upload, gatherer=_device_gatherer(loader))

    def _upload(self, block, source: int = 0) -> DeviceBlock:
        """On source ``source``'s read-ahead thread: upload a block (its Uploader is made there, where uploads run)."""
        up = self._uploaders.get(source)
        if up is None:
            shard_source = getattr(self.source, "sources", [self.source])[source]  # a mixed stream's SourceGroup
            up = self._uploaders[source] = Uploader(self.loader.device, shard_source, self._counter, source)
        return up(block)

    def _next(self) -> dict[str, Any]:
        return next(self.node)


def _device_gatherer(loader: WindowLoader) -> DeviceGatherer:
    ds = loader.dataset
    return DeviceGatherer(ds.manifest, ds.spec, loader.device, with_weight=ds.layout().has("weight"),
                          mixed=ds.manifests if ds.sources else None, batch_size=ds.batch_size)


class DeviceWorkerPass(WorkerPass):
    """Device mode with workers: they read blocks and send them in chunks; this process uploads
    each chunk as it arrives (from its page-locked slot, on a side stream) and cuts the windows
    on the device. Streams are batched round robin, as in WorkerPass; a mixed stream's blocks
    arrive in the order its MixBatcher reads them, each tagged with its source."""

    def __init__(self, loader: WindowLoader, plan, world: tuple[int, int]):
        Pass.__init__(self, loader, plan, world)
        ds, n = loader.dataset, loader.num_workers
        self.pool = pool = loader._worker_pool(world)
        self.device = loader.device
        self.cuda = self.device.type == "cuda"
        self.side = torch.cuda.Stream(self.device) if self.cuda else None
        self.device_bytes = DeviceBytes()
        plans = plan.plans if ds.sources else [plan]
        # blocks uploaded ahead per worker, counted in the order they are read: device memory stays bounded
        self.ahead = max(1, ds.readahead) * len(plans)
        gatherer = _device_gatherer(loader)
        self.inboxes = [Inbox(self, w, len(plans)) for w in range(n)]
        self.batchers: list[Batcher | MixBatcher] = []
        for w, inbox in enumerate(self.inboxes):
            readers = [RemoteBlocks(inbox, i, p, world[0] * n + w) for i, p in enumerate(plans)]
            self.batchers.append(MixBatcher(readers, plan.quotas, gatherer, lambda: None) if ds.sources
                                 else Batcher(readers[0], gatherer, lambda: None))
        first = [worker_batches(self.position(), n, w) for w in range(n)]
        for batcher, j in zip(self.batchers, first):
            batcher.reset({Batcher.BATCH_KEY: j})
        pool.start(loader._epoch, first, loader._rest)

    def _next(self) -> dict[str, Any]:
        self._recycle()
        for inbox in self.inboxes:  # take in what has arrived: uploads overlap the training step
            inbox.pump()
        return next(self.batchers[self.position() % self.loader.num_workers])

    def begin_block(self, nbytes: int, windows: int, source: int) -> dict[str, Any]:
        """A device buffer for a block of ``source`` about to arrive: its bytes, then its window table."""
        total = table_at(nbytes) + TABLE_BYTES * windows
        if self.cuda:
            with torch.cuda.stream(self.side):
                dev = torch.empty(total, dtype=torch.uint8, device=self.device)
        else:
            dev = torch.empty(total, dtype=torch.uint8, device=self.device)
        self.device_bytes.count(dev, total)
        return {"dev": dev, "nbytes": nbytes, "table": np.empty(TABLE_BYTES * windows, dtype=np.uint8), "got": 0,
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
            self.pool.held.append([w, slot, event])  # back to the worker once the copy is done
        else:
            dest.copy_(torch.from_numpy(src))
            self.pool.release(w, slot)
        block["got"] = got + k
        return block["got"] == tlen + block["nbytes"]


class Inbox:
    """Worker ``w``'s blocks as they arrive: each assembled on the device, then filed under its source."""

    def __init__(self, owner: DeviceWorkerPass, w: int, sources: int):
        self.owner, self.w = owner, w
        self.ready: list[deque] = [deque() for _ in range(sources)]
        self.partial: dict[str, Any] | None = None

    def take(self, source: int) -> DeviceBlock:
        """Source ``source``'s next block, waiting for it (blocks arrive in the order they are taken)."""
        while not self.ready[source]:
            self.pump(wait=True)
        return self.ready[source].popleft()

    def pump(self, wait: bool = False) -> None:
        """Upload what has arrived, up to ``owner.ahead`` blocks; with ``wait``, until one more whole block is in."""
        owner = self.owner
        while wait or self.partial is not None or sum(map(len, self.ready)) < owner.ahead:
            msg = owner.pool.receive(self.w, owner._recycle, wait=wait)
            if msg is None:
                return
            kind, a, b, c = msg
            if kind == BLOCK:
                self.partial = owner.begin_block(a, b, c)
            elif owner.add_chunk(self.partial, self.w, a, b):
                p, self.partial = self.partial, None
                self.ready[p["source"]].append(device_block(p["dev"], p["nbytes"], p["table"], p["ready"], p["source"]))
                if wait:
                    return


class RemoteBlocks(BaseNode):
    """Source ``source``'s blocks of a worker's stream, from its Inbox (the reader of a Batcher or MixBatcher)."""

    def __init__(self, inbox: Inbox, source: int, plan, stream: int):
        super().__init__()
        self.inbox, self.source, self.plan, self.stream = inbox, source, plan, stream
        self.k = 0

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
