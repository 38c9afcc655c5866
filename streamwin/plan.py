"""The plan: which windows each stream yields, in which order, and how many batches.

A pure function of (window counts per sequence, shard boundaries, window spec, epoch, seed,
world_size, num_workers, batch_size); no I/O, so it is exhaustively testable and plans
4096 ranks on one machine in milliseconds.

It works in *window space*: the windows of the whole dataset numbered 0..N-1 in manifest
order (sequence by sequence, start by start).

1. A **slice** is a run of about ``slice_windows`` consecutive windows inside one shard:
   one byte-range read. Shards are cut into slices of equal size; a long sequence spans
   several slices, a slice may hold many short sequences.
2. The slices are permuted with an RNG keyed by (seed, epoch), the same on every rank, and
   laid end to end: the epoch's window order ``V``.
3. ``V`` is cut into ``S = world_size * max(1, num_workers)`` ranges whose sizes differ by at
   most one window. Stream ``s`` (rank ``s // workers``, worker ``s % workers``) takes range
   ``s``, so the streams are balanced to the window whatever the data.
4. Every stream yields exactly ``L`` windows, ``L`` a multiple of the batch size: with
   equalize="drop" ``L`` rounds the smallest range down (fewer than S * batch_size windows are
   dropped per epoch); with "pad" it rounds the largest up and fills with the windows that
   follow the range in ``V`` (fewer than S * batch_size repeats, each marked weight 0).
5. A stream's windows are cut into blocks of ``block_windows``; each block is permuted with an
   RNG keyed by (seed, epoch, stream, block). That is the shuffle; its state is a position.

Window space itself depends only on the data, the window spec and the split, never on the
epoch, world or workers: a ``WindowIndex`` numbers it once per dataset. It keeps the first
window of every ``chunk``-th sequence (1/64 of an array of window starts: 1.25 MB rather
than 80 MB at 10 million sequences) and counts the windows of the few chunks a block touches
when it locates them; so a plan holds nothing per sequence, and a worker process that
receives the index (pickled, 1.25 MB) never scans the dataset.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

CHUNK_SEQS = 64  # sequences per WindowIndex chunk
SCAN_SEQS = 1 << 20  # sequences counted at once when a WindowIndex is built (bounds its temporaries)
Views = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]  # sequence indices -> (first step, steps)


@dataclass(frozen=True)
class WindowSpec:
    """How windows are cut from a sequence of length T.

    Windows start at 0, stride, 2*stride, ... while start + window + horizon <= T. With
    ``pad`` a sequence shorter than window + horizon (but not empty) gives one window at 0,
    padded with zeros and masked.
    """

    window: int
    stride: int
    horizon: int = 0
    pad: bool = False

    def __post_init__(self) -> None:
        for name, low in (("window", 1), ("stride", 1), ("horizon", 0)):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")

    @property
    def span(self) -> int:
        """Steps one window reads: the window and its horizon."""
        return self.window + self.horizon

    def counts(self, lengths: np.ndarray) -> np.ndarray:
        """Windows per sequence (int64), vectorized."""
        # float64 division is exact here (lengths < 2**52) and several times faster than int64 //
        room = np.asarray(lengths, dtype=np.float64) - self.span
        n = np.floor_divide(room, self.stride, out=room)
        n += 1
        np.maximum(n, 1.0 if self.pad else 0.0, out=n)
        n = n.astype(np.int64)
        if self.pad:
            n[np.asarray(lengths) <= 0] = 0
        return n


@dataclass(frozen=True)
class PlanConfig:
    """Everything besides the data that the plan depends on; part of the checkpoint fingerprint."""

    spec: WindowSpec
    batch_size: int
    world_size: int = 1
    num_workers: int = 0
    seed: int = 0
    shuffle: bool = True
    block_windows: int = 10_000
    slice_windows: int = 1_250
    equalize: str = "drop"

    def __post_init__(self) -> None:
        for name, low in (("batch_size", 1), ("world_size", 1), ("num_workers", 0), ("seed", 0),
                          ("block_windows", 1), ("slice_windows", 1)):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.equalize not in ("drop", "pad"):
            raise ValueError(f"equalize must be 'drop' or 'pad', got {self.equalize!r}")

    @property
    def workers_per_rank(self) -> int:
        return max(1, self.num_workers)

    @property
    def num_streams(self) -> int:
        return self.world_size * self.workers_per_rank


class WindowIndex:
    """Window space of a dataset: which sequence and step each global window index means.

    Built once per dataset (it depends on the lengths, the window spec and the split views
    only). ``views(seqs)`` gives (first step, steps) of the part of each sequence a split
    reads; None reads whole sequences. ``coarse`` (from another process's index of the same
    data) skips the scan.
    """

    def __init__(self, lengths: np.ndarray, spec: WindowSpec, views: Views | None = None, *,
                 coarse: np.ndarray | None = None, chunk: int = CHUNK_SEQS):
        self.lengths, self.spec, self.views, self.chunk = lengths, spec, views, int(chunk)
        self.n = len(lengths)
        chunks = -(-self.n // self.chunk)
        if coarse is not None and len(coarse) != chunks + 1:
            raise ValueError(f"coarse window index has {len(coarse)} entries, {self.n} sequences need {chunks + 1}")
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
        """(sequence index, window start step) of global window indices ``g``."""
        g = np.asarray(g, dtype=np.int64)
        if not len(g):
            return g.copy(), g.copy()
        # the chunk of each window is the last one starting at or before it; count only those chunks
        chunks = np.unique(np.searchsorted(self.coarse, g, side="right") - 1)
        seqs, first, lo = self._rows(chunks)
        # first windows are sorted across the rows: the last one at or before g is g's sequence
        pos = np.searchsorted(first, g, side="right") - 1
        start = (g - first[pos]) * self.spec.stride
        if lo is not None:
            start = start + lo[pos]
        return seqs[pos], start

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


@dataclass(frozen=True, eq=False)
class Plan:
    """One epoch's plan for all streams; cheap to build, arrays shared by every stream."""

    config: PlanConfig
    epoch: int
    index: WindowIndex  # the dataset's window space (shared by every epoch's plan)
    slice_lo: np.ndarray  # [P] first global window of each slice, in epoch order
    slice_pos: np.ndarray  # [P + 1] position in V where each slice begins
    stream_lo: np.ndarray  # [S + 1] range of V owned by each stream
    windows_per_stream: int  # L, a multiple of batch_size

    @property
    def total_windows(self) -> int:
        return self.index.total

    @property
    def batches_per_stream(self) -> int:
        return self.windows_per_stream // self.config.batch_size

    @property
    def batches_per_rank(self) -> int:
        return self.batches_per_stream * self.config.workers_per_rank

    @property
    def dropped_windows(self) -> int:
        """Windows of the dataset not yielded this epoch (equalize="drop")."""
        owned = np.minimum(np.diff(self.stream_lo), self.windows_per_stream)
        return self.total_windows - int(owned.sum())

    @property
    def repeated_windows(self) -> int:
        """Windows yielded a second time to equalize steps (equalize="pad"), marked weight 0."""
        return int(np.maximum(self.windows_per_stream - np.diff(self.stream_lo), 0).sum())

    def num_blocks(self, stream: int) -> int:
        return -(-self.windows_per_stream // self.config.block_windows)

    def block(self, stream: int, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(global window indices, real flags) of one block of a stream, in yield order."""
        g, real, order = self.block_parts(stream, block)
        return (g[order], real[order]) if order is not None else (g, real)

    def block_parts(self, stream: int, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(global window indices, real flags, yield order) of a block: ``g[order]`` is ``block()``'s.

        ``g`` is in stream order, runs of consecutive windows, which the reader finds and
        groups by sequence faster than a shuffled order; ``order`` is None without shuffle.
        """
        cfg = self.config
        lo = block * cfg.block_windows
        hi = min(lo + cfg.block_windows, self.windows_per_stream)
        if not 0 <= lo < hi:
            raise IndexError(f"stream {stream} has no block {block}")
        positions = np.arange(lo, hi, dtype=np.int64)
        owned = int(self.stream_lo[stream + 1] - self.stream_lo[stream])
        real = positions < owned
        v = (self.stream_lo[stream] + positions) % max(self.total_windows, 1)
        j = np.searchsorted(self.slice_pos, v, side="right") - 1
        g = self.slice_lo[j] + (v - self.slice_pos[j])
        order = None
        if cfg.shuffle:
            order = np.random.default_rng([cfg.seed, self.epoch, stream, block, 1]).permutation(len(g))
        return g, real, order

    def locate(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(sequence index, window start step) of global window indices."""
        return self.index.locate(g)

    def ends(self, seq: np.ndarray) -> np.ndarray:
        """Step where each sequence's usable data ends (its length, or its view's end under a split)."""
        return self.index.ends(seq)


def make_plan(lengths: np.ndarray | None, shard_starts: np.ndarray, config: PlanConfig, epoch: int,
              views: tuple[np.ndarray, np.ndarray] | None = None, *, index: WindowIndex | None = None) -> Plan:
    """Plan one epoch. ``shard_starts[k]`` is the first sequence of shard k (with a final total).

    ``views`` = (first step, number of steps) per sequence restricts windows to part of each
    sequence (a split: 0 steps excludes a sequence; a temporal holdout keeps a prefix or suffix).
    ``index``, the dataset's WindowIndex built once, replaces ``lengths`` and ``views``: then
    planning an epoch costs O(slices), nothing per sequence.
    """
    if not isinstance(epoch, (int, np.integer)) or epoch < 0:
        raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
    if index is None:
        index = WindowIndex(np.asarray(lengths, dtype=np.int64), config.spec,
                            None if views is None else array_views(*views))
    elif index.spec != config.spec:
        raise ValueError(f"the window index was built for {index.spec}, the plan asks for {config.spec}")
    slice_lo, slice_len = _cut_slices(index.starts(shard_starts), config.slice_windows)
    if config.shuffle and len(slice_lo) > 1:
        order = np.random.default_rng([config.seed, epoch, 0]).permutation(len(slice_lo))
        slice_lo, slice_len = slice_lo[order], slice_len[order]
    slice_pos = np.concatenate([[0], np.cumsum(slice_len)]).astype(np.int64)
    total = index.total
    streams = config.num_streams
    stream_lo = (np.arange(streams + 1, dtype=np.int64) * total) // streams
    sizes = np.diff(stream_lo)
    b = config.batch_size
    if config.equalize == "drop":
        per_stream = b * (int(sizes.min()) // b)
    else:
        per_stream = b * -(-int(sizes.max()) // b) if total else 0
    return Plan(config, epoch, index, slice_lo, slice_pos, stream_lo, per_stream)


def _cut_slices(shard_window_bounds: np.ndarray, target: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut each shard's window range into near-equal slices of at most ``target`` windows."""
    lo, hi = shard_window_bounds[:-1], shard_window_bounds[1:]
    n = hi - lo
    pieces = np.where(n > 0, -(-n // target), 0)
    shard = np.repeat(np.arange(len(n)), pieces)
    k = np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    start = lo[shard] + (k * n[shard]) // pieces[shard]
    end = lo[shard] + ((k + 1) * n[shard]) // pieces[shard]
    return start.astype(np.int64), (end - start).astype(np.int64)
