"""How far a process reads ahead of the blocks it batches: enough bytes in flight for the latency it sees.

Reading from local disk, a block is mapped in microseconds and one block ahead is plenty.
From object storage each GET waits a round trip before its first byte, so the next blocks'
GETs must be in flight while this one is batched. By Little's law the bytes in flight that
keep a rate R flowing over a latency L are R x L. The loader measures both where it reads:
L, the time from a GET's request to its first byte (the transport's), and R, the bytes its
GETs delivered per second between two blocks taken (as much as the batcher took, or as
much as the store gave, whichever was less). It keeps MARGIN x R x L bytes read ahead
beyond the block it started, so a rate that could grow is not held down by the read-ahead
(as a TCP window grows while its round trips fill), within ``limit`` bytes
(``readahead_bytes``) beyond the ``readahead`` blocks each stream always reads ahead.
A store with no latency to hide (local files, the node cache) is never read further ahead.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

LIMIT_BYTES = 256 << 20  # the default bound on bytes read ahead per source and process (readahead_bytes)
MARGIN = 2.0  # bytes read ahead, in rate x latency: twice what the rate seen needs, so it can grow
SMOOTH = 0.5  # weight of the newest measure of the rate (an exponential moving average)


class ReadAhead:
    """The read-ahead of one source's streams in one process (see the module docstring).

    Args:
        limit: bytes its streams may have read ahead (started, not yet taken), beyond the blocks each
            always reads ahead.
        measure: the transport's (bytes it has delivered, latency to a GET's first byte in seconds), or
            None: a store with no latency to hide, read no further ahead.
    """

    def __init__(self, limit: int = LIMIT_BYTES, measure: Callable[[], tuple[int, float]] | None = None):
        self.limit, self.measure = limit, measure
        self.want = 0.0  # bytes to hold ahead: MARGIN x rate x latency, and a block
        self.rate = 0.0  # bytes/s delivered, smoothed
        self.blocks = 0  # blocks started and not yet taken, of all streams
        self.block_bytes = 0.0  # a block's bytes, on average (of the last few taken)
        self.peak_bytes = 0.0  # the most bytes held ahead at once (as estimated when blocks start)
        self._seen: tuple[int, float] | None = None  # (bytes delivered, when) at the last block taken
        self._lock = threading.Lock()

    def may_start(self) -> bool:
        """Whether a stream may start one more block than it always reads ahead."""
        if self.measure is None:
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

    def taken(self, nbytes: int) -> None:
        """A block of ``nbytes`` was taken: measure the rate and latency, and set how far to read ahead."""
        with self._lock:
            self.blocks = max(0, self.blocks - 1)
            self.block_bytes = nbytes if not self.block_bytes else (1 - SMOOTH) * self.block_bytes + SMOOTH * nbytes
            if self.measure is None:
                return
            delivered, latency = self.measure()
            now = time.perf_counter()
            if self._seen is not None and now > self._seen[1]:
                rate = (delivered - self._seen[0]) / (now - self._seen[1])
                self.rate = rate if not self.rate else (1 - SMOOTH) * self.rate + SMOOTH * rate
            self._seen = (delivered, now)
            self.want = MARGIN * self.rate * latency + self.block_bytes

    def restart(self) -> None:
        """A stream starts anew (a reset): the time until its first block is a start-up, not a rate."""
        with self._lock:
            self._seen = None
