"""The pipeline's torchdata.nodes stages: BlockReader -> Batcher (-> Prefetcher).

Both states are cursors, never payloads: the reader's is the next block index, the
batcher's the number of batches it has produced. Everything else (which windows, in which
order, which bytes) is recomputed from the plan, so a checkpoint is a few integers.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
from torchdata.nodes import BaseNode

from streamwin.batch import Gatherer
from streamwin.plan.mix import quota_positions
from streamwin.plan.epoch import Plan
from streamwin.read import Block, ShardReader


class BlockReader(BaseNode[Block]):
    """Yields the blocks of one stream, reading ``readahead`` blocks ahead on a thread."""

    BLOCK_KEY = "block"

    def __init__(self, source: ShardReader, plan: Plan, stream: int, *, readahead: int = 1,
                 transform: Callable[[Block], Any] | None = None):
        super().__init__()
        self.source, self.plan, self.stream, self.readahead = source, plan, stream, readahead
        self.transform = transform  # runs on the read-ahead thread (device mode: upload the block)
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[int, Future] = {}
        self._next = 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._cancel()
        self._next = int(initial_state[self.BLOCK_KEY]) if initial_state is not None else 0

    def next(self) -> Block:
        n = self.plan.num_blocks(self.stream)
        k = self._next
        if k >= n:
            raise StopIteration
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamwin-read")
        for j in range(k, min(k + 1 + self.readahead, n)):
            if j not in self._pending:
                self._pending[j] = self._pool.submit(self._read, j)
        block = self._pending.pop(k).result()
        self._next = k + 1
        return block

    def _read(self, k: int):
        block = self.source.read_block(self.plan, self.stream, k)
        return self.transform(block) if self.transform is not None else block

    def release(self, block) -> None:
        """Give a block's memory back once no batch needs it."""
        if isinstance(block, Block):
            self.source.release(block)

    def get_state(self) -> dict[str, Any]:
        return {self.BLOCK_KEY: self._next}

    def _cancel(self) -> None:
        for f in self._pending.values():
            f.cancel()
        self._pending.clear()

    def close(self) -> None:
        self._cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


class Batcher(BaseNode[dict]):
    """Cuts a stream's blocks into exactly ``plan.batches_per_stream`` batches.

    Each batch is gathered into the buffer ``next_buffer()`` hands out (its field views): a
    reused in-process array or a worker's shared-memory slot.
    """

    BATCH_KEY = "batch"

    def __init__(self, reader: BlockReader, gatherer: Gatherer, next_buffer: Callable[[], dict[str, np.ndarray]]):
        super().__init__()
        self.reader, self.gatherer, self.next_buffer = reader, gatherer, next_buffer
        self.plan = reader.plan
        self._batch = 0
        self._block: Block | None = None
        self._pos = 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._batch = int(initial_state[self.BATCH_KEY]) if initial_state is not None else 0
        first = self._batch * self.plan.config.batch_size
        k, self._pos = divmod(first, self.plan.config.block_windows)
        self.reader.reset({BlockReader.BLOCK_KEY: k})
        self._block = None

    def next(self) -> dict:
        if self._batch >= self.plan.batches_per_stream:
            raise StopIteration
        parts, done = [], []
        self._block, self._pos = _take(self.reader, self._block, self._pos, self.plan.config.batch_size, parts, done)
        self._batch += 1
        batch = self.gatherer.gather(parts, self.next_buffer())  # copies: no field is a view of a block buffer
        for block in done:
            self.reader.release(block)
        return batch

    def get_state(self) -> dict[str, Any]:
        return {self.BATCH_KEY: self._batch}

    def close(self) -> None:
        """Stop the reader's read-ahead thread."""
        self.reader.close()


def _take(reader: BaseNode, block: Block | None, pos: int, need: int, parts: list, done: list) -> tuple[Block | None, int]:
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
        parts.append((block, pos, pos + take))
        pos += take
        need -= take
    return block, pos


