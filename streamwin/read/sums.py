"""The checksums a reader verifies against, read from the shards' sums files as blocks need them.

A dataset's chunk and block checksums sit in a sums file beside each shard (formats/checks.py),
index.json keeping only the digest of each one's page table. Before a block's bytes are
verified, ``load`` fetches what its reads need and the reader does not hold yet: the page
table of each shard it reads (checked against index.json's digest), and the pages that
cover the bytes read (each checked against the table; READ_PAGES at a time; a small sums file
is read whole with its table), all in one concurrent round of ranged reads through the
dataset's transport (retried like shard reads), started with the block's own reads
(``request``) and taken in when the block is verified (``load``). What is held is
kept least-recently-used up to ``limit`` bytes (beyond it only while one block needs more),
so a process holds the sums of the shards in flight, a few KiB per 4 MiB page, whatever the
corpus. A sums file that is missing, cut short, damaged or another shard's is a ShardError
naming it, raised when a block first needs it (with on_error="skip": that block's pieces in
the shard are lost, counted).

A manifest that holds every shard's chunk sums itself (the older form) is served from
memory (``Checks.span``): nothing is read.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from streamwin.errors import ShardError
from streamwin.formats.checks import Checks
from streamwin.formats.sums import SumsSpan, parse_pages

SUMS_LIMIT = 4 << 20  # bytes of sums (page tables and pages) a reader keeps
READ_PAGES = 16  # pages are read in aligned groups of this many (64 MiB of shard, 65 KiB of sums): fewer, larger reads
WHOLE_BYTES = 256 << 10  # a sums file this small (of a shard up to ~250 MiB) is read whole with its table
WHOLE = -2  # a read of a whole sums file: its table and every page
Submit = Callable[[list[tuple[int, int, memoryview]]], Any]  # reads of (shard, offset, out) of sums files: a Pending


class Sums:
    """The sums of one dataset's shards as its reads need them (see the module docstring).

    ``submit(reads)`` starts reading (shard k, offset, destination) ranges of shards' sums files,
    its ``wait()`` giving each one's ShardError or None; ``sums_url(k)`` names shard k's sums file. What
    is held: each shard's page table, and runs of pages as they were read (``_Pages``).
    """

    def __init__(self, checks: Checks, submit: Submit, sums_url: Callable[[int], str], limit: int | None = None):
        self.checks, self.submit, self.sums_url = checks, submit, sums_url
        self.limit = SUMS_LIMIT if limit is None else limit
        self.nbytes = 0  # bytes held
        self._held: OrderedDict[tuple[int, int], np.ndarray | _Pages] = OrderedDict()  # (shard, -1 | first page)
        self._page: dict[tuple[int, int], int] = {}  # (shard, page) -> the first page of the run holding it
        self._failed: dict[int, ShardError] = {}  # shards whose sums failed, for the block being read
        self._inflight: list = []  # reads ``request`` started: (runs, buffers, Pending)
        self._asked: set[tuple[int, int, int]] = set()  # their runs
        self._lock = threading.Lock()

    def held(self) -> list[int]:
        """The shards whose sums (or page table) this reader holds now."""
        with self._lock:
            return sorted({k for k, _ in self._held})

    def request(self, shard: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        """Start reading what verifying bytes [lo[j], hi[j]) of shards ``shard[j]`` needs and is not held or asked
        for already, without waiting: ``load`` takes it in (a block's sums are read while its bytes are)."""
        if not self.checks.in_files:
            return
        with self._lock:
            runs, _ = self._plan(shard, lo, hi)
            runs = [r for r in runs if r not in self._asked]
            if runs:
                self._inflight.append(self._start(runs))
                self._asked.update(runs)

    def load(self, shard: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        """Fetch what verifying bytes [lo[j], hi[j]) of shards ``shard[j]`` needs and is not held (no-op for sums
        held in memory): what ``request`` started, then the rest, tables and pages in one round; a shard whose
        sums cannot be had fails its ``span`` calls until the next ``load``."""
        if not self.checks.in_files:
            return
        with self._lock:
            self._failed = {}
            while self._inflight:
                self._take(*self._inflight.pop(0))
            self._asked.clear()
            runs, want = self._plan(shard, lo, hi)
            if runs:
                self._take(*self._start([r for r in runs if r[0] not in self._failed]))
            for key in want:
                if key in self._held:
                    self._held.move_to_end(key)
            while self.nbytes > self.limit and next(iter(self._held)) not in want:
                self._drop(next(iter(self._held)))

    def _plan(self, shard: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[list[tuple[int, int, int]], set]:
        """(the reads that verifying these ranges needs: each shard's table (``WHOLE``: with every page) not held,
        then neighbouring groups of READ_PAGES pages a read; the held keys they need)."""
        ks = sorted(set(shard.tolist()))
        tables = [(k, WHOLE if self._small(k) else -1, 0) for k in ks if (k, -1) not in self._held]
        whole = {k for k, p0, _ in tables if p0 == WHOLE}
        want = {(k, -1) for k in ks}
        missing = set()
        for k, a, b in zip(shard.tolist(), lo.tolist(), hi.tolist()):
            if k not in self._failed and k not in whole and b > a:
                p0, p1 = self.checks.layout(k).pages_of(a, b)
                for p in range(p0, p1):
                    first = self._page.get((k, p))
                    if first is None:
                        missing.add((k, p // READ_PAGES))
                    else:
                        want.add((k, first))
        runs: list[tuple[int, int, int]] = []  # neighbouring groups of missing pages of a shard: one read
        for k, g in sorted(missing):
            p0, p1 = g * READ_PAGES, min((g + 1) * READ_PAGES, self.checks.layout(k).pages)
            if runs and runs[-1][0] == k and runs[-1][2] == p0:
                runs[-1] = (k, runs[-1][1], p1)
            else:
                runs.append((k, p0, p1))
        want |= {(k, p0) for k, p0, _ in runs} | {(k, 0) for k in whole}
        return tables + runs, want

    def span(self, k: int, lo: int, hi: int) -> SumsSpan:
        """The sums that verify bytes [lo, hi) of shard k (after ``load``); ShardError if they could not be had."""
        if not self.checks.in_files:
            return self.checks.span(k)
        with self._lock:
            if k in self._failed:
                raise self._failed[k]
            layout = self.checks.layout(k)
            p, p1 = layout.pages_of(lo, hi)
            runs = []
            while p < p1:
                runs.append(self._held[(k, self._page[(k, p)])])
                p = runs[-1].end
        per = layout.block // layout.chunk
        first = runs[0].first * layout.page_blocks
        coarse = runs[0].coarse if len(runs) == 1 else np.concatenate([r.coarse for r in runs])
        fine = runs[0].fine if len(runs) == 1 else np.concatenate([r.fine for r in runs])
        return SumsSpan(layout.nbytes, layout.chunk, first * per, fine, layout.block, first, coarse)

    def _start(self, runs: list[tuple[int, int, int]]):
        """(runs, their buffers, the reads in flight) of shards' page tables (p0 -1; ``WHOLE``: the whole file) and
        runs of pages [p0, p1)."""
        reads, bufs = [], []
        for k, p0, p1 in runs:
            layout = self.checks.layout(k)
            if p0 == WHOLE:
                a, b = 0, layout.page_range(layout.pages - 1)[1]
            else:
                a, b = (0, layout.table_bytes) if p0 < 0 else (layout.page_range(p0)[0], layout.page_range(p1 - 1)[1])
            bufs.append(np.empty(b - a, dtype=np.uint8))
            reads.append((k, a, memoryview(bufs[-1])))
        return runs, bufs, self.submit(reads)

    def _take(self, runs: list[tuple[int, int, int]], bufs: list[np.ndarray], pending) -> None:
        """Check and hold what reads started by ``_start`` got (tables first, as started); a shard whose read or
        check fails is noted in ``_failed``."""
        for (k, p0, p1), buf, err in zip(runs, bufs, pending.wait()):
            if k in self._failed or (k, max(p0, -1)) in self._held:
                continue
            try:
                if err is not None:
                    raise err
                if p0 == WHOLE:  # the table, then every page
                    layout = self.checks.layout(k)
                    self._hold((k, -1), self.checks.table(k, buf[: layout.table_bytes]).copy())
                    p0, p1, buf = 0, layout.pages, buf[layout.table_bytes :]
                if p0 < 0:
                    self._hold((k, -1), self.checks.table(k, buf).copy())
                elif (k, -1) not in self._held:  # its table failed, or was dropped since: read again when needed
                    continue
                else:
                    coarse, fine = parse_pages(buf, self.checks.layout(k), p0, self._held[(k, -1)])
                    self._hold((k, p0), _Pages(p0, p1, coarse, fine))
                    self._page.update(((k, p), p0) for p in range(p0, p1))
            except (ShardError, ValueError) as e:
                self._failed[k] = self._error(k, e)

    def _small(self, k: int) -> bool:
        """Whether shard k's sums file is read whole when its table is first needed (one round trip, not two)."""
        layout = self.checks.layout(k)
        return layout.pages > 0 and layout.page_range(layout.pages - 1)[1] <= WHOLE_BYTES

    def _hold(self, key: tuple[int, int], value) -> None:
        self._held[key] = value
        self.nbytes += value.nbytes

    def _drop(self, key: tuple[int, int]) -> None:
        value = self._held.pop(key)
        self.nbytes -= value.nbytes
        if isinstance(value, _Pages):
            for p in range(value.first, value.end):
                del self._page[(key[0], p)]

    def _error(self, k: int, e: Exception) -> ShardError:
        """The ShardError of shard k's sums file (``e``: why it could not be had)."""
        url = self.sums_url(k)
        if isinstance(e, ShardError):
            return ShardError(f"cannot read the chunk checksums file {url}: {e.reason}", shard=e.shard, offset=e.offset)
        return ShardError(f"the chunk checksums file {url} is damaged: {e}; rerun `streamwin index` (or repack)",
                          shard=url)


@dataclass(frozen=True, eq=False)
class _Pages:
    """The sums of pages [first, end) of one shard's sums file, read together."""

    first: int
    end: int
    coarse: np.ndarray
    fine: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.coarse.nbytes + self.fine.nbytes
