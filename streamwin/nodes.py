"""The pipeline's torchdata.nodes stages: BlockReader (one per source) -> Batcher (-> torchdata's Prefetcher).

Every stage keeps the ``BaseNode`` contract: ``reset(state)``, ``next()``, ``get_state()``,
plus ``shutdown()``, which stops the threads it started. The states are cursors, never
payloads: the reader's is the next block index, the batcher's the number of batches it has
produced. Everything else (which windows, in which order, which bytes) is recomputed from the
plan, so a checkpoint is a few integers.

A block holds *items*: windows, or with ``pack_length`` rows of crops (the crop stage,
crop_stage.py, runs on the reader's read-ahead thread). The plan says how many items each block
holds (``SourcePlan.item_bounds``), so the batcher's cursor still locates a block and an item.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any, Callable

import numpy as np
from torchdata.nodes import BaseNode

from streamwin.crop_stage import cut, needs_cut, release_of
from streamwin.plan.schedule import Schedule
from streamwin.plan.streams import SourcePlan
from streamwin.read import Block, ShardReader


class BlockReader(BaseNode[Block]):
    """Yields the blocks of one source's stream, reading ``readahead`` blocks ahead (or more: see below).

    Each block is read in two steps on the reader's thread (ShardReader.thread: one thread, so
    they run in the order queued): ``start`` (its GETs sent, on remote storage) and ``finish``
    (its bytes in, checked, verified). The starts of the next blocks are queued before the
    finish of the one the batcher needs next, so their GETs are in flight while it waits and
    while it is batched. Beyond ``readahead`` blocks, the reader's ``ReadAhead``
    (read/ahead.py) says whether a stream may start more: on remote storage as many bytes as
    the batcher's rate and the latency measured need (Little's law), within
    ``readahead_bytes``. Once every block of the stream is started, it goes on with the first
    ``readahead`` blocks (at least one) of the stream ``then()`` names (the same stream of the
    next epoch), kept by the reader for that stream: an epoch's end is no barrier either.

    Where batches need crop lengths or packed rows, each block is cut into crops there too
    (crop_stage.cut): a CropBlock, whose ``len()`` is its items.
    """

    BLOCK_KEY = "block"

    def __init__(self, reader: ShardReader, plan: SourcePlan, stream: int, *, readahead: int = 1,
                 transform: Callable[[Block], Any] | None = None, blocks: list[int] | None = None,
                 then: Callable[[], tuple[SourcePlan, int, list[int] | None] | None] | None = None):
        super().__init__()
        self.reader, self.plan, self.stream, self.readahead = reader, plan, stream, readahead
        self.blocks = blocks  # the stream's blocks it reads, in order (a worker's chunks of packed rows); None: all
        self.transform = transform  # runs on the read-ahead thread (device mode: upload the block)
        self.then = then  # (plan, stream, blocks) of the stream to read after this one, or None
        self.cut = needs_cut(plan)
        self._started: dict[int, Future] = {}  # block -> its start (a StartedBlock), not yet to be finished
        self._pending: dict[int, Future] = {}  # block -> its finish (the Block)
        self._next = 0
        self._last = -1  # the last block started
        self._early = 0  # the blocks of the stream after this one started early
        self._taken_at: float | None = None

    @property
    def num_blocks(self) -> int:
        return self.plan.num_blocks(self.stream) if self.blocks is None else len(self.blocks)

    @property
    def bounds(self) -> np.ndarray:
        """[blocks + 1]: items (windows, or packed rows) of the stream before each block (of those it reads)."""
        bounds = self.plan.item_bounds(self.stream)
        if self.blocks is None:
            return bounds
        return np.concatenate([[0], np.cumsum(np.diff(bounds)[self.blocks])]).astype(np.int64)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._cancel()
        self._next = int(initial_state[self.BLOCK_KEY]) if initial_state is not None else 0
        self._last = self._next - 1
        self._taken_at: float | None = None  # when the last block was taken (the batcher's time on a block)

    def next(self) -> Block:
        k = self._next
        if k >= self.num_blocks:
            raise StopIteration
        if k not in self._pending:  # a stream's start: its first blocks alone, so the first batch has the store's
            self._start_ahead(k, further=False)  # bandwidth to itself; the rest once it is taken
            self._queue_finish(k)
        asked = time.perf_counter()
        block = self._pending.pop(k).result()
        read = release_of(block)
        self.reader.readahead.taken(0 if read is None else read.nbytes,
                                    None if self._taken_at is None else asked - self._taken_at)
        self._taken_at = time.perf_counter()
        self._next = k + 1
        self._start_ahead(k)  # while block k is batched
        self._queue_finish(k + 1)
        return block

    def _start_ahead(self, batching: int, further: bool = True) -> None:
        """Queue the starts of the blocks after the last one started: up to ``readahead`` past block ``batching``,
        and with ``further``, more while the read-ahead allows, then the next stream's first blocks."""
        n, ahead = self.num_blocks, self.reader.readahead
        while self._last + 1 < n and (self._last + 1 <= batching + self.readahead or further and ahead.may_start()):
            self._last += 1
            key = block_key(self.plan, self.stream, self._block(self._last))
            early = self.reader.started_early(key)  # started by the stream before this one (counted then)
            if early is None:
                early = self.reader.thread().submit(self._start, self._last)
                ahead.started()
            self._started[self._last] = early
        if further and self._last + 1 >= n and self.then is not None and ahead.may_start():
            self._start_next(ahead)

    def _start_next(self, ahead) -> None:
        """Start the first blocks of the stream after this one, as far as the read-ahead allows (kept by the reader)."""
        after = self.then()
        if after is None:
            return
        plan, stream, blocks = after
        n = min(plan.num_blocks(stream) if blocks is None else len(blocks), max(self.readahead, 1))  # what its
        while self._early < n and ahead.may_start():  # first batch waits for: the rest, once it is asked for
            block = self._early if blocks is None else blocks[self._early]
            self.reader.start_early(block_key(plan, stream, block), plan, stream, block)
            ahead.started()
            self._early += 1

    def _block(self, k: int) -> int:
        """The plan's block number of this reader's k-th block."""
        return k if self.blocks is None else self.blocks[k]

    def _queue_finish(self, k: int) -> None:
        """Queue the finish of block k, once its start is queued (it then runs after it, on the one read thread)."""
        if k in self._started:
            self._pending[k] = self.reader.thread().submit(self._finish, k, self._started.pop(k))

    def _start(self, k: int):
        return self.reader.start_block(self.plan, self.stream, self._block(k))

    def _finish(self, k: int, started: Future):
        block = self.reader.finish_block(started.result())  # done: started before, on this one thread
        if self.cut:
            block = cut(block, self.plan, self.stream, self._block(k), self.reader.manifest.step_bytes)
        return self.transform(block) if self.transform is not None else block

    def release(self, block) -> None:
        """Give a block's memory back once no batch needs it."""
        read = release_of(block)
        if read is not None:
            self.reader.release(read)

    def get_state(self) -> dict[str, Any]:
        return {self.BLOCK_KEY: self._next}

    def _cancel(self) -> None:
        for f in (*self._started.values(), *self._pending.values()):
            f.cancel()
        for f in self._started.values():  # started reads no one will finish: their GETs not yet sent are dropped
            if f.done() and not f.cancelled() and f.exception() is None:
                self.reader.cancel(f.result())
        self.reader.readahead.dropped(len(self._started) + len(self._pending))
        self._started.clear()
        self._pending.clear()

    def shutdown(self) -> None:
        """Drop the blocks queued and not read (a read in flight finishes on its own, on the reader's thread)."""
        self._cancel()


