"""An epoch's window order of one source: its slices, permuted per epoch (and per repetition), end to end.

1. A **slice** is a run of about ``slice_windows`` consecutive windows inside one shard: one
   byte-range read. Each shard's window range is cut into slices of equal size; a long
   sequence spans several slices, a slice may hold many short sequences.
2. The slices are permuted with an RNG keyed by (seed, epoch, source, repetition), the same on
   every rank, and laid end to end. A source's share of an epoch is ``total`` windows of that
   order: every window once for a dataset of one source; with mixing a small source repeats
   (each repetition permuted anew) and a large one gives a different subset each epoch.

The order is a pure function of these inputs, so a checkpoint never stores it.
"""
from __future__ import annotations

import numpy as np

# a dataset of one source keeps the RNG keys of streamwin 0.1, so its checkpoints resume exactly
ONLY_SOURCE = None


def slice_key(seed: int, epoch: int, source: int | None, repetition: int) -> list[int]:
    """RNG key of the slice permutation of ``source``'s ``repetition`` in ``epoch`` (``ONLY_SOURCE``: unmixed)."""
    if source is ONLY_SOURCE:
        return [seed, epoch, 0]
    return [seed, epoch, source, repetition, 2]


def block_key(seed: int, epoch: int, stream: int, block: int, generation: int, source: int | None) -> list[int]:
    """RNG key of the permutation of one block of a stream (a new generation after each elastic resume)."""
    key = [seed, epoch, stream, block, 1] + ([generation] if generation else [])
    return key if source is ONLY_SOURCE else key + [2, source]


def chunk_key(seed: int, epoch: int, chunk: int, generation: int, source: int | None) -> list[int]:
    """RNG key of the one permutation of a chunk of steps, every canonical stream's block of it (one phase)."""
    key = [seed, epoch, chunk, 3] + ([generation] if generation else [])
    return key if source is ONLY_SOURCE else key + [2, source]


