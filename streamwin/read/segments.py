"""Extended sequences: a block's pieces mapped onto the members that hold their steps, and stitched back.

A sequence of a dataset that grew may be a chain of members (formats/growth.py): its first
member, then its continuations, each a whole ``.npy`` of its own. The plan sees one sequence
of the total length; here each piece's steps [s_lo, s_hi) are cut at the members' bounds into
member pieces (rows of ``Manifest.members()``), which are read like any other member (runs.py,
frames.py): their headers checked, their bytes verified. A piece that lies in one member is
not copied: its sequence's step 0 is placed where that member's would be, less the steps
before the member. A piece that spans members has its parts copied end to end into the
block buffer's *stitch area* (between its bytes and its zero tail; in a buffer mapped from the
page cache, scratch memory mapped there), so that every window is still one contiguous slice
of the buffer, which is what the gather copies.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from streamwin.formats.manifest import Manifest
from streamwin.read.block import READABLE
from streamwin.read.pieces import Pieces
from streamwin.storage import mapped


@dataclass(frozen=True)
class MemberPieces:
    """A block's sequence pieces cut at member bounds: ``pieces`` (seq = member row, steps of the member, in
    manifest order), and per member piece its sequence piece (``owner``) and the sequence step where its
    member's step 0 is (``first``); per sequence piece whether it is ``stitched`` and where in the stitch
    area (``stitch_at``, bytes)."""

    pieces: Pieces
    owner: np.ndarray
    first: np.ndarray
    stitched: np.ndarray
    stitch_at: np.ndarray
    stitch_bytes: int


class SegmentMap:
    """Where each step of a manifest's sequences lies among its members (with continuations only)."""

    def __init__(self, manifest: Manifest):
        seg = manifest.segments
        self.members = manifest.members()
        self.n = n = seg.heads
        self.step_bytes = manifest.step_bytes
        self.begin = seg.per_sequence(n)  # sequence i's continuations: begin[i]..begin[i + 1] - 1
        self.head = np.asarray(seg.length[:n], dtype=np.int64)
        steps = np.asarray(seg.length[n:], dtype=np.int64)
        seq = np.asarray(seg.seq, dtype=np.int64)
        before = np.cumsum(steps) - steps  # steps of all continuations before continuation j
        self.first = self.head[seq] + before - before[self.begin[seq]] if len(seq) else before
        self.steps = steps
        self.seq = seq

    def kinds(self, seq: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        """Per window (steps [start, end) of ``seq``), the member its first step lies in and, when it spans two or
        more, the one its last lies in (0 for sequences of one member): a piece holds windows of one kind, so
        only the windows across a member's end are copied together, not the whole of their piece."""
        out = np.zeros(len(seq), dtype=np.int64)
        grown = np.flatnonzero(self.begin[seq + 1] > self.begin[seq])
        for i in np.unique(seq[grown]).tolist():  # the extended sequences of a block (a few)
            rows = grown[seq[grown] == i]
            bounds = self.first[self.begin[i] : self.begin[i + 1]]  # where each continuation starts
            a = np.searchsorted(bounds, start[rows], side="right")
            b = np.searchsorted(bounds, end[rows] - 1, side="right")
            out[rows] = a * (len(bounds) + 2) + b + 1
        return out

    def split(self, p: Pieces) -> MemberPieces:
        """Pieces ``p`` of sequences, as pieces of members (see MemberPieces)."""
        sb = self.step_bytes
        count = self.begin[p.seq + 1] - self.begin[p.seq]  # each piece's sequence's continuations
        u = np.repeat(np.arange(len(p.seq)), count + 1)  # every member of each piece's chain
        k = np.arange(len(u)) - np.repeat(np.cumsum(count + 1) - (count + 1), count + 1)  # 0: the first member
        j = self.begin[p.seq][u] + k - 1  # the continuation (k >= 1)
        cont = k > 0
        jj = np.where(cont, j, 0)
        first = np.where(cont, self.first[jj] if len(self.first) else 0, 0)
        end = np.where(cont, first + (self.steps[jj] if len(self.steps) else 0), self.head[p.seq][u])
        s_lo, s_hi = p.s_lo[u], p.s_hi[u]
        keep = (first < s_hi) & (end > s_lo)
        u, k, first, end, s_lo, s_hi, jj = (a[keep] for a in (u, k, first, end, s_lo, s_hi, jj))
        row = np.where(k > 0, self.n + jj, p.seq[u])
        lo, hi = np.maximum(s_lo - first, 0), np.minimum(s_hi, end) - first
        parts = np.bincount(u, minlength=len(p.seq))
        stitched = parts > 1
        nbytes = np.where(stitched, (p.s_hi - p.s_lo) * sb, 0)
        stitch_at = np.cumsum(nbytes) - nbytes
        lead = np.ones(len(u), dtype=bool)
        lead[1:] = u[1:] != u[:-1]
        joined = lead & (k == 0) & p.joined[u]  # a piece's first part keeps what it says of its neighbour
        order = np.lexsort((lo, row))  # manifest order: the sequences' first members, then continuations
        pieces = Pieces(row[order], lo[order], hi[order], joined[order], np.arange(len(order)))
        return MemberPieces(pieces, u[order], first[order], stitched, stitch_at, int(nbytes.sum()))

    def in_byte_order(self, q: Pieces) -> Pieces:
        """Member pieces ``q`` (header reads among them) sorted by shard and byte, so that neighbours in a shard
        are read in one run (a sequence's members lie in the shards of several appends; the rows of the
        continuations follow their sequences, not their bytes). A piece is joined to the one before when the bytes
        between them are the headers of the next member: the one before reads to its member's end, this one
        from its member's first step, the next member of the same shard."""
        m, sb = self.members, self.step_bytes
        shard = m.shards_of(q.seq)
        offset, size, hlen = (np.asarray(c)[q.seq].astype(np.int64) for c in (m.offset, m.size, m.hlen))
        first = offset + hlen + q.s_lo * sb
        order = np.lexsort((first, shard))
        where = np.empty_like(order)
        where[order] = np.arange(len(order))
        seq, s_lo, s_hi = q.seq[order], q.s_lo[order], q.s_hi[order]
        shard, offset, size = shard[order], offset[order], size[order]
        ends = offset + size  # each member's last byte (plain members: its last step's)
        joined = np.zeros(len(seq), dtype=bool)
        if len(seq) > 1:
            whole_end = (offset + hlen[order] + s_hi * sb)[:-1] == ends[:-1]
            joined[1:] = (shard[1:] == shard[:-1]) & whole_end & (s_lo[1:] == 0) & (offset[1:] - ends[:-1] <= 2048)
        return Pieces(seq, s_lo, s_hi, joined, where[q.index])

    def join(self, mp: MemberPieces, p: Pieces, buf: np.ndarray, base: np.ndarray, good: np.ndarray,
             stitch0: int) -> tuple[np.ndarray, np.ndarray]:
        """(where each sequence piece's step 0 lies in ``buf``, steps of it readable), from where each member piece's
        member has its step 0 (``base``) and its steps readable (``good``); stitched pieces' parts are copied
        to ``stitch0`` + their place in the stitch area first."""
        sb, q = self.step_bytes, mp.pieces
        out = np.empty(len(p.seq), dtype=np.int64)
        solo = ~mp.stitched[mp.owner]
        out[mp.owner[solo]] = base[solo] - mp.first[solo] * sb
        out[mp.stitched] = stitch0 + mp.stitch_at[mp.stitched] - p.s_lo[mp.stitched] * sb
        parts = np.flatnonzero(~solo)  # each part of a stitched piece, end to end
        if len(parts):
            area = memoryview(mapped.writable(buf, stitch0, mp.stitch_bytes)).cast("B")
            src = memoryview(buf).cast("B")
            u = mp.owner[parts]
            a = (base[parts] + q.s_lo[parts] * sb).tolist()
            n = ((q.s_hi[parts] - q.s_lo[parts]) * sb).tolist()
            at = (mp.stitch_at[u] + (mp.first[parts] + q.s_lo[parts] - p.s_lo[u]) * sb).tolist()
            for a_, n_, at_ in zip(a, n, at):
                area[at_ : at_ + n_] = src[a_ : a_ + n_]
        readable = np.full(len(p.seq), READABLE, dtype=np.int64)
        short = good < q.s_hi
        if short.any():  # on_error="skip": a part that lost steps loses the piece's steps from there on
            np.minimum.at(readable, mp.owner[short], mp.first[short] + good[short])
        return out, readable

    def sequence_damage(self, damage: list) -> list:
        """Damage (member row, first step, end step) as (sequence, first step, end step)."""
        out = []
        for row, a, b in damage:
            if row < self.n:
                out.append((row, a, b))
            else:
                j = row - self.n
                out.append((int(self.seq[j]), int(self.first[j] + a), int(self.first[j] + b)))
        return out
