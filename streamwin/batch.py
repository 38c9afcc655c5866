"""Gather windows from a block's byte buffer into a batch's fixed buffers, one vectorized copy each.

A window is ``window * step_bytes`` contiguous bytes starting at ``Block.offs[i]``. Viewing
the block buffer as rows of that many bytes with a row stride of one byte lets a single
``torch.index_select`` copy all windows of a batch, with no Python per window. torch runs
the copy without the GIL, so it overlaps the block reader and the training step.

Every batch of a loader has the same fields and shapes (``BatchLayout``): the plan makes
all batches full. So a batch is one byte buffer with the fields at fixed offsets, and the
gather writes straight into it: a reused in-process array (``BufferPool``) or a
shared-memory slot that a worker process fills and the trainer only views.
Keys travel as sequence indices and become strings only when read (``BatchKeys``).

Pretraining batches (crop_stage.py cuts the blocks): with drawn lengths (``min_window``) each
window is gathered whole and the steps past its crop are zeroed (``length``, ``mask``; a
horizon follows the crop). Packed (``pack_length``) a row is gathered by patches: one
``index_select`` of the patches of every row, each from its crop's bytes or from the block's
zero tail; then ``segment_ids`` and ``positions``, and one entry per crop (``PER_CROP``, the
first ``crops`` of a capacity fixed by the shortest crop). ``missing="mask"`` adds
``observed`` and zeroes NaN and inf.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from streamwin.crop_stage import CropBlock, crop_rows, segments
from streamwin.formats.manifest import Manifest
from streamwin.plan.crops import units
from streamwin.plan.options import WindowSpec
from streamwin.buffers import BufferPool  # noqa: F401  (re-exported: the feeds take their buffers from here)
from streamwin.read import Block
from streamwin.seqfields import FieldGather

ALIGN = 64  # each field starts on a cache line
PER_CROP = ("start", "length", "row", "seq", "weight", "source")  # packed: per crop, the first ``crops`` entries


@dataclass(frozen=True)
class Field:
    """One array of a batch: name, dtype, shape and byte offset inside the batch buffer."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int = field(init=False)  # computed once: views() runs per batch on the trainer's thread

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize)


