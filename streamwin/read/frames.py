"""zstd members on the read side: which compressed bytes a block reads, and where its steps land.

A read decompresses whole *units*: a frame of a member packed as frames (listed in
``manifest.frames``, ``rows`` steps each, frame 0 holding the npy header too), or a whole
member otherwise. A piece of a framed member, or of a member small enough to be one unit
(up to WHOLE_UNIT_BYTES), lays out only its own steps, taken from the frames that hold
them (which a reading thread caches for the next pieces and blocks); a piece of any other
member lays out the whole member, once for every piece of its sequence.

The compressed ranges are read in runs (neighbours in a shard closer than COMPRESSED_GAP
as one), RAW_BATCH bytes of runs at a time. Pure numpy, no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from streamwin.formats.manifest import Manifest
from streamwin.read.pieces import Pieces

COMPRESSED_GAP = 4 << 10  # compressed members this close are read as one run (tar headers, json members)
RAW_BATCH = 8 << 20  # compressed bytes of a block read (and decompressed) at a time
WHOLE_UNIT_BYTES = 256 << 10  # an unframed zstd member up to this size is cached like a frame (pack's frame size)
SLICE_UNITS = 8  # a default zstd read slice spans this many frames or members (see zstd_slice_windows)


def zstd_slice_windows(m: Manifest, stride: int) -> int:
    """Fewest windows of a default read slice of a zstd dataset (1 for others): SLICE_UNITS of the units a
    read decompresses whole (a frame of a framed member, else a member), a unit's size weighted by it.

    A slice's edges cut a unit that the blocks of both neighbours read and decompress: with
    slices of a few windows each unit would be read about once per slice in it (frames of
    thousands of windows: bytes read 10-100x the shards). A slice SLICE_UNITS times the
    (size-weighted) unit reads and decompresses about 1 + 1 / SLICE_UNITS of them.
    """
    if m.compression is None or not m.num_sequences:
        return 1
    rows = m.frames.rows if m.frames is not None else max(1, WHOLE_UNIT_BYTES // max(m.step_bytes, 1))
    length = m.length.astype(np.float64)
    if not length.sum():
        return 1
    frames, rest = np.divmod(length, rows)  # each member: units of ``rows`` steps and one shorter
    weighted = float(frames.sum()) * rows * rows + float(np.dot(rest, rest))  # sum over units of steps squared
    return int(np.ceil(SLICE_UNITS * weighted / float(length.sum()) / stride))


# -- units: what one decompression yields --------------------------------------------------------
def listed(m: Manifest, i: int) -> bool:
    """Member i is packed as frames that the manifest lists."""
    fr = m.frames
    at = int(np.searchsorted(fr.seq, i)) if fr is not None else 0
    return fr is not None and at < len(fr.seq) and int(fr.seq[at]) == i


def frame_ends(m: Manifest, i: int) -> np.ndarray:
    """Where each unit of member i ends, from its first byte (a member not listed as frames: one unit)."""
    if not listed(m, i):
        return m.size[i : i + 1]
    fr = m.frames
    at = int(np.searchsorted(fr.seq, i))
    return fr.ends[fr.first[at] : fr.first[at + 1]]


def unit_rows(m: Manifest, i: int) -> int:
    """Steps per unit of member i: a listed frame's, else the whole member's."""
    return m.frames.rows if listed(m, i) else int(m.length[i])


@dataclass(frozen=True)
class Units:
    """What each piece of a block lays out in the block buffer, and where.

    Piece u lays out steps [a[u], b[u]) of its member at ``pos[u]``: its own steps when
    ``framed[u]`` (taken from units), else the whole member. A piece ``shared`` with the one
    before (the same member, laid out whole) lays out nothing; ``owner[u]`` is the piece that
    laid its member out (u itself unless shared).
    """

    a: np.ndarray
    b: np.ndarray
    framed: np.ndarray
    shared: np.ndarray
    pos: np.ndarray  # [pieces + 1]: byte offsets in the block buffer; pos[-1] the bytes laid out
    owner: np.ndarray

    def base(self, step_bytes: int) -> np.ndarray:
        """Where each piece's sequence has its step 0 in the buffer (its owner lays out steps from a)."""
        return self.pos[self.owner] - self.a[self.owner] * step_bytes


