"""The pipeline: the one place that wires a stream's stages, top to bottom.

    per source:  ShardReader (bytes)  ->  BlockReader (blocks of the plan, read ahead)
                 [-> cut (crops with drawn lengths; packed rows), on the read-ahead thread: crop_stage.py]
    then:        Batcher (quotas of every source per batch, gathered into a buffer)
                 -> torchdata Prefetcher (optional, ``prefetch`` batches ahead on a thread)

A stream is one rank's (or one worker's) share of the plan, started at any batch: its state
is a cursor, so starting at batch ``k`` seeks every reader to its block and offset. Device
mode in-process swaps the gather (windows are cut on the device).
"""
from __future__ import annotations

import copy
import warnings
from dataclasses import fields
from functools import partial
from typing import Any, Callable

import numpy as np
from torchdata.nodes import BaseNode, Prefetcher

from streamwin.batch import Gatherer
from streamwin.dataset import WindowDataset
from streamwin.nodes import Batcher, BlockReader, block_key
from streamwin.plan.epoch import Plan
from streamwin.read import ReadStats, ShardReader
from streamwin.storage import mapped

_WARNED: set = set()  # the URLs warned about (once a process)
WARN_BYTES = 256 << 20  # warn where the blocks a process may hold in memory exceed this


class Stream:
    """A running stream: its top node (batches) and the shard readers under it (one per source), which it gives
    back to their sources when it is done, for the next stream of the process (the next epoch's)."""

    def __init__(self, node: Any, batcher: Any, readers: list[ShardReader], sources: list[Any]):
        self.node, self.batcher, self.readers, self.sources = node, batcher, readers, sources
        self.counted = [copy.copy(reader.stats) for reader in readers]  # what the readers had read before

    def __iter__(self):
        return iter(self.node)

    def __next__(self):
        return next(self.node)

    def stats(self) -> list[ReadStats]:
        """What every source's reader read for this stream (summed by whoever reports them)."""
        return [ReadStats(**{f.name: getattr(reader.stats, f.name) - getattr(before, f.name) for f in fields(ReadStats)})
                for reader, before in zip(self.readers, self.counted)]

    def shutdown(self) -> None:
        """Stop the stream: the prefetcher's thread (dropped: torchdata stops it then), the blocks queued and not
        read; its readers go back to their sources (a read still in flight ends on its reader's thread)."""
        self.node = None
        self.batcher.shutdown()
        for source, reader in zip(self.sources, self.readers):
            source.give_back(reader)


def open_stream(ds: WindowDataset, plan: Plan, stream: int, first_batch: int,
                next_buffer: Callable[[], dict[str, np.ndarray] | None], *, prefetch: bool = True,
                transform: Callable | None = None, gatherer=None) -> Stream:
    """Stream ``stream`` of ``plan``, yielding its batches from batch ``first_batch`` on.

    ``transform(block, source=i)`` runs on each of source i's blocks on its read-ahead thread
    (device mode uploads there); ``gatherer`` replaces the CPU gather (device mode gathers on
    the device).
    """
    schedule = plan.schedule(stream)
    readers = [source.reader() for source in ds.sources]  # one per source, its lanes' (one read thread each)
    ours = {block_key(p, 0, 0)[:4] for p in schedule.plans}
    for reader in readers:  # blocks started early for another plan than this one: dropped
        reader.readahead.dropped(reader.drop_early(lambda key: key[:4] in ours))
    if len(schedule.lanes) > len(readers):  # canonical streams
        warn_unmapped(ds, readers, len(schedule.lanes) // len(readers))
    only = schedule.blocks  # per lane, the blocks it reads (a worker's chunks of packed rows), or None: all
    # a process that reads epoch after epoch (in the trainer, or a persistent worker) reads the next one's first
    # blocks early, at this stream's end
    follows = [source.follows(plan.config, plan.epoch) for source in ds.sources]
    after = next_epoch(ds, plan, stream, len(schedule.lanes)) if all(follows) else None
    blocks = [BlockReader(readers[i], schedule.plans[i], s, readahead=ds.readahead,
                          transform=None if transform is None else partial(transform, source=i),
                          blocks=None if only is None else only[lane],
                          then=None if after is None else partial(after, lane))
              for lane, (i, s) in enumerate(schedule.lanes)]
    gather = gatherer or gatherer_of(ds)
    if gatherer is None and ds.transform is not None:  # the user's transform, on each batch where it is gathered
        gather = ds.transform.gatherer(gather, ds.seed, plan.epoch)  # its draws: of (seed, epoch, window)
    batcher = Batcher(blocks, schedule, gather, next_buffer)
    batcher.reset({Batcher.BATCH_KEY: first_batch})
    node: BaseNode = batcher
    if prefetch and ds.prefetch > 0:
        node = Prefetcher(batcher, prefetch_factor=ds.prefetch)
        node.reset({"snapshot": batcher.state_dict(), "steps_since_snapshot": 0})
    return Stream(node, batcher, readers, list(ds.sources))


def next_epoch(ds: WindowDataset, plan: Plan, stream: int, lanes: int) -> Callable[[int], tuple | None]:
    """``after(lane)``: (plan, stream, blocks) of the lane of the same stream in the next epoch, whose first blocks a
    lane reads once it has started all of its own (None where that stream has other lanes); planned once, when
    first asked."""
    made: list = []

    def after(lane: int) -> tuple | None:
        if not made:
            config = plan.config
            nxt = ds.plan(plan.epoch + 1, config.num_workers, world_size=config.world_size)
            schedule = nxt.schedule(stream)
            only = schedule.blocks
            same = nxt.config == config and len(schedule.lanes) == lanes
            made.append([(schedule.plans[i], s, only[k] if only is not None else None)
                         for k, (i, s) in enumerate(schedule.lanes)] if same else None)
        return made[0][lane] if made[0] is not None else None
    return after


def gatherer_of(ds: WindowDataset) -> Gatherer:
    """The CPU gather of ``ds``'s batches (windows or packed rows)."""
    return Gatherer(ds.manifest, ds.spec, ds.pack_length, ds.missing, ds.field_gather())



def warn_unmapped(ds: WindowDataset, readers: list[ShardReader], lanes: int) -> None:
    """Warn once per source whose blocks are held in memory, not mapped from the page cache (remote shards with no
    node cache, zstd shards): each of the process's ``lanes`` canonical streams then holds its blocks in RAM."""
    for source, reader in zip(ds.sources, readers):
        m = source.manifest
        if source.url in _WARNED or (not m.compression and reader.shards.mappable and mapped.available()):
            continue
        span = ds.spec.span * m.step_bytes
        block = ds.config().block_windows * min(ds.spec.stride * m.step_bytes, span) + span  # packed: shuffle_buffer / A
        if lanes * (ds.readahead + 1) * block < WARN_BYTES:
            continue
        _WARNED.add(source.url)
        why = "zstd shards are decompressed into memory" if m.compression else "remote shards with no cache_dir"
        warnings.warn(
            f"streamwin: {source.url}: {why}, so each of this process's {lanes} canonical streams holds its blocks "
            f"in memory: up to {lanes} x (readahead={ds.readahead} + 1) blocks of up to {block / 2**20:,.1f} MB "
            "(shuffle_buffer windows; packed rows: shuffle_buffer / A). Pass read=sw.Read(cache_dir=...) (a node "
            "cache: blocks are mapped from it), a smaller shuffle_buffer, or order=sw.Order(canonical=None) (one "
            "stream a process; the order then depends on the world size and workers)", RuntimeWarning, stacklevel=3)
