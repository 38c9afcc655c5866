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
        valid = np.concatenate([b.valid[lo:hi] for b, lo, hi in parts]) if len(parts) > 1 else parts[0][0].valid[parts[0][1]:parts[0][2]]
        if spec.pad:
            out["mask"] = np.arange(spec.window) < valid[:, None]
            if spec.horizon:
                out["y_mask"] = np.arange(spec.horizon) < (valid - spec.window)[:, None]
            if (valid < spec.span).any():  # zero the steps past a short sequence's end
                x[~out["mask"]] = 0
                if spec.horizon:
                    out["y"][~out["y_mask"]] = 0
        seq = np.concatenate([b.seq[lo:hi] for b, lo, hi in parts])
        out["start"] = np.concatenate([b.start[lo:hi] for b, lo, hi in parts])
        out["key"] = self.manifest.keys(seq)
        if self.with_weight:
            out["weight"] = np.concatenate([b.real[lo:hi] for b, lo, hi in parts]).astype(np.float32)
        return out

    def _take(self, parts: list[tuple[Block, int, int]], shift: int, steps: int) -> np.ndarray:
        nbytes = steps * self.sb
        chunks = [_byte_windows(b.buf, nbytes)[b.offs[lo:hi] + shift] for b, lo, hi in parts]
        raw = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
        return raw.view(np.uint8).view(self.dtype).reshape((len(raw), steps) + self.step_shape)
