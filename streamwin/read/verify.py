"""Every read verified: the chunks a read covers checked against the shards' checksums.

A read of shard bytes [lo, hi) verifies the whole chunks that hold them (formats/checks.py),
so it reads up to a chunk (4 KiB) more at either end (``spans``); a local file mapped by the
page maps those bytes anyway. The blocks (256 KiB) it covers whole are verified with one
xxh3 call each, the chunks at its ends one by one, against the sums ``sums.Sums`` fetched
for the block (``load``). A chunk whose checksum differs from what was packed is damage:
with on_error="raise" a ShardError naming the shard, the first member whose bytes the read
needs in it, and the byte offset; with "skip" it is counted as a skipped range and only
the windows whose steps lie in a damaged chunk are lost (``lost_windows``). Damage in bytes
no window of the block needs (tar headers or json members between two read pieces) is not
an error of this read.

A read's edge chunks are partly other pieces' bytes: a neighbouring piece, read by another
block, needs the same chunk. Each reading thread keeps the edge chunks it verified last
(``EdgeChunks``, EDGE_BYTES), and a read whose edge chunk is there takes it from there
instead of reading it again; so neighbouring pieces read a chunk they share once while it
is kept, and a read costs its bytes plus at most a chunk at either end when it is not.
Blocks read ahead are started before the ones before them are finished, so a read also
leaves out an edge chunk that a block started before it will keep (``promised``) and takes
it when it is finished, after that block (``take_later``), or reads it then if it was not kept.
Pure numpy besides the counters, no I/O.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import numpy as np

from streamwin.errors import ShardError
from streamwin.read.counts import Counters
from streamwin.read.members import Members
from streamwin.read.sums import Sums

Damage = tuple[int, int, int]  # (sequence, first step, end step) whose bytes failed verification
EDGE_BYTES = 4 << 20  # verified edge chunks kept per reading thread


class EdgeChunks:
    """Verified chunks at the edges of recent reads, by (shard, chunk); the least recently used dropped first."""

    def __init__(self, limit: int = EDGE_BYTES):
        self.limit, self.nbytes = limit, 0
        self.entries: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self.promised: OrderedDict[tuple[int, int], int] = OrderedDict()  # chunk -> the read that will keep it
        self.reads = 0  # reads started on this thread

    def settle(self, read: int) -> None:
        """Read ``read`` is finished: the promises of it and of reads started before it are kept or void."""
        while self.promised and next(iter(self.promised.values())) <= read:
            self.promised.popitem(last=False)

    def get(self, k: int, j: int) -> np.ndarray | None:
        """Chunk j of shard k, if kept."""
        data = self.entries.get((k, j))
        if data is not None:
            self.entries.move_to_end((k, j))
        return data

    def keep(self, k: int, j: int, data: np.ndarray) -> None:
        """Keep a copy of chunk j of shard k (verified)."""
        if (k, j) in self.entries:
            return
        self.entries[(k, j)] = data.copy()
        self.nbytes += len(data)
        while self.nbytes > self.limit:
            self.nbytes -= len(self.entries.popitem(last=False)[1])


class Verifier:
    """Chunk checks of one dataset's reads against ``sums`` (a no-op when ``sums`` is None: the manifest has
    none, or verification is off)."""

    def __init__(self, members: Members, counters: Counters, sums: Sums | None):
        self.members, self.counters, self.sums = members, counters, sums
        self.checks = sums.checks if sums is not None else None
        self._local = threading.local()

    def request(self, shard: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        """Start reading the sums that verifying bytes [lo[j], hi[j]) of shards ``shard[j]`` needs (sums.Sums.request):
        ``load`` then finds them in."""
        if self.sums is not None:
            self.sums.request(shard, lo, hi)

    def load(self, shard: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        """Fetch the sums that verifying bytes [lo[j], hi[j]) of shards ``shard[j]`` needs (sums.Sums.load)."""
        if self.sums is not None:
            self.sums.load(shard, lo, hi)

    def edges(self) -> EdgeChunks:
        """This thread's kept edge chunks (blocks are read on one thread; they need no lock)."""
        local = self._local
        if getattr(local, "edges", None) is None:
            local.edges = EdgeChunks()
        return local.edges

    def reuse_edges(self, shard: np.ndarray, lo: np.ndarray, hi: np.ndarray, need_lo: np.ndarray,
                    need_hi: np.ndarray, buf: np.ndarray, at: np.ndarray, ahead: bool = False
                    ) -> tuple[np.ndarray, np.ndarray, "Later"]:
        """For reads of whole chunks [lo, hi) of runs that need [need_lo, need_hi), placed at ``at`` in ``buf``:
        copy each edge chunk kept by this thread into place; with ``ahead`` (a read finished later, ``settle``d
        then), leave out those a read started before will keep, and promise its own. (lo, hi) left to read
        (hi <= lo: nothing), and the chunks left out (``take_later`` fills them)."""
        rlo, rhi = lo.copy(), hi.copy()
        later = Later(-1, [])
        if self.checks is None:
            return rlo, rhi, later
        promised = self.edges().promised if ahead else {}
        c, edges = self.checks.chunk, self.edges()
        for j in range(len(lo)):
            k, a, b = int(shard[j]), int(lo[j]), int(hi[j])
            if a < need_lo[j]:
                first = edges.get(k, a // c)
                n = min(c, b - a)
                if first is not None and len(first) == n:
                    buf[at[j] : at[j] + n] = first
                    rlo[j] = a + n
                elif (k, a // c) in promised:
                    later.chunks.append((j, k, a, n, int(at[j])))
                    rlo[j] = a + n
            last_at = (b - 1) // c * c
            if b > need_hi[j] and last_at >= rlo[j]:
                last = edges.get(k, last_at // c)
                if last is not None and len(last) == b - last_at:
                    buf[at[j] + last_at - a : at[j] + b - a] = last
                    rhi[j] = last_at
                elif (k, last_at // c) in promised:
                    later.chunks.append((j, k, last_at, b - last_at, int(at[j] + last_at - a)))
                    rhi[j] = last_at
        if not ahead:
            return rlo, rhi, later
        edges.reads += 1
        later.read = edges.reads
        for j in range(len(lo)):  # the edge chunks this read will keep once it is verified
            k, a, b = int(shard[j]), int(lo[j]), int(hi[j])
            if a < need_lo[j]:
                edges.promised[(k, a // c)] = later.read
            if b > need_hi[j]:
                edges.promised[(k, (b - 1) // c)] = later.read
        return rlo, rhi, later

    def take_later(self, later: "Later", buf: np.ndarray) -> list[tuple[int, int, int, int, int]]:
        """Copy the chunks ``reuse_edges`` left out into ``buf`` from those kept since; the ones not kept (their
        read failed, or was dropped): (run, shard, first byte, bytes, where in ``buf``), to read now."""
        edges, missing = self.edges(), []
        for j, k, a, n, pos in later.chunks:
            data = edges.get(k, a // self.checks.chunk)
            if data is not None and len(data) == n:
                buf[pos : pos + n] = data
            else:
                missing.append((j, k, a, n, pos))
        return missing

    def settle(self, later: "Later") -> None:
        """The read ``later`` came from is finished (its edges kept, if verified)."""
        if later.read >= 0:
            self.edges().settle(later.read)

    def keep_edges(self, k: int, a: int, data: np.ndarray, need_lo: int, need_hi: int) -> None:
        """Keep the first and last chunk of verified bytes ``data`` of shard k (from ``a``) where they reach past
        the bytes needed [need_lo, need_hi): a neighbouring read needs them."""
        if self.checks is None or not len(data):
            return
        c, edges, b = self.checks.chunk, self.edges(), a + len(data)
        if a < need_lo:
            edges.keep(k, a // c, data[: min(c, len(data))])
        last_at = (b - 1) // c * c
        if b > need_hi and last_at >= a:
            edges.keep(k, last_at // c, data[last_at - a :])

    @property
    def chunk(self) -> int:
        """Bytes per chunk (0 when nothing is verified)."""
        return self.checks.chunk if self.checks is not None else 0

    def spans(self, shard: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The byte ranges to verify (and so to read) for ranges [lo, hi) of shards ``shard``: whole chunks."""
        if self.checks is None:
            return lo, hi
        c = self.checks.chunk
        return lo // c * c, np.minimum(-(-hi // c) * c, self.checks.sizes[shard])

    def check(self, k: int, at: int, data: np.ndarray, needs: Callable[[], tuple[np.ndarray, np.ndarray, np.ndarray]]
              ) -> list[tuple[int, int, int]]:
        """Verify shard k's bytes ``data`` (from byte ``at``, a chunk boundary). ``needs()`` gives the ranges the
        read needs, (member seq[u], bytes [need_lo[u], need_hi[u])), asked only when something is damaged. Of each
        damaged range that overlaps a needed one: (u, first byte, end byte), after raising (on_error "raise") or
        counting it (a skipped range, "skip"). Sums that cannot be had (sums.Sums) damage every byte."""
        if self.checks is None or not len(data):
            return []
        self.counters.add(bytes_verified=len(data))
        try:
            bad, cause = self.sums.span(k, at, at + len(data)).bad(at, data), None
        except ShardError as e:
            bad, cause = [(at, at + len(data))], e
        if not bad:
            return []
        seq, need_lo, need_hi = needs()
        out = []
        for a, b in bad:
            hit = np.flatnonzero((need_hi > a) & (need_lo < b))
            if not len(hit):
                continue  # bytes of this read that no window needs (tar headers, json members between pieces)
            u = int(hit[0])
            self.counters.skip_or_raise(cause or self.error(k, a, b, int(seq[u]), max(a, int(need_lo[u]))))
            out += [(int(v), a, b) for v in hit.tolist()]
        return out

    def error(self, k: int, a: int, b: int, i: int, at: int) -> ShardError:
        """The ShardError of damaged bytes [a, b) of shard k, named at member i and byte ``at``."""
        return self.members.error(f"checksum mismatch: shard bytes {a}..{b} differ from what was packed (chunk "
                                  f"checksums of {self.checks.chunk} bytes, {self.checks.algorithm})", i, k, at)


@dataclass
class Later:
    """Edge chunks a read left out, to take from those kept when it is finished: (run, shard, first byte, bytes,
    where in the buffer) each; ``read``: the read's number on its thread."""

    read: int
    chunks: list[tuple[int, int, int, int, int]]


def lost_windows(damage: list[Damage], seq: np.ndarray, start: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Which windows (of sequences ``seq``, steps [start, start + valid)) have a step in a damaged range."""
    lost = np.zeros(len(seq), dtype=bool)
    for i, s0, s1 in damage:
        lost |= (seq == i) & (start < s1) & (start + valid > s0)
    return lost
