"""The crop stage: a block's windows as crops with their lengths, packed into rows with ``pack_length``.

(Not the shard packer: that is packing/, which writes the shards; this cuts blocks as they are read.)

It runs after a block is read and before the gather, on the block's read-ahead thread (so a
batch never waits for it), and only when a batch needs more than a window's bytes: drawn
lengths (``min_window``) or packed rows (``pack_length``). Everything it adds is a pure
function of the block and the plan (plan/crops.py, plan/rows.py), so it keeps no state: a
reader resumed at block k cuts block k alike, and the batcher's cursor (rows taken) says
where in it a batch begins.

    Block (windows in yield order)  ->  CropBlock
        unpacked:  every window, its crop length               (len = crops)
        packed:    the crops row by row, each one's row offset (len = rows)

    a packed block of 3 rows of 8 patches ('.': padding, segment id 0):
        row 0  [ a a a | b b | c . . ]      row_ptr = [0, 3, 5, 6]
        row 1  [ d d d d | e e . . ]        crops   =  a b c | d e | f   (row-major)
        row 2  [ f f f f f f . . ]          offset  =  0 3 5 | 0 4 | 0   (patches)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from streamwin.plan.crops import units
from streamwin.plan.rows import pack
from streamwin.plan.streams import SourcePlan
from streamwin.read.reader import Block

PATCH_COPY = 4  # patches of at least this many steps are copied by index (a row is few patches), else in runs


@dataclass
class CropBlock:
    """A block's crops in the order batches take them: the block's bytes plus a table per crop.

    ``offs``, ``start``, ``real``, ``valid`` and ``seq`` are the read's window table (``seq``:
    manifest indices) for each crop; ``length`` its steps. Packed, row r holds crops
    ``row_ptr[r]:row_ptr[r + 1]``, crop i at patch ``offset[i]`` of its row; ``len()`` counts rows.
    """

    block: Block
    offs: np.ndarray
    start: np.ndarray
    real: np.ndarray
    valid: np.ndarray
    seq: np.ndarray
    length: np.ndarray
    row_ptr: np.ndarray | None = None
    offset: np.ndarray | None = None
    runs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # packed, small patches: ``row_runs``
    patches: np.ndarray | None = None  # packed, else: ``patch_index`` of its rows
    buf_tensor: Any = None  # the gatherer's tensor views of buf, made once

    @property
    def buf(self) -> np.ndarray:
        return self.block.buf

    @property
    def packed(self) -> bool:
        return self.row_ptr is not None

    def __len__(self) -> int:
        return len(self.row_ptr) - 1 if self.row_ptr is not None else len(self.offs)

    def crops(self, lo: int, hi: int) -> tuple[int, int]:
        """The crops of items [lo, hi): rows when packed, else crops themselves."""
        return (int(self.row_ptr[lo]), int(self.row_ptr[hi])) if self.row_ptr is not None else (lo, hi)


def needs_cut(plan: SourcePlan) -> bool:
    """Whether batches need more than a window's bytes: drawn lengths or packed rows."""
    return plan.config.spec.variable or plan.rows is not None


