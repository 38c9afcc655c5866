"""Local shard files: read at an offset with retries, or mapped into a block's address range."""
from __future__ import annotations

import os
from typing import BinaryIO

from streamwin.errors import ShardError
from streamwin.read.counts import Counters
from streamwin.read.members import Members
from streamwin.read.transport import Retrying, Transport, read_file
from streamwin.storage import mapped


class LocalShards(Transport):
    """The shard files of a dataset on the local filesystem (under ``root``)."""

    mappable = True

    def __init__(self, root: str, members: Members, counters: Counters, *, retries: int, backoff: float):
        super().__init__(root, members, counters)
        self.retrying = Retrying(members, counters, retries, backoff)

    def read_into(self, k: int, offset: int, out: memoryview) -> None:
        self.retrying.fill(read_local, self.path(k), self.members.shard_url(k), offset, out)
        self.counters.read(len(out))

    def read_sums_into(self, k: int, offset: int, out: memoryview) -> None:
        self.retrying.fill(read_local, self.path(k) + self.members.manifest.checks.suffix, self.sums_url(k), offset,
                           out)
        self.counters.add(bytes_sums=len(out))

    def open_file(self, k: int, offset: int) -> tuple[BinaryIO, bool]:
        try:
            return open(self.path(k), "rb", buffering=0), False
        except OSError as e:
            raise ShardError(f"cannot open shard: {e}", shard=self.members.shard_url(k), offset=offset) from e


def read_local(path: str, offset: int, out: memoryview) -> int:
    """Read into ``out`` from a local file at ``offset``; returns the bytes read (short at EOF)."""
    with open(path, "rb", buffering=0) as f:
        return read_file(f, offset, out)


def map_range(shards: Transport, target: mapped.MappedBuffer, at: int, k: int, lo: int, hi: int) -> None:
    """Map bytes [lo, hi) of shard k (a ``mappable`` transport's file) so that byte lo lands at ``at``
    (``at`` = ``lo`` modulo PAGE).

    A file that ends early has what it holds mapped, then raises a ShardError at its end;
    OSError when the system refuses the mapping.
    """
    f, hit = shards.open_file(k, lo)
    with f:
        size = os.fstat(f.fileno()).st_size
        end = min(hi, size)  # mapping a page wholly past the end would fault (SIGBUS) on access
        start = mapped.page_floor(lo)
        if end > lo:
            target.map_file(at - (lo - start), f.fileno(), start, end - start)  # OSError: the caller reads
    shards.counters.read(max(end - lo, 0), hit)
    if end < hi:
        raise ShardError(f"shard ends early: wanted bytes {lo}..{hi}, the file has {size}",
                         shard=shards.members.shard_url(k), offset=max(size, lo))
