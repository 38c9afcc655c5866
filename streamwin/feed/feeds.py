"""The passes a WindowLoader runs: one epoch's batches, from this process or from worker processes.

A feed makes one pass's batches ready (``Feed.fill``) and ``Pass``, what ``iter(loader)`` returns,
hands them out, moving the loader's position (epoch, batches taken) by one per batch: the feed
gets the plan and the position when the pass begins. The kinds, the same batches bit for bit for
the same plan:

- ``LocalFeed``: the rank's one stream in this process; batches gathered into buffers
  reused once nothing refers to them (page-locked and fenced with ``pin_memory``).
- ``WorkerFeed``: round robin over worker processes' shared-memory slots (pool.py), every batch
  at hand taken in one go; a slot goes back to its worker once nothing refers to it and its
  queued CUDA copies are done.
- device feeds (device_feeds.py): blocks uploaded once, windows cut on the device.
"""
from __future__ import annotations

import itertools
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch

from streamwin.batch import PER_CROP, BatchKeys, BufferPool
from streamwin.dataset import WindowDataset
from streamwin.feed.pool import WorkerPool
from streamwin.feed.stats import STAT_FIELDS, RunStats, read_counters
from streamwin.pipeline import open_stream
from streamwin.plan.epoch import Plan
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

    The keys keep a copy of ``seq`` (and ``source``), a small one: keys kept alone (a log of them) must not pin
    the buffer, nor be overwritten with it. Packed rows: the per-crop fields cut to the batch's ``crops``."""
    if "crops" in views:
        n = int(views["crops"][0])
        views = {k: v[:n] if k in per_crop else v for k, v in views.items() if k != "crops"}
    out: dict[str, Any] = {k: torch.from_numpy(v) for k, v in views.items() if k != "seq"}
    source = views["source"].copy() if "source" in views else None
    out["key"] = BatchKeys(manifests=manifests, seq=views["seq"].copy(), source=source)
    return out


class Pass(itertools.chain):
    """What ``iter(loader)`` returns: the pass begins at the first ``next()``, and a batch costs no Python frame.

    Frameworks (Lightning) may call ``iter()`` more than once before iterating one of the
    results; the epoch, the position and the streams are settled when batches are asked for.
    After a training step the trainer's caches are cold and every Python call costs several
    microseconds, so ``next()`` is itertools.chain's, in C: it hands out the next batch of the
    run its feed made ready (``Feed.fill``: with workers, every batch they have ready, at once);
    only at a run's end does Python run (``_Runs``). The position counts the run's batches
    as they are handed out (``Position.taken``: those counted less the run's still at hand).
    """

    runs: "_Runs"
    length: Callable[[], int]

    @classmethod
    def of(cls, begin: Callable[[], "Feed"], length: Callable[[], int]) -> "Pass":
        """A pass whose feed ``begin()`` starts at the first ``next()``; ``len()`` is ``length()``."""
        runs = _Runs(begin)
        p = cls.from_iterable(runs)  # an instance of this class: chain's next(), in C
        p.runs, p.length = runs, length
        return p

    def __len__(self) -> int:
        return self.length()

    def at_hand(self) -> int:
        """Batches made ready and not yet handed out (the next ``next()`` calls take them, looking at nothing else)."""
        feed = self.runs.feed  # once closed, the position may be a later pass's
        at_hand = None if feed is None or feed.closed else feed.position.at_hand
        return 0 if at_hand is None else at_hand()


class _Runs:
    """A pass's runs of batches, for itertools.chain: the feed begins at the first, each is ``Feed.fill``'s."""

    def __init__(self, begin: Callable[[], "Feed"]):
        self.begin, self.feed = begin, None

    def __iter__(self) -> "_Runs":
        return self

    def __next__(self) -> Iterator[dict[str, Any]]:
        if self.feed is None:
            self.feed = self.begin()
        return self.feed.fill()


