"""Plain (uncompressed) members: the byte runs a block reads, and where its bytes land in the block buffer.

Piece u needs steps [s_lo, s_hi) of its sequence: bytes ``data0 + s_lo * step_bytes`` up to
``data0 + s_hi * step_bytes`` of its shard, from the member's tar header on when it starts
at step 0 (so its tar and npy headers are checked before any window is cut). Neighbouring
pieces of a shard are read as one run:

- across any gap up to MERGE_GAP when they hold consecutive windows (``joined``: the gap
  is tar and npy headers, json members and sequences without windows), so a slice of many
  short sequences is one read;
- else only across a gap small beside both pieces (at most 1/OTHER_GAP_RATIO of each, and
  at most MERGE_GAP): the gap is other blocks' data, which an epoch would read twice.

So an epoch reads each shard byte about once, and a block's buffer holds about what its
windows cover, however long the sequences. Runs (widened to whole checksum chunks when read,
see verify.py) land in the buffer back to back when read (``packed``), or each at its own
page, ``lo % PAGE`` bytes in, when mapped (``paged``).
Pure numpy, no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from streamwin.formats import tar as tarfmt
from streamwin.formats.manifest import Manifest
from streamwin.read.pieces import Pieces
from streamwin.storage.mapped import page_ceil, page_floor

MERGE_GAP = 64 << 10  # read through gaps (tar and npy headers, json members) up to this size
OTHER_GAP_RATIO = 8  # read through another block's bytes only up to 1/8 of the reads beside them


@dataclass(frozen=True)
class PlainRuns:
    """The byte ranges of a block's pieces (in manifest order) and the runs of a shard they are read in."""

    seq: np.ndarray  # each piece's sequence
    s_lo: np.ndarray  # first step it reads
    lo: np.ndarray  # first byte it reads: its tar header when it reads from step 0
    hi: np.ndarray  # end of the bytes it reads
    data0: np.ndarray  # where its sequence's array data begins in the shard
    header: np.ndarray  # where its sequence's npy header begins in the shard
    hlen: np.ndarray  # the header's length
    run: np.ndarray  # the run each piece is read in
    first: np.ndarray  # [runs + 1]: the first piece of each run, then the number of pieces
    shard: np.ndarray  # the shard of each run
    run_lo: np.ndarray  # first byte of each run
    run_hi: np.ndarray  # end of each run
    step_bytes: int

    def __len__(self) -> int:
        return len(self.run_lo)

    def land(self, run_at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(where each piece's step 0, where its npy header) lies in a buffer holding run r at ``run_at[r]``."""
        at = run_at[self.run] - self.run_lo[self.run]
        return at + self.data0, at + self.header

    def headers_only(self) -> np.ndarray:
        """[runs]: which runs read members' headers and no step (to check members no piece reads from step 0)."""
        return np.maximum.reduceat(self.hi - self.data0, self.first[:-1]) <= 0 if len(self) else np.zeros(0, bool)

    def covers_header(self) -> np.ndarray:
        """Which pieces read their member's tar and npy headers (those from step 0)."""
        return self.s_lo == 0

    def steps_before(self, u: int, fail: int) -> int:
        """Steps of piece u's sequence whose bytes lie before byte ``fail`` (none if its header was cut short)."""
        if self.s_lo[u] == 0 and fail < self.data0[u]:
            return 0
        return max(int(fail - self.data0[u]) // self.step_bytes, 0)


def plain_runs(m: Manifest, p: Pieces) -> PlainRuns:
    """The byte ranges of pieces ``p`` of manifest ``m``'s plain members, merged into runs as documented above."""
    sb = m.step_bytes
    seq = p.seq
    shard = m.shards_of(seq)
    header, hlen = m.offset[seq], m.hlen[seq]
    data0 = header + hlen
    lo = np.where(p.s_lo == 0, header - tarfmt.BLOCK, data0 + p.s_lo * sb)  # from step 0: the tar and npy headers
    hi = data0 + p.s_hi * sb
    new = np.ones(len(seq), dtype=bool)
    gap = lo[1:] - hi[:-1]
    small = np.minimum(hi - lo, MERGE_GAP * OTHER_GAP_RATIO) // OTHER_GAP_RATIO
    room = np.where(p.joined[1:], MERGE_GAP, np.minimum(small[1:], small[:-1]))
    # a piece that starts before the one before it (a manifest whose members are not in byte order: edited) starts
    # a run of its own, so that no piece lies before its run's first byte
    new[1:] = (shard[1:] != shard[:-1]) | (gap > room) | (lo[1:] < lo[:-1])
    first = np.flatnonzero(new)
    run_hi = np.maximum.reduceat(hi, first) if len(first) else hi
    return PlainRuns(seq, p.s_lo, lo, hi, data0, header, hlen, np.cumsum(new) - 1,
                     np.append(first, len(seq)), shard[first], lo[first], run_hi, sb)


def packed(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, int]:
    """(where each range [lo, hi) starts, bytes in all) in a buffer that holds the ranges back to back (read)."""
    pos = np.zeros(len(lo) + 1, dtype=np.int64)
    np.cumsum(hi - lo, out=pos[1:])
    return pos[:-1], int(pos[-1])


def paged(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, int]:
    """(where each range [lo, hi) starts, bytes in all) in a buffer that maps each range from its page boundary on.

    Range r starts ``lo[r] % PAGE`` bytes into a page of its own, so that a file mapped
    from the page boundary before ``lo[r]`` puts byte ``lo[r]`` there.
    """
    lead = lo - page_floor(lo)
    pos = np.zeros(len(lo) + 1, dtype=np.int64)
    np.cumsum(page_ceil(hi - lo + lead), out=pos[1:])
    return pos[:-1] + lead, int(pos[-1])
