"""Window space: the windows of one source numbered 0..N-1 in manifest order.

Window space depends only on the data, the window spec and the split, never on the epoch,
world or workers: a ``WindowSpace`` numbers it once per source. It keeps the first window of
every ``chunk``-th sequence (1/64 of an array of window starts: 1.25 MB rather than 80 MB at
10 million sequences) and counts the windows of the few chunks a block touches when it locates
them; so a plan holds nothing per sequence, and a worker process that receives the space's
scan (pickled, 1.25 MB) never scans the dataset.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from streamwin.plan.options import WindowSpec

CHUNK_SEQS = 64  # sequences per WindowSpace chunk
SCAN_SEQS = 1 << 20  # sequences counted at once when a WindowSpace is built (bounds its temporaries)
Views = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]  # sequence indices -> (first step, steps)


class WindowSpace:
    """The window space of one source: which sequence and step each global window index means.

    Built once per dataset (it depends on the lengths, the window spec and the split views
    only). ``views(seqs)`` gives (first step, steps) of the part of each sequence a split
    reads; None reads whole sequences. ``coarse`` (the scan of another process's space over the
    same data) skips the scan.
    """

    def __init__(self, lengths: np.ndarray, spec: WindowSpec, views: Views | None = None, *,
                 coarse: np.ndarray | None = None, chunk: int = CHUNK_SEQS):
        self.lengths, self.spec, self.views, self.chunk = lengths, spec, views, int(chunk)
        self.n = len(lengths)
        chunks = -(-self.n // self.chunk)
        if coarse is not None and len(coarse) != chunks + 1:
            raise ValueError(f"coarse window space has {len(coarse)} entries, {self.n} sequences need {chunks + 1}")
        self.coarse = self._scan() if coarse is None else np.asarray(coarse, dtype=np.int64)

    @property
    def total(self) -> int:
        return int(self.coarse[-1])

    def _counts(self, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """(windows, first step of the view or None) of sequences ``seqs``."""
        if self.n == 0:  # nothing to index (the callers clamp indices to n - 1)
            zeros = np.zeros(np.shape(np.arange(0)[seqs] if isinstance(seqs, slice) else seqs), dtype=np.int64)
            return zeros, None if self.views is None else zeros
        if self.views is None:
            return self.spec.counts(self.lengths[seqs]), None
        lo, steps = self.views(seqs)
        return self.spec.counts(steps), lo

    def _scan(self) -> np.ndarray:
        """First window of every chunk-th sequence (and the total), counted SCAN_SEQS sequences at a time."""
        k = self.chunk
        sums = np.zeros(-(-self.n // k), dtype=np.int64)
        step = max(k, SCAN_SEQS - SCAN_SEQS % k)
        for lo in range(0, self.n, step):
            hi = min(lo + step, self.n)
            counts = self._counts(np.arange(lo, hi) if self.views is not None else slice(lo, hi))[0]
            padded = np.zeros(-(-(hi - lo) // k) * k, dtype=np.int64)
            padded[: hi - lo] = counts
            sums[lo // k : lo // k + len(padded) // k] = padded.reshape(-1, k).sum(axis=1)
        coarse = np.zeros(len(sums) + 1, dtype=np.int64)
        np.cumsum(sums, out=coarse[1:])
        return coarse

    def _rows(self, chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(sequences, first window of each, view starts) of whole chunks, flattened in order."""
        k = self.chunk
        seqs = (chunks[:, None] * k + np.arange(k)).ravel()
        valid = seqs < self.n
        counts, lo = self._counts(np.minimum(seqs, max(self.n - 1, 0)))
        counts = np.where(valid, counts, 0).reshape(-1, k)
        starts = np.cumsum(counts, axis=1) - counts + self.coarse[chunks][:, None]
        return seqs, starts.ravel(), lo

    def starts(self, seqs: np.ndarray) -> np.ndarray:
        """First global window of sequences ``seqs`` (``n`` gives the total)."""
        seqs = np.asarray(seqs, dtype=np.int64)
        chunks, within = np.divmod(seqs, self.chunk)
        members = chunks[:, None] * self.chunk + np.arange(self.chunk)
        counts = self._counts(np.minimum(members, max(self.n - 1, 0)).ravel())[0].reshape(members.shape)
        before = np.arange(self.chunk) < within[:, None]
        return self.coarse[chunks] + np.where(before, counts, 0).sum(axis=1)

    def locate(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(sequence index, window start step) of global window indices ``g`` on the stride grid."""
        seq, j, lo = self.slots(g)
        return seq, lo + j * self.spec.stride

    def slots(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sequence index, slot within its sequence, first step of its view) of global window indices ``g``."""
        g = np.asarray(g, dtype=np.int64)
        if not len(g):
            return g.copy(), g.copy(), g.copy()
        # the chunk of each window is the last one starting at or before it; count only those chunks
        chunks = np.unique(np.searchsorted(self.coarse, g, side="right") - 1)
        seqs, first, lo = self._rows(chunks)
        # first windows are sorted across the rows: the last one at or before g is g's sequence
        pos = np.searchsorted(first, g, side="right") - 1
        return seqs[pos], g - first[pos], np.zeros_like(g) if lo is None else lo[pos]

    def ends(self, seqs: np.ndarray) -> np.ndarray:
        """Step where each sequence's usable data ends (its length, or its view's end under a split)."""
        seqs = np.asarray(seqs, dtype=np.int64)
        if self.views is None:
            return np.asarray(self.lengths[seqs], dtype=np.int64)
        lo, steps = self.views(seqs)
        return lo + steps

    def totals(self) -> dict[str, int]:
        """Sequences with data, their steps, and those too short for a window (pad off), counted in pieces."""
        out = {"sequences": 0, "steps": 0, "short_sequences": 0}
        for lo in range(0, self.n, SCAN_SEQS):
            seqs = np.arange(lo, min(lo + SCAN_SEQS, self.n))
            steps = np.asarray(self.lengths[seqs] if self.views is None else self.views(seqs)[1], dtype=np.int64)
            used = steps > 0
            out["sequences"] += int(used.sum())
            out["steps"] += int(steps.sum())
            out["short_sequences"] += 0 if self.spec.pad else int((used & (steps < self.spec.span)).sum())
        return out


def array_views(view_lo: np.ndarray, view_len: np.ndarray) -> Views:
    """Views given as two per-sequence arrays (first step, steps)."""
    lo, steps = np.asarray(view_lo, dtype=np.int64), np.asarray(view_len, dtype=np.int64)
    return lambda seqs: (lo[seqs], steps[seqs])
