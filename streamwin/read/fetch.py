"""Ranged GETs in flight together: runs split into parts, a pool of connections, a depth that backs off.

Object stores answer each GET after a round trip of tens of milliseconds and give each
connection a share of their bandwidth, so bytes flow only while many GETs are in flight
(Little's law: bandwidth x latency bytes). A block's runs are split into parts of at most
PART_BYTES (object stores serve parts of a few MB best, each on its own connection) and
handed to a pool of ``connections`` threads, first come first served, so the parts of the
next blocks are fetched while this one is batched. How many GETs may be in flight at once
is the ``Throttle``'s: all ``connections``, halved when the store answers 503 (S3's
SlowDown) or 429, grown back one at a time as GETs succeed.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from streamwin.errors import ShardError

PART_BYTES = 8 << 20  # a run longer than this is fetched as parts of about this size, concurrently

Run = tuple[int, int, memoryview]  # (shard, offset, destination): read bytes [offset, offset + len) of the shard
ReadRun = Callable[[Run], "ShardError | None"]


class Throttle:
    """At most ``allowed`` GETs in flight (1 <= allowed <= ``most``), additive increase, multiplicative decrease.

    ``slow_down()`` (a 503 or 429 answer) halves ``allowed``, once per round of GETs: the
    answers of GETs already in flight when it was cut do not cut it again. Every ``allowed``
    GETs that succeed (a round of them) give one more back, up to ``most``, as TCP grows its
    window by one segment a round trip.
    """

    def __init__(self, most: int):
        self.most = self.allowed = self.lowest = most
        self.active = self.peak = self.slowed = 0
        self._ok = 0
        self._since_cut = most  # GETs ended since the last cut (a cut needs a round of them)
        self._cond = threading.Condition()

    def __enter__(self) -> "Throttle":
        with self._cond:
            while self.active >= self.allowed:
                self._cond.wait()
            self.active += 1
            self.peak = max(self.peak, self.active)
        return self

    def __exit__(self, *exc) -> None:
        with self._cond:
            self.active -= 1
            self._since_cut += 1
            self._cond.notify()

    def succeeded(self) -> None:
        """A GET got its answer: grow ``allowed`` back once enough have."""
        with self._cond:
            if self.allowed >= self.most:
                return
            self._ok += 1
            if self._ok >= self.allowed:
                self._ok = 0
                self.allowed += 1
                self._cond.notify()

    def slow_down(self) -> None:
        """The store asked for fewer requests: halve ``allowed`` (once per round of GETs in flight)."""
        with self._cond:
            self.slowed += 1
            if self._since_cut >= self.allowed:
                self.allowed = max(1, self.allowed // 2)
                self.lowest = min(self.lowest, self.allowed)
                self._since_cut = self._ok = 0


def split(runs: list[Run], part: int = PART_BYTES) -> tuple[list[Run], list[int]]:
    """Runs cut into parts of at most about ``part`` bytes (equal parts of each run); the run of each part."""
    parts, owner = [], []
    for j, (k, offset, out) in enumerate(runs):
        n = len(out)
        count = max(1, -(-n // part))
        size = -(-n // count)
        for a in range(0, n, size) if n else (0,):
            parts.append((k, offset + a, out[a : a + size]))
            owner.append(j)
    return parts, owner


class Pending:
    """Runs being read: ``wait()`` gives each run's ShardError or None once all its parts are in.

    A run of several parts fails with the error of its first failing part (the lowest
    offset): every byte of the run before that offset is in place, as after a single read.
    """

    def __init__(self, count: int, futures: list[Future] | None = None, owner: list[int] | None = None,
                 errors: list[ShardError | None] | None = None):
        self.count, self.futures, self.owner, self.errors = count, futures or [], owner or [], errors

    def wait(self) -> list[ShardError | None]:
        if self.errors is None:
            errors: list[ShardError | None] = [None] * self.count
            for j, f in zip(self.owner, self.futures):
                err = f.result()
                if err is not None and (errors[j] is None or _at(err) < _at(errors[j])):
                    errors[j] = err
            self.errors, self.futures = errors, []
        return self.errors

    def cancel(self) -> None:
        """Drop the parts not started yet (those in flight end on their own)."""
        for f in self.futures:
            f.cancel()


def _at(err: ShardError) -> int:
    return err.offset if err.offset is not None else -1


class Fetcher:
    """A pool of ``connections`` threads reading parts of runs, first come first served."""

    def __init__(self, connections: int, part: int | None = None):
        self.connections, self.part = connections, part or PART_BYTES
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def submit(self, runs: list[Run], read: ReadRun) -> Pending:
        """Start reading ``runs`` (each split into parts) with ``read``; the Pending reads."""
        parts, owner = split(runs, self.part)
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.connections, thread_name_prefix="streamwin-get")
            pool = self._pool
        return Pending(len(runs), [pool.submit(read, r) for r in parts], owner)

    def shutdown(self, wait: bool = True) -> None:
        """Stop the threads (a later submit starts new ones); ``wait=False``: a GET in flight ends on its own."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=wait, cancel_futures=True)
