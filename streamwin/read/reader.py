"""Read the sequences a block of windows needs into one contiguous byte buffer.

Local (and node-cached) shards are mapped into the buffer instead of read (see mapped.py):
the batch gather is then the only copy of a window's bytes.

A block's windows are cut into pieces, runs of consecutive windows of one sequence (with
shuffle a block holds several slices of the plan, scattered over the shards and over a long
sequence), and only the steps each piece covers are read. Pieces of consecutive windows are
merged across the headers between them, so a slice of many short sequences is one read;
pieces of different slices only across a gap small beside them, so an epoch reads each
shard byte about once (bytes read / shard bytes near 1, in ``stats()``), and a block's
buffer holds what its windows cover, however long the sequences. Every
``.npy`` header that a read covers is checked against the manifest (dtype, shape, header
length) before any window is cut from it. Reads retry with exponential backoff; what still
fails is a ShardError naming the shard, the member and the byte offset.
"""
from __future__ import annotations

import os
import threading
import time
import warnings
from typing import Any

import numpy as np

import streamwin.read.local as local_files
from streamwin.errors import ShardError
from streamwin.formats import npy as npyfmt
from streamwin.formats import tar as tarfmt
from streamwin.formats.manifest import Manifest
from streamwin.plan.epoch import Plan
from streamwin.read.block import READABLE, Block, ReadStats
from streamwin.read.frames import (compressed_ranges, compressed_runs, frame_ends, listed, raw_batches, unit_rows,
                                   unit_span, units, zstd_slice_windows)
from streamwin.read.inflate import FRAME_CACHE_BYTES, FrameCache
from streamwin.read.pieces import Pieces, land, pieces
from streamwin.read.runs import MERGE_GAP, PlainRuns, packed, paged, plain_runs
from streamwin.read.transport import fill, read_file
from streamwin.storage import mapped
from streamwin.storage.ranged import BrokenRead, RangeReader
from streamwin.storage.retry import describe, permanent
from streamwin.storage.urls import is_local, join, url_to_fs

__all__ = ["READABLE", "Block", "ReadStats", "ShardSource", "zstd_slice_windows"]

REMOTE_CONCURRENCY = 8  # concurrent range GETs per block on object storage
MAX_MAPPED_RUNS = 1024  # a block of more separate runs is read, not mapped (mappings per process are limited)


