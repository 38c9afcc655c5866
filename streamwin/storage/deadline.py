"""Bounded waits: a transfer that runs past its time is cut, wherever it is blocked.

A socket's read timeout bounds each wait for a byte, not a transfer: a server that sends a
byte just before each timeout (a trickle), or a little and then stalls, keeps a read going
for ever, and a retry that resumes at the byte starts the same again. So every streamed GET
has a time limit of its own, ``attempt_limit``: the stall timeout plus its bytes at MIN_RATE
(30 s + 1 s per MiB by default over http); past it, ``Watchdog`` shuts the socket down and
the read ends at once, short, naming the limit. A range then fails for good once its retries
are spent or once it has run for ``total_limit`` (its attempts' limits and the backoffs
between them), however many bytes each attempt delivered. One daemon thread per process,
started on first use (anew in a forked child).
"""
from __future__ import annotations

import heapq
import itertools
import os
import threading
import time
from typing import Callable

MIN_RATE = 1 << 20  # bytes per second a transfer must average, beyond the stall timeout, to go on


def attempt_limit(nbytes: int, stall: float | None, total: float | None = None) -> float:
    """Seconds one GET of ``nbytes`` may take: ``total`` when the user set one, else stall + nbytes / MIN_RATE."""
    if total is not None:
        return float(total)
    return (stall if stall is not None else 300.0) + nbytes / MIN_RATE


def total_limit(attempt: float, retries: int, backoff: float) -> float:
    """Seconds a range read may take over all its attempts: each attempt's limit and the backoffs between them."""
    return (retries + 1) * attempt + backoff * (2 ** retries - 1)


class Watch:
    """One transfer being watched: ``cut`` once its time ran out and its socket was shut down."""

    def __init__(self, seconds: float, stop: Callable[[], None]):
        self.seconds, self.stop, self.cut, self.done = seconds, stop, False, False


class Watchdog:
    """Shuts down the socket of each watched transfer that runs past its deadline (a thread of its own)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Watch]] = []
        self._count = itertools.count()
        self._wake = threading.Condition()
        threading.Thread(target=self._run, name="streamwin-deadlines", daemon=True).start()

    def watch(self, seconds: float, stop: Callable[[], None]) -> Watch:
        """Call ``stop()`` (from the watchdog's thread) if the transfer is not ``finish``ed within ``seconds``."""
        w = Watch(seconds, stop)
        with self._wake:
            heapq.heappush(self._heap, (time.monotonic() + seconds, next(self._count), w))
            self._wake.notify()
        return w

    def finish(self, w: Watch) -> None:
        """The transfer ended: nothing to cut."""
        w.done = True

    def _run(self) -> None:
        while True:
            with self._wake:
                while self._heap and self._heap[0][2].done:
                    heapq.heappop(self._heap)
                wait = self._heap[0][0] - time.monotonic() if self._heap else None
                if wait is None or wait > 0:
                    self._wake.wait(wait)
                    continue
                _, _, w = heapq.heappop(self._heap)
            if not w.done:
                w.cut = True
                try:
                    w.stop()
                except Exception:  # the transfer ended meanwhile
                    pass


_dog: tuple[int, Watchdog] | None = None
_lock = threading.Lock()


def _after_fork() -> None:
    global _lock
    _lock = threading.Lock()  # another thread may have held it when the process forked


os.register_at_fork(after_in_child=_after_fork)


def watchdog() -> Watchdog:
    """This process's watchdog (a forked child starts its own: threads do not survive a fork)."""
    global _dog
    with _lock:
        if _dog is None or _dog[0] != os.getpid():
            _dog = (os.getpid(), Watchdog())
        return _dog[1]
