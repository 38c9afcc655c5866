"""Packed rows: how many rows of ``pack_length`` steps each block of a stream fills, and which crop goes where.

Pure (numpy only). With ``pack_length=L`` a batch is B rows of L steps, each holding whole
crops side by side (``segment_ids`` tell them apart). Patches of p = window_multiple steps are
the unit: a crop of length l occupies ceil(l / p) patches and starts on a patch boundary, so a
patch of a row never holds two crops, and a row has Lu = L / p patches.

1. **Rows per block, from lengths alone.** Block b of a stream (its real crops, whose lengths
   are pure functions of the plan, plan/crops.py) fills R_b rows: its patches with 1% slack,
   plus one row, and at least one row per crop longer than half a row (no two of those share
   one). No packing is run to count them, so every stream's rows, hence the equal batch count
   of the epoch, are known before it starts, and the row where batch j begins is a cursor:
   block k with ``bounds[k] <= row < bounds[k + 1]``, row ``row - bounds[k]`` of it. A small
   block (EXACT_CROPS crops or fewer: a stream's last, or every block of a small corpus dealt
   over canonical streams) is packed once to count the rows it fills: a few rows of slack would
   be many percent of its rows.
2. **Packing a block** (``pack``): best-fit decreasing into those R_b rows. Crops go in
   decreasing length (ties in the block's shuffled order), each into the fullest row it
   fits. Best fit wastes far less than the slack (0.35% for lengths in [64, 512] into rows of
   2048, fill 98.9%), so every crop finds a row; one that does not would be left out of the
   epoch. Within a row crops keep the block's shuffled order. Deterministic from the block:
   the stage that packs, the resume that skips rows and the elastic rest of an epoch all find
   the same rows.

    block of 9 crops (patches): 5 3 2 6 1 4 2 3 4, rows of Lu = 8 patches, 4 rows
    best fit, largest first:    2+6 | 5+3 | 4+4 | 1+2+3   (row-major, block order within a row)
"""
from __future__ import annotations

from bisect import bisect_left, insort

import numpy as np

from streamwin.plan.crops import units

SLACK = 0.01  # rows per block: the block's patches plus 1%, plus one row
EXACT_CROPS = 512  # a block of at most this many crops takes the rows it fills when packed (once, when planned)

