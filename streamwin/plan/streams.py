"""One source's window order dealt over the streams, cut into shuffled blocks; and the rest of it.

1. The order (``ShareOrder``, or a ``RestOrder`` after an elastic resume) is cut into
   ``S = world_size * max(1, num_workers)`` ranges whose sizes differ by at most one window.
   Stream ``s`` (rank ``s // workers``, worker ``s % workers``) takes range ``s``, so the
   streams are balanced to the window whatever the data.
2. Every stream yields exactly ``windows_per_stream`` windows of the source (the plan's batch
   quotas fix that number, see epoch.py): fewer than its range drops the rest
   (equalize="drop"); more fills with the windows that follow the range in the order
   (equalize="pad": repeats, each marked not real, weight 0).
3. A stream's windows are cut into blocks of ``block_windows``; each block is permuted with an
   RNG keyed by (seed, epoch, stream, block). That is the shuffle; its state is a position.
4. Each window is a crop: where it starts and how long it is are drawn from (seed, epoch,
   source, window) alone (crops.py). With ``pack_length`` a stream yields rows instead of
   windows: each block's crops fill a number of rows known from their lengths (rows.py), and
   the batch quotas count rows; the stream reads its windows' blocks until its rows are out.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Sequence

import numpy as np

from streamwin.plan.crops import lengths, place, units
from streamwin.plan.mix import quota_positions
from streamwin.plan.options import PlanConfig
from streamwin.plan.order import block_key, chunk_key
from streamwin.plan.rows import RowPlan, pack
from streamwin.plan.schedule import Parts, Schedule
from streamwin.plan.space import WindowSpace


@dataclass(frozen=True, eq=False)
class Plan:
    """One epoch's plan: a ``SourcePlan`` per source and the windows of each source in every batch."""

    config: PlanConfig
    epoch: int
    weights: np.ndarray  # normalized
    sources: tuple[SourcePlan, ...]  # per source: its order dealt over the streams; items_per_stream = its quotas' sum
    quotas: np.ndarray  # [J, sources] windows (rows when packed) of each source in batch j of every stream
    generation: int = 0  # elastic resumes this epoch has been through
    shared: bool = False  # a rank's workers share each batch, each writing its slots' rows (plan/canon.py)

    @property
    def positions(self) -> np.ndarray:
        """[J + 1, sources]: windows of each source a stream has yielded before batch j."""
        return quota_positions(self.quotas)

    @property
    def batches_per_stream(self) -> int:
        return len(self.quotas)

    @property
    def batches_per_rank(self) -> int:
        return self.batches_per_stream * self.config.workers_per_rank

    @property
    def total_windows(self) -> int:
        """Windows in this plan's orders: the epoch's, or what an interrupted epoch had left."""
        return sum(p.total_windows for p in self.sources)

    @property
    def dropped_windows(self) -> int:
        return sum(p.dropped_windows for p in self.sources)

    @property
    def repeated_windows(self) -> int:
        return sum(p.repeated_windows for p in self.sources)

    @property
    def dropped_rows(self) -> int:
        """Packed: rows the streams could fill but leave out to yield equally many (0 unpacked)."""
        return sum(p.dropped_rows for p in self.sources)

    def taken(self, stream: int, batches_per_rank: int) -> int:
        """Batches ``stream`` has yielded once its rank took ``batches_per_rank`` (round robin over workers)."""
        n = self.config.workers_per_rank
        return min(worker_batches(batches_per_rank, n, stream % n), self.batches_per_stream)

    def used(self, batches_per_rank: int) -> np.ndarray:
        """[sources, streams]: windows (rows when packed) of each source each stream has yielded after
        ``batches_per_rank``."""
        steps = [self.taken(s, batches_per_rank) for s in range(self.config.num_streams)]
        return self.positions[steps].T.copy()

    def worker_of(self, step: int, workers: int) -> int:
        """The worker that makes the rank's batch ``step`` (round robin)."""
        return step % workers

    def worker_taken(self, batches_per_rank: int, workers: int, worker: int) -> int:
        """Batches ``worker`` has made once its rank took ``batches_per_rank``."""
        return worker_batches(batches_per_rank, workers, worker)

    def rows(self, stream: int) -> tuple[int, int] | None:
        """The rows of the rank's batch that process ``stream`` writes when workers share batches, else None."""
        return None

    def schedule(self, stream: int) -> "QuotaSchedule":
        """What stream ``stream`` (rank * max(1, workers) + worker) takes from each source per batch."""
        return QuotaSchedule(self.quotas, [(i, stream) for i in range(len(self.sources))], self.sources)


