"""How far a process reads ahead of the blocks it batches: enough bytes in flight for the latency it sees.

Reading from local disk, a block is mapped in microseconds and one block ahead is plenty.
From object storage each GET waits a round trip before its first byte, so the next blocks'
GETs must be in flight while this one is batched. By Little's law the bytes in flight that
keep a rate R flowing over a latency L are R x L. The loader measures both where it reads:
L, the time from a GET's request to its first byte (the transport's), and R, the rate at
which the batcher takes bytes when they are there (a block's bytes over the time it spent
on the block before it asked for the next, over the last TAKES blocks: what the trainer's
steps allow, not what the store gave, so a read-ahead that is short does not hold itself
down). It keeps MARGIN x R x L bytes read ahead beyond the block it started (GETs arrive
in bursts, a block's parts at once), within ``limit`` bytes (``readahead_bytes``) beyond
the ``readahead`` blocks each stream always reads ahead. A store with no latency to hide
(local files, the node cache) is never read further ahead; nor is a slow one with none:
more bytes in flight would not come sooner.
What was measured outlives a stream: the next epoch's streams of the same source in the same
process (``of_source``) read as far ahead as the last one ended, not from one block, once their
first block is in (a stream starts its first blocks alone: they would share the store's
bandwidth with every block after them, and the first batch would come last).
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Callable

LIMIT_BYTES = 512 << 20  # the default bound on bytes read ahead per source and process (readahead_bytes)
MARGIN = 2.0  # bytes read ahead, in rate x latency: twice what the rate seen needs, so it can grow
SMOOTH = 0.5  # weight of the newest block's bytes in a block's bytes on average
TAKES = 8  # the rate is measured over the last this many blocks taken
FAST = 1e-3  # seconds a block is batched in, at least (a batcher that takes blocks at once is not infinitely fast)


_SOURCES: dict[tuple[str, int], "ReadAhead"] = {}  # (source URL, limit) -> its read-ahead in this process


def of_source(url: str, limit: int, latency: Callable[[], float] | None) -> "ReadAhead":
    """The read-ahead of source ``url`` in this process (made on first use), measuring ``latency`` from now on:
    a new stream of the source (the next epoch) starts from what its last one measured."""
    ahead = _SOURCES.get((url, limit))
    if ahead is None:
        ahead = _SOURCES[(url, limit)] = ReadAhead(limit)
    ahead.latency = latency
    return ahead


class ReadAhead:
    """The read-ahead of one source's streams in one process (see the module docstring).

    Args:
        limit: bytes its streams may have read ahead (started, not yet taken), beyond the blocks each
            always reads ahead.
        latency: the transport's seconds to a GET's first byte lately, or None: a store with no latency to
            hide, read no further ahead.
    """

    def __init__(self, limit: int = LIMIT_BYTES, latency: Callable[[], float] | None = None):
        self.limit, self.latency = limit, latency
        self.want = 0.0  # bytes to hold ahead: MARGIN x rate x latency, and a block
        self.rate = 0.0  # bytes/s the batcher takes when they are there
        self.blocks = 0  # blocks started and not yet taken, of all streams
        self.block_bytes = 0.0  # a block's bytes, on average (of the last few taken)
        self.peak_bytes = 0.0  # the most bytes held ahead at once (as estimated when blocks start)
        self._seen: deque[tuple[int, float]] = deque(maxlen=TAKES)  # (bytes, seconds batched) of the last blocks
        self._lock = threading.Lock()

    def may_start(self) -> bool:
        """Whether a stream may start one more block than it always reads ahead."""
        if self.latency is None:
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

    def taken(self, nbytes: int, batched: float | None) -> None:
        """A block of ``nbytes`` was taken, the batcher having spent ``batched`` s on the block before it (None: the
        first of a stream): measure the rate and latency, and set how far to read ahead."""
        with self._lock:
            self.blocks = max(0, self.blocks - 1)
            self.block_bytes = nbytes if not self.block_bytes else (1 - SMOOTH) * self.block_bytes + SMOOTH * nbytes
            if self.latency is None:
                return
            if batched is not None:
                self._seen.append((nbytes, batched))
                self.rate = sum(n for n, _ in self._seen) / max(sum(t for _, t in self._seen), len(self._seen) * FAST)
            # at most twice what is read ahead now: a start-up that asked for all at once would share the store's
            # bandwidth over every block it asked for, and the next block would come last with them (slow start)
            grown = 2 * (self.blocks + 1) * self.block_bytes
            self.want = min(MARGIN * self.rate * self.latency() + self.block_bytes, max(grown, self.want))


