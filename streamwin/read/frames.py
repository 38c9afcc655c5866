"""zstd members on the read side: the units a read decompresses whole, and how long a read slice should be.

A member packed as frames (``manifest.frames``) is decompressed frame by frame; any other
member whole. Pure numpy, no I/O.
"""
from __future__ import annotations

import numpy as np

from streamwin.formats.manifest import Manifest

COMPRESSED_GAP = 4 << 10  # compressed members this close are read as one run (tar headers, json members)
RAW_BATCH = 8 << 20  # compressed bytes of a block read (and decompressed) at a time
WHOLE_UNIT_BYTES = 256 << 10  # an unframed zstd member up to this size is cached like a frame (pack's frame size)
SLICE_UNITS = 8  # a default zstd read slice spans this many frames or members (see zstd_slice_windows)


def zstd_slice_windows(m: Manifest, stride: int) -> int:
    """Fewest windows of a default read slice of a zstd dataset (1 for others): SLICE_UNITS of the units a
    read decompresses whole (a frame of a framed member, else a member), a unit's size weighted by it.

    A slice's edges cut a unit that the blocks of both neighbours read and decompress: with
    slices of a few windows each unit would be read about once per slice in it (frames of
    thousands of windows: bytes read 10-100x the shards). A slice SLICE_UNITS times the
    (size-weighted) unit reads and decompresses about 1 + 1 / SLICE_UNITS of them.
    """
    if m.compression is None or not m.num_sequences:
        return 1
    rows = m.frames.rows if m.frames is not None else max(1, WHOLE_UNIT_BYTES // max(m.step_bytes, 1))
    length = m.length.astype(np.float64)
    if not length.sum():
        return 1
    frames, rest = np.divmod(length, rows)  # each member: units of ``rows`` steps and one shorter
    weighted = float(frames.sum()) * rows * rows + float(np.dot(rest, rest))  # sum over units of steps squared
    return int(np.ceil(SLICE_UNITS * weighted / float(length.sum()) / stride))