class QuotaSchedule(Schedule):
    """A stream's batches: batch j takes ``quotas[j, i]`` items of source i's lane (i, stream), from each source's
    block plan (``plans``)."""

    def __init__(self, quotas: np.ndarray, lanes: list[tuple[int, int]], plans: Sequence[SourcePlan]):
        self.quotas, self.lanes, self.batches, self.plans = quotas, lanes, len(quotas), plans
        self._positions = quota_positions(quotas)

    def parts(self, j: int) -> tuple[Parts, np.ndarray]:
        q = self.quotas[j]
        return [(i, int(n)) for i, n in enumerate(q.tolist()) if n], q

    def positions(self, j: int) -> list[int]:
        return self._positions[min(j, self.batches)].tolist()


def stream_ranges(total: int, streams: int, weights: np.ndarray | None = None) -> np.ndarray:
    """[S + 1]: stream s owns positions [r[s], r[s + 1]) of an order of ``total`` (sizes differ by at most one,
    or with ``weights`` [S] are in their proportion, within one)."""
    if weights is None:
        return (np.arange(streams + 1, dtype=np.int64) * total) // streams
    cw = np.concatenate([[0], np.cumsum(weights, dtype=np.int64)])
    return (cw * total) // max(int(cw[-1]), 1)


def worker_batches(batches_per_rank: int, workers: int, worker: int) -> int:
    """Batches worker ``worker`` of a rank has yielded once the rank took ``batches_per_rank`` (round robin)."""
    return batches_per_rank // workers + (worker < batches_per_rank % workers)


