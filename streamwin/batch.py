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
"""
from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from streamwin.formats.manifest import Manifest
from streamwin.plan.options import WindowSpec
from streamwin.read import Block

ALIGN = 64  # each field starts on a cache line


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
                 with_source: bool = False):
        step, dt, b = tuple(manifest.step_shape), np.dtype(manifest.dtype), batch_size
        wanted = [("x", dt, (b, spec.window) + step)]
        if spec.horizon:
            wanted.append(("y", dt, (b, spec.horizon) + step))
        if spec.pad:
            wanted.append(("mask", np.dtype(bool), (b, spec.window)))
            if spec.horizon:
                wanted.append(("y_mask", np.dtype(bool), (b, spec.horizon)))
        wanted.append(("start", np.dtype(np.int64), (b,)))
        wanted.append(("seq", np.dtype(np.int64), (b,)))
        if with_weight:
            wanted.append(("weight", np.dtype(np.float32), (b,)))
        if with_source:  # a mixed dataset: which source each window came from
            wanted.append(("source", np.dtype(np.int64), (b,)))
        self.fields: list[Field] = []
        at = 0
        for name, dtype, shape in wanted:
            f = Field(name, dtype, shape, at)
            self.fields.append(f)
            at += -(-f.nbytes // ALIGN) * ALIGN
        self.nbytes = at

    def has(self, name: str) -> bool:
        """Whether batches have field ``name``."""
        return any(f.name == name for f in self.fields)

    def views(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        """The fields as numpy arrays over ``buf`` (``nbytes`` bytes, uint8); each view keeps ``buf`` alive."""
        return {f.name: buf[f.offset : f.offset + f.nbytes].view(f.dtype).reshape(f.shape) for f in self.fields}


class BatchKeys(Sequence):
    """The sequence keys of a batch's windows: a read-only list of str, decoded on first use.

    Equal to the list of the same strings; pickles as that list. The trainer never pays for
    strings a training step does not read. ``manifests`` lists the sources' manifests and
    ``source`` says whose index each ``seq`` is (None: all of the first).
    """

    __slots__ = ("_manifests", "_seq", "_source", "_names")

    def __init__(self, names=None, *, manifests: Sequence[Manifest] | None = None, seq: np.ndarray | None = None,
                 source: np.ndarray | None = None):
        self._names = None if names is None else [str(n) for n in names]
        self._manifests, self._seq, self._source = manifests, seq, source

    def _list(self) -> list[str]:
        if self._names is None:
            self._names = self._decode()
            self._manifests = self._seq = self._source = None
        return self._names

    def _decode(self) -> list[str]:
        """The keys of the batch's sequences, each looked up in its own source's manifest."""
        if self._source is None:
            return self._manifests[0].keys(self._seq)
        names: list[str] = [""] * len(self._seq)
        for i in np.unique(self._source):
            rows = np.flatnonzero(self._source == i)
            for row, key in zip(rows.tolist(), self._manifests[int(i)].keys(self._seq[rows])):
                names[row] = key
        return names

    def __getitem__(self, i):
        return self._list()[i]

    def __len__(self) -> int:
        return len(self._seq) if self._names is None else len(self._names)

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


class BufferPool:
    """Batch buffers reused once no one else refers to them (in-process batches).

    Every view of a buffer (numpy views, tensors from ``torch.from_numpy``, a batch a training
    loop kept) holds a reference to it, so a reference count of two (this pool's list and
    getrefcount's argument) means its contents are nobody's any more. A consumer that keeps
    every batch just makes the pool allocate fresh buffers; nothing it holds is overwritten.
    With ``fenced`` (page-locked buffers), a released buffer is reused only once the CUDA work
    queued before its release (a ``non_blocking`` copy from it) has finished.
    """

    def __init__(self, nbytes: int, keep: int = 6, allocate=None, fenced: bool = False):
        self.nbytes, self.keep, self.fenced = nbytes, keep, fenced
        self._allocate = allocate or (lambda n: np.empty(n, dtype=np.uint8))
        self._buffers: list[np.ndarray] = []
        self._fences: list = []

    def get(self) -> np.ndarray:
        """A buffer nobody else holds (and whose queued copies are done), or a fresh one."""
        buffers = self._buffers
        for i in range(len(buffers)):
            if sys.getrefcount(buffers[i]) == 2 and self._settled(i):
                return buffers[i]
        fresh = self._allocate(self.nbytes)
        if len(buffers) >= self.keep:
            buffers.pop(0)
            self._fences.pop(0)
        buffers.append(fresh)
        self._fences.append(None)
        return fresh

    def _settled(self, i: int) -> bool:
        """Whether the CUDA work queued before buffer i was released is done (always, unfenced)."""
        if not self.fenced:
            return True
        fence = self._fences[i]
        if fence is None:
            self._fences[i] = fence = torch.cuda.Event()
            fence.record()
        if not fence.query():
            return False
        self._fences[i] = None
        return True


def _cat(parts: list[tuple[Block, int, int]], name: str, out: np.ndarray) -> np.ndarray:
    """A per-window field of the batch, written into ``out``."""
    at = 0
    for block, lo, hi in parts:
        out[at : at + hi - lo] = getattr(block, name)[lo:hi]
        at += hi - lo
    return out


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
    """Writes the windows of (block, window range) parts into one batch's field arrays."""

    def __init__(self, manifest: Manifest, spec: WindowSpec):
        self.spec = spec
        self.sb = manifest.step_bytes

    def gather(self, parts: list[tuple[Block, int, int]], out: dict[str, np.ndarray],
               counts: np.ndarray) -> dict[str, np.ndarray]:
        """Fill ``out`` (``layout.views`` of a batch buffer) with the windows ``block.offs[lo:hi]`` of each part;
        ``counts[i]``: the batch's windows of source i (its rows come in source order)."""
        spec, sb = self.spec, self.sb
        self._take(parts, 0, spec.window, out["x"])
        if spec.horizon:
            self._take(parts, spec.window * sb, spec.horizon, out["y"])
        if spec.pad:
            valid = np.concatenate([b.valid[lo:hi] for b, lo, hi in parts]) if len(parts) > 1 else \
                parts[0][0].valid[parts[0][1] : parts[0][2]]
            np.less(np.arange(spec.window), valid[:, None], out=out["mask"])
            if spec.horizon:
                np.less(np.arange(spec.horizon), (valid - spec.window)[:, None], out=out["y_mask"])
            if (valid < spec.span).any():  # zero the steps past a short sequence's end
                out["x"][~out["mask"]] = 0
                if spec.horizon:
                    out["y"][~out["y_mask"]] = 0
        _cat(parts, "start", out["start"])
        at = 0
        seq = out["seq"]
        for b, lo, hi in parts:
            np.take(b.seq_ids, b.key_index[lo:hi], out=seq[at : at + hi - lo])
            at += hi - lo
        if "weight" in out:
            _cat(parts, "real", out["weight"])
        if "source" in out:
            out["source"][:] = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        return out

    def _take(self, parts: list[tuple[Block, int, int]], shift: int, steps: int, dest_array: np.ndarray) -> None:
        nbytes = steps * self.sb
        n = len(dest_array)
        dest = torch.from_numpy(dest_array.reshape(n, -1).view(np.uint8))
        at = 0
        for b, lo, hi in parts:
            index = torch.from_numpy(b.offs[lo:hi] + shift if shift else b.offs[lo:hi])
            # one-block batches (nearly all) skip the slice: each torch call lets go of the GIL
            torch.index_select(_byte_rows(b, nbytes), 0, index, out=dest if len(parts) == 1 else dest[at : at + hi - lo])
            at += hi - lo