class MixBatcher(BaseNode[dict]):
    """A mixed dataset's stream: batch j takes ``quotas[j, i]`` windows from source i's reader, rows grouped by source.

    The state is the batch count, as for ``Batcher``: source i's position at batch j is
    ``quotas[:j, i].sum()``, so a reset seeks every reader to its block and offset.
    """

    BATCH_KEY = Batcher.BATCH_KEY

    def __init__(self, readers: list[BlockReader], quotas: np.ndarray, gatherer: Gatherer,
                 next_buffer: Callable[[], dict[str, np.ndarray]]):
        super().__init__()
        self.readers, self.quotas, self.gatherer, self.next_buffer = readers, quotas, gatherer, next_buffer
        self.cum = quota_positions(quotas)
        self._batch = 0
        self._blocks: list[Block | None] = [None] * len(readers)
        self._pos = [0] * len(readers)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._batch = int(initial_state[self.BATCH_KEY]) if initial_state is not None else 0
        j = min(self._batch, len(self.quotas))
        for i, reader in enumerate(self.readers):
            k, self._pos[i] = divmod(int(self.cum[j, i]), reader.plan.config.block_windows)
            reader.reset({BlockReader.BLOCK_KEY: k})
            self._blocks[i] = None

    def next(self) -> dict:
        j = self._batch
        if j >= len(self.quotas):
            raise StopIteration
        parts, done = [], []  # done: (reader, block) of the blocks this batch finished
        for i, reader in enumerate(self.readers):
            need, finished = int(self.quotas[j, i]), []
            if need:
                self._blocks[i], self._pos[i] = _take(reader, self._blocks[i], self._pos[i], need, parts, finished)
            done += [(reader, block) for block in finished]
        self._batch += 1
        batch = self.gatherer.gather(parts, self.next_buffer())  # copies: no field is a view of a block buffer
        if isinstance(batch["source"], np.ndarray):  # the CPU gather leaves it; the device one cuts it from block tags
            batch["source"][:] = np.repeat(np.arange(len(self.readers), dtype=np.int64), self.quotas[j])
        for reader, block in done:
            reader.release(block)
        return batch

    def get_state(self) -> dict[str, Any]:
        return {self.BATCH_KEY: self._batch}

    def close(self) -> None:
        """Stop every source's read-ahead thread."""
        for reader in self.readers:
            reader.close()


def block_order(quotas: np.ndarray, block_windows: int, first_batch: int) -> np.ndarray:
    """(source, block) rows: the blocks a MixBatcher reset to ``first_batch`` reads, in the order it reads them.

    Block k of source i is read by the first batch whose windows of source i reach past
    max(k * block_windows, the source's position at ``first_batch``); in one batch, sources go
    in order, as its parts do. A device worker sends its blocks in this order, so the trainer
    never waits for a block behind blocks it needs only later. One source: quotas [J, 1] of B.
    """
    cum = quota_positions(quotas)
    j0 = min(first_batch, len(quotas))
    rows = [np.zeros((0, 3), dtype=np.int64)]
    for i in range(quotas.shape[1]):
        pos, end = int(cum[j0, i]), int(cum[-1, i])
        if pos >= end:
            continue
        k = np.arange(pos // block_windows, -(-end // block_windows), dtype=np.int64)
        need = np.searchsorted(cum[:, i], np.maximum(k * block_windows, pos), side="right") - 1
        rows.append(np.stack([need, np.full(len(k), i), k], axis=1))
    rows = np.concatenate(rows)
    return rows[np.lexsort((rows[:, 2], rows[:, 1], rows[:, 0]))][:, 1:]


class ShipOrder:
    """A device worker's blocks of every source, as (source, block), in the order its stream's batcher reads them."""

    def __init__(self, readers: list[BlockReader], quotas: np.ndarray, first_batch: int):
        self.readers = readers
        self.order = block_order(quotas, readers[0].plan.config.block_windows, first_batch)
        for i, reader in enumerate(readers):
            mine = self.order[self.order[:, 0] == i, 1]
            reader.reset({BlockReader.BLOCK_KEY: int(mine[0]) if len(mine) else reader.plan.num_blocks(reader.stream)})

    def __iter__(self):
        for i, _ in self.order:
            yield int(i), next(self.readers[i])

    def release(self, source: int, block: Block) -> None:
        self.readers[source].release(block)

    def close(self) -> None:
        """Stop every source's read-ahead thread."""
        for reader in self.readers:
            reader.close()


class ThreadPrefetcher(BaseNode[dict]):
    """Runs its source on a background thread, ``depth`` items ahead.

    numpy's copies release the GIL, so gathering the next batch overlaps the training step
    in the same process at no IPC cost. The state is the source's state *as consumed*: the
    number of batches handed out, not the number produced ahead.
    """

    def __init__(self, source: "Batcher | MixBatcher", depth: int = 2):
        super().__init__()
        self.source, self.depth = source, depth
        self._queue = None
        self._thread = None
        self._stop = None
        self._consumed = 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.close()
        self.source.reset(initial_state)
        self._consumed = int(initial_state[Batcher.BATCH_KEY]) if initial_state is not None else 0
        import queue
        import threading

        self._queue = queue.Queue(maxsize=self.depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(self._queue, self._stop), daemon=True,
                                        name="streamwin-prefetch")
        self._thread.start()

    def _run(self, q, stop) -> None:
        try:
            for item in self.source:
                while not stop.is_set():
                    try:
                        q.put((item, None), timeout=0.1)
                        break
                    except Exception:  # queue.Full
                        continue
                if stop.is_set():
                    return
            q.put((None, StopIteration()))
        except BaseException as e:  # hand errors to the consumer, in order
            q.put((None, e))

    def next(self) -> dict:
        item, err = self._queue.get()
        if err is not None:
            self._queue.put((None, err))  # stay exhausted / failed on later calls
            raise err
        self._consumed += 1
        return item

    def get_state(self) -> dict[str, Any]:
        return {Batcher.BATCH_KEY: self._consumed}

    def close(self) -> None:
        if self._stop is not None:
            self._stop.set()
            try:
                while True:
                    self._queue.get_nowait()
            except Exception:
                pass
            self._thread.join(timeout=5)
            self._stop = None
        self.source.close()
