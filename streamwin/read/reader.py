"""Read the sequences a block of windows needs into one contiguous byte buffer.

A block's windows are cut into pieces (pieces.py); what each piece needs is worked out
without I/O (runs.py for plain members, frames.py for zstd ones) and fetched through the
dataset's transport: the local shard files (local.py), ranged GETs on object storage
(remote.py), or the node cache's copies (cached.py). Local and cached shards are mapped
into the buffer instead of read, so the batch gather is the only copy of a window's bytes
(plain.py); zstd members are decompressed frame by frame (compressed.py, inflate.py).

Pieces of consecutive windows are merged across the headers between them, so a slice of
many short sequences is one read; pieces of different slices only across a gap small
beside them, so an epoch reads each shard byte about once (bytes read / shard bytes near
1, in ``stats``), and a block's buffer holds what its windows cover, however long the
sequences. Every ``.npy`` header that a read covers is checked against the manifest
(dtype, shape, header length) before any window is cut from it, and every byte it covers
against the manifest's chunk checksums (verify.py). Reads retry with
exponential backoff; what still fails is a ShardError naming the shard, the member and the
byte offset (or, with on_error="skip", windows of weight 0, counted).
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

from streamwin.errors import ShardError
from streamwin.formats import npy as npyfmt
from streamwin.formats.manifest import Manifest
from streamwin.read.ahead import of_source
from streamwin.read.block import READABLE, Block, ReadStats
from streamwin.read.cached import CachedShards
from streamwin.read.compressed import CompressedReads
from streamwin.read.counts import Counters
from streamwin.read.frames import zstd_slice_windows
from streamwin.read.local import LocalShards
from streamwin.read.members import Members
from streamwin.read.options import ReadOptions
from streamwin.read.pieces import Pieces, land, pieces, with_headers
from streamwin.read.plain import PlainReads
from streamwin.read.remote import RemoteShards
from streamwin.read.runs import MERGE_GAP
from streamwin.read.segments import MemberPieces, SegmentMap
from streamwin.read.sums import Sums
from streamwin.read.transport import Transport
from streamwin.read.verify import Verifier, lost_windows
from streamwin.storage import mapped
from streamwin.storage.cache import ShardCache
from streamwin.storage.urls import is_local, url_to_fs

# batch.py and feed/device.py import Block from here; the rest of the library imports from streamwin.read
__all__ = ["Block", "BlockPlan", "READABLE", "ReadOptions", "ReadStats", "ShardReader", "zstd_slice_windows"]


class BlockPlan(Protocol):
    """What the reader asks of one source's plan (streamwin.plan's ``SourcePlan``)."""

    config: Any  # .spec.span: steps a window reads (window + horizon)

    def block_parts(self, stream: int, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(global window indices in stream order, which are real, the shuffle of the block or None)."""

    def locate(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(sequence, first step) of windows ``g``."""

    def ends(self, seq: np.ndarray) -> np.ndarray:
        """Where each sequence ends in the plan's view (a split may end it early)."""


class ShardReader:
    """Reads the blocks of a plan from a dataset's shards (any fsspec URL), as ``options`` say.

    Args:
        url: the dataset's root (local path or fsspec URL).
        manifest: its manifest, which every read and header is checked against.
        options: storage options, retries, on_error and the node cache (see ReadOptions).
    """

    def __init__(self, url: str, manifest: Manifest, options: ReadOptions | None = None):
        self.options = options = options if options is not None else ReadOptions()
        self.manifest = manifest
        self.members = Members(url, manifest.members())  # with continuations: a row per member
        self.segments = SegmentMap(manifest) if manifest.segments is not None else None
        self.counters = Counters(options.on_error)
        self.shards = _transport(url, self.members, self.counters, options)
        checks = manifest.checks if options.verify_checksums else None
        sums = None if checks is None else Sums(checks, self.shards.submit_sums, self.shards.sums_url)
        verifier = Verifier(self.members, self.counters, sums)
        self.sums = sums  # the checksums this reader holds (None: nothing is verified)
        if manifest.compression:
            self.reads: PlainReads | CompressedReads = CompressedReads(self.shards, self.members, self.counters,
                                                                       verifier)
        else:  # local and cached shards are mapped, not read: the gather then copies straight from the page cache
            map_files = self.shards.mappable and mapped.available()
            self.reads = PlainReads(self.shards, self.members, self.counters, map_files=map_files, verifier=verifier)
        # how far its streams read ahead: as far as the latency needs on remote storage (read/ahead.py)
        self.readahead = of_source(url, options.readahead_bytes,
                                   self.shards.latency if isinstance(self.shards, RemoteShards) else None)
        self._unmap: list[mapped.MappedBuffer] = []  # released mappings, dropped by the next read
        self._thread: ThreadPoolExecutor | None = None
        self._early: dict[tuple, Future] = {}  # blocks of a plan to come, started before its stream: key -> start
        self._lock = threading.Lock()

    @property
    def stats(self) -> ReadStats:
        """What reading has cost so far (bytes, requests, retries, skips, cache hits)."""
        return self.counters.stats

    def read_block(self, plan: BlockPlan, stream: int, block: int) -> Block:
        """Read what block ``block`` of ``stream`` needs; windows in yield order."""
        return self.finish_block(self.start_block(plan, stream, block))

    def start_block(self, plan: BlockPlan, stream: int, block: int) -> "StartedBlock":
        """Start reading block ``block`` of ``stream``: its GETs in flight on remote storage (read whole
        elsewhere); ``finish_block`` gives the Block. Blocks are finished in the order they were started,
        on the thread that started them."""
        with self._lock:
            self._unmap.clear()
        self.shards.begin_block()
        g, real, shuffled = plan.block_parts(stream, block)  # stream order: runs of consecutive windows
        m = self.manifest
        span, sb = plan.config.spec.span, m.step_bytes
        order = np.argsort(g, kind="stable")  # manifest order: by sequence, then start
        seq, start = plan.locate(g[order])
        real = real[order]
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))  # where each window of stream order went in manifest order
        into_yield = rank if shuffled is None else rank[shuffled]
        length = plan.ends(seq)  # a split's view may end before the sequence does
        if npyfmt.is_big_endian(m.dtype) and len(seq):  # an index made elsewhere; every read would be wrong
            raise self.members.byte_order_error(int(seq[0]))
        end = np.minimum(start + span, length)
        kind = self.segments.kinds(seq, start, end) if self.segments is not None else None
        p = pieces(g[order], seq, start, end, MERGE_GAP // sb, kind)
        valid = np.minimum(length - start, span)
        split = self.segments.split(p) if self.segments is not None else None  # pieces of members
        q = split.pieces if split is not None else p
        tail = span * sb + (split.stitch_bytes if split is not None else 0)  # the stitch area, then the zero tail
        if isinstance(self.reads, PlainReads):
            heads = self.members.unchecked(q.seq, q.s_lo)  # members whose headers this block must read to check
            if len(heads):
                q = with_headers(q, heads)
        if split is not None:  # read members in the order their bytes lie, not their rows'
            q = self.segments.in_byte_order(q)
        if isinstance(self.reads, PlainReads) and not isinstance(self.shards, CachedShards):
            read: Any = self.reads.start(q, tail)
        else:  # zstd members and the node cache: read now
            read = self._read(q, tail)
        # (with continuations base and good come per member piece, and are mapped back to ``p`` in finish_block)
        return StartedBlock(p if split is not None else q, read, seq, start, real, valid, into_yield, sb, span, q,
                            split)

    def finish_block(self, b: "StartedBlock") -> Block:
        """The Block of a started read, once its bytes are in, checked and verified."""
        buf, base, good, damage = b.read if isinstance(b.read, tuple) else self.reads.finish(b.read)
        seq, start, real, valid, sb, span = b.seq, b.start, b.real, b.valid, b.step_bytes, b.span
        if b.split is not None:  # member pieces back to the sequences' pieces (stitched where they span members)
            at = b.member_pieces.index  # where each member piece went among those read (with header reads)
            stitch = len(buf) - span * sb - b.split.stitch_bytes  # (in a mapped buffer: from a page boundary)
            stitch = stitch if buf.flags.writeable else mapped.page_floor(stitch)
            base, good = self.segments.join(b.split, b.pieces, buf, base[at], good[at], stitch)
            damage = self.segments.sequence_damage(damage)
        uniq, inv = np.unique(seq, return_inverse=True)
        offs, lost = land(b.pieces, base, good, start, valid, sb, len(buf) - span * sb)
        if damage:  # on_error="skip": windows with a step in a chunk that failed verification
            bad = lost_windows(damage, seq, start, valid) & ~lost
            offs[bad], lost = len(buf) - span * sb, lost | bad
        if lost.any():  # on_error="skip": unreadable windows become zeros of weight 0
            real = real & ~lost
            valid = np.where(lost, 0, valid)
            self.counters.add(skipped_windows=int(lost.sum()))
        offs, start, real, valid, inv = (a[b.into_yield] for a in (offs, start, real, valid, inv))
        return Block(buf, offs, start, real, valid, uniq, inv)

    def cancel(self, b: "StartedBlock") -> None:
        """Drop a started read that will not be finished (its GETs not yet sent are not sent)."""
        if not isinstance(b.read, tuple):
            b.read.pending.cancel()

    def _read(self, p: Pieces, tail: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, list]:
        """The pieces' bytes (``reads.read``). Through the node cache, a read that fails is first done with
        every failure raised; if the shard's copy turns out damaged it is dropped (CachedShards.repair) and
        the block read again from a fresh copy, else read again as on_error says."""
        if not isinstance(self.shards, CachedShards):
            return self.reads.read(p, tail)
        try:
            with self.counters.raising():
                return self.reads.read(p, tail)
        except ShardError as e:
            if not self.shards.repair(e) and self.options.on_error == "raise":
                raise
        return self.reads.read(p, tail)

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

    def thread(self) -> ThreadPoolExecutor:
        """The one thread this reader's blocks are started and finished on, in the order they are asked for (made on
        first use): every stream that reads with it, one after the other, queues there, so no two run at once."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamwin-read")
        return self._thread

    def start_early(self, key: tuple, plan: BlockPlan, stream: int, block: int) -> None:
        """Start block ``block`` of ``stream`` of a plan to come (the next epoch's) on the reader's thread, kept under
        ``key`` for the stream that will read it (``started_early``)."""
        self._early[key] = self.thread().submit(self.start_block, plan, stream, block)

    def started_early(self, key: tuple) -> Future | None:
        """The start of a block ``start_early`` began under ``key`` (taken: it is the caller's), or None."""
        future = self._early.pop(key, None)
        if future is not None:
            self.counters.add(early_blocks=1)
        return future

    def drop_early(self, keep: Callable[[tuple], bool]) -> int:
        """Drop the blocks started early whose key ``keep`` refuses (their GETs not sent yet are not sent); how many."""
        gone = [key for key in self._early if not keep(key)]
        for key in gone:
            future = self._early.pop(key)
            if not future.cancel():
                future.add_done_callback(self._cancel_started)
        return len(gone)

    def _cancel_started(self, future: Future) -> None:
        if not future.cancelled() and future.exception() is None:
            self.cancel(future.result())

    def shutdown(self, wait: bool = True) -> None:
        """Stop the read thread and the GET threads and close the pooled connections (a later read starts them anew);
        with ``wait=False`` a read still in flight ends on its own instead of being waited for."""
        self.drop_early(lambda key: False)
        if self._thread is not None:
            self._thread.shutdown(wait=wait, cancel_futures=True)
            self._thread = None
        self.shards.shutdown(wait)


@dataclass
class StartedBlock:
    """A block whose read has started: its pieces, the read (in flight, or done), and its windows' places."""

    pieces: Pieces
    read: Any  # PlainRead in flight, or the (buffer, bases, good, damage) of a read already done
    seq: np.ndarray
    start: np.ndarray
    real: np.ndarray
    valid: np.ndarray
    into_yield: np.ndarray
    step_bytes: int
    span: int
    member_pieces: Pieces | None = None  # what was read: pieces of members (with header reads), if continuations
    split: MemberPieces | None = None  # how the pieces map onto members, with continuations


def _transport(url: str, members: Members, counters: Counters, options: ReadOptions) -> Transport:
    """How the shards at ``url`` are read: through the node cache if ``options`` name one, else directly."""
    fs, root = url_to_fs(url, options.storage_options, own_retries=True)
    retries, backoff = options.retries, options.retry_backoff
    if options.cache_dir is not None:  # node-local copies: fetched once per node, verified, then read locally
        cache = ShardCache(options.cache_dir, limit_bytes=options.cache_limit, retries=retries, backoff=backoff)
        return CachedShards(cache, fs, root, members, counters, retries=retries, backoff=backoff)
    if is_local(fs):
        return LocalShards(root, members, counters, retries=retries, backoff=backoff)
    return RemoteShards(fs, root, members, counters, retries=retries, backoff=backoff)
