"""Batch buffers reused once nothing refers to them (in-process batches, page-locked with ``pin_memory``)."""
from __future__ import annotations

import sys

import numpy as np
import torch


class BufferPool:
    """Batch buffers reused once no one else refers to them (in-process batches).

    Every view of a buffer (numpy views, tensors from ``torch.from_numpy``, a batch a training
    loop kept) holds a reference to it, so a reference count of two (this pool's list and
    getrefcount's argument) means its contents are nobody's any more. A consumer that keeps
    every batch just makes the pool allocate fresh buffers; nothing it holds is overwritten.
    With ``fenced`` (page-locked buffers), a released buffer is reused only once the CUDA work
    queued before its release (a ``non_blocking`` copy from it) has finished.
    """

    KEEP = 6  # buffers kept for reuse (a consumer that keeps batches makes it allocate more)

    def __init__(self, nbytes: int, keep: int = KEEP, allocate=None, fenced: bool = False):
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
