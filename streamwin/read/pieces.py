"""A block's windows cut into pieces: runs of consecutive windows of one sequence, each read as one range.

With shuffle a block holds several slices of the plan, scattered over the shards and over
a long sequence; only the steps each piece covers are read. Pure numpy, no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MERGE_GAP = 64 << 10  # read through gaps (tar and npy headers, json members) up to this size
OTHER_GAP_RATIO = 8  # read through another block's bytes only up to 1/8 of the reads beside them


@dataclass(frozen=True)
class Pieces:
    """The step ranges a block reads: one piece per sequence and run of consecutive windows."""

    seq: np.ndarray  # sequence of each piece, in manifest order
    s_lo: np.ndarray  # first step the piece's windows cover
    s_hi: np.ndarray  # end of the steps they cover
    joined: np.ndarray  # the piece's first window directly follows the previous piece's last one
    index: np.ndarray  # piece of each window


def pieces(g: np.ndarray, seq: np.ndarray, start: np.ndarray, end: np.ndarray, gap: int) -> Pieces:
    """Cut a block's windows (sorted global indices, their sequence, first and end step) into pieces.

    A piece is a run of consecutive windows of one sequence (a slice of the plan, or part of
    one) no more than ``gap`` steps apart: its steps are read as one range. Windows far apart
    in a long sequence are separate pieces, so a block reads what its windows cover, not the
    sequence between them (nor the steps a stride larger than the window skips).
    """
    n = len(g)
    step = np.diff(g) > 1  # duplicates (equalize="pad" wrapping around) stay in one piece
    new = np.ones(n, dtype=bool)
    new[1:] = step | (seq[1:] != seq[:-1]) | (start[1:] - end[:-1] > gap)
    first = np.flatnonzero(new)
    joined = np.zeros(len(first), dtype=bool)
    joined[1:] = ~step[first[1:] - 1]
    s_hi = np.maximum.reduceat(end, first) if n else end
    return Pieces(seq[first], start[first], s_hi, joined, np.cumsum(new) - 1)


@dataclass(frozen=True)
class Reach:
    """The byte ranges a block reads per sequence: which steps a read that failed at a byte delivered."""

    uniq: np.ndarray
    r_lo: np.ndarray  # first byte read of each sequence (its .npy header when read from step 0)
    r_hi: np.ndarray  # end of the bytes read
    data0: np.ndarray  # where its array data begins
    s_lo: np.ndarray  # first step read
    step_bytes: int

    def steps_before(self, u: int, fail: int) -> int:
        """Steps of sequence u whose bytes lie before byte ``fail`` (none if its header was cut short)."""
        if self.s_lo[u] == 0 and fail < self.data0[u]:
            return 0
        return max(int(fail - self.data0[u]) // self.step_bytes, 0)
