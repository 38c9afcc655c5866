"""How far a process reads ahead of the blocks it batches: enough bytes in flight for the latency it sees.

Reading from local disk, a block is mapped in microseconds and one block ahead is plenty.
From object storage each GET waits a round trip before its first byte, so the next blocks'
GETs must be in flight while this one is batched: by Little's law, the bytes in flight must
be the rate the batcher takes them times the time a block takes to arrive. Neither is
known in advance, and both move (a server slows, a trainer's step changes), so the loader
measures them where they meet: each time the batcher has to wait for a block, it asks for
as many more blocks ahead as the wait was long in blocks batched (the wait over the time it
spent batching the previous block), and after SETTLE blocks in a row that it did not wait
for, one block fewer. Beyond the ``readahead`` blocks each stream always reads ahead, never
more than ``limit`` bytes are read ahead (``readahead_bytes``).
"""
from __future__ import annotations

import math
import threading

WAITED = 1e-3  # a wait for a block longer than this (seconds) says the read-ahead is short
SETTLE = 32  # blocks taken in a row without a wait before the read-ahead gives one block back
LIMIT_BYTES = 256 << 20  # the default bound on bytes read ahead per source and process (readahead_bytes)


class ReadAhead:
    """The read-ahead of one source's streams in one process (see the module docstring).

    Args:
        limit: bytes its streams may have read ahead (started, not yet taken), beyond the blocks each
            always reads ahead.
        adaptive: read more ahead while the batcher waits (remote storage); False: never more.
    """

    def __init__(self, limit: int = LIMIT_BYTES, adaptive: bool = True):
        self.limit, self.adaptive = limit, adaptive
        self.want = 0.0  # bytes to hold ahead, grown by waits (within limit)
        self.blocks = 0  # blocks started and not yet taken, of all streams
        self.block_bytes = 0.0  # a block's bytes, on average (of the last few taken)
        self.calm = 0  # blocks taken in a row without a wait
        self.peak_bytes = 0.0  # the most bytes held ahead at once (as estimated when blocks start)
        self.waits = 0  # blocks the batcher waited for
        self._lock = threading.Lock()

    def may_start(self) -> bool:
        """Whether a stream may start one more block than it always reads ahead."""
        if not self.adaptive:
            return False
        with self._lock:
            return 0 < (self.blocks + 1) * self.block_bytes <= min(self.want, self.limit)

    def started(self) -> None:
        """A block was started."""
        with self._lock:
            self.blocks += 1
            self.peak_bytes = max(self.peak_bytes, self.blocks * self.block_bytes)

    def dropped(self, count: int) -> None:
        """``count`` started blocks will not be taken (a reset or shutdown)."""
        with self._lock:
            self.blocks = max(0, self.blocks - count)

    def taken(self, nbytes: int, waited: float, batched: float) -> None:
        """A block of ``nbytes`` was taken after the batcher waited ``waited`` s for it, having spent ``batched`` s
        on the block before: grow the read-ahead by the blocks the wait lasted, or settle."""
        with self._lock:
            self.blocks = max(0, self.blocks - 1)
            self.block_bytes = nbytes if not self.block_bytes else 0.75 * self.block_bytes + 0.25 * nbytes
            if waited > WAITED:
                self.waits += 1
                self.calm = 0
                more = math.ceil(waited / max(batched, WAITED))
                self.want = min(self.limit, max(self.want, self.blocks * self.block_bytes) + more * self.block_bytes)
            else:
                self.calm += 1
                if self.calm >= SETTLE:
                    self.calm = 0
                    self.want = max(0.0, self.want - self.block_bytes)
