"""zstd decompression into a block's buffer, with the decompressed frames each reading thread keeps.

A unit (a listed frame, or a member packed whole) is decompressed straight into the block
buffer, or into the thread's FrameCache and copied from there: pieces of one block that
share a frame, and the blocks that follow one another through a slice (or cut a member in
two), then take it from the cache instead of reading and decompressing it again. Frame 0
(or a whole member) starts with the npy header, checked against the manifest; a unit must
hold exactly the data bytes the manifest implies.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from streamwin.errors import ShardError
from streamwin.read.counts import Counters
from streamwin.read.frames import frame_ends, listed, unit_rows, unit_span
from streamwin.read.members import Members
from streamwin.read.transport import fill
from streamwin.storage import mapped

FRAME_CACHE_BYTES = 4 << 20  # decompressed zstd frames kept per reading thread for the next pieces and blocks


class FrameCache:
    """Decompressed frames of zstd members (a frame, or a small member whole), the least recently used dropped
    first, at most ``limit`` bytes."""

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
        """Hold frame ``key``'s data (a buffer from ``slot``)."""
        self.entries[key] = frame
        self.nbytes += len(frame)


class Inflater:
    """Lays out zstd members' steps in block buffers; per reading thread a decompressor and a FrameCache."""

    def __init__(self, members: Members, counters: Counters):
        self.members, self.counters = members, counters
        self.manifest = members.manifest
        self._local = threading.local()

    def _decompressor(self):
        """This thread's zstd decompressor, made once: a fresh one per block costs memory that is not given back."""
        import zstandard  # an optional dependency: only zstd datasets need it

        local = self._local
        if getattr(local, "dctx", None) is None:
            local.dctx = zstandard.ZstdDecompressor()
        return local.dctx

    def _frames(self) -> FrameCache:
        """This thread's decompressed frames (blocks are read on one thread; the cache needs no lock)."""
        local = self._local
        if getattr(local, "frames", None) is None:
            local.frames = FrameCache(FRAME_CACHE_BYTES)
        return local.frames

    def take_cached(self, seq: np.ndarray, a: np.ndarray, b: np.ndarray, framed: np.ndarray,
                    buf: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Lay out the units at either end of each framed piece (steps [a, b) of member seq, at ``pos`` in
        ``buf``) that the cache holds; (first, end) unit left to read per piece (a member laid out whole: (0, 1)).

        Done before any unit of the block is decompressed, so none of these is evicted first.
        """
        f0, f1 = np.zeros(len(seq), dtype=np.int64), np.ones(len(seq), dtype=np.int64)
        cache, sb = self._frames(), self.manifest.step_bytes
        for n in np.flatnonzero(framed).tolist():
            i, s0, s1 = int(seq[n]), int(a[n]), int(b[n])
            j0, j1 = unit_span(self.manifest, i, s0, s1)
            out = buf[pos[n] : pos[n] + (s1 - s0) * sb]
            while j0 < j1 and self._copy_cached(cache, out, i, j0, s0, s1):
                j0 += 1
            while j1 > j0 and self._copy_cached(cache, out, i, j1 - 1, s0, s1):
                j1 -= 1
            f0[n], f1[n] = j0, j1
        return f0, f1

    def lay_out_frames(self, raw: memoryview, out: np.ndarray, i: int, k: int, steps: tuple[int, int],
                       frames: tuple[int, int], bad: list[tuple[int, int]] = ()) -> list[tuple[int, int]]:
        """Steps [a, b) of framed member i (of shard k) into ``out``: units [f0, f1) from ``raw`` (which holds
        them) or the cache, one by one; units outside [f0, f1) were laid out from the cache already.

        A unit whose compressed bytes overlap a damaged shard range of ``bad`` is not decompressed, and
        one that fails to decompress is counted (on_error="skip"; else raised): the steps of the piece
        in such units are returned, [s0, s1) each, and the other units are laid out.
        """
        (a, b), (f0, f1) = steps, frames
        m, rows, cache = self.manifest, unit_rows(self.manifest, i), self._frames()
        ends = frame_ends(m, i)
        base = int(ends[f0 - 1]) if f0 else 0
        lost: list[tuple[int, int]] = []
        for j in range(f0, f1):
            frame = cache.get((i, j))
            if frame is None:
                lo, hi = (int(ends[j - 1]) if j else 0) - base, int(ends[j]) - base
                at = int(m.offset[i]) + base + lo  # the unit's first byte in the shard
                if any(x < at + hi - lo and y > at for x, y in bad):  # damaged bytes: never decompressed
                    lost.append((max(a, j * rows), min(b, (j + 1) * rows)))
                    continue
                size = min(rows, int(m.length[i]) - j * rows) * m.step_bytes  # the frame's array bytes
                frame = cache.slot((i, j), rows * m.step_bytes)
                head = int(m.hlen[i]) if j == 0 else 0
                try:  # a member not listed as frames is one unit, which may hold frames of its own
                    self._inflate(raw[lo:hi], frame[:size], i, k, at, head, across=not listed(m, i))
                except ShardError as e:
                    self.counters.skip_or_raise(e)
                    lost.append((max(a, j * rows), min(b, (j + 1) * rows)))
                    continue
                cache.keep((i, j), frame)
            self._copy_steps(frame, out, i, j, a, b)
        return lost

    def decompress_whole(self, raw: memoryview, out: np.ndarray, i: int, k: int) -> None:
        """All of member i (its frames, listed or not) into ``out``, its header checked."""
        m = self.manifest
        self._inflate(raw, out, i, k, int(m.offset[i]), int(m.hlen[i]), across=True)

    def _copy_cached(self, cache: FrameCache, out: np.ndarray, i: int, j: int, a: int, b: int) -> bool:
        """Copy the steps of unit j of member i that a piece of steps [a, b) needs into ``out``, if cached."""
        frame = cache.get((i, j))
        if frame is not None:
            self._copy_steps(frame, out, i, j, a, b)
        return frame is not None

    def _copy_steps(self, frame: np.ndarray, out: np.ndarray, i: int, j: int, a: int, b: int) -> None:
        """Steps [a, b) of member i that lie in its unit j, from the unit's data into ``out`` (steps from a)."""
        rows, sb = unit_rows(self.manifest, i), self.manifest.step_bytes
        s0, s1 = max(a, j * rows), min(b, (j + 1) * rows)
        out[(s0 - a) * sb : (s1 - a) * sb] = frame[(s0 - j * rows) * sb : (s1 - j * rows) * sb]

    def _inflate(self, raw, out: np.ndarray, i: int, k: int, off: int, head: int, *, across: bool) -> None:
        """Decompress ``raw`` straight into ``out`` (after a ``head``-byte npy header, checked against the
        manifest), where its data must end exactly. Errors name member i and offset ``off``.

        No bytes object is made for the output: decompressed into memory of its own, 256 kB
        frames fragmented the heap as read buffers did.
        """
        import zstandard  # an optional dependency: only zstd datasets need it

        done = 0
        try:
            with self._decompressor().stream_reader(raw, read_across_frames=across) as src:
                if head:
                    header = bytearray(head)
                    if fill(src, memoryview(header)) < head:
                        raise self._size_error(0, len(out), i, k, off)
                    self.members.check_header(bytes(header), i, k)
                done = fill(src, memoryview(out).cast("B"))
                extra = bool(src.read(1)) if done == len(out) else False
        except zstandard.ZstdError as e:
            raise self.members.error(f"cannot decompress member: {e}", i, k, off) from e
        self.counters.add(bytes_decompressed=head + done)
        if done < len(out) or extra:
            raise self._size_error(done, len(out), i, k, off, more=extra)

    def _size_error(self, got: int, nbytes: int, i: int, k: int, off: int, more: bool = False) -> ShardError:
        """A unit that holds ``got`` data bytes (or ``more`` than expected) where the manifest implies ``nbytes``."""
        held = f"more than {nbytes}" if more else str(got)
        return self.members.error(f"member holds {held} data bytes here, the manifest implies {nbytes}", i, k, off)