def cut(block: Block, plan: SourcePlan, stream: int, k: int, step_bytes: int) -> CropBlock:
    """Block ``k`` of ``stream`` as crops (packed into its rows when ``plan`` packs); ``step_bytes``: of one step."""
    g, planned = plan.block(stream, k)  # yield order, as the block's windows
    length = plan.crop_lengths(g)
    seq = np.take(block.seq_ids, block.key_index)
    if plan.rows is None:
        return CropBlock(block, block.offs, block.start, block.real, block.valid, seq, length)
    mine = np.flatnonzero(planned)  # the rows were planned from these crops (read errors do not move rows)
    order, row_ptr, offset = pack(units(plan.config.spec, length[mine]), plan.rows.rows(stream, k),
                                  plan.rows.row_units, plan.row_key(stream, k))
    pick = mine[order]
    out = CropBlock(block, block.offs[pick], block.start[pick], block.real[pick], block.valid[pick], seq[pick],
                    length[pick], row_ptr, offset)
    spec, steps = plan.config.spec, plan.config.pack_length
    p = spec.window_multiple
    if p >= PATCH_COPY:
        row = np.repeat(np.arange(len(row_ptr) - 1, dtype=np.int64), np.diff(row_ptr))
        out.patches = patch_index(out.offs, row * (steps // p) + offset, units(spec, out.length), p * step_bytes,
                                  (len(row_ptr) - 1) * (steps // p), len(block.buf) - spec.span * step_bytes)
    else:
        out.runs = row_runs(out.offs, out.length, offset * p, row_ptr, steps, step_bytes)
    return out


def patch_index(offs: np.ndarray, first: np.ndarray, size: np.ndarray, patch_bytes: int, total: int,
                zero: int) -> np.ndarray:
    """Byte offset (into the block's bytes) of each of ``total`` patches of some rows: crop i's ``size[i]``
    patches from patch ``first[i]`` on come from its bytes at ``offs[i]``, every other one from ``zero`` (the
    block's zero tail). Rows lo:hi of a block are then one ``index_select`` of patches."""
    out = np.full(total, zero, dtype=np.int64)
    within = np.arange(int(size.sum()), dtype=np.int64) - np.repeat(np.cumsum(size) - size, size)
    out[np.repeat(first, size) + within] = np.repeat(offs, size) + within * patch_bytes
    return out


def row_runs(offs: np.ndarray, length: np.ndarray, first: np.ndarray, row_ptr: np.ndarray, row_steps: int,
             step_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(source byte, bytes, rows' first run) of the runs that lay a block's rows end to end: each crop's bytes
    (from ``offs``), then zeros (source -1) up to the next crop or the row's end; an empty row is one run of zeros.

    ``first``: the step where each crop begins in its row. A batch of rows lo:hi is runs
    ``row_run[lo]:row_run[hi]`` concatenated: the CPU gather of packed rows, at memcpy speed.
    """
    rows = len(row_ptr) - 1
    counts = np.diff(row_ptr)
    row = np.repeat(np.arange(rows, dtype=np.int64), counts)
    end = first + length
    nxt = np.full(len(first), row_steps, dtype=np.int64)
    same = row[1:] == row[:-1]
    nxt[:-1][same] = first[1:][same]
    empty = np.flatnonzero(counts == 0)
    src = np.concatenate([np.stack([offs, np.full(len(offs), -1)], axis=1).ravel(), np.full(len(empty), -1)])
    size = np.concatenate([np.stack([length, nxt - end], axis=1).ravel(), np.full(len(empty), row_steps)])
    of = np.concatenate([np.repeat(row, 2), empty])
    keep = np.flatnonzero(size > 0)
    keep = keep[np.argsort(of[keep], kind="stable")]  # row by row; a row's runs in order
    row_run = np.searchsorted(of[keep], np.arange(rows + 1), side="left").astype(np.int64)
    return src[keep].astype(np.int64), size[keep].astype(np.int64) * step_bytes, row_run


def release_of(block: Any) -> Block | None:
    """The read Block inside ``block`` (a CropBlock's), to give its memory back; None for anything else."""
    if isinstance(block, CropBlock):
        block.buf_tensor = None
        return block.block
    return block if isinstance(block, Block) else None


# -- a packed batch's tables, from its parts (rows lo:hi of CropBlocks); numpy, shared by every delivery ------

def crop_rows(block: CropBlock, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """(row within the block, rank within its row) of the crops of rows [lo, hi), in row-major order."""
    ptr = block.row_ptr[lo : hi + 1]
    counts = np.diff(ptr)
    row = np.repeat(np.arange(lo, hi, dtype=np.int64), counts)
    return row, np.arange(ptr[0], ptr[-1]) - np.repeat(ptr[:-1], counts)


def segments(first: np.ndarray, length: np.ndarray, rank: np.ndarray, seg: np.ndarray, pos: np.ndarray) -> None:
    """Write ``segment_ids`` (rank in the row + 1, 0 on padding) and ``positions`` (step within the crop, 0 on
    padding) of rows laid flat (``seg``, ``pos``: int32), crop i at steps [first[i], first[i] + length[i]).

    One ``np.repeat`` over runs: padding, crop, padding, crop, ..., padding (crops in order).
    """
    n, total = len(first), len(seg)
    if not n:
        seg[:] = 0
        pos[:] = 0
        return
    end = first + length
    runs = np.empty(2 * n + 1, dtype=np.int64)
    runs[0], runs[2:-1:2], runs[-1] = first[0], first[1:] - end[:-1], total - end[-1]
    runs[1::2] = length
    ids = np.zeros(2 * n + 1, dtype=np.int32)
    ids[1::2] = rank + 1
    seg[:] = np.repeat(ids, runs)
    base = np.zeros(2 * n + 1, dtype=np.int32)  # int32 throughout: half the bytes, no casting loop
    base[1::2], base[2::2] = first, end
    np.subtract(np.arange(total, dtype=np.int32), np.repeat(base, runs), out=pos)
    pos[seg == 0] = 0
