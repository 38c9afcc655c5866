"""Plain (uncompressed) members: a block's byte runs mapped or read into its buffer, failures recovered.

The runs come from runs.py. Where the shards are local files (the dataset's own, or the
node cache's copies) each run is mapped into one reserved address range, so the batch
gather is the only copy a window's bytes make; with more than MAX_MAPPED_RUNS runs, or when
the system refuses a mapping, the runs are read into anonymous memory instead. Every npy
header a run covers is checked against the manifest before any window is cut from it, and
every run's chunks against the manifest's checksums (verify.py): a read runs from the chunk
boundary before its first byte to the one after its last (a mapping maps those pages anyway).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from streamwin.errors import ShardError
from streamwin.formats import tar as tarfmt
from streamwin.read.block import READABLE
from streamwin.read.counts import Counters
from streamwin.read.fetch import Pending
from streamwin.read.local import map_range
from streamwin.read.members import Members
from streamwin.read.pieces import Pieces
from streamwin.read.runs import PlainRuns, packed, paged, plain_runs
from streamwin.read.transport import Transport
from streamwin.read.verify import Damage, Later, Verifier
from streamwin.storage import mapped

MAX_MAPPED_RUNS = 1024  # a block of more separate runs is read, not mapped (mappings per process are limited)


class PlainReads:
    """Reads the pieces of a block of plain members through ``shards``; maps them where ``map_files``."""

    def __init__(self, shards: Transport, members: Members, counters: Counters, *, map_files: bool,
                 verifier: Verifier):
        self.shards, self.members, self.counters, self.map_files = shards, members, counters, map_files
        self.verifier = verifier

    def read(self, p: Pieces, tail: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[Damage]]:
        """(buffer, where each piece's sequence has its step 0 in it, steps readable per piece, damage).

        The buffer ends in ``tail`` zero bytes. Each run's headers are checked once it is in
        (after ``_recover`` read again what a failed run lost, with on_error="skip"), then its
        chunks: with on_error="skip", ``damage`` lists the steps of each piece in a damaged chunk.
        """
        return self.finish(self.start(p, tail))

    def start(self, p: Pieces, tail: int) -> "PlainRead":
        """Start reading pieces ``p`` (mapped now, or GETs in flight on remote storage): ``finish`` gives the read."""
        runs = plain_runs(self.members.manifest, p)
        vlo, vhi = self.verifier.spans(runs.shard, runs.run_lo, runs.run_hi)
        # runs of members' headers alone hold no window's byte: read as they are, not verified (the headers are
        # checked against the manifest, which is what they are read for), a few hundred bytes, not a chunk
        alone = runs.headers_only()
        vlo[alone], vhi[alone] = runs.run_lo[alone], runs.run_hi[alone]
        self.verifier.request(runs.shard[~alone], vlo[~alone], vhi[~alone])  # the sums they are verified against
        return PlainRead(runs, vlo, vhi, *self._fetch(runs, vlo, vhi, tail))

    def finish(self, r: "PlainRead") -> tuple[np.ndarray, np.ndarray, np.ndarray, list[Damage]]:
        """What ``read`` gives, once the reads ``start`` began are in."""
        runs, vlo, vhi, buf, run_at, refill, spans = r.runs, r.vlo, r.vhi, r.buf, r.run_at, r.refill, r.spans
        errors = r.pending.wait()
        for j, k, a, n, pos in self.verifier.take_later(r.later, buf):  # edge chunks not kept as promised: read,
            err = self.shards.try_read((k, a, memoryview(buf)[pos : pos + n]))  # and verified with the run
            spans[0][j], spans[1][j] = min(spans[0][j], a), max(spans[1][j], a + n)
            if err is not None and errors[j] is None:
                errors[j] = err
        alone = runs.headers_only()
        self.verifier.load(runs.shard[~alone], vlo[~alone], vhi[~alone])  # (requested when the read started)
        base, header_at = runs.land(run_at)
        at, hlens, bounds = header_at.tolist(), runs.hlen.tolist(), runs.first.tolist()
        heads = runs.covers_header().tolist()
        good = np.full(len(runs.seq), READABLE, dtype=np.int64)
        for j, err in enumerate(errors):
            if err is not None:  # skip mode: keep what the run delivered, read the rest member by member
                self._recover(err, runs, j, run_at, refill, good, int(vhi[j]))
        good[self.members.bad[runs.seq]] = 0  # members an earlier block found bad (on_error="skip"): lost again
        damage = self._verify(runs, buf, run_at - (runs.run_lo - vlo), vlo, spans, errors, good)
        # then the headers: the tar header names the member (a manifest that lies about where it is fails here),
        # the npy header says its dtype and shape (a damaged byte in either failed its checksum above first)
        self._check_members(runs, buf, header_at, good)
        for j in range(len(errors)):
            k, u0, u1 = int(runs.shard[j]), bounds[j], bounds[j + 1]
            for u in range(u0, u1):
                if heads[u] and good[u] > 0:  # the read covers this member's .npy header: check it
                    try:
                        self.members.check_header(buf[at[u] : at[u] + hlens[u]].tobytes(), int(runs.seq[u]), k)
                    except ShardError as e:
                        self._lose_member(e, runs, good, int(runs.seq[u]))
        self.verifier.settle(r.later)
        return buf, base, good, damage

    def _check_members(self, runs: PlainRuns, buf: np.ndarray, header_at: np.ndarray, good: np.ndarray) -> None:
        """Check the tar header of each member a piece read from step 0 (Members.check_members): one that names
        another member loses every piece of it (with on_error="skip"); the rest are marked checked."""
        u = np.flatnonzero(runs.covers_header() & (good > 0))
        seq = runs.seq[u]
        for row, e in self.members.check_members(buf, header_at[u] - tarfmt.BLOCK, seq, runs.shard[runs.run[u]]):
            self._lose_member(e, runs, good, int(seq[row]))
        self.members.checked[seq[good[u] > 0]] = True

    def _lose_member(self, err: ShardError, runs: PlainRuns, good: np.ndarray, i: int) -> None:
        """A header of member i says other than the manifest: raise, or lose every piece of it, now and in later
        blocks (on_error="skip", counted once)."""
        self.counters.skip_or_raise(err)
        self.members.bad[i] = True
        good[runs.seq == i] = 0

    def _verify(self, runs: PlainRuns, buf: np.ndarray, at: np.ndarray, vlo: np.ndarray, spans, errors: list,
                good: np.ndarray) -> list[Damage]:
        """Check each run's chunks (run j's bytes from ``vlo[j]`` lie at ``at[j]`` in ``buf``; ``spans``: the
        bytes [lo, hi) of each that were read, else None: mapped, all); the steps of each damaged piece.

        A run that failed and was recovered (on_error="skip") is checked piece by piece over
        the bytes each kept: a chunk it only partly got fails, and loses that piece's steps in it.
        Read edge chunks are kept for the next reads (``Verifier.keep_edges``).
        """
        if self.verifier.checks is None:
            return []
        damage: list[Damage] = []
        sb, bounds, shards = runs.step_bytes, runs.first.tolist(), runs.shard.tolist()
        at_, vlo_, lo_, hi_ = at.tolist(), vlo.tolist(), spans[0].tolist(), spans[1].tolist()
        alone = runs.headers_only().tolist()
        for j, err in enumerate(errors):
            k, u0, u1 = shards[j], bounds[j], bounds[j + 1]
            if alone[j]:  # members' headers alone: checked against the manifest, not verified
                continue

            def kept(u0: int = u0, u1: int = u1) -> np.ndarray:  # the run's pieces that kept steps
                return np.arange(u0, u1)[good[u0:u1] > 0]

            def needs(u0: int = u0, u1: int = u1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # what each kept
                keep = kept(u0, u1)
                hi = np.minimum(runs.hi[keep], runs.data0[keep] + np.minimum(good[keep], runs.hi[keep]) * sb)
                return runs.seq[keep], runs.lo[keep], hi
            if err is None:
                todo = [(lo_[j], hi_[j])]
            else:  # each kept piece over what it kept
                _, lo, hi = needs()
                a_, b_ = self.verifier.spans(np.full(len(lo), k), lo, hi)
                todo = list(zip(a_.tolist(), b_.tolist()))
            for a, b in todo:
                data = buf[at_[j] + a - vlo_[j] : at_[j] + b - vlo_[j]]
                found = self.verifier.check(k, a, data, needs)
                keep = kept() if found else None
                for u, x, y in found:
                    v = int(keep[u])
                    s0 = max(0, (x - int(runs.data0[v])) // sb)
                    damage.append((int(runs.seq[v]), s0, -(-(y - int(runs.data0[v])) // sb)))
                if not found and err is None and spans[2]:
                    self.verifier.keep_edges(k, a, data, int(runs.run_lo[j]), int(runs.run_hi[j]))
        return damage

    def _fetch(self, runs: PlainRuns, vlo: np.ndarray, vhi: np.ndarray, tail: int):
        """The runs mapped (local files, up to MAX_MAPPED_RUNS of them) or else read: see ``_read_runs``.

        Read, a run is fetched from ``vlo`` to ``vhi`` (whole chunks, to be verified) but for the
        edge chunks this thread kept; mapped, only its own bytes, whose pages hold those chunks
        when a chunk divides a page. Returns (buffer, run starts, the reads (Pending), refill,
        (read from, read to, edges kept: whether this was read)).
        """
        if self.map_files and len(runs) <= MAX_MAPPED_RUNS:
            whole = self.verifier.chunk == 0 or mapped.PAGE % self.verifier.chunk == 0
            try:
                buf, run_at, pending, refill, later = self._map_runs(runs, runs.run_lo if whole else vlo,
                                                                     runs.run_hi if whole else vhi, tail)
                return buf, run_at, pending, refill, (vlo, vhi, False), later
            except OSError:  # out of address space or mappings: read instead
                pass
        return self._read_runs(runs, vlo, vhi, tail)

    def _recover(self, err: ShardError, runs: PlainRuns, j: int, run_at: np.ndarray, refill,
                 good: np.ndarray, end: int) -> None:
        """After run j failed: the steps each member got before the failure; the rest read again.

        A failed read leaves every byte before the error's offset in place. The member holding
        that offset keeps the steps before it; the members after it are read again, from the
        next one's first byte, until a read gets to the end. An error at no place in the range
        (a shard the cache could not fetch), or a read again that gets no byte at all (a file
        cut short, an object gone), loses the rest of the run at once: each try would fail
        alike. Each failure is one skipped range.
        """
        u, u1, again = int(runs.first[j]), int(runs.first[j + 1]), False
        while err is not None:
            err = self.members.from_byte(err, int(runs.lo[u]))
            self.counters.skip_or_raise(self.members.name_member(err, runs.seq[u:u1]))
            fail = err.offset
            if fail is None or (again and fail <= runs.lo[u]):  # (before lo[u]: in the chunk a read starts with)
                good[u:u1] = 0
                return
            v = u + int(np.searchsorted(runs.hi[u:u1], fail, side="right"))  # members before v are whole
            if v < u1 and runs.lo[v] <= fail:  # the failure is inside member v
                good[v] = runs.steps_before(v, fail)
                v += 1
            if v == u1:
                return
            into = int(run_at[j] + runs.lo[v] - runs.run_lo[j])  # member v's place in the buffer
            err, u, again = refill(int(runs.shard[j]), int(runs.lo[v]), end, into), v, True

    def _read_runs(self, runs: PlainRuns, lo: np.ndarray, hi: np.ndarray, tail: int):
        """Start reading bytes [lo[j], hi[j]) of each run's shard (its bytes and more) into one buffer, back to back.

        Returns (buffer, run starts, the reads (Pending), refill), where ``refill(k, lo, hi, at)``
        reads bytes [lo, hi) of shard k to ``at`` in the buffer again (ShardError or None).
        """
        at, nbytes = packed(lo, hi)
        buf = mapped.anonymous(nbytes + tail)  # zeroed: the tail too
        rlo, rhi, later = self.verifier.reuse_edges(runs.shard, lo, hi, runs.run_lo, runs.run_hi, buf, at, ahead=True)
        todo = np.flatnonzero(rhi > rlo)
        reads = [(int(runs.shard[j]), int(rlo[j]), memoryview(buf)[at[j] + rlo[j] - lo[j] : at[j] + rhi[j] - lo[j]])
                 for j in todo.tolist()]
        pending = _Spread(self.shards.submit(reads), todo.tolist(), len(runs))
        run_at = at + (runs.run_lo - lo)

        def refill(k: int, a: int, b: int, at: int) -> ShardError | None:
            return self.shards.try_read((k, a, memoryview(buf)[at : at + b - a]))
        return buf, run_at, pending, refill, (rlo, np.maximum(rhi, rlo), True), later

    def _map_runs(self, runs: PlainRuns, lo: np.ndarray, hi: np.ndarray, tail: int):
        """Map bytes [lo[j], hi[j]) of each run's (local or cached) shard file into one address range.

        No bytes are copied: the gather reads the page cache directly. Each range starts at a
        page boundary of the buffer, ``lo % PAGE`` bytes in. Returns (buffer, run starts, the reads
        (done), refill) as ``_read_runs`` does; raises OSError when the system refuses a mapping.
        """
        at, nbytes = paged(lo, hi)
        # the page tables are filled by the mapping call, which runs without the GIL, even where every page is
        # hashed right away: its first touches would map them one by one, some with the GIL held (header checks,
        # edge chunks), stalling the thread that gathers
        target = mapped.MappedBuffer(nbytes + tail)
        run_at = at + (runs.run_lo - lo)
        errors: list[ShardError | None] = []
        for j, k in enumerate(runs.shard.tolist()):
            try:
                map_range(self.shards, target, int(at[j]), k, int(lo[j]), int(hi[j]))
                errors.append(None)
            except ShardError as e:
                errors.append(e)

        def refill(k: int, a: int, b: int, at: int) -> ShardError | None:
            try:
                map_range(self.shards, target, at, k, a, b)
            except ShardError as e:
                return e
            except OSError as e:  # the mapping was refused now: the bytes are not there
                return ShardError(f"cannot map shard bytes: {e}", shard=self.members.shard_url(k), offset=a)
            return None
        return target.array(), run_at, Pending(len(errors), errors=errors), refill, Later(-1, [])


@dataclass
class PlainRead:
    """A block's plain reads, started: the runs, the spans verified, the buffer and where each run lands in it."""

    runs: PlainRuns
    vlo: np.ndarray
    vhi: np.ndarray
    buf: np.ndarray
    run_at: np.ndarray
    pending: "Pending | _Spread"
    refill: Callable[[int, int, int, int], "ShardError | None"]
    spans: tuple
    later: Later  # edge chunks left out, to take from those an earlier read keeps


class _Spread:
    """The errors of the runs of ``pending`` placed at indices ``at`` of ``count`` runs (the rest: None)."""

    def __init__(self, pending: Pending, at: list[int], count: int):
        self.pending, self.at, self.count = pending, at, count

    def wait(self) -> list[ShardError | None]:
        errors: list[ShardError | None] = [None] * self.count
        for j, err in zip(self.at, self.pending.wait()):
            errors[j] = err
        return errors

    def cancel(self) -> None:
        self.pending.cancel()
