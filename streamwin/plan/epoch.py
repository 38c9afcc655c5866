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
from functools import lru_cache
from typing import Callable, Sequence

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


class SliceOrder:
    """An epoch's window order ``V`` in a fresh plan: the (permuted) slices laid end to end."""

    dropped_before = 0  # windows of the epoch no earlier plan left out

    def __init__(self, slice_lo: np.ndarray, slice_pos: np.ndarray):
        self.slice_lo, self.slice_pos = slice_lo, slice_pos  # first global window / position in V of each slice
        self.total = int(slice_pos[-1])

    def at(self, v: np.ndarray) -> np.ndarray:
        """Global window indices at positions ``v`` of the order."""
        j = np.searchsorted(self.slice_pos, v, side="right") - 1
        return self.slice_lo[j] + (v - self.slice_pos[j])


@dataclass(frozen=True, eq=False)
class Plan:
    """One epoch's plan for all streams; cheap to build, arrays shared by every stream."""

    config: PlanConfig
    epoch: int
    index: WindowIndex  # the dataset's window space (shared by every epoch's plan)
    order: "SliceOrder | RestOrder"  # the epoch's window order V that the streams cut into ranges
    stream_lo: np.ndarray  # [S + 1] range of V owned by each stream
    windows_per_stream: int  # L, a multiple of batch_size
    generation: int = 0  # elastic resumes this epoch has been through (keys the block shuffle)
    source: int | None = None  # a mixed dataset's source this plan deals (keys the block shuffle)

    @property
    def total_windows(self) -> int:
        """Windows in this plan's order: the dataset's, or what an interrupted epoch had left."""
        return self.order.total

    @property
    def batches_per_stream(self) -> int:
        return self.windows_per_stream // self.config.batch_size

    @property
    def batches_per_rank(self) -> int:
        return self.batches_per_stream * self.config.workers_per_rank

    @property
    def dropped_windows(self) -> int:
        """Windows of the epoch not yielded (equalize="drop"; after an elastic resume, by either plan)."""
        owned = np.minimum(np.diff(self.stream_lo), self.windows_per_stream)
        return self.order.dropped_before + self.total_windows - int(owned.sum())

    @property
    def repeated_windows(self) -> int:
        """Windows yielded a second time to equalize steps (equalize="pad"), marked weight 0."""
        return int(np.maximum(self.windows_per_stream - np.diff(self.stream_lo), 0).sum())

    def num_blocks(self, stream: int) -> int:
        return -(-self.windows_per_stream // self.config.block_windows)

    def owned(self, stream: int) -> int:
        """Windows of the order that stream ``stream`` owns (those of its positions that are real)."""
        return int(self.stream_lo[stream + 1] - self.stream_lo[stream])

    def consumed(self, stream: int, batches_per_rank: int) -> int:
        """Positions of ``stream`` yielded once its rank has taken ``batches_per_rank`` batches (round robin)."""
        n = self.config.workers_per_rank
        return min(worker_batches(batches_per_rank, n, stream % n), self.batches_per_stream) * self.config.batch_size

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
        real = positions < self.owned(stream)
        g = self.order.at((self.stream_lo[stream] + positions) % max(self.total_windows, 1))
        order = None
        if cfg.shuffle:
            key = [cfg.seed, self.epoch, stream, block, 1] + ([self.generation] if self.generation else [])
            if self.source is not None:  # sources' blocks of one stream are shuffled independently
                key += [2, self.source]
            order = np.random.default_rng(key).permutation(len(g))
        return g, real, order

    def locate(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(sequence index, window start step) of global window indices."""
        return self.index.locate(g)

    def ends(self, seq: np.ndarray) -> np.ndarray:
        """Step where each sequence's usable data ends (its length, or its view's end under a split)."""
        return self.index.ends(seq)


class RestOrder:
    """What an interrupted epoch had not yielded yet: each old stream's remaining real windows,
    in the order it would have yielded them, stream after stream (elastic resume deals this anew).

    ``rows`` lists (old stream, old block, positions of the block already yielded) for every
    block with windows left, and ``row_pos`` where each row's windows begin in the order: one
    row per block, so it stays small (a 10-million-window epoch in blocks of 10,000: ~1,000 rows).
    The yielded part is ``batches_per_rank`` batches per rank, or ``used[s]`` windows of each
    stream ``s`` (a mixed dataset's source takes a varying number of windows per batch).
    """

    def __init__(self, base: Plan, batches_per_rank: int | None = None, *, used: Sequence[int] | None = None):
        if (batches_per_rank is None) == (used is None):
            raise ValueError("RestOrder needs batches_per_rank or used (windows yielded per stream), not both")
        streams = base.config.num_streams
        if used is None:
            used = [base.consumed(s, int(batches_per_rank)) for s in range(streams)]
        elif len(used) != streams:
            raise ValueError(f"used lists {len(used)} streams, the plan has {streams}")
        self.base, self.used = base, [int(u) for u in used]
        self.dropped_before = base.dropped_windows
        bw, length = base.config.block_windows, base.windows_per_stream
        rows, counts = [], []
        for s in range(streams):
            used_s, owned = self.used[s], base.owned(s)
            for b in range(used_s // bw, base.num_blocks(s)):
                lo, hi = b * bw, min((b + 1) * bw, length)
                skip = max(used_s - lo, 0)
                if hi <= owned:  # every window of the block is real
                    left = hi - lo - skip
                elif lo >= owned:  # padding only (equalize="pad")
                    left = 0
                elif skip == 0:
                    left = owned - lo
                else:  # a partly yielded block holding padding: which are real depends on its shuffle
                    left = int(base.block(s, b)[1][skip:].sum())
                if left > 0:
                    rows.append((s, b, skip))
                    counts.append(left)
        self.rows = np.array(rows, dtype=np.int64).reshape(-1, 3)
        self.row_pos = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
        self.total = int(self.row_pos[-1])
        # blocks smaller than the old ones read one row many times in a row (and a rest of a rest multiplies
        # that): the last rows' windows are kept, so each old block is shuffled about once per pass
        self._left = lru_cache(maxsize=32)(self._row_windows)

    def _row_windows(self, row: int) -> np.ndarray:
        """The windows row ``row`` has left, in the order its old stream would have yielded them."""
        s, block, skip = self.rows[row].tolist()
        g, real = self.base.block(s, block)
        return g[skip:][real[skip:]]

    def at(self, v: np.ndarray) -> np.ndarray:
        """Global window indices at positions ``v`` of the order."""
        v = np.asarray(v, dtype=np.int64)
        r = np.searchsorted(self.row_pos, v, side="right") - 1
        out = np.empty(len(v), dtype=np.int64)
        runs = np.concatenate([[0], np.flatnonzero(np.diff(r)) + 1, [len(v)]]).tolist() if len(v) else []
        for a, b in zip(runs[:-1], runs[1:]):  # a block asks for consecutive positions: a few runs of one row each
            row = int(r[a])
            out[a:b] = self._left(row)[v[a:b] - self.row_pos[row]]
        return out


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
    return Plan(config, epoch, index, SliceOrder(slice_lo, slice_pos), *_deal(int(slice_pos[-1]), config))


def rest_plan(base: Plan, batches_per_rank: int, config: PlanConfig) -> Plan:
    """The rest of ``base``'s epoch after each rank took ``batches_per_rank`` batches, dealt over ``config``'s world.

    Elastic resume: every window ``base`` had not yielded (and meant to) is dealt once over the
    new streams, balanced to the window as in a fresh plan; blocks are shuffled anew. What the
    new streams cannot take as whole batches (fewer than streams * batch_size) is dropped, or
    with equalize="pad" filled with repeats.
    """
    check_elastic(base.config, config)
    order = RestOrder(base, batches_per_rank)
    return Plan(config, base.epoch, base.index, order, *_deal(order.total, config), generation=base.generation + 1)


def check_elastic(old: PlanConfig, new: PlanConfig) -> None:
    """Refuse to deal an interrupted epoch's rest under another window spec, seed or shuffle."""
    if new.spec != old.spec or new.seed != old.seed or new.shuffle != old.shuffle:
        raise ValueError("an elastic resume keeps the window spec, seed and shuffle of the interrupted plan")


def worker_batches(batches_per_rank: int, workers: int, worker: int) -> int:
    """Batches worker ``worker`` of a rank has yielded once the rank took ``batches_per_rank`` (round robin)."""
    return batches_per_rank // workers + (worker < batches_per_rank % workers)


def stream_ranges(total: int, streams: int) -> np.ndarray:
    """[S + 1]: stream s owns positions [r[s], r[s + 1]) of an order of ``total`` (sizes differ by at most one)."""
    return (np.arange(streams + 1, dtype=np.int64) * total) // streams


def _deal(total: int, config: PlanConfig) -> tuple[np.ndarray, int]:
    """Cut ``total`` windows into one range per stream (sizes differ by at most one) and the windows each yields."""
    stream_lo = stream_ranges(total, config.num_streams)
    sizes = np.diff(stream_lo)
    b = config.batch_size
    if config.equalize == "drop":
        return stream_lo, b * (int(sizes.min()) // b)
    return stream_lo, (b * -(-int(sizes.max()) // b) if total else 0)


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
