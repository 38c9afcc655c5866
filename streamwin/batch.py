"""Gather windows from a block's byte buffer into batch arrays, one vectorized copy each.

A window is ``window * step_bytes`` contiguous bytes starting at ``Block.offs[i]``. Viewing
the block buffer as an array of such byte strings with a stride of one byte lets numpy's
fancy indexing copy all windows of a batch in one call, with no Python per window.
"""
from __future__ import annotations

import numpy as np

from .manifest import Manifest
from .plan import WindowSpec
from .read import Block


def _byte_windows(buf: np.ndarray, nbytes: int) -> np.ndarray:
    """A read-only view of ``buf`` whose item i is the ``nbytes`` bytes starting at byte i."""
    count = max(len(buf) - nbytes + 1, 0)
    view = np.ndarray(shape=(count,), dtype=np.dtype((np.void, nbytes)), buffer=buf, offset=0, strides=(1,))
    view.flags.writeable = False
    return view


def _cat(parts: list[tuple[Block, int, int]], name: str) -> np.ndarray:
    """A per-window field of the batch (a view when the batch lies in one block)."""
    if len(parts) == 1:
        block, lo, hi = parts[0]
        return getattr(block, name)[lo:hi]
    return np.concatenate([getattr(b, name)[lo:hi] for b, lo, hi in parts])


class Gatherer:
    """Turns (block, window range) parts into one batch dict of numpy arrays."""

    def __init__(self, manifest: Manifest, spec: WindowSpec, *, with_weight: bool):
        self.manifest = manifest
        self.spec = spec
        self.dtype = manifest.dtype
        self.step_shape = manifest.step_shape
        self.sb = manifest.step_bytes
        self.with_weight = with_weight

    def gather(self, parts: list[tuple[Block, int, int]]) -> dict:
        """Batch of the windows ``block.offs[lo:hi]`` of each part, in order."""
        spec, sb = self.spec, self.sb
        x = self._take(parts, 0, spec.window)
        out = {"x": x}
        if spec.horizon:
            out["y"] = self._take(parts, spec.window * sb, spec.horizon)
        valid = _cat(parts, "valid")
        if spec.pad:
            out["mask"] = np.arange(spec.window) < valid[:, None]
            if spec.horizon:
                out["y_mask"] = np.arange(spec.horizon) < (valid - spec.window)[:, None]
            if (valid < spec.span).any():  # zero the steps past a short sequence's end
                x[~out["mask"]] = 0
                if spec.horizon:
                    out["y"][~out["y_mask"]] = 0
        out["start"] = _cat(parts, "start").copy()
        out["key"] = [k for b, lo, hi in parts for k in b.batch_keys(lo, hi)]
        if self.with_weight:
            out["weight"] = _cat(parts, "real").astype(np.float32)
        return out

    def _take(self, parts: list[tuple[Block, int, int]], shift: int, steps: int) -> np.ndarray:
        nbytes = steps * self.sb
        chunks = [_byte_windows(b.buf, nbytes)[b.offs[lo:hi] + shift] for b, lo, hi in parts]
        raw = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
        return raw.view(np.uint8).view(self.dtype).reshape((len(raw), steps) + self.step_shape)
