"""What a block read gives the batcher: the bytes of a block's windows and where each starts, and counters.

A ``Block`` is the unit the read side hands on: one buffer (mapped from the page cache, or
read or decompressed into anonymous memory) and, per window, the byte offset of its step 0
in it. ``ReadStats`` counts what reading cost (bytes, requests, retries, skips), summed over
a loader's streams for ``loader.stats()``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

READABLE = np.iinfo(np.int64).max  # steps readable of a sequence that read without error: all of them


@dataclass
class Block:
    """The windows of one block and the bytes they are cut from.

    ``offs[i]`` is the byte offset in ``buf`` where window i's step 0 begins; ``valid[i]`` the
    steps of window + horizon that lie inside the sequence (less than the span only for a
    padded window of a short sequence). ``buf`` has a zero tail one span long, so a padded
    window never reads past it.
    """

    buf: np.ndarray
    offs: np.ndarray
    start: np.ndarray
    real: np.ndarray
    valid: np.ndarray
    seq_ids: np.ndarray  # manifest indices of the block's distinct sequences
    key_index: np.ndarray  # window i belongs to sequence seq_ids[key_index[i]]
    buf_tensor: Any = None  # the gatherer's tensor views of buf, made once; dropped with buf

    def __len__(self) -> int:
        return len(self.offs)

    @property
    def nbytes(self) -> int:
        """Bytes of the block's buffer (the read-ahead's memory)."""
        return self.buf.nbytes


@dataclass
class ReadStats:
    """What reading cost so far: bytes and requests, retries, skipped ranges and windows, cache hits."""

    bytes_read: int = 0
    reads: int = 0
    retries: int = 0
    skipped_ranges: int = 0
    skipped_windows: int = 0
    cache_hits: int = 0
    bytes_decompressed: int = 0  # zstd output (npy headers included): near the members' bytes when frames are used once
    bytes_verified: int = 0  # bytes checked against the manifest's chunk checksums (whole chunks: a little more than read)
    bytes_sums: int = 0  # bytes of the shards' sums files read (the checksums, formats/checks.py; not in bytes_read)
    throttled: int = 0  # answers of a store asking for fewer requests (503 SlowDown, 429): GETs in flight halved
    early_blocks: int = 0  # blocks of a stream read before it began (at the end of the epoch before, remote storage)