def block_key(plan: SourcePlan, stream: int, block: int) -> tuple:
    """What names a block of a plan whatever object holds the plan: its config, epoch, resumes, source, stream, block."""
    return plan.config, plan.epoch, plan.generation, plan.source, stream, block


class Batcher(BaseNode[dict]):
    """Cuts a process's blocks into batches as its schedule says: batch j takes so many items (windows, or
    packed rows) of each reader (a lane: one source's stream), grouped by source.

    The schedule (the plan's ``schedule(stream)``, plan/schedule.py) gives per batch the (lane,
    items) parts in batch order and the items of each source, the items a lane passes over
    first, and the items each lane has given before any batch. Without canonical streams a
    lane is a source (batch j takes ``quotas[j, i]`` of source i); with them, one of the
    process's canonical streams of a source (plan/canon.py). Each batch is gathered into the buffer
    ``next_buffer()`` hands out (its field views): a reused in-process array or a worker's
    shared-memory slot. The state is the batch count, so a reset seeks every reader to its
    block and offset (each reader's ``bounds``: items before each block).
    """

    BATCH_KEY = "batch"

    def __init__(self, readers: list[BaseNode], schedule: Schedule, gatherer,
                 next_buffer: Callable[[], dict[str, np.ndarray] | None]):
        super().__init__()
        self.readers, self.schedule = readers, schedule
        self.bounds = [reader.bounds for reader in readers]
        self.gatherer, self.next_buffer = gatherer, next_buffer
        self._batch = 0
        self._blocks: list[Any] = [None] * len(readers)
        self._pos = [0] * len(readers)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._batch = int(initial_state[self.BATCH_KEY]) if initial_state is not None else 0
        j = min(self._batch, self.schedule.batches)
        for i, (reader, item) in enumerate(zip(self.readers, self.schedule.positions(j))):
            k, self._pos[i] = locate(self.bounds[i], item)
            reader.reset({BlockReader.BLOCK_KEY: k})
            self._blocks[i] = None

    def next(self) -> dict:
        j = self._batch
        if j >= self.schedule.batches:
            raise StopIteration
        parts, done = [], []  # done: (reader, block) of the blocks this batch finished
        for i, n in self.schedule.skips(j):
            self._advance(i, n, [], done)  # rows another worker's chunk takes: passed over
        wanted, counts = self.schedule.parts(j)
        for i, need in wanted:
            self._advance(i, need, parts, done)
        self._batch += 1
        batch = self.gatherer.gather(parts, self.next_buffer(), counts)  # copies: no view of a block
        for reader, block in done:
            reader.release(block)
        return batch

    def _advance(self, i: int, n: int, parts: list, done: list) -> None:
        """Lane ``i``'s next ``n`` items into ``parts``; (reader, block) of each block they finish into ``done``."""
        reader, finished = self.readers[i], []
        self._blocks[i], self._pos[i] = _take(reader, self._blocks[i], self._pos[i], n, parts, finished)
        done += [(reader, block) for block in finished]

    def get_state(self) -> dict[str, Any]:
        return {self.BATCH_KEY: self._batch}

    def shutdown(self) -> None:
        """Stop every source's read-ahead thread."""
        for reader in self.readers:
            reader.shutdown()


def _take(reader: BaseNode, block: Any, pos: int, need: int, parts: list, done: list) -> tuple[Any, int]:
    """Append (block, lo, hi) parts of the reader's next ``need`` windows; finished blocks go to ``done``.

    ``block`` is the current block (None right after a reset, ``pos`` then being the offset
    in the first block read); returns the new (block, pos).
    """
    while need:
        if block is None:  # first block after reset: pos is the offset in it
            block = next(reader)
        elif pos >= len(block):
            done.append(block)
            block, pos = next(reader), 0
        take = min(need, len(block) - pos)
        if take:  # a block of no items (a packed block of no crops) adds no part
            parts.append((block, pos, pos + take))
        pos += take
        need -= take
    return block, pos


def locate(bounds: np.ndarray, item: int) -> tuple[int, int]:
    """(block, item within it) of a stream's item ``item``, given the items before each block (``bounds``).

    Blocks of no items are passed over: the block found holds the item (or it is the end).
    """
    k = int(np.searchsorted(bounds, item, side="right")) - 1
    return k, item - int(bounds[k])