class ShardSource:
    """Reads byte ranges of a dataset's shards (any fsspec URL) and assembles blocks."""

    def __init__(self, url: str, manifest: Manifest, *, storage_options: dict[str, Any] | None = None,
                 retries: int = 5, backoff: float = 0.2, on_error: str = "raise", cache=None):
        self.url = url.rstrip("/")
        self.manifest = manifest
        self.fs, self.root = url_to_fs(url, storage_options, own_retries=True)
        self.local = is_local(self.fs)
        self.ranges = None if self.local else RangeReader(self.fs)  # streamed GETs, pooled connections
        self.retries, self.backoff = retries, backoff
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.on_error = on_error
        self.cache = cache  # a streamwin.cache.ShardCache, or None
        # local and cached shards are mapped, not read: the gather then copies straight from the page cache
        self.map_files = (self.local or cache is not None) and mapped.available()
        self._pool = None
        self._unmap: list[mapped.MappedBuffer] = []  # released mappings, dropped by the next read
        self.stats = ReadStats()
        self._header_cache: dict[bytes, tuple] = {}
        self._unfetchable: dict[int, ShardError] = {}  # shards the cache failed to fetch for the current block
        self._lock = threading.Lock()
        self._local = threading.local()  # per reading thread: its zstd decompressor

    def shard_url(self, k: int) -> str:
        return f"{self.url}/{self.manifest.shards[k].name}"

    def read_block(self, plan: Plan, stream: int, block: int) -> Block:
        """Read what block ``block`` of ``stream`` needs; windows in yield order."""
        with self._lock:
            self._unmap.clear()
            self._unfetchable.clear()
        g, real, shuffled = plan.block_parts(stream, block)  # stream order: runs of consecutive windows
        m = self.manifest
        span = plan.config.spec.span
        sb = m.step_bytes
        order = np.argsort(g, kind="stable")  # manifest order: by sequence, then start
        seq, start = plan.locate(g[order])
        real = real[order]
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))  # where each window of stream order went in manifest order
        into_yield = rank if shuffled is None else rank[shuffled]
        length = plan.ends(seq)  # a split's view may end before the sequence does
        if npyfmt.is_big_endian(m.dtype) and len(seq):  # an index made elsewhere; every read would be wrong
            raise self._byte_order_error(int(seq[0]))
        p = pieces(g[order], seq, start, np.minimum(start + span, length), MERGE_GAP // sb)
        uniq, inv = np.unique(seq, return_inverse=True)
        valid = np.minimum(length - start, span)
        if m.compression:
            buf, base, good = self._read_compressed(p, span * sb)
        else:
            buf, base, good = self._read_plain(p, span * sb)
        offs, lost = land(p, base, good, start, valid, sb, len(buf) - span * sb)
        if lost.any():  # on_error="skip": unreadable windows become zeros of weight 0
            real = real & ~lost
            valid = np.where(lost, 0, valid)
            with self._lock:
                self.stats.skipped_windows += int(lost.sum())
        offs, start, real, valid, inv = (a[into_yield] for a in (offs, start, real, valid, inv))
        return Block(buf, offs, start, real, valid, uniq, inv)

    def release(self, block: Block) -> None:
        """Drop a block's buffer (the caller must hold no view of it any more); a mapping is unmapped later.

        Buffers are not kept for reuse: each is its own anonymous mapping, given back to the
        system when dropped. Reused, they were malloc'd, and a freed one raised glibc's mmap
        threshold to its size, after which smaller buffers came from heaps that kept them.
        """
        base = block.buf.base if block.buf is not None and block.buf.base is not None else block.buf
        if isinstance(base, mapped.MappedBuffer):  # unmapped by the reading thread, off the batch path
            with self._lock:
                self._unmap.append(base)
        block.buf = block.buf_tensor = None

    def _name_member(self, err: ShardError, seqs: np.ndarray) -> ShardError:
        """The same error, naming the member whose bytes hold the failing offset."""
        if err.member is not None or err.offset is None or not len(seqs):
            return err
        starts = self.manifest.offset[seqs] - tarfmt.BLOCK  # each member's tar header
        i = int(seqs[max(int(np.searchsorted(starts, err.offset, side="right")) - 1, 0)])
        named = ShardError(err.reason, shard=err.shard, member=self._member(i), offset=err.offset)
        named.__cause__ = err.__cause__
        return named

    def _skip_or_raise(self, err: ShardError) -> None:
        if self.on_error == "raise":
            raise err
        with self._lock:
            self.stats.skipped_ranges += 1
            first = self.stats.skipped_ranges == 1
        if first:
            warnings.warn(f"streamwin: skipping unreadable data (on_error='skip'), further skips are counted "
                          f"in loader.stats(): {err}", RuntimeWarning, stacklevel=2)

    # -- uncompressed: byte ranges mapped, or read, into the block buffer ---------------------
    def _read_plain(self, p: Pieces, tail: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(buffer, where each piece's sequence has its step 0 in it, steps readable per piece).

        The pieces' bytes are read in runs (see runs.py): mapped where the shard is a local
        file, else read into the buffer. A run that fails (on_error="skip") keeps what it
        delivered and reads the rest member by member (``_recover``).
        """
        runs = plain_runs(self.manifest, p)
        mapping = None
        if self.map_files and len(runs) <= MAX_MAPPED_RUNS:
            try:
                mapping = self._map_runs(runs, tail)
            except OSError:  # out of address space or mappings: read instead
                pass
        buf, run_at, errors, refill = mapping or self._read_runs(runs, tail)
        base, header_at = runs.land(run_at)
        at, hlens = header_at.tolist(), runs.hlen.tolist()
        covers, bounds = runs.covers_header(), runs.first.tolist()
        good = np.full(len(runs.seq), READABLE, dtype=np.int64)
        for j, err in enumerate(errors):
            k, u0, u1 = int(runs.shard[j]), bounds[j], bounds[j + 1]
            if err is not None:  # skip mode: keep what the run delivered, read the rest member by member
                def reread(v: int) -> ShardError | None:
                    return refill(k, int(runs.lo[v]), int(runs.run_hi[j]), int(run_at[j] + runs.lo[v] - runs.run_lo[j]))
                self._recover(err, runs, u0, u1, reread, good)
            for u in range(u0, u1):
                if covers[u] and good[u] > 0:  # the read covers this member's .npy header: check it
                    try:
                        self._check_header(buf[at[u] : at[u] + hlens[u]].tobytes(), int(runs.seq[u]), k)
                    except ShardError as e:
                        self._skip_or_raise(e)
                        good[u] = 0
        return buf, base, good

    def _recover(self, err: ShardError, runs: PlainRuns, u0: int, u1: int, reread, good: np.ndarray) -> None:
        """After a failed run read: the steps each member got before the failure; the rest read again.

        A failed read leaves every byte before the error's offset in place. The member holding
        that offset keeps the steps before it; the members after it are read again, from the
        next one's first byte, until a read gets to the end. An error at no place in the range
        (a shard the cache could not fetch), or a read again that gets no byte at all (a file
        cut short, an object gone), loses the rest of the run at once: each try would fail
        alike. Each failure is one skipped range.
        """
        u, again = u0, False
        while err is not None:
            self._skip_or_raise(self._name_member(err, runs.seq[u:u1]))
            fail = err.offset
            if fail is None or fail < runs.lo[u] or (again and fail == runs.lo[u]):
                good[u:u1] = 0
                return
            v = u + int(np.searchsorted(runs.hi[u:u1], fail, side="right"))  # members before v are whole
            if v < u1 and runs.lo[v] <= fail:  # the failure is inside member v
                good[v] = runs.steps_before(v, fail)
                v += 1
            if v == u1:
                return
            err, u, again = reread(v), v, True

    def _read_runs(self, runs: PlainRuns, tail: int):
        """Read each run of its shard into one buffer, back to back.

        Returns (buffer, run starts, errors, refill), where ``refill(k, lo, hi, at)`` reads bytes
        [lo, hi) of shard k to ``at`` in the buffer again (ShardError or None).
        """
        run_at, nbytes = packed(runs)
        buf = mapped.anonymous(nbytes + tail)  # zeroed: the tail too
        size = runs.run_hi - runs.run_lo
        reads = [(int(runs.shard[j]), int(runs.run_lo[j]), memoryview(buf)[run_at[j] : run_at[j] + size[j]])
                 for j in range(len(runs))]

        def refill(k: int, a: int, b: int, at: int) -> ShardError | None:
            return self._try_read((k, a, memoryview(buf)[at : at + b - a]))
        return buf, run_at, self._read_many(reads), refill

    def _map_runs(self, runs: PlainRuns, tail: int):
        """Map each run of its (local or cached) shard file into one address range.

        No bytes are copied: the gather reads the page cache directly. Each run starts at a
        page boundary of the range, ``lo % PAGE`` bytes in. Returns (buffer, run starts, errors,
        refill) as ``_read_runs`` does; raises OSError when the system refuses a mapping.
        """
        run_at, nbytes = paged(runs)
        target = mapped.MappedBuffer(nbytes + tail)
        errors: list[ShardError | None] = []
        for j, k in enumerate(runs.shard.tolist()):
            try:
                self._map_run(target, int(run_at[j]), k, int(runs.run_lo[j]), int(runs.run_hi[j]))
                errors.append(None)
            except ShardError as e:
                errors.append(e)

        def refill(k: int, a: int, b: int, at: int) -> ShardError | None:
            try:
                self._map_run(target, at, k, a, b)
            except ShardError as e:
                return e
            except OSError as e:  # the mapping was refused now: the bytes are not there
                return ShardError(f"cannot map shard bytes: {e}", shard=self.shard_url(k), offset=a)
            return None
        return target.array(), run_at, errors, refill

    def _map_run(self, target: mapped.MappedBuffer, at: int, k: int, lo: int, hi: int) -> None:
        """Map bytes [lo, hi) of shard k so that byte lo lands at ``at`` (``at`` = ``lo`` modulo PAGE).

        A file that ends early has what it holds mapped, then raises a ShardError at its end.
        """
        f, hit = self._open_local(k, lo)
        with f:
            size = os.fstat(f.fileno()).st_size
            end = min(hi, size)  # mapping a page wholly past the end would fault (SIGBUS) on access
            start = mapped.page_floor(lo)
            if end > lo:
                target.map_file(at - (lo - start), f.fileno(), start, end - start)  # OSError: the caller reads
        with self._lock:
            self.stats.bytes_read += max(end - lo, 0)
            self.stats.reads += 1
            self.stats.cache_hits += hit
        if end < hi:
            raise ShardError(f"shard ends early: wanted bytes {lo}..{hi}, the file has {size}",
                             shard=self.shard_url(k), offset=max(size, lo))

    def _open_local(self, k: int, offset: int):
        """(open file, cache hit) of shard k: the shard itself, or its node-local copy.

        A cached copy evicted by another process between fetch and open is fetched again, once.
        """
        path = join(self.root, self.manifest.shards[k].name)
        entry = self.manifest.shards[k]
        for attempt in (0, 1):
            hit = False
            local = path
            if self.cache is not None:
                failed = self._unfetchable.get(k)
                if failed is not None:  # this block already tried: a shard that failed to fetch is not fetched again
                    raise failed
                hit = self.cache.has(self.shard_url(k), entry)
                try:
                    local = self.cache.fetch(self.shard_url(k), self.fs, path, entry)
                except ShardError as e:
                    self._unfetchable[k] = e
                    raise
            try:
                return open(local, "rb", buffering=0), hit
            except FileNotFoundError as e:
                if self.cache is None or attempt:
                    raise ShardError(f"cannot open shard: {e}", shard=self.shard_url(k), offset=offset) from e
            except OSError as e:
                raise ShardError(f"cannot open shard: {e}", shard=self.shard_url(k), offset=offset) from e
        raise AssertionError("unreachable")

    def _check_header(self, header: bytes, i: int, k: int) -> int:
        m = self.manifest
        shape = (int(m.length[i]),) + m.step_shape
        hlen = int(m.hlen[i])
        if header == npyfmt.npy_header_for(m.dtype, shape):  # the common case, without a parse
            return hlen
        expected = (m.dtype, shape, hlen)
        got = self._header_cache.get(header)
        if got is None:
            try:
                got = npyfmt.parse_npy_header(header)
            except ValueError as e:
                raise ShardError(f"bad .npy header: {e}", shard=self.shard_url(k), member=self._member(i),
                                 offset=int(m.offset[i])) from e
            if len(self._header_cache) < 4096:
                self._header_cache[header] = got
        if got != expected:
            raise ShardError(
                f"member disagrees with the manifest: dtype {got[0]}, shape {got[1]}, header {got[2]} bytes in the shard; "
                f"manifest says dtype {expected[0]}, shape {expected[1]}, header {expected[2]} bytes",
                shard=self.shard_url(k), member=self._member(i), offset=int(m.offset[i]))
        return got[2]

    def _byte_order_error(self, i: int) -> ShardError:
        m = self.manifest
        k = int(np.searchsorted(m.shard_starts, i, side="right")) - 1
        return ShardError(f"the manifest declares big-endian dtype {m.dtype.str}: streamwin reads little-endian "
                          "arrays only (streamwin.pack converts big-endian input)",
                          shard=self.shard_url(k), member=self._member(i), offset=int(m.offset[i]))

    def _member(self, i: int) -> str:
        return f"{self.manifest.key(i)}.npy" + (".zst" if self.manifest.compression else "")

    # -- compressed members: decompress the frames a piece needs, lay out their array data ----------
    def _read_compressed(self, p: Pieces, span_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(buffer, where each piece's sequence has its step 0 in it, steps readable per piece).

        Each piece lays out what frames.units says: its own steps from the units that hold
        them, each unit decompressed once for the block and kept for the next (see
        FrameCache), or its whole member, once for all the pieces of its sequence. The
        compressed bytes are read first, neighbours in a shard as one run (concurrently on
        remote storage), then decompressed piece by piece, straight into the block buffer or
        the frame cache.
        """
        m = self.manifest
        u = units(m, p)
        buf = mapped.anonymous(int(u.pos[-1]) + span_bytes)  # zero-filled, given back to the system when dropped
        good = np.full(len(p.seq), READABLE, dtype=np.int64)
        own = np.flatnonzero(~u.shared)
        f0, f1 = self._frames_cached(p.seq[own], u.a[own], u.b[own], u.framed[own], buf, u.pos[own])
        todo = np.flatnonzero(f0 < f1)  # pieces with frames to read (a member decompressed whole: all of it)
        seq = p.seq[own[todo]]
        shard = np.searchsorted(m.shard_starts, seq, side="right") - 1
        lo, hi = compressed_ranges(m, seq, f0[todo], f1[todo], u.framed[own[todo]])
        dctx = self._decompressor()
        failed = np.zeros(len(todo), dtype=bool)
        for n0, n1, raw, at in self._read_compressed_runs(seq, shard, lo, hi, failed):
            for n in range(n0, n1):
                j, i, k = int(own[todo[n]]), int(seq[n]), int(shard[n])
                src = memoryview(raw)[at[n - n0] : at[n - n0] + hi[n] - lo[n]]
                out = buf[u.pos[j] : u.pos[j + 1]]
                try:
                    if failed[n]:
                        continue
                    if u.framed[j]:
                        self._lay_out_frames(dctx, src, out, i, k, (int(u.a[j]), int(u.b[j])),
                                             (int(f0[todo[n]]), int(f1[todo[n]])))
                    else:
                        self._decompress_whole(dctx, src, out, i, k)
                except ShardError as e:
                    self._skip_or_raise(e)
                    failed[n] = True
        good[own[todo[failed]]] = 0  # what a piece reads is decompressed whole: all of it or nothing
        return buf, u.base(m.step_bytes), good[u.owner]

    def _frames_cached(self, seq: np.ndarray, a: np.ndarray, b: np.ndarray, framed: np.ndarray,
                       buf: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Lay out the frames at either end of each framed piece that the cache holds; (first, end) frame
        left to read per piece (a member decompressed whole: (0, 1)).

        Done before any frame of the block is decompressed, so none of these is evicted first.
        """
        f0, f1 = np.zeros(len(seq), dtype=np.int64), np.ones(len(seq), dtype=np.int64)
        cache = self._frame_cache()
        for n in np.flatnonzero(framed).tolist():
            i, s0, s1 = int(seq[n]), int(a[n]), int(b[n])
            j0, j1 = unit_span(self.manifest, i, s0, s1)
            out = buf[pos[n] : pos[n] + (s1 - s0) * self.manifest.step_bytes]
            while j0 < j1 and self._copy_cached(cache, out, i, j0, s0, s1):
                j0 += 1
            while j1 > j0 and self._copy_cached(cache, out, i, j1 - 1, s0, s1):
                j1 -= 1
            f0[n], f1[n] = j0, j1
        return f0, f1

    def _copy_cached(self, cache: FrameCache, out: np.ndarray, i: int, j: int, a: int, b: int) -> bool:
        """Copy the steps of frame j of member i that a piece of steps [a, b) needs into ``out``, if cached."""
        frame = cache.get((i, j))
        if frame is not None:
            self._copy_steps(frame, out, i, j, a, b)
        return frame is not None

    def _copy_steps(self, frame: np.ndarray, out: np.ndarray, i: int, j: int, a: int, b: int) -> None:
        """Steps [a, b) of member i that lie in its frame j, from the frame's data into ``out`` (steps from a)."""
        rows, sb = unit_rows(self.manifest, i), self.manifest.step_bytes
        s0, s1 = max(a, j * rows), min(b, (j + 1) * rows)
        out[(s0 - a) * sb : (s1 - a) * sb] = frame[(s0 - j * rows) * sb : (s1 - j * rows) * sb]

    def _read_compressed_runs(self, seq: np.ndarray, shard: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                              failed: np.ndarray):
        """Read ranges [lo, hi) in runs, a batch of about RAW_BATCH bytes at a time (concurrently on remote
        storage); yields (first range, end range, bytes, where each range of the batch is in them).

        Ranges of a run that fails are marked in ``failed`` (after the error is raised or counted).
        """
        runs = compressed_runs(shard, lo, hi)
        bounds = runs.first
        for r0, r1 in raw_batches(runs):
            pos = np.zeros(r1 - r0 + 1, dtype=np.int64)
            np.cumsum(runs.run_hi[r0:r1] - runs.run_lo[r0:r1], out=pos[1:])
            raw = mapped.anonymous(int(pos[-1]))
            reads = [(int(shard[bounds[r]]), int(runs.run_lo[r]), memoryview(raw)[pos[r - r0] : pos[r - r0 + 1]])
                     for r in range(r0, r1)]
            for r, err in zip(range(r0, r1), self._read_many(reads)):
                if err is not None:
                    self._skip_or_raise(self._name_member(err, seq[bounds[r] : bounds[r + 1]]))
                    failed[bounds[r] : bounds[r + 1]] = True
            n0, n1 = int(bounds[r0]), int(bounds[r1])
            run = runs.run[n0:n1]
            yield n0, n1, raw, pos[run - r0] + (lo[n0:n1] - runs.run_lo[run])

    def _decompressor(self):
        """This thread's zstd decompressor, made once: a fresh one per block costs memory that is not given back."""
        import zstandard

        local = self._local
        if getattr(local, "dctx", None) is None:
            local.dctx = zstandard.ZstdDecompressor()
        return local.dctx

    def _frame_cache(self) -> FrameCache:
        """This thread's decompressed frames (blocks are read on one thread; the cache needs no lock)."""
        local = self._local
        if getattr(local, "frames", None) is None:
            local.frames = FrameCache(FRAME_CACHE_BYTES)
        return local.frames

    def _lay_out_frames(self, dctx, raw: memoryview, out: np.ndarray, i: int, k: int, steps: tuple[int, int],
                        frames: tuple[int, int]) -> None:
        """Steps [a, b) of framed member i into ``out``: frames [f0, f1) from ``raw`` (which holds them) or
        the cache, one by one; frames outside [f0, f1) were laid out from the cache already."""
        (a, b), (f0, f1) = steps, frames
        m, rows, cache = self.manifest, unit_rows(self.manifest, i), self._frame_cache()
        ends = frame_ends(self.manifest, i)
        base = int(ends[f0 - 1]) if f0 else 0
        for j in range(f0, f1):
            frame = cache.get((i, j))
            if frame is None:
                lo, hi = (int(ends[j - 1]) if j else 0) - base, int(ends[j]) - base
                size = min(rows, int(m.length[i]) - j * rows) * m.step_bytes  # the frame's array bytes
                frame = cache.slot((i, j), rows * m.step_bytes)
                self._decompress_frame(dctx, raw[lo:hi], frame[:size], i, k, j, base + lo)
                cache.keep((i, j), frame)
            self._copy_steps(frame, out, i, j, a, b)

    def _decompress_frame(self, dctx, raw: memoryview, out: np.ndarray, i: int, k: int, j: int, at: int) -> None:
        """Frame j of member i into ``out``, its header checked (frame 0); a member not listed as frames is one
        unit, which may hold frames of its own."""
        m = self.manifest
        head = int(m.hlen[i]) if j == 0 else 0
        self._inflate(dctx, raw, out, i, k, int(m.offset[i]) + at, head, across=not listed(self.manifest, i))

    def _decompress_whole(self, dctx, raw: memoryview, out: np.ndarray, i: int, k: int) -> None:
        """All of member i (its frames, listed or not) into ``out``, its header checked."""
        m = self.manifest
        self._inflate(dctx, raw, out, i, k, int(m.offset[i]), int(m.hlen[i]), across=True)

    def _inflate(self, dctx, raw, out: np.ndarray, i: int, k: int, off: int, head: int, *, across: bool) -> None:
        """Decompress ``raw`` straight into ``out`` (after a ``head``-byte npy header, checked against the
        manifest), where its data must end exactly. Errors name member i and offset ``off``.

        No bytes object is made for the output: decompressed into memory of its own, 256 kB
        frames fragmented the heap as read buffers did.
        """
        import zstandard

        done = 0
        try:
            with dctx.stream_reader(raw, read_across_frames=across) as src:
                if head:
                    header = bytearray(head)
                    if fill(src, memoryview(header)) < head:
                        raise self._size_error(0, len(out), i, k, off)
                    self._check_header(bytes(header), i, k)
                done = fill(src, memoryview(out).cast("B"))
                extra = bool(src.read(1)) if done == len(out) else False
        except zstandard.ZstdError as e:
            raise self._zstd_error(e, i, k, off) from e
        with self._lock:
            self.stats.bytes_decompressed += head + done
        if done < len(out) or extra:
            raise self._size_error(done, len(out), i, k, off, more=extra)

    def _zstd_error(self, e: Exception, i: int, k: int, off: int) -> ShardError:
        return ShardError(f"cannot decompress member: {e}", shard=self.shard_url(k), member=self._member(i), offset=off)

    def _size_error(self, got: int, nbytes: int, i: int, k: int, off: int, more: bool = False) -> ShardError:
        held = f"more than {nbytes}" if more else str(got)
        return ShardError(f"member holds {held} data bytes here, the manifest implies {nbytes}",
                          shard=self.shard_url(k), member=self._member(i), offset=off)

    # -- raw reads with retries -----------------------------------------------------------------
    def _read_many(self, runs: list[tuple[int, int, memoryview]]) -> list[ShardError | None]:
        """Read (shard, offset, destination) runs; concurrently on remote storage (latency-bound)."""
        if self.local or len(runs) < 2:
            return [self._try_read(r) for r in runs]
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(max_workers=REMOTE_CONCURRENCY, thread_name_prefix="streamwin-get")
        return list(self._pool.map(self._try_read, runs))

    def _try_read(self, run: tuple[int, int, memoryview]) -> ShardError | None:
        """Read one (shard, offset, destination) run; the ShardError instead of raising it."""
        try:
            self._read_into(*run)
            return None
        except ShardError as e:
            return e

    def _read_into(self, k: int, offset: int, out: memoryview) -> None:
        if self.cache is not None:  # node-local copy: fetched once per node, verified, then read locally
            f, hit = self._open_local(k, offset)
            with f:
                got = read_file(f, offset, out)
            with self._lock:
                self.stats.cache_hits += hit
            if got < len(out):
                raise ShardError(f"cached shard ends early: wanted {len(out)} bytes at offset {offset}, got {got}",
                                 shard=self.shard_url(k), offset=offset + got)
        else:
            self._read_direct(k, join(self.root, self.manifest.shards[k].name), offset, out)
        with self._lock:
            self.stats.bytes_read += len(out)
            self.stats.reads += 1

    def _read_direct(self, k: int, path: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` from the shard itself (local file or object), retrying transient errors.

        Each attempt asks for everything from the first byte not yet in ``out``: a remote read
        is one streamed GET, and when it breaks, the bytes it delivered stay (BrokenRead says
        how many). ``retries`` bounds failures in a row: an attempt that delivered bytes before
        it broke starts the count anew, so a long range on a flaky link goes on as long as it
        advances.
        """
        done = 0
        attempt = 0
        while done < len(out):
            try:
                n = self._read_some(path, offset + done, out[done:])
            except (FileNotFoundError, PermissionError) as e:
                raise ShardError(f"cannot open shard: {e}", shard=self.shard_url(k), offset=offset + done) from e
            except Exception as e:  # transient storage errors: retry from the byte where it broke
                got = e.delivered if isinstance(e, BrokenRead) else 0
                done += got
                attempt = 1 if got else attempt + 1
                if attempt > self.retries or permanent(e):
                    raise ShardError(f"read {describe(e, self.retries)}", shard=self.shard_url(k),
                                     offset=offset + done) from e
                with self._lock:
                    self.stats.retries += 1
                time.sleep(self.backoff * 2 ** (attempt - 1))
                continue
            if n == 0:
                raise ShardError(f"shard ends early: wanted {len(out)} bytes at offset {offset}, got {done}",
                                 shard=self.shard_url(k), offset=offset + done)
            done += n
            attempt = 0  # retries bound failures in a row; a read that keeps advancing goes on

    def _read_some(self, path: str, offset: int, out: memoryview) -> int:
        """Bytes read into the front of ``out`` from ``offset``; 0 when the shard ends there."""
        if self.local:
            return local_files.read_local(path, offset, out)
        return self.ranges.read_into(path, offset, out)