class BatchLayout:
    """Where each field of a batch lies in its byte buffer; the same for every batch of a loader."""

    def __init__(self, manifest: Manifest, spec: WindowSpec, batch_size: int, *, with_weight: bool,
                 with_source: bool = False, pack_length: int | None = None, missing: bool = False,
                 fields: Sequence[tuple[str, np.dtype]] = ()):
        step, dt, b = tuple(manifest.step_shape), np.dtype(manifest.dtype), batch_size
        wanted = _packed_fields(spec, b, pack_length, step, dt, missing) if pack_length else \
            _window_fields(spec, b, step, dt, missing)
        n = wanted.pop()  # windows, or crops, per batch
        wanted.append(("seq", np.dtype(np.int64), (n,)))
        if with_weight:
            wanted.append(("weight", np.dtype(np.float32), (n,)))
        if with_source:  # a mixed dataset: which source each window came from
            wanted.append(("source", np.dtype(np.int64), (n,)))
        if pack_length:
            wanted.append(("crops", np.dtype(np.int64), (1,)))
        wanted += [(name, np.dtype(dtype), (n,)) for name, dtype in fields]  # one value per window (or crop)
        self.per_crop = PER_CROP + tuple(name for name, _ in fields)  # packed: cut to the batch's crops
        self.place(wanted)

    @classmethod
    def of(cls, wanted: list[tuple[str, np.dtype, tuple[int, ...]]], per_crop: tuple[str, ...] = PER_CROP
           ) -> "BatchLayout":
        """A layout of the fields ``wanted`` (name, dtype, shape), in that order (a transform's output)."""
        layout = cls.__new__(cls)
        layout.per_crop = per_crop
        layout.place(wanted)
        return layout

    def place(self, wanted: list) -> None:
        """Lay the fields out one after the other, each at a multiple of ALIGN bytes."""
        self.fields: list[Field] = []
        at = 0
        for name, dtype, shape in wanted:
            f = Field(name, dtype, shape, at)
            self.fields.append(f)
            at += -(-f.nbytes // ALIGN) * ALIGN
        self.nbytes = at
        self._spans = [(f.name, f.offset, f.offset + f.nbytes, f.dtype, f.shape) for f in self.fields]

    def has(self, name: str) -> bool:
        """Whether batches have field ``name``."""
        return any(f.name == name for f in self.fields)

    def views(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        """The fields as numpy arrays over ``buf`` (``nbytes`` bytes, uint8); each view keeps ``buf`` alive."""
        return {name: buf[lo:hi].view(dtype).reshape(shape) for name, lo, hi, dtype, shape in self._spans}


def _window_fields(spec: WindowSpec, b: int, step: tuple, dt: np.dtype, missing: bool) -> list:
    """The fields of a batch of windows (``x`` [B, W, ...]), then the number of windows."""
    wanted = [("x", dt, (b, spec.window) + step)]
    if spec.horizon:
        wanted.append(("y", dt, (b, spec.horizon) + step))
    if spec.pad or spec.variable:
        wanted.append(("mask", np.dtype(bool), (b, spec.window)))
        if spec.horizon and spec.pad:
            wanted.append(("y_mask", np.dtype(bool), (b, spec.horizon)))
    if spec.variable:
        wanted.append(("length", np.dtype(np.int64), (b,)))
    if missing:
        wanted.append(("observed", np.dtype(bool), (b, spec.window) + step))
        if spec.horizon:
            wanted.append(("y_observed", np.dtype(bool), (b, spec.horizon) + step))
    return wanted + [("start", np.dtype(np.int64), (b,)), b]


def _packed_fields(spec: WindowSpec, b: int, length: int, step: tuple, dt: np.dtype, missing: bool) -> list:
    """The fields of a batch of packed rows (``x`` [B, L, ...]), then its capacity of crops: as many per row
    as the shortest crop allows (one patch with ``pad``)."""
    wanted = [("x", dt, (b, length) + step), ("segment_ids", np.dtype(np.int32), (b, length)),
              ("positions", np.dtype(np.int32), (b, length))]
    if missing:
        wanted.append(("observed", np.dtype(bool), (b, length) + step))
    shortest = 1 if spec.pad else int(units(spec, spec.shortest))
    n = b * ((length // spec.window_multiple) // shortest)
    return wanted + [(name, np.dtype(np.int64), (n,)) for name in ("start", "length", "row")] + [n]


class BatchKeys(Sequence):
    """The sequence keys of a batch's windows: a read-only list of str, decoded on first use.

    Equal to the list of the same strings; pickles as that list. The trainer never pays for
    strings a training step does not read. ``manifests`` lists the sources' manifests and
    ``source`` says whose index each ``seq`` is (None: all of the first); each an int64 array, or
    its bytes. Keys made over a reused buffer's fields are ``detach``ed before it is reused.
    """

    __slots__ = ("_manifests", "_seq", "_source", "_names")

    def __init__(self, names=None, *, manifests: Sequence[Manifest] | None = None, seq: np.ndarray | None = None,
                 source: np.ndarray | None = None):
        self._names = None if names is None else [str(n) for n in names]
        self._manifests, self._seq, self._source = manifests, seq, source

    def reading(self) -> bool:
        """Whether the keys still read the arrays they were made with (not decoded, not detached)."""
        return self._names is None and isinstance(self._seq, np.ndarray)

    def detach(self) -> None:
        """Keep copies of the arrays the keys read (their buffer is about to be reused)."""
        if self.reading():
            self._seq = self._seq.tobytes()
            self._source = None if self._source is None else self._source.tobytes()

    def _list(self) -> list[str]:
        if self._names is None:
            self._names = self._decode()
            self._manifests = self._seq = self._source = None
        return self._names

    def _decode(self) -> list[str]:
        """The keys of the batch's sequences, each looked up in its own source's manifest."""
        seq = _int64(self._seq)
        if self._source is None:
            return self._manifests[0].keys(seq)
        source = _int64(self._source)
        names: list[str] = [""] * len(seq)
        for i in np.unique(source):
            rows = np.flatnonzero(source == i)
            for row, key in zip(rows.tolist(), self._manifests[int(i)].keys(seq[rows])):
                names[row] = key
        return names

    def __getitem__(self, i):
        return self._list()[i]

    def __len__(self) -> int:
        return len(_int64(self._seq)) if self._names is None else len(self._names)

    def __iter__(self):
        return iter(self._list())

    def __eq__(self, other) -> bool:
        if isinstance(other, BatchKeys):
            other = list(other)
        return isinstance(other, (list, tuple)) and self._list() == list(other)

    __hash__ = None

    def __repr__(self) -> str:
        return repr(self._list())

    def __reduce__(self):
        return (list, (self._list(),))


def _int64(values) -> np.ndarray:  # an int64 array, or bytes of one, as an int64 array
    return values if isinstance(values, np.ndarray) else np.frombuffer(values, dtype=np.int64)


def _cat(parts: list[tuple[Block, int, int]], name: str, out: np.ndarray) -> np.ndarray:
    """A per-window field of the batch, written into ``out``."""
    at = 0
    for block, lo, hi in parts:
        out[at : at + hi - lo] = getattr(block, name)[lo:hi]
        at += hi - lo
    return out


# OpenMP keeps torch's intra-op thread count per thread; torch's native pool (macOS) fixes it once for all
_OPENMP = "parallel backend: OpenMP" in torch.__config__.parallel_info()


def _byte_rows(block: Block, nbytes: int) -> torch.Tensor:
    """Row i = the ``nbytes`` bytes of the block buffer from byte i (made once per block and size).

    Made once because every torch call lets go of the GIL, and getting it back behind the
    block reader's thread can cost more than the call: per batch only the copy lets go.
    """
    views = block.buf_tensor
    if views is None:
        views = block.buf_tensor = {}
    rows = views.get(nbytes)
    if rows is None:
        with warnings.catch_warnings():  # read-only mapping: nothing ever writes through this tensor
            warnings.simplefilter("ignore", UserWarning)
            buf = torch.from_numpy(block.buf)
        rows = views[nbytes] = buf.as_strided((max(len(buf) - nbytes + 1, 0), nbytes), (1, 1))
    return rows


class Gatherer:
    """Writes the windows (or packed rows) of (block, item range) parts into one batch's field arrays."""

    def __init__(self, manifest: Manifest, spec: WindowSpec, pack_length: int | None = None, missing: bool = False,
                 fields: FieldGather | None = None):
        self.spec, self.pack_length, self.missing, self.fields = spec, pack_length, missing, fields
        self.sb = manifest.step_bytes
        self._zeros: np.ndarray | None = None  # packed: a row of zero bytes, the source of padding

    def gather(self, parts: list[tuple[Block, int, int]], out: dict[str, np.ndarray],
               counts: np.ndarray) -> dict[str, np.ndarray]:
        """The batch of ``parts`` in ``out``, with its per-sequence fields (seqfields.py), on one thread.

        One thread, as in a worker process: after a parallel copy torch's other OpenMP threads spin,
        waiting for more work, which costs an in-process loader several times the copy's CPU for no
        shorter step. OpenMP keeps the thread count per calling thread, so the caller's own torch work
        keeps its threads.
        """
        threads = torch.get_num_threads() if _OPENMP else 1
        if threads > 1:
            torch.set_num_threads(1)
        try:
            out = self._gather(parts, out, counts)
            if self.fields is not None:
                self.fields.fill(out, int(out["crops"][0]) if self.pack_length else None)
        finally:
            if threads > 1:
                torch.set_num_threads(threads)
        return out

    def _gather(self, parts: list[tuple[Block, int, int]], out: dict[str, np.ndarray],
                counts: np.ndarray) -> dict[str, np.ndarray]:
        """Fill ``out`` (``layout.views`` of a batch buffer) with the items ``lo:hi`` of each part's block (windows
        ``block.offs[lo:hi]``, or packed rows); ``counts[i]``: the batch's items of source i (in source order)."""
        if self.pack_length:
            return self._gather_rows(parts, out, counts)
        spec, sb = self.spec, self.sb
        self._take(parts, 0, spec.window, out["x"])
        if spec.variable:
            self._crop_steps(parts, out)
        elif spec.horizon:
            self._take(parts, spec.window * sb, spec.horizon, out["y"])
        if spec.pad and not spec.variable:
            valid = np.concatenate([b.valid[lo:hi] for b, lo, hi in parts]) if len(parts) > 1 else \
                parts[0][0].valid[parts[0][1] : parts[0][2]]
            np.less(np.arange(spec.window), valid[:, None], out=out["mask"])
            if spec.horizon:
                np.less(np.arange(spec.horizon), (valid - spec.window)[:, None], out=out["y_mask"])
            if (valid < spec.span).any():  # zero the steps past a short sequence's end
                out["x"][~out["mask"]] = 0
                if spec.horizon:
                    out["y"][~out["y_mask"]] = 0
        if self.missing:
            _observe(out["x"], out.get("mask"), out["observed"])
            if spec.horizon:
                _observe(out["y"], out.get("y_mask"), out["y_observed"])
        _cat(parts, "start", out["start"])
        at = 0
        seq = out["seq"]
        for b, lo, hi in parts:
            if isinstance(b, CropBlock):
                seq[at : at + hi - lo] = b.seq[lo:hi]
            else:
                np.take(b.seq_ids, b.key_index[lo:hi], out=seq[at : at + hi - lo])
            at += hi - lo
        if "weight" in out:
            _cat(parts, "real", out["weight"])
        if "source" in out:
            out["source"][:] = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        return out

    def _crop_steps(self, parts: list[tuple[CropBlock, int, int]], out: dict[str, np.ndarray]) -> None:
        """Drawn lengths: ``length``, ``mask``, the steps past each crop zeroed; the horizon after each crop."""
        spec, sb = self.spec, self.sb
        length = _cat(parts, "length", out["length"])
        np.less(np.arange(spec.window), length[:, None], out=out["mask"])
        if (length < spec.window).any():
            out["x"][~out["mask"]] = 0
        if not spec.horizon:
            return
        self._take(parts, 0, spec.horizon, out["y"], shifts=[b.length[lo:hi] * sb for b, lo, hi in parts])
        if spec.pad:  # a padded short crop's horizon has what its sequence has left after the crop
            valid = np.concatenate([b.valid[lo:hi] for b, lo, hi in parts])
            np.less(np.arange(spec.horizon), (valid - length)[:, None], out=out["y_mask"])
            out["y"][~out["y_mask"]] = 0

    def _gather_rows(self, parts: list[tuple[CropBlock, int, int]], out: dict[str, np.ndarray],
                     counts: np.ndarray) -> dict[str, np.ndarray]:
        """Packed rows: each part's rows laid end to end (its crops' bytes and zeros), then segments, positions
        and the crop table."""
        steps, p = self.pack_length, self.spec.window_multiple
        flat, row_bytes = out["x"].reshape(-1).view(np.uint8), steps * self.sb
        if self._zeros is None:
            self._zeros = np.zeros(row_bytes, dtype=np.uint8)
        sources = np.cumsum(counts)
        row_at = crop_at = 0
        tables = []
        for blk, lo, hi in parts:
            self._lay_rows(blk, lo, hi, flat[row_at * row_bytes : (row_at + hi - lo) * row_bytes])
            c0, c1 = blk.crops(lo, hi)
            row, rank = crop_rows(blk, lo, hi)
            row += row_at - lo
            source = int(np.searchsorted(sources, row_at, side="right"))
            for name, value in (("start", blk.start[c0:c1]), ("length", blk.length[c0:c1]), ("row", row),
                                ("seq", blk.seq[c0:c1]), ("weight", blk.real[c0:c1]), ("source", source)):
                if name in out:
                    out[name][crop_at : crop_at + c1 - c0] = value
            tables.append((row * steps + blk.offset[c0:c1] * p, blk.length[c0:c1], rank))
            row_at, crop_at = row_at + hi - lo, crop_at + c1 - c0
        first, length, rank = (np.concatenate(t) for t in zip(*tables))
        seg = out["segment_ids"]
        segments(first, length, rank, seg.reshape(-1), out["positions"].reshape(-1))
        if (length % p).any():  # copied by patch: zero the rest of a short crop's last patch
            out["x"][seg == 0] = 0
        if self.missing:
            _observe(out["x"], seg > 0, out["observed"])
        out["crops"][0] = crop_at
        return out

    def _lay_rows(self, blk: CropBlock, lo: int, hi: int, dest: np.ndarray) -> None:
        """Rows lo:hi of a packed block into ``dest`` (their bytes): one ``index_select`` of their patches, or (small
        patches) one concatenation of their runs."""
        if blk.patches is not None:
            per_row, patch = len(blk.patches) // len(blk), self.sb * self.spec.window_multiple
            index = torch.from_numpy(blk.patches[lo * per_row : hi * per_row])
            torch.index_select(_byte_rows(blk, patch), 0, index, out=torch.from_numpy(dest.reshape(-1, patch)))
            return
        src, size, row_run = blk.runs
        a, z = int(row_run[lo]), int(row_run[hi])
        buf, zeros = blk.buf, self._zeros
        np.concatenate([buf[s : s + n] if s >= 0 else zeros[:n] for s, n in zip(src[a:z].tolist(), size[a:z].tolist())],
                       out=dest)

    def _take(self, parts: list[tuple[Block, int, int]], shift: int, steps: int, dest_array: np.ndarray,
              shifts: list[np.ndarray] | None = None) -> None:
        """Copy ``steps`` steps of each window from ``shift`` bytes (or ``shifts[part]`` per window) past its start."""
        nbytes = steps * self.sb
        n = len(dest_array)
        dest = torch.from_numpy(dest_array.reshape(n, -1).view(np.uint8))
        at = 0
        for k, (b, lo, hi) in enumerate(parts):
            offs = b.offs[lo:hi] if shifts is None else b.offs[lo:hi] + shifts[k]
            index = torch.from_numpy(offs + shift if shift else offs)
            # one-block batches (nearly all) skip the slice: each torch call lets go of the GIL
            torch.index_select(_byte_rows(b, nbytes), 0, index, out=dest if len(parts) == 1 else dest[at : at + hi - lo])
            at += hi - lo


def _observe(x: np.ndarray, inside: np.ndarray | None, observed: np.ndarray) -> None:
    """``observed``: x is finite there (and not padding, where ``inside`` says so); NaN and inf in x become 0."""
    if x.dtype.kind == "f":
        np.isfinite(x, out=observed)
        x[~observed] = 0
    else:
        observed[...] = True
    if inside is not None:
        observed &= inside.reshape(inside.shape + (1,) * (x.ndim - inside.ndim))
