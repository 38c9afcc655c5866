"""zstd members (``<key>.npy.zst``): how a member's npy bytes are cut into independent frames.

A short member is one zstd frame of its whole ``.npy`` content (header and rows). A long one
is cut into frames of ``frame_rows(step_bytes)`` steps, about FRAME_BYTES of rows each, every
frame compressed on its own: frame 0 holds the npy header and the first rows, and the
manifest records where each frame ends (``Frames``), so a reader decompresses only the frames
that hold the steps it needs and its memory does not grow with the sequence. Pure functions
(zstandard level 3), no I/O.
"""
from __future__ import annotations

import functools

import numpy as np

from streamwin.errors import PackError

try:
    import zstandard
except ImportError:  # an optional dependency: only compression="zstd" needs it
    zstandard = None

FRAME_BYTES = 256 << 10  # a longer member is packed as independent frames of about this many bytes of rows
LEVEL = 3


@functools.cache
def compressor() -> "zstandard.ZstdCompressor":
    """The compressor every member is written with; PackError when zstandard is not installed."""
    if zstandard is None:
        raise PackError("compression='zstd' needs the zstandard package: pip install 'streamwin[zstd]'")
    return zstandard.ZstdCompressor(level=LEVEL)


def frame_rows(step_bytes: int) -> int:
    """Steps per zstd frame of a long member: about FRAME_BYTES of rows."""
    return max(1, FRAME_BYTES // max(step_bytes, 1))


def compress_frame(data: bytes | np.ndarray) -> bytes:
    """One independent zstd frame of ``data``."""
    return compressor().compress(data)


def compress_member(head: bytes, body: np.ndarray, length: int) -> tuple[bytes, tuple[int, ...] | None]:
    """(zstd member, frame ends) of an npy header and its ``length`` rows of bytes ``body``: one
    frame, or independent frames of ``frame_rows`` steps (frame ends counted from the member's start)."""
    step = len(body) // max(length, 1)
    rows = frame_rows(step)
    if length <= rows:
        return compress_frame(head + body.tobytes()), None
    frames = [compress_frame(head + body[: rows * step].tobytes())]
    frames += [compress_frame(body[a * step : (a + rows) * step].tobytes()) for a in range(rows, length, rows)]
    return b"".join(frames), tuple(np.cumsum([len(f) for f in frames]).tolist())


def decompress_frames(member: bytes, ends) -> bytes:
    """A zstd member's content: its frames (ending at ``ends``, from the member's first byte) decompressed, joined."""
    d = zstandard.ZstdDecompressor()
    starts = [0, *[int(e) for e in ends[:-1]]]
    return b"".join(d.decompress(member[a:int(b)]) for a, b in zip(starts, ends))