class Feed:
    """One pass over an epoch: batches made ready ahead (``fill``), handed out by a Pass, which moves the position."""

    def __init__(self, ctx: FeedContext, plan: Plan, position: Position):
        self.ctx, self.plan, self.position = ctx, plan, position
        self.offset = position.offset  # batches of the epoch taken before this plan began (elastic resume)
        self.total = self.offset + plan.batches_per_rank
        self.began = position.taken  # this pass's batches: position.taken - began
        self.manifests = ctx.dataset.manifests  # one per source (a mixed dataset's keys decode by source)
        self.ready: list = []  # the live run: batches made, handed out by its iterator (emptied when the pass closes)
        self.closed = False

    def fill(self) -> Iterator[dict[str, Any]]:
        """The next run: an iterator over at least one batch (waited for); StopIteration at the end of the pass, or
        once closed. The position counts the run's batches as its iterator hands them out.

        The time spent here is the data-wait (``loader.stats()["wait_s"]``).
        """
        left = self.total - self.position.taken
        if self.closed or left <= 0:
            if not self.closed:
                self.ctx.on_end()
            raise StopIteration
        t = time.perf_counter()
        self.ready = []
        try:
            self._fill(left)
        except BaseException:
            if self.ctx.on_error is not None:  # no worker of a failed pass waits for the next one
                self.ctx.on_error()
            raise
        run = iter(self.ready)
        pos = self.position
        pos.counted, pos.at_hand = pos.taken + len(self.ready), run.__length_hint__
        self.ctx.stats.wait_s += time.perf_counter() - t
        return run

    def _fill(self, left: int) -> None:
        """Make at least one and at most ``left`` batches ready (one, unless a feed has more at hand)."""
        self.ready.append(self._next())

    def _next(self) -> dict[str, Any]:
        raise NotImplementedError

    def batches(self) -> int:
        """Batches this pass has handed out."""
        return self.position.taken - self.began

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
        """Stop the pass's threads; its totals become the run's; batches made but not handed out are dropped."""
        self.drop_run()
        if not self.closed:
            self.ctx.stats.batches += self.batches()
        self.closed = True

    def drop_run(self) -> None:
        """The live run's batches not yet handed out are dropped, and not taken: its iterator hands out nothing more."""
        self.position.settle()
        self.ready.clear()


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
        pool.start(position.epoch, [plan.worker_taken(j, n, w) for w in range(n)], position.rest, plan.shared)

    def _fill(self, left: int) -> None:
        """Every batch the workers have ready, in order (at least one, waited for): one pass over the held slots
        and one release per fill, not per batch; no torch or numpy call for a batch whose slot's tensors are made."""
        pool, ready, n = self.pool, self.ready, self.ctx.num_workers
        j = self.first_batch()
        pool.recycle(send=True)  # the slots the training loop let go of, back to their workers at once
        worker_of = self.plan.worker_of
        while len(ready) < left:
            w = worker_of(j + len(ready), n)
            got = pool.hand_out(w, wait=not ready)
            if got is None:  # not ready yet (or the worker's slots are all held): hand out what is
                break
            slot, batch, held = got
            if batch is None:
                batch = to_batch(pool.fields(w, slot), self.manifests, self.layout.per_crop) if held else \
                    self._copy_out(w, slot)
            ready.append(batch)

    def _copy_out(self, w: int, slot: int) -> dict[str, Any]:
        """The batch of a slot not held (batches are being kept: the worker would run out), copied out of it."""
        self._warn_keep()
        buf = self.copies.get()
        np.copyto(buf, self.pool.bases[w][slot][: self.layout.nbytes])
        self.pool.release(w, slot)
        return to_batch(self.layout.views(buf), self.manifests, self.layout.per_crop)

    def _warn_keep(self) -> None:
        stats = self.ctx.stats
        if not stats.warned_keep:
            stats.warned_keep = True
            warnings.warn("streamwin: batches are being kept while iterating; to keep worker slots free, later "
                          "batches are copied out of shared memory (one extra copy each). Clone what you keep, or "
                          "drop batches you no longer need, to avoid the copy.", RuntimeWarning, stacklevel=6)

    def close(self) -> None:
        super().close()  # batches made, not handed out, are dropped: their slots are free
        self.pool.recycle()  # slots still held stay held, released by a later pass once dropped

