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

from functools import partial
from typing import Any, Callable

import numpy as np
from torchdata.nodes import BaseNode, Prefetcher

from streamwin.batch import Gatherer
from streamwin.dataset import WindowDataset
from streamwin.nodes import Batcher, BlockReader
from streamwin.plan.epoch import Plan
from streamwin.read import ReadStats, ShardReader


class Stream:
    """A running stream: its top node (batches) and the shard readers under it."""

    def __init__(self, node: Any, batcher: Any, readers: list[ShardReader]):
        self.node, self.batcher, self.readers = node, batcher, readers

    def __iter__(self):
        return iter(self.node)

    def __next__(self):
        return next(self.node)

    def stats(self) -> list[ReadStats]:
        """The read counters of every source's reader (summed by whoever reports them)."""
        return [reader.stats for reader in self.readers]

    def shutdown(self) -> None:
        """Stop the stream's threads: the prefetcher's (dropped: torchdata stops it then), the read-ahead
        threads, then the shard readers' GET threads and connections."""
        self.node = None
        self.batcher.shutdown()
        for reader in self.readers:
            reader.shutdown(wait=False)  # a block read still in flight on a read-ahead thread is not waited for


def open_stream(ds: WindowDataset, plan: Plan, stream: int, first_batch: int,
                next_buffer: Callable[[], dict[str, np.ndarray] | None], *, prefetch: bool = True,
                transform: Callable | None = None, gatherer=None) -> Stream:
    """Stream ``stream`` of ``plan``, yielding its batches from batch ``first_batch`` on.

    ``transform(block, source=i)`` runs on each of source i's blocks on its read-ahead thread
    (device mode uploads there); ``gatherer`` replaces the CPU gather (device mode gathers on
    the device).
    """
    readers = [source.reader() for source in ds.sources]
    blocks = [BlockReader(reader, p, stream, readahead=ds.readahead,
                          transform=None if transform is None else partial(transform, source=i))
              for i, (reader, p) in enumerate(zip(readers, plan.sources))]
    gather = gatherer or gatherer_of(ds)
    if gatherer is None and ds.transform is not None:  # the user's transform, on each batch where it is gathered
        gather = ds.transform.gatherer(gather, ds.seed, plan.epoch, stream, first_batch)
    batcher = Batcher(blocks, plan.quotas, gather, next_buffer)
    batcher.reset({Batcher.BATCH_KEY: first_batch})
    node: BaseNode = batcher
    if prefetch and ds.prefetch > 0:
        node = Prefetcher(batcher, prefetch_factor=ds.prefetch)
        node.reset({"snapshot": batcher.state_dict(), "steps_since_snapshot": 0})
    return Stream(node, batcher, readers)


def gatherer_of(ds: WindowDataset) -> Gatherer:
    """The CPU gather of ``ds``'s batches (windows or packed rows)."""
    return Gatherer(ds.manifest, ds.spec, ds.pack_length, ds.missing, ds.field_gather())

