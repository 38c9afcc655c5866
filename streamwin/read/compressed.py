"""zstd members: the compressed bytes a block needs, read in runs, then decompressed into its buffer.

Each piece lays out what ``frames.units`` says: its own steps, from the units that hold
them (each decompressed once for the block and kept for the next, see inflate.py), or its
whole member, once for all the pieces of its sequence. The units the frame cache holds at
either end of a piece are laid out first; the compressed bytes of the rest are read in
runs (neighbours in a shard as one, concurrently on remote storage), RAW_BATCH bytes at a
time, each widened to whole checksum chunks and verified (verify.py), then decompressed piece
by piece straight into the block buffer or the frame cache. No damaged byte is ever
decompressed; with on_error="skip", what a damaged chunk costs is the steps of the units its
bytes belong to (a frame of a framed member: ``rows`` steps; else the member), reported as
damage so that only the windows with a step there weigh 0. A piece whose run cannot be read
at all loses all its steps.
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from streamwin.errors import ShardError
from streamwin.formats import tar as tarfmt
from streamwin.read.block import READABLE
from streamwin.read.counts import Counters
from streamwin.read.frames import compressed_ranges, compressed_runs, raw_batches, units
from streamwin.read.inflate import Inflater
from streamwin.read.members import Members
from streamwin.read.pieces import Pieces
from streamwin.read.transport import Transport
from streamwin.read.verify import Damage, Verifier
from streamwin.storage import mapped


class CompressedReads:
    """Reads the pieces of a block of zstd members through ``shards`` and decompresses them."""

    def __init__(self, shards: Transport, members: Members, counters: Counters, verifier: Verifier):
        self.shards, self.members, self.counters, self.verifier = shards, members, counters, verifier
        self.inflater = Inflater(members, counters)

    def read(self, p: Pieces, tail: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[Damage]]:
        """(buffer, where each piece's sequence has its step 0 in it, steps readable per piece, damage: the
        steps of the units whose compressed bytes failed verification or decompression).

        The buffer ends in ``tail`` zero bytes. With on_error="skip" a piece laid out from units
        (frames) loses the steps of its damaged units only, a piece laid out whole all its steps.
        """
        m = self.members.manifest
        u = units(m, p)
        buf = mapped.anonymous(int(u.pos[-1]) + tail)  # zero-filled, given back to the system when dropped
        good = np.full(len(p.seq), READABLE, dtype=np.int64)

        own = np.flatnonzero(~u.shared)
        f0, f1 = self.inflater.take_cached(p.seq[own], u.a[own], u.b[own], u.framed[own], buf, u.pos[own])
        todo = np.flatnonzero((f0 < f1) & (good[own] > 0))  # pieces with units to read (a member laid out whole: all)
        seq = p.seq[own[todo]]
        shard = m.shards_of(seq)
        lo, hi = compressed_ranges(m, seq, f0[todo], f1[todo], u.framed[own[todo]])
        # a member's tar header is checked before its bytes are decompressed: read with it where its range starts
        # at its first byte (``head``), else (and for members of the block no range reads) in a read of its own
        fresh = ~(self.members.checked[seq] | self.members.bad[seq])
        head = fresh & (lo == m.offset[seq])
        unread = self._check_members(np.setdiff1d(p.seq, seq[head]))
        read_lo = np.where(head, lo - tarfmt.BLOCK, lo)
        failed = np.isin(seq, unread) | self.members.bad[seq]
        bad: dict[int, list[tuple[int, int]]] = {}  # range -> its damaged shard bytes (verified, skip mode)
        damage: list[Damage] = []
        for n0, n1, raw, at in self._read_runs(seq, shard, read_lo, hi, failed, bad):
            self._check_read(raw, at, n0 + np.flatnonzero(head[n0:n1] & ~failed[n0:n1]), n0, seq, shard, failed)
            at = at + (lo[n0:n1] - read_lo[n0:n1])  # where each range's own bytes begin
            for n in range(n0, n1):
                j, i, k = int(own[todo[n]]), int(seq[n]), int(shard[n])
                if failed[n] or (n in bad and not u.framed[j]):  # a member laid out whole: all of it lost
                    failed[n] = True
                    continue
                src = memoryview(raw)[at[n - n0] : at[n - n0] + hi[n] - lo[n]]
                out = buf[u.pos[j] : u.pos[j + 1]]
                try:
                    if u.framed[j]:
                        damage += [(i, s0, s1) for s0, s1 in self.inflater.lay_out_frames(
                            src, out, i, k, (int(u.a[j]), int(u.b[j])), (int(f0[todo[n]]), int(f1[todo[n]])),
                            bad.get(n, []))]
                    else:
                        self.inflater.decompress_whole(src, out, i, k)
                except ShardError as e:
                    self.counters.skip_or_raise(e)
                    failed[n] = True
        good[own[todo[failed]]] = 0
        good = good[u.owner]
        good[self.members.bad[p.seq] | np.isin(p.seq, unread)] = 0  # (on_error="skip") members whose tar header
        return buf, u.base(m.step_bytes), good, damage  # disagrees or could not be read: every piece lost

    def _check_read(self, raw: np.ndarray, at: np.ndarray, ranges: np.ndarray, n0: int, seq: np.ndarray,
                    shard: np.ndarray, failed: np.ndarray) -> None:
        """Check the tar headers read with ``ranges`` (range n's at ``at[n - n0]`` in ``raw``): a header that does not
        name its member is raised, or marks the member bad and its range failed (on_error="skip")."""
        if not len(ranges):
            return
        for row, err in self.members.check_members(raw, at[ranges - n0], seq[ranges], shard[ranges]):
            self.counters.skip_or_raise(err)
            self.members.bad[seq[ranges[row]]] = True
            failed[ranges[row]] = True
        self.members.checked[seq[ranges]] = ~self.members.bad[seq[ranges]]

    def _check_members(self, seqs: np.ndarray) -> np.ndarray:
        """Read and check the tar header of each member of ``seqs`` not checked yet (Members.check_members), all
        in one round of reads: one that does not name its member as the manifest does is raised, or with
        on_error="skip" marks it bad; the members whose header could not be read (on_error="skip").
        The header is read as it is (512 bytes), not verified: it holds no step."""
        m = self.members.manifest
        todo = seqs[~(self.members.checked[seqs] | self.members.bad[seqs])]
        if not len(todo):
            return todo
        shard = m.shards_of(todo)
        heads = np.zeros(len(todo) * tarfmt.BLOCK, dtype=np.uint8)
        reads = [(int(k), int(m.offset[i]) - tarfmt.BLOCK, memoryview(heads)[n * tarfmt.BLOCK : (n + 1) * tarfmt.BLOCK])
                 for n, (i, k) in enumerate(zip(todo.tolist(), shard.tolist()))]
        unread = np.zeros(len(todo), dtype=bool)
        for n, err in enumerate(self.shards.read_many(reads)):
            if err is not None:
                self.counters.skip_or_raise(self.members.name_member(err, todo[n : n + 1]))
                unread[n] = True
        read = np.flatnonzero(~unread)
        at = np.arange(len(todo), dtype=np.int64) * tarfmt.BLOCK
        for row, err in self.members.check_members(heads, at[read], todo[read], shard[read]):
            self.counters.skip_or_raise(err)
            self.members.bad[todo[read[row]]] = True
        self.members.checked[todo[read]] = ~self.members.bad[todo[read]]
        return todo[unread]

    def _read_runs(self, seq: np.ndarray, shard: np.ndarray, lo: np.ndarray, hi: np.ndarray, failed: np.ndarray,
                   bad: dict[int, list[tuple[int, int]]]) -> Iterator[tuple[int, int, np.ndarray, np.ndarray]]:
        """Read ranges [lo, hi) of members ``seq`` in runs, a batch of about RAW_BATCH bytes at a time
        (concurrently on remote storage); yields (first range, end range, bytes, where each range of the
        batch is in them).

        Ranges of a run that fails are marked in ``failed``, the damaged chunks [a, b) of a range's bytes
        listed in ``bad`` (after each error is raised or counted).
        """
        runs = compressed_runs(shard, lo, hi)
        bounds = runs.first
        vlo, vhi = self.verifier.spans(shard[bounds[:-1]], runs.run_lo, runs.run_hi)  # whole chunks, to verify
        self.verifier.load(shard[bounds[:-1]], vlo, vhi)  # the sums they are verified against
        for r0, r1 in raw_batches(runs):
            pos = np.zeros(r1 - r0 + 1, dtype=np.int64)
            np.cumsum(vhi[r0:r1] - vlo[r0:r1], out=pos[1:])
            raw = mapped.anonymous(int(pos[-1]))
            ks = shard[bounds[r0:r1]]
            rlo, rhi, _ = self.verifier.reuse_edges(ks, vlo[r0:r1], vhi[r0:r1], runs.run_lo[r0:r1], runs.run_hi[r0:r1],
                                                 raw, pos)
            rhi = np.maximum(rhi, rlo)
            into = pos[:-1] + rlo - vlo[r0:r1]
            reads = [(int(ks[r]), int(rlo[r]), memoryview(raw)[into[r] : into[r] + rhi[r] - rlo[r]])
                     for r in range(r1 - r0)]
            for r, err in zip(range(r0, r1), self.shards.read_many(reads)):
                b0, b1, q = bounds[r], bounds[r + 1], r - r0
                if err is not None:
                    err = self.members.from_byte(err, int(lo[b0]))
                    self.counters.skip_or_raise(self.members.name_member(err, seq[b0:b1]))
                    failed[b0:b1] = True
                    continue
                data = raw[into[q] : into[q] + rhi[q] - rlo[q]]
                found = self.verifier.check(int(ks[q]), int(rlo[q]), data,
                                            lambda b0=b0, b1=b1: (seq[b0:b1], lo[b0:b1], hi[b0:b1]))
                for n, a, b in found:
                    bad.setdefault(int(b0 + n), []).append((a, b))
                if not found:
                    self.verifier.keep_edges(int(ks[q]), int(rlo[q]), data, int(runs.run_lo[r]), int(runs.run_hi[r]))
            n0, n1 = int(bounds[r0]), int(bounds[r1])
            run = runs.run[n0:n1]
            yield n0, n1, raw, pos[run - r0] + (lo[n0:n1] - vlo[run])
