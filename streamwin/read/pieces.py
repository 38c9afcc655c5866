"""A block's windows cut into pieces (runs of consecutive windows of one sequence), and where each lands.

With shuffle a block holds several slices of the plan, scattered over the shards and over
a long sequence. Only the steps each piece covers are read (runs.py for plain members,
frames.py for zstd ones), and once the reads say where each piece's sequence has its step 0
in the block buffer, ``land`` gives each window its offset there. Pure numpy, no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from streamwin.read.block import READABLE


@dataclass(frozen=True)
class Pieces:
    """The step ranges a block reads: one piece per sequence and run of consecutive windows."""

    seq: np.ndarray  # sequence of each piece, in manifest order
    s_lo: np.ndarray  # first step the piece's windows cover
    s_hi: np.ndarray  # end of the steps they cover
    joined: np.ndarray  # the piece's first window directly follows the previous piece's last one
    index: np.ndarray  # piece of each window


def pieces(g: np.ndarray, seq: np.ndarray, start: np.ndarray, end: np.ndarray, gap: int,
           kind: np.ndarray | None = None) -> Pieces:
    """Cut a block's windows (sorted global indices, their sequence, first and end step) into pieces.

    A piece is a run of consecutive windows of one sequence (a slice of the plan, or part of
    one) no more than ``gap`` steps apart: its steps are read as one range. Windows far apart
    in a long sequence are separate pieces, so a block reads what its windows cover, not the
    sequence between them (nor the steps a stride larger than the window skips). ``kind``: where
    it changes between neighbours, a new piece starts too (an extended sequence's windows inside
    one member and those across two: read/segments.py).
    """
    n = len(g)
    step = np.diff(g) > 1  # duplicates (equalize="pad" wrapping around) stay in one piece
    new = np.ones(n, dtype=bool)
    new[1:] = step | (seq[1:] != seq[:-1]) | (start[1:] - end[:-1] > gap)
    if kind is not None:
        new[1:] |= kind[1:] != kind[:-1]
    first = np.flatnonzero(new)
    joined = np.zeros(len(first), dtype=bool)
    joined[1:] = ~step[first[1:] - 1]
    s_hi = np.maximum.reduceat(end, first) if n else end
    return Pieces(seq[first], start[first], s_hi, joined, np.cumsum(new) - 1)


def land(p: Pieces, base: np.ndarray, good: np.ndarray, start: np.ndarray, valid: np.ndarray, step_bytes: int,
         nowhere: int) -> tuple[np.ndarray, np.ndarray]:
    """(where each window's step 0 lies in the block buffer, which windows are lost).

    ``base[u]`` is where piece u's sequence has its step 0, ``good[u]`` how many of its steps
    were read (on_error="skip" loses the rest). A window needs steps [start, start + valid);
    a lost one points at ``nowhere``, the buffer's zero tail.
    """
    offs = base[p.index] + start * step_bytes
    if good.min(initial=READABLE) == READABLE:  # every piece read whole (always, but with on_error="skip")
        return offs, np.zeros(len(offs), dtype=bool)
    lost = start + valid > good[p.index]
    offs[lost] = nowhere
    return offs, lost


def with_headers(p: Pieces, seqs: np.ndarray) -> Pieces:
    """``p`` and a piece of no steps from step 0 of each sequence of ``seqs`` (sorted, none with a piece from
    step 0 in ``p``): a read of just its member's headers, so they are checked before its windows are cut."""
    seq = np.concatenate([p.seq, seqs])
    s_lo = np.concatenate([p.s_lo, np.zeros(len(seqs), dtype=p.s_lo.dtype)])
    order = np.lexsort((s_lo, seq))  # manifest order: a sequence's header piece first (its others start later)
    where = np.empty_like(order)
    where[order] = np.arange(len(order))
    # a header piece is not joined to its neighbours: the bytes between are other members', or other blocks' steps
    joined = np.concatenate([p.joined, np.zeros(len(seqs), dtype=bool)])[order]
    joined[where[len(p.seq):] + 1] = False
    s_hi = np.concatenate([p.s_hi, np.zeros(len(seqs), dtype=p.s_hi.dtype)])
    return Pieces(seq[order], s_lo[order], s_hi[order], joined, where[p.index])
