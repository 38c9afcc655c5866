"""Decompressed zstd frames kept per reading thread.

Pieces of one block that share a frame, and the blocks that follow one another through a
slice, take a frame from the cache instead of reading and decompressing it again.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from streamwin.storage import mapped

FRAME_CACHE_BYTES = 4 << 20  # decompressed zstd frames kept per reading thread for the next pieces and blocks


class FrameCache:
    """Decompressed frames of zstd members (a frame, or a small member whole), the least recently used dropped
    first, at most ``limit`` bytes.

    Pieces of one block that share a frame, and the blocks that follow one another through a
    slice (or cut a member in two), take it from here instead of reading and decompressing it
    again.
    """

    def __init__(self, limit: int):
        self.limit, self.nbytes = limit, 0
        self.entries: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def get(self, key: tuple[int, int]) -> np.ndarray | None:
        """The frame's data, if held."""
        frame = self.entries.get(key)
        if frame is not None:
            self.entries.move_to_end(key)
        return frame

    def slot(self, key: tuple[int, int], size: int) -> np.ndarray:
        """A ``size``-byte buffer to decompress frame ``key`` into (an evicted one of that size if any);
        ``keep`` it once filled."""
        spare = self.entries.pop(key, None)
        self.nbytes -= len(spare) if spare is not None else 0
        while self.entries and self.nbytes + size > self.limit:
            _, evicted = self.entries.popitem(last=False)
            self.nbytes -= len(evicted)
            spare = evicted if len(evicted) == size else spare
        return spare if spare is not None and len(spare) == size else mapped.anonymous(size)

    def keep(self, key: tuple[int, int], frame: np.ndarray) -> None:
        self.entries[key] = frame
        self.nbytes += len(frame)