def cut_slices(shard_window_bounds: np.ndarray, target: int) -> tuple[np.ndarray, np.ndarray]:
    """(first window, windows) of each slice: each shard's window range cut into near-equal slices of at most ``target``."""
    lo, hi = shard_window_bounds[:-1], shard_window_bounds[1:]
    n = hi - lo
    pieces = np.where(n > 0, -(-n // target), 0)
    shard = np.repeat(np.arange(len(n)), pieces)
    k = np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    start = lo[shard] + (k * n[shard]) // pieces[shard]
    end = lo[shard] + ((k + 1) * n[shard]) // pieces[shard]
    return start.astype(np.int64), (end - start).astype(np.int64)


class ShareOrder:
    """A source's window order in an epoch: its slices permuted per repetition, cut at ``total`` windows."""

    dropped_before = 0  # windows of the epoch no earlier plan left out

    def __init__(self, slice_lo: np.ndarray, slice_len: np.ndarray, total: int, *, seed: int, epoch: int,
                 source: int | None, shuffle: bool):
        self.slice_lo, self.slice_len = slice_lo, slice_len  # in manifest order
        self.windows = int(slice_len.sum())  # N: the source's windows
        if total > 0 and self.windows == 0:
            raise ValueError(f"source {source} has no windows but a share of {total}")
        self.total, self.seed, self.epoch, self.source, self.shuffle = int(total), int(seed), int(epoch), source, shuffle
        self._reps: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    @property
    def repeats(self) -> float:
        """How many times the epoch takes each window of the source on average (E_i / N_i)."""
        return self.total / self.windows if self.windows else 0.0

    def repetition(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        """(first window, position in the repetition) of each slice of repetition ``r``, with the end."""
        if r not in self._reps:
            if len(self._reps) > 8:
                self._reps.clear()
            lo, n = self.slice_lo, self.slice_len
            if self.shuffle and len(lo) > 1:
                perm = np.random.default_rng(slice_key(self.seed, self.epoch, self.source, r)).permutation(len(lo))
                lo, n = lo[perm], n[perm]
            self._reps[r] = lo, np.concatenate([[0], np.cumsum(n)]).astype(np.int64)
        return self._reps[r]

    def at(self, v: np.ndarray) -> np.ndarray:
        """Global window indices (of the source's window space) at positions ``v`` of the order."""
        v = np.asarray(v, dtype=np.int64)
        rep, pos = np.divmod(v, max(self.windows, 1))
        if len(v) and rep[0] == rep.min() == rep.max():  # one repetition (a block, mostly): no sort of rep
            lo, at = self.repetition(int(rep[0]))
            j = np.searchsorted(at, pos, side="right") - 1
            return lo[j] + (pos - at[j])
        out = np.empty(len(v), dtype=np.int64)
        for r in np.unique(rep):
            lo, at = self.repetition(int(r))
            pick = rep == r
            j = np.searchsorted(at, pos[pick], side="right") - 1
            out[pick] = lo[j] + (pos[pick] - at[j])
        return out


class StripedOrder:
    """An order whose streams' step-aligned blocks lie chunk after chunk (canonical streams with one phase).

    Stream a owns range [lo_a, lo_{a+1}) of the positions (``stream_lo``) and its block j holds its
    positions [bounds[a][j], bounds[a][j + 1]) of that range: the items of steps [jQ, (j + 1)Q). The
    positions are laid out on ``order`` chunk by chunk: chunk j's blocks of every stream, stream after
    stream, end to end (then what no block takes, stream after stream). Chunk j of the whole world is then
    one run of ``order``, and a process's blocks of it (its slots are consecutive streams) a run inside
    it: a block reads the runs one stream's block reads, whatever the slots it holds. A bijection of
    [0, total), a pure function of the plan (never of the world).
    """

    def __init__(self, order, stream_lo: np.ndarray, bounds):
        self.order, self.stream_lo = order, np.asarray(stream_lo, dtype=np.int64)
        ranges = np.diff(self.stream_lo)[:, None]  # a block past its stream's range (padding) takes none of it
        bounds = np.minimum(np.stack([np.asarray(b, dtype=np.int64) for b in bounds]), ranges)  # [streams, chunks + 1]
        sizes = np.diff(bounds, axis=1)  # [streams, chunks]: items of each stream's block j
        flat = sizes.T.reshape(-1)  # chunk-major, stream after stream
        start = (np.cumsum(flat) - flat).reshape(sizes.shape[::-1]).T  # [streams, chunks]: block (a, j) begins
        left = np.diff(self.stream_lo) - bounds[:, -1]  # each stream's positions after its last block
        tail = int(bounds[:, -1].sum()) + np.cumsum(left) - left  # where each stream's rest begins
        # segments in range order, (stream, block j) then the stream's rest: where each begins in the ranges and
        # in ``order`` (nondecreasing in the ranges; an empty one begins where the next does)
        self._virt = (self.stream_lo[:-1, None] + bounds).reshape(-1)
        self._real = np.concatenate([start, tail[:, None]], axis=1).reshape(-1)

    def __getattr__(self, name: str):  # total, dropped_before, ...: the order's
        if name == "order":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.order, name)

    def at(self, v: np.ndarray) -> np.ndarray:
        """Global window indices at positions ``v`` (of the streams' ranges)."""
        return self.order.at(self.position(v))

    def at_runs(self, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """``at`` of the positions of runs [starts[i], starts[i] + counts[i]), end to end: a run inside one segment
        (a stream's block) is placed by its first position, not searched for position by position."""
        starts, counts = np.asarray(starts, dtype=np.int64), np.asarray(counts, dtype=np.int64)
        k = np.searchsorted(self._virt, starts, side="right") - 1
        ends = np.append(self._virt, np.iinfo(np.int64).max)[k + 1]  # where the next segment begins
        v = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(starts - (np.cumsum(counts) - counts), counts)
        if not (starts + counts <= ends).all():
            return self.at(v)
        return self.order.at(v + np.repeat(self._real[k] - self._virt[k], counts))

    def position(self, v: np.ndarray) -> np.ndarray:
        """Where positions ``v`` of the streams' ranges lie in ``order``."""
        v = np.asarray(v, dtype=np.int64)
        k = np.searchsorted(self._virt, v, side="right") - 1  # the last segment beginning at or before v
        return self._real[k] + (v - self._virt[k])
