"""Gather windows from a block's byte buffer into batch arrays, one vectorized copy each.

A window is ``window * step_bytes`` contiguous bytes starting at ``Block.offs[i]``. Viewing
the block buffer as rows of that many bytes with a row stride of one byte lets a single
``torch.index_select`` copy all windows of a batch, with no Python per window. torch runs
the copy without the GIL and on its intra-op threads, so it overlaps the block reader and
uses every core torch is given (DataLoader workers get one each).

Batch arrays are reused once nothing outside holds them any more (``BatchArrays``), so the
copy writes into memory that is already mapped and warm in cache instead of fresh pages.
"""
from __future__ import annotations

import sys
import warnings

import numpy as np
import torch

from .manifest import Manifest
from .plan import WindowSpec
from .read import Block


class BatchArrays:
    """A few batch-sized byte arrays, each handed out again only when no one else refers to it.

    Every view of an array (numpy views, tensors made with ``torch.from_numpy``, a batch a
    training loop kept) holds a reference to it, so a reference count of one (this pool's)
    means its contents are nobody's any more. A consumer that keeps every batch just makes
    the pool allocate fresh arrays; nothing it holds is ever overwritten.
    """

    def __init__(self, keep: int = 6):
        self.keep = keep
        self._arrays: list[np.ndarray] = []

    def get(self, nbytes: int) -> np.ndarray:
        arrays = self._arrays
        for i in range(len(arrays)):
            # 2 = the list's reference + getrefcount's argument: nothing else holds it
            if len(arrays[i]) == nbytes and sys.getrefcount(arrays[i]) == 2:
                return arrays[i]
        fresh = np.empty(nbytes, dtype=np.uint8)
        if len(arrays) >= self.keep:
            arrays.pop(0)
        arrays.append(fresh)
        return fresh


def _cat(parts: list[tuple[Block, int, int]], name: str) -> np.ndarray:
    """A per-window field of the batch (a view when the batch lies in one block)."""
    if len(parts) == 1:
        block, lo, hi = parts[0]
        return getattr(block, name)[lo:hi]
    return np.concatenate([getattr(b, name)[lo:hi] for b, lo, hi in parts])


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
    """Turns (block, window range) parts into one batch dict of numpy arrays."""

    def __init__(self, manifest: Manifest, spec: WindowSpec, *, with_weight: bool):
        self.manifest = manifest
        self.spec = spec
        self.dtype = manifest.dtype
        self.step_shape = manifest.step_shape
        self.sb = manifest.step_bytes
        self.with_weight = with_weight
        self.arrays = BatchArrays()

    def gather(self, parts: list[tuple[Block, int, int]]) -> dict:
        """Batch of the windows ``block.offs[lo:hi]`` of each part, in order."""
        spec, sb = self.spec, self.sb
        x = self._take(parts, 0, spec.window)
        out = {"x": x}
        if spec.horizon:
            out["y"] = self._take(parts, spec.window * sb, spec.horizon)
        if spec.pad:
            valid = _cat(parts, "valid")
            out["mask"] = np.arange(spec.window) < valid[:, None]
            if spec.horizon:
                out["y_mask"] = np.arange(spec.horizon) < (valid - spec.window)[:, None]
            if (valid < spec.span).any():  # zero the steps past a short sequence's end
                x[~out["mask"]] = 0
                if spec.horizon:
                    out["y"][~out["y_mask"]] = 0
        out["start"] = _cat(parts, "start").copy()
        out["key"] = [k for b, lo, hi in parts for k in b.batch_keys(lo, hi)] if len(parts) > 1 else \
            parts[0][0].batch_keys(parts[0][1], parts[0][2])
        if self.with_weight:
            out["weight"] = _cat(parts, "real").astype(np.float32)
        return out

    def _take(self, parts: list[tuple[Block, int, int]], shift: int, steps: int) -> np.ndarray:
        nbytes = steps * self.sb
        n = sum(hi - lo for _, lo, hi in parts)
        raw = self.arrays.get(n * nbytes)
        dest = torch.from_numpy(raw.reshape(n, nbytes))
        at = 0
        for b, lo, hi in parts:
            index = torch.from_numpy(b.offs[lo:hi] + shift if shift else b.offs[lo:hi])
            # one-block batches (nearly all) skip the slice: each torch call lets go of the GIL
            torch.index_select(_byte_rows(b, nbytes), 0, index, out=dest if len(parts) == 1 else dest[at : at + hi - lo])
            at += hi - lo
        return raw.view(self.dtype).reshape((n, steps) + self.step_shape)
