"""Shards on remote storage (http, s3, any fsspec filesystem): one ranged GET per run, retried at the byte."""
from __future__ import annotations

import fsspec

from streamwin.read.counts import Counters
from streamwin.read.members import Members
from streamwin.read.transport import Retrying, Transport
from streamwin.storage.ranged import RangeReader


class RemoteShards(Transport):
    """The shard objects of a dataset on ``fs`` (under ``root``), read with pooled, streamed GETs.

    A block's runs are read concurrently (REMOTE_CONCURRENCY GETs), each straight into its
    place in the block buffer; a GET that breaks is resumed at the byte it got to.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, members: Members, counters: Counters, *,
                 retries: int, backoff: float):
        super().__init__(root, members, counters, concurrent=True)
        self.ranges = RangeReader(fs)  # streamed GETs, pooled connections
        self.retrying = Retrying(members, counters, retries, backoff, limit=self.ranges.attempt_limit)

    def read_into(self, k: int, offset: int, out: memoryview) -> None:
        self.retrying.fill(self.ranges.read_into, self.path(k), self.members.shard_url(k), offset, out)
        self.counters.read(len(out))

    def read_sums_into(self, k: int, offset: int, out: memoryview) -> None:
        self.retrying.fill(self.ranges.read_into, self.path(k) + self.members.manifest.checks.suffix,
                           self.sums_url(k), offset, out)
        self.counters.add(bytes_sums=len(out))

    def shutdown(self, wait: bool = True) -> None:
        """Stop the GET threads and close the pooled connections."""
        super().shutdown(wait)
        self.ranges.close()