def units(m: Manifest, p: Pieces) -> Units:
    """The layout of pieces ``p`` of zstd members (see Units)."""
    n = len(p.seq)
    a = np.zeros(n, dtype=np.int64)
    b = m.length[p.seq].astype(np.int64)
    framed = b * m.step_bytes <= WHOLE_UNIT_BYTES
    fr = m.frames
    if fr is not None and len(fr.seq):
        at = np.minimum(np.searchsorted(fr.seq, p.seq), len(fr.seq) - 1)
        framed |= fr.seq[at] == p.seq
    a, b = np.where(framed, p.s_lo, a), np.where(framed, p.s_hi, b)
    shared = np.zeros(n, dtype=bool)  # a whole member already laid out for the piece before
    shared[1:] = ~framed[1:] & (p.seq[1:] == p.seq[:-1])
    pos = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.where(shared, 0, (b - a) * m.step_bytes), out=pos[1:])
    owner = np.maximum.accumulate(np.where(shared, 0, np.arange(n)))
    return Units(a, b, framed, shared, pos, owner)


def unit_span(m: Manifest, i: int, a: int, b: int) -> tuple[int, int]:
    """The units [j0, j1) of member i that hold its steps [a, b)."""
    rows = unit_rows(m, i)
    return a // rows, -(-b // rows)


# -- compressed bytes: ranges per piece, runs per shard, batches of runs ---------------------------
def compressed_ranges(m: Manifest, seq: np.ndarray, f0: np.ndarray, f1: np.ndarray,
                      framed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Shard byte ranges [lo, hi) to read of each member ``seq``: its units [f0, f1) when ``framed``, else all of it."""
    lo, hi = m.offset[seq].copy(), m.offset[seq] + m.size[seq]
    for n in np.flatnonzero(framed).tolist():
        ends = frame_ends(m, int(seq[n]))
        j0, j1 = int(f0[n]), int(f1[n])
        hi[n] = lo[n] + ends[j1 - 1]
        lo[n] += ends[j0 - 1] if j0 else 0
    return lo, hi


@dataclass(frozen=True)
class CompressedRuns:
    """Compressed ranges (in piece order) merged into runs of a shard: range n is read in run ``run[n]``."""

    run: np.ndarray
    first: np.ndarray  # [runs + 1]: the first range of each run, then the number of ranges
    run_lo: np.ndarray
    run_hi: np.ndarray

    def __len__(self) -> int:
        return len(self.run_lo)


def compressed_runs(shard: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> CompressedRuns:
    """Ranges [lo, hi) of shards ``shard`` as runs: neighbours in a shard at most COMPRESSED_GAP apart read as one."""
    new = np.ones(len(lo), dtype=bool)
    new[1:] = (shard[1:] != shard[:-1]) | (lo[1:] - hi[:-1] > COMPRESSED_GAP)
    first = np.flatnonzero(new)
    run_hi = np.maximum.reduceat(hi, first) if len(first) else hi
    return CompressedRuns(np.cumsum(new) - 1, np.append(first, len(lo)), lo[first], run_hi)


def raw_batches(runs: CompressedRuns) -> list[tuple[int, int]]:
    """Runs [r0, r1) read (and decompressed) together: as many as fit in RAW_BATCH bytes, at least one."""
    out, r0 = [], 0
    while r0 < len(runs):
        sizes = np.cumsum(runs.run_hi[r0:] - runs.run_lo[r0:])
        r1 = r0 + max(1, int(np.searchsorted(sizes, RAW_BATCH, side="right")))
        out.append((r0, r1))
        r0 = r1
    return out