@dataclass(frozen=True, eq=False)
class SourcePlan:
    """One source's order in one epoch, dealt over every stream; cheap to build, arrays shared by every stream."""

    config: PlanConfig
    epoch: int
    space: WindowSpace  # the source's window space (shared by every epoch's plan)
    order: "object"  # the epoch's window order V (ShareOrder or RestOrder) that the streams cut into ranges
    stream_lo: np.ndarray  # [S + 1] range of V owned by each stream
    windows_per_stream: int  # windows of this source each stream takes from its range (packed: all it owns)
    generation: int = 0  # elastic resumes this epoch has been through (keys the block shuffle)
    source: int | None = None  # the source this plan deals, None for a dataset of one (keys the block shuffle)
    rows: RowPlan | None = None  # packed (pack_length): every stream's rows per block
    rows_per_stream: int | np.ndarray = 0  # packed: rows of this source each stream yields (canonical: per stream)
    lengths: np.ndarray | None = None  # canonical: windows each stream yields (they differ by slot), else None
    bounds: tuple | None = None  # canonical, aligned: per stream, items before each of its blocks (Q steps each)
    _recent: dict = field(default_factory=dict, init=False, repr=False)  # the last blocks' parts (read, then cut)

    @property
    def items_per_stream(self) -> int:
        """What each stream yields of this source: rows when packed, else windows (the batch quotas' unit)."""
        return self.rows_per_stream if self.rows is not None else self.windows_per_stream

    def item_bounds(self, stream: int) -> np.ndarray:
        """[blocks + 1]: items (rows when packed, else windows) of ``stream`` before each of its blocks."""
        if self.rows is not None:
            return self.rows.bounds(stream)
        if self.bounds is not None:
            return self.bounds[stream]
        nb = self.num_blocks(stream)
        return np.minimum(np.arange(nb + 1, dtype=np.int64) * self.config.block_windows, self.length(stream))

    @property
    def crop_key(self) -> tuple[int, int, int | None]:
        """What a crop's draws are keyed by besides its window: (seed, epoch, source)."""
        return self.config.seed, self.epoch, self.source

    @property
    def total_windows(self) -> int:
        """Windows in this plan's order: the source's share, or what an interrupted epoch had left."""
        return self.order.total

    @property
    def dropped_windows(self) -> int:
        """Windows of the epoch not yielded (equalize="drop"; after an elastic resume, by either plan).

        Packed: the windows dealt to no stream (the rows a stream leaves are ``dropped_rows``).
        """
        owned = np.minimum(np.diff(self.stream_lo), self._lengths)
        return self.order.dropped_before + self.total_windows - int(owned.sum())

    @property
    def dropped_rows(self) -> int:
        """Packed: rows the streams could fill but leave out so that every stream yields as many (else 0)."""
        return 0 if self.rows is None else int((self.rows.per_stream - self.rows_per_stream).sum())

    @property
    def repeated_windows(self) -> int:
        """Windows yielded a second time to equalize steps (equalize="pad"), marked weight 0."""
        return int(np.maximum(self._lengths - np.diff(self.stream_lo), 0).sum())

    @property
    def _lengths(self) -> np.ndarray | int:
        return self.windows_per_stream if self.lengths is None else self.lengths

    def length(self, stream: int) -> int:
        """Windows of this source stream ``stream`` yields in the epoch (packed: reads)."""
        return self.windows_per_stream if self.lengths is None else int(self.lengths[stream])

    def num_blocks(self, stream: int) -> int:
        if self.bounds is not None:
            return len(self.bounds[stream]) - 1
        return -(-self.length(stream) // self.config.block_windows)

    def owned(self, stream: int) -> int:
        """Windows of the order that stream ``stream`` owns (those of its positions that are real)."""
        return int(self.stream_lo[stream + 1] - self.stream_lo[stream])

    def block(self, stream: int, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(global window indices, real flags) of one block of a stream, in yield order."""
        g, real, order = self.block_parts(stream, block)
        return (g[order], real[order]) if order is not None else (g, real)

    def block_parts(self, stream: int, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(global window indices, real flags, yield order) of a block: ``g[order]`` is ``block()``'s.

        ``g`` is in stream order, runs of consecutive windows, which the reader finds and
        groups by sequence faster than a shuffled order; ``order`` is None without shuffle.
        """
        parts = self._recent.get((stream, block))
        if parts is None:
            parts = self._block_parts(stream, block)
            if len(self._recent) >= 4:
                self._recent.clear()
            self._recent[(stream, block)] = parts
        return parts

    def _block_parts(self, stream: int, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        cfg = self.config
        if self.bounds is not None:
            lo, hi = int(self.bounds[stream][block]), int(self.bounds[stream][block + 1])
        else:
            lo = block * cfg.block_windows
            hi = min(lo + cfg.block_windows, self.length(stream))
        if not 0 <= lo < hi and not (self.bounds is not None and 0 <= lo == hi):  # aligned: a slot of 0 items
            raise IndexError(f"stream {stream} has no block {block}")
        positions = np.arange(lo, hi, dtype=np.int64)
        real = positions < self.owned(stream)
        g = self.order.at((self.stream_lo[stream] + positions) % max(self.total_windows, 1))
        order = None
        if cfg.shuffle and self.bounds is not None:  # aligned to the step: the chunk's permutation, restricted
            order = self.stripe_shuffle(block, stream, stream + 1)
        elif cfg.shuffle:
            key = block_key(cfg.seed, self.epoch, stream, block, self.generation, self.source)
            order = np.random.default_rng(key).permutation(len(g))
        for a in (g, real, order):
            if a is not None:
                a.flags.writeable = False  # shared by the callers of the same block
        return g, real, order

    def stripe_shuffle(self, block: int, first: int, last: int) -> np.ndarray:
        """Blocks aligned to the step: streams [first, last)'s items of block ``block``, laid end to end, in their
        shuffled order, stream after stream. One permutation of the chunk (every stream's block ``block``, keyed
        (seed, epoch, block)), restricted to each stream's items: the same order whichever streams a process holds."""
        sizes = np.array([b[block + 1] - b[block] for b in self.bounds], dtype=np.int64)
        at = np.concatenate([[0], np.cumsum(sizes)])
        key = chunk_key(self.config.seed, self.epoch, block, self.generation, self.source)
        perm = np.random.default_rng(key).permutation(int(at[-1]))
        lo, hi = at[first], at[last]
        mine = perm if lo == 0 and hi == len(perm) else perm[(perm >= lo) & (perm < hi)] - lo  # in the chunk's order
        if last - first == 1:
            return mine
        owner = np.repeat(np.arange(last - first, dtype=np.int16), sizes[first:last])  # <= 4096 slots
        return mine[np.argsort(owner[mine], kind="stable")]  # a radix sort

    def locate(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(sequence index, crop start step) of global window indices: the grid's, or drawn (crops.place)."""
        spec = self.config.spec
        if not (spec.jitter or spec.windows_per_sequence is not None):
            return self.space.locate(g)
        seq, j, lo = self.space.slots(g)
        return seq, place(spec, self.crop_key, g, j, lo, self.space.ends(seq))

    def crop_lengths(self, g: np.ndarray) -> np.ndarray:
        """Steps of the crops at global window indices ``g`` (the window, or drawn; a padded short one's steps)."""
        spec = self.config.spec
        if spec.pad:  # only a padded window of a short sequence has fewer steps than its span
            seq, start = self.locate(g)
            valid = np.minimum(self.space.ends(seq) - start, spec.span)
        else:
            valid = np.full(len(g), spec.span, dtype=np.int64)
        return lengths(spec, self.crop_key, g, valid)

    def packed(self, stream: int, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(order, row_ptr, offset) of block ``block``'s crops packed into its rows (rows.pack), indices
        into the block's windows in yield order (``block()``); offsets in patches."""
        g, real = self.block(stream, block)
        mine = np.flatnonzero(real)
        size = units(self.config.spec, self.crop_lengths(g[mine]))
        order, row_ptr, offset = pack(size, self.rows.rows(stream, block), self.rows.row_units,
                                      self.row_key(stream, block))
        return mine[order], row_ptr, offset

    def row_key(self, stream: int, block: int) -> list[int] | None:
        """RNG key of the order of a packed block's rows (None without shuffle)."""
        cfg = self.config
        if not cfg.shuffle:
            return None
        return block_key(cfg.seed, self.epoch, stream, block, self.generation, self.source) + [3]

    def ends(self, seq: np.ndarray) -> np.ndarray:
        """Step where each sequence's usable data ends (its length, or its view's end under a split)."""
        return self.space.ends(seq)


class RestOrder:
    """What an interrupted epoch had not yielded yet of one source: each old stream's remaining real
    windows, in the order it would have yielded them, stream after stream (elastic resume deals this anew).

    ``rows`` lists (old stream, old block, positions of the block already yielded) for every
    block with windows left, and ``row_pos`` where each row's windows begin in the order: one
    row per block, so it stays small (a 10-million-window epoch in blocks of 10,000: ~1,000 rows).
    ``used[s]`` is how many windows old stream ``s`` had yielded.
    """

    def __init__(self, base: SourcePlan, used: Sequence[int]):
        streams = base.config.num_streams
        if len(used) != streams:
            raise ValueError(f"used lists {len(used)} streams, the plan has {streams}")
        self.base, self.used = base, [int(u) for u in used]
        self.dropped_before = base.dropped_windows
        rows, counts = [], []
        for s in range(streams):
            left = self._packed_left(s) if base.rows is not None else self._left_of(s)
            for b, skip, n in left:
                if n > 0:
                    rows.append((s, b, skip))
                    counts.append(n)
        self.rows = np.array(rows, dtype=np.int64).reshape(-1, 3)
        self.row_pos = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
        self.total = int(self.row_pos[-1])
        # blocks smaller than the old ones read one row many times in a row (and a rest of a rest multiplies
        # that): the last rows' windows are kept, so each old block is shuffled about once per pass
        self._left = lru_cache(maxsize=32)(self._row_windows)

    def _left_of(self, s: int):
        """(block, windows of it yielded, windows left) of old stream ``s``'s blocks with windows left."""
        base, used_s = self.base, self.used[s]
        owned, bounds = base.owned(s), base.item_bounds(s)  # blocks of block_windows, or aligned to the step
        for b in range(max(int(np.searchsorted(bounds, used_s, side="right")) - 1, 0), base.num_blocks(s)):
            lo, hi = int(bounds[b]), int(bounds[b + 1])
            skip = max(used_s - lo, 0)
            if hi <= owned:  # every window of the block is real
                left = hi - lo - skip
            elif lo >= owned:  # padding only (equalize="pad")
                left = 0
            elif skip == 0:
                left = owned - lo
            else:  # a partly yielded block holding padding: which are real depends on its shuffle
                left = int(base.block(s, b)[1][skip:].sum())
            yield b, skip, left

    def _packed_left(self, s: int):
        """(block, rows of it yielded, crops left) of old stream ``s``'s blocks (packed): every crop not in a
        yielded row, those of the block the stream stopped in (packing it) and every one of the blocks after."""
        base, used_s = self.base, self.used[s]
        bw, length, owned = base.config.block_windows, base.length(s), base.owned(s)
        bounds = base.rows.bounds(s)
        first = int(np.searchsorted(bounds, used_s, side="right")) - 1
        for b in range(first, base.num_blocks(s)):
            real = max(min(owned, (b + 1) * bw, length) - b * bw, 0)
            skip = used_s - int(bounds[b]) if b == first else 0
            yield b, skip, real - (int(base.packed(s, b)[1][skip]) if skip else 0)

    def _row_windows(self, row: int) -> np.ndarray:
        """The windows row ``row`` has left, in the order its old stream would have yielded them.

        Packed, from a block partly yielded: the crops of its rows not yielded, row by row, then
        any crop that fit in no row, in block order.
        """
        s, block, skip = self.rows[row].tolist()
        g, real = self.base.block(s, block)
        if self.base.rows is None:
            return g[skip:][real[skip:]]
        if not skip:
            return g[real]
        order, row_ptr, _ = self.base.packed(s, block)
        placed = np.zeros(len(g), dtype=bool)
        placed[order] = True
        return g[np.concatenate([order[row_ptr[skip]:], np.flatnonzero(real & ~placed)])]

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
