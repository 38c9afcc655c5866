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

import threading
from typing import Any

import numpy as np

from streamwin.errors import ShardError
from streamwin.formats import npy as npyfmt
from streamwin.formats.manifest import Manifest
from streamwin.plan.epoch import Plan
from streamwin.read.block import READABLE, Block, ReadStats
from streamwin.read.cached import CachedShards
from streamwin.read.counts import Counters
from streamwin.read.frames import (compressed_ranges, compressed_runs, frame_ends, listed, raw_batches, unit_rows,
                                   unit_span, units, zstd_slice_windows)
from streamwin.read.inflate import FRAME_CACHE_BYTES, FrameCache
from streamwin.read.local import LocalShards, map_range
from streamwin.read.members import Members
from streamwin.read.pieces import Pieces, land, pieces
from streamwin.read.remote import RemoteShards
from streamwin.read.runs import MERGE_GAP, PlainRuns, packed, paged, plain_runs
from streamwin.read.transport import Transport, fill
from streamwin.storage import mapped
from streamwin.storage.cache import ShardCache
from streamwin.storage.urls import is_local, url_to_fs

__all__ = ["READABLE", "Block", "ReadStats", "ShardSource", "zstd_slice_windows"]

MAX_MAPPED_RUNS = 1024  # a block of more separate runs is read, not mapped (mappings per process are limited)


class ShardSource:
    """Reads byte ranges of a dataset's shards (any fsspec URL) and assembles blocks."""

    def __init__(self, url: str, manifest: Manifest, *, storage_options: dict[str, Any] | None = None,
                 retries: int = 5, backoff: float = 0.2, on_error: str = "raise", cache: ShardCache | None = None):
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.manifest = manifest
        self.members = Members(url, manifest)
        self.counters = Counters(on_error)
        fs, root = url_to_fs(url, storage_options, own_retries=True)
        if cache is not None:  # node-local copies: fetched once per node, verified, then read locally
            self.shards: Transport = CachedShards(cache, fs, root, self.members, self.counters)
        elif is_local(fs):
            self.shards = LocalShards(root, self.members, self.counters, retries=retries, backoff=backoff)
        else:
            self.shards = RemoteShards(fs, root, self.members, self.counters, retries=retries, backoff=backoff)
        # local and cached shards are mapped, not read: the gather then copies straight from the page cache
        self.map_files = self.shards.mappable and mapped.available()
        self._unmap: list[mapped.MappedBuffer] = []  # released mappings, dropped by the next read
        self._lock = threading.Lock()
        self._local = threading.local()  # per reading thread: its zstd decompressor

    @property
    def stats(self) -> ReadStats:
        """What reading has cost so far."""
        return self.counters.stats

    def read_block(self, plan: Plan, stream: int, block: int) -> Block:
        """Read what block ``block`` of ``stream`` needs; windows in yield order."""
        with self._lock:
            self._unmap.clear()
        self.shards.begin_block()
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
            raise self.members.byte_order_error(int(seq[0]))
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
            self.counters.add(skipped_windows=int(lost.sum()))
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
                        self.members.check_header(buf[at[u] : at[u] + hlens[u]].tobytes(), int(runs.seq[u]), k)
                    except ShardError as e:
                        self.counters.skip_or_raise(e)
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
            self.counters.skip_or_raise(self.members.name_member(err, runs.seq[u:u1]))
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
            return self.shards.try_read((k, a, memoryview(buf)[at : at + b - a]))
        return buf, run_at, self.shards.read_many(reads), refill

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
                map_range(self.shards, target, int(run_at[j]), k, int(runs.run_lo[j]), int(runs.run_hi[j]))
                errors.append(None)
            except ShardError as e:
                errors.append(e)

        def refill(k: int, a: int, b: int, at: int) -> ShardError | None:
            try:
                map_range(self.shards, target, at, k, a, b)
            except ShardError as e:
                return e
            except OSError as e:  # the mapping was refused now: the bytes are not there
                return ShardError(f"cannot map shard bytes: {e}", shard=self.members.shard_url(k), offset=a)
            return None
        return target.array(), run_at, errors, refill

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
                    self.counters.skip_or_raise(e)
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
            for r, err in zip(range(r0, r1), self.shards.read_many(reads)):
                if err is not None:
                    self.counters.skip_or_raise(self.members.name_member(err, seq[bounds[r] : bounds[r + 1]]))
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
                    self.members.check_header(bytes(header), i, k)
                done = fill(src, memoryview(out).cast("B"))
                extra = bool(src.read(1)) if done == len(out) else False
        except zstandard.ZstdError as e:
            raise self._zstd_error(e, i, k, off) from e
        self.counters.add(bytes_decompressed=head + done)
        if done < len(out) or extra:
            raise self._size_error(done, len(out), i, k, off, more=extra)

    def _zstd_error(self, e: Exception, i: int, k: int, off: int) -> ShardError:
        return self.members.error(f"cannot decompress member: {e}", i, k, off)

    def _size_error(self, got: int, nbytes: int, i: int, k: int, off: int, more: bool = False) -> ShardError:
        held = f"more than {nbytes}" if more else str(got)
        return self.members.error(f"member holds {held} data bytes here, the manifest implies {nbytes}", i, k, off)
