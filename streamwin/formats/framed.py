"""Manifest parts of the optional fields: NaN/inf counts and the frames of long zstd members."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from streamwin.errors import ManifestError
from streamwin.formats.meta import encode_column as _encode


@dataclass(frozen=True)
class NonFinite:
    """NaN and ±inf values in a dataset's arrays, counted by pack (and index); per shard NaN + inf."""

    nan: int
    inf: int
    per_shard: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class Frames:
    """Long zstd members packed as independent frames of ``rows`` steps each (the last may be shorter).

    Frame 0 of a member also holds its npy header. ``seq`` lists the framed sequences (sorted);
    ``ends`` holds, for each in turn, the compressed end offset (from the member's first byte)
    of each of its ``ceil(length / rows)`` frames. Members not listed are one frame.
    """

    rows: int
    seq: np.ndarray
    ends: np.ndarray
    first: np.ndarray = field(repr=False)  # [len(seq) + 1]: where each framed sequence's ends begin

    @classmethod
    def make(cls, rows: int, seq: np.ndarray, ends: np.ndarray, length: np.ndarray) -> "Frames":
        """Frames of the sequences ``seq`` of a dataset whose lengths are ``length``; checked."""
        seq, ends = np.asarray(seq, dtype=np.int64), np.asarray(ends, dtype=np.int64)
        if rows < 1 or (len(seq) and (seq.min() < 0 or seq.max() >= len(length) or np.any(np.diff(seq) <= 0))):
            raise ManifestError(f"manifest frames: rows {rows} or framed sequence numbers out of range")
        first = np.zeros(len(seq) + 1, dtype=np.int64)
        np.cumsum(-(-length[seq] // rows), out=first[1:])
        if first[-1] != len(ends):
            raise ManifestError(f"manifest frames: {len(ends)} frame ends for {first[-1]} frames")
        return cls(int(rows), seq, ends, first)

    def to_doc(self) -> dict:
        return {"rows": self.rows, "seq": _encode(self.seq.astype("<i8")), "ends": _encode(self.ends.astype("<i8"))}