class RowPlan:
    """The rows of every stream of one source's plan, per block (built once per plan, O(windows) numpy)."""

    def __init__(self, plan, row_units: int):
        self.row_units = int(row_units)
        self._bounds = [self._stream_bounds(plan, s) for s in range(plan.config.num_streams)]

    def _stream_bounds(self, plan, stream: int) -> np.ndarray:
        """[blocks + 1]: rows of stream ``stream`` before each of its blocks."""
        n, bw = plan.length(stream), plan.config.block_windows
        owned = min(plan.owned(stream), n)
        patches = np.zeros(-(-n // bw), dtype=np.float64)
        crops_in, long = np.zeros_like(patches), np.zeros_like(patches)
        for lo in range(0, owned, 1 << 20):  # bounded temporaries on long streams
            pos = np.arange(lo, min(lo + (1 << 20), owned), dtype=np.int64)
            g = plan.order.at((plan.stream_lo[stream] + pos) % max(plan.total_windows, 1))
            size = units(plan.config.spec, plan.crop_lengths(g))
            block = pos // bw
            patches += np.bincount(block, weights=size, minlength=len(patches))
            crops_in += np.bincount(block, minlength=len(patches))
            long += np.bincount(block[2 * size > self.row_units], minlength=len(patches))
        rows = np.where(crops_in > 0, np.maximum(np.ceil(patches * (1 + SLACK) / self.row_units) + 1, long), 0)
        if plan.config.packing >= 2:  # options.PACKING (1: as planned before small blocks were packed to count)
            for b in np.flatnonzero((crops_in > 0) & (crops_in <= EXACT_CROPS)).tolist():
                rows[b] = self._packed_rows(plan, stream, b, int(rows[b]))
        return np.concatenate([[0], np.cumsum(rows.astype(np.int64))]).astype(np.int64)

    def _packed_rows(self, plan, stream: int, block: int, rows: int) -> int:
        """The rows a small block's crops take when packed into ``rows``: its slack row and rounding are many
        percent of a few rows (canonical streams of a small corpus: a block a stream). Packed into as many rows,
        best fit places every crop as it did (it opens rows in one order and never needs another)."""
        g, real = plan.block(stream, block)
        return rows_filled(units(plan.config.spec, plan.crop_lengths(g[real])), rows, self.row_units)

    def bounds(self, stream: int) -> np.ndarray:
        """[blocks + 1]: rows of ``stream`` before each of its blocks (the last entry: all its rows)."""
        return self._bounds[stream]

    @property
    def per_stream(self) -> np.ndarray:
        """Rows every stream could yield (int64 [streams])."""
        return np.array([b[-1] for b in self._bounds], dtype=np.int64)

    def rows(self, stream: int, block: int) -> int:
        """Rows block ``block`` of ``stream`` fills."""
        b = self._bounds[stream]
        return int(b[block + 1] - b[block])


def rows_filled(size: np.ndarray, rows: int, row_units: int) -> int:
    """The rows that crops of ``size`` patches fill when packed into ``rows`` rows, or into more where some would be
    left out (the estimate falls short of crops of about half a row: 22 + 23 patches do not share a row of 44)."""
    order, row_ptr, _ = pack(size, rows, row_units)
    while len(order) < len(size):
        rows += 1
        order, row_ptr, _ = pack(size, rows, row_units)
    return int((np.diff(row_ptr) > 0).sum())


def pack(size: np.ndarray, rows: int, row_units: int, key: list[int] | None = None
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pack crops of ``size`` patches (in block order) into ``rows`` rows of ``row_units`` patches.

    Returns (order, row_ptr, offset): ``order`` the indices of the crops placed, row after row
    and in block order within a row; row r holds ``order[row_ptr[r]:row_ptr[r + 1]]``; ``offset``
    the patch where each of them starts in its row. Crops left out are not in ``order``. With
    an RNG ``key`` the rows come in an order drawn from it (best fit fills rows largest crops
    first: unshuffled, a batch would hold only long crops, the next only shorter ones).
    """
    size = np.asarray(size, dtype=np.int64)
    row_of = np.full(len(size), -1, dtype=np.int64)
    if rows > 0 and len(size):
        if (size == size[0]).all():  # one size (fixed-length crops): rows fill in block order
            per_row = row_units // int(size[0])
            k = min(len(size), rows * per_row)
            row_of[:k] = np.arange(k) // per_row
        else:
            _best_fit_decreasing(size, rows, row_units, row_of)
    placed = np.flatnonzero(row_of >= 0)
    if key is not None and rows > 1:
        row_of[placed] = np.random.default_rng(key).permutation(rows)[row_of[placed]]
    order = placed[np.argsort(row_of[placed], kind="stable")]  # row-major; block order within a row
    row_ptr = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(row_of[order], minlength=rows), out=row_ptr[1:])
    before = np.concatenate([[0], np.cumsum(size[order])]).astype(np.int64)
    offset = before[:-1] - np.repeat(before[row_ptr[:-1]], np.diff(row_ptr))
    return order, row_ptr, offset


def _best_fit_decreasing(size: np.ndarray, rows: int, row_units: int, row_of: np.ndarray) -> None:
    """Fill ``row_of`` (-1: left out): largest crops first, each into the row with the least room that fits it.

    Crops of one size go together: the tightest row that fits one takes as many as fit in a
    row (it stays the tightest), then the next row of that room, so a step places a row's share
    of a size, not one crop (the same rows as one crop at a time, several times faster).
    """
    free = {row_units: list(range(rows - 1, -1, -1))}  # room -> rows with that room (popped from the end)
    rooms = [row_units]  # the distinct rooms some row has, sorted
    by_size = np.argsort(-size, kind="stable")
    ordered = size[by_size]
    edges = [0, *(np.flatnonzero(np.diff(ordered)) + 1).tolist(), len(size)]
    order, placed = by_size.tolist(), [-1] * len(size)
    for a, z in zip(edges[:-1], edges[1:]):
        s, at = int(ordered[a]), a
        while at < z:
            k = bisect_left(rooms, s)
            if k == len(rooms):
                break  # the rest of this size fits in no row: left out
            room = rooms[k]
            holders, each = free[room], room // s
            take = min(-(-(z - at) // each), len(holders))
            got = holders[-take:][::-1]  # the rows one crop at a time would pop, in that order
            del holders[-take:]
            if not holders:
                del free[room]
                del rooms[k]
            n = min(take * each, z - at)
            for j, row in enumerate(got):
                part = min(each, n - j * each)
                for i in order[at + j * each : at + j * each + part]:
                    placed[i] = row
                _give(free, rooms, room - part * s, row)
            at += n
    row_of[:] = placed


def _give(free: dict, rooms: list, room: int, row: int) -> None:
    """Row ``row`` now has ``room`` left."""
    if room in free:
        free[room].append(row)
    else:
        free[room] = [row]
        insort(rooms, room)
