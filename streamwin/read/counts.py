"""The read counters, added to by every reading thread, and what ``on_error`` does with a failure."""
from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from streamwin.errors import ShardError
from streamwin.read.block import ReadStats


class Counters:
    """ReadStats that the reading threads add to under one lock, and the on_error policy.

    ``on_error="raise"`` raises a ShardError; ``"skip"`` counts it as a skipped range (the
    first one is also a warning) and the caller carries on without the bytes it lost.
    """

    def __init__(self, on_error: str):
        self.stats = ReadStats()
        self.on_error = on_error
        self._lock = threading.Lock()
        self._raising = threading.local()  # set on a thread whose read may be repaired and done again

    def read(self, nbytes: int, hit: bool = False) -> None:
        """Count one read of ``nbytes`` (``hit``: from the node cache's copy); the most frequent count, kept cheap."""
        with self._lock:
            stats = self.stats
            stats.bytes_read += nbytes
            stats.reads += 1
            stats.cache_hits += hit

    def add(self, **counts: int) -> None:
        """Add to the named counters (ReadStats fields)."""
        with self._lock:
            for name, n in counts.items():
                setattr(self.stats, name, getattr(self.stats, name) + n)

    @contextmanager
    def raising(self) -> Iterator[None]:
        """Within: every failure on this thread raises, whatever ``on_error`` says (nothing is counted yet: the
        caller may repair what failed and read again)."""
        self._raising.on = True
        try:
            yield
        finally:
            self._raising.on = False

    def skip_or_raise(self, err: ShardError) -> None:
        """Raise ``err``, or with on_error="skip" count it (and warn the first time)."""
        if self.on_error == "raise" or getattr(self._raising, "on", False):
            raise err
        with self._lock:
            self.stats.skipped_ranges += 1
            first = self.stats.skipped_ranges == 1
        if first:
            warnings.warn(f"streamwin: skipping unreadable data (on_error='skip'), further skips are counted "
                          f"in loader.stats(): {err}", RuntimeWarning, stacklevel=2)
