"""Shards through the node cache: each fetched whole once per node (verified), then read or mapped locally."""
from __future__ import annotations

from typing import BinaryIO

import fsspec

from streamwin.errors import ShardError
from streamwin.read.counts import Counters
from streamwin.read.members import Members
from streamwin.read.transport import Transport, read_file
from streamwin.storage.cache import ShardCache
from streamwin.storage.urls import is_local


class CachedShards(Transport):
    """The shards of a dataset on ``fs`` (under ``root``), read from their copies in ``cache``.

    A shard that fails to fetch is not fetched again for the same block (each of its runs
    would fail alike). Runs of remote shards are read concurrently: several shards are
    fetched at once. A read that fails on a copy that no longer holds what was packed
    (``repair``) drops it, so that the block is read again from a fresh copy.
    """

    mappable = True

    def __init__(self, cache: ShardCache, fs: fsspec.AbstractFileSystem, root: str, members: Members,
                 counters: Counters):
        super().__init__(root, members, counters, concurrent=not is_local(fs))
        self.cache, self.fs = cache, fs
        self._unfetchable: dict[int, ShardError] = {}  # shards that failed to fetch for the current block
        self._whole: set[int] = set()  # shards whose copy was checked whole after a failed read: not again
        self._by_url: dict[str, int] | None = None

    def begin_block(self) -> None:
        self._unfetchable.clear()

    def repair(self, err: ShardError) -> bool:
        """After a read failed with ``err``: drop the cached copy of the shard it names if that copy is damaged
        (ShardCache.repair, with a warning naming the file); True if dropped (read again: it is fetched anew)."""
        if self._by_url is None:
            self._by_url = {self.members.shard_url(k): k for k in range(len(self.members.manifest.shards))}
        k = self._by_url.get(err.shard)
        if k is None or k in self._whole or k in self._unfetchable:
            return False
        if self.cache.repair(err.shard, self.members.manifest.shards[k]):
            return True
        self._whole.add(k)  # the copy holds what was packed: the error is the shard's own
        return False

    def read_into(self, k: int, offset: int, out: memoryview) -> None:
        f, hit = self.open_file(k, offset)
        with f:
            got = read_file(f, offset, out)
        if got < len(out):
            self.counters.add(cache_hits=hit)
            raise ShardError(f"cached shard ends early: wanted {len(out)} bytes at offset {offset}, got {got}",
                             shard=self.members.shard_url(k), offset=offset + got)
        self.counters.read(len(out), hit)

    def open_file(self, k: int, offset: int) -> tuple[BinaryIO, bool]:
        """The shard's cached copy, fetched first if needed; fetched again, once, if another process evicted
        it between fetch and open."""
        url, entry = self.members.shard_url(k), self.members.manifest.shards[k]
        for attempt in (0, 1):
            failed = self._unfetchable.get(k)
            if failed is not None:  # this block already tried: a shard that failed to fetch is not fetched again
                raise failed
            hit = self.cache.has(url, entry)
            try:
                local = self.cache.fetch(url, self.fs, self.path(k), entry)
            except ShardError as e:
                self._unfetchable[k] = e
                raise
            try:
                return open(local, "rb", buffering=0), hit
            except FileNotFoundError as e:
                if attempt:
                    raise ShardError(f"cannot open shard: {e}", shard=url, offset=offset) from e
            except OSError as e:
                raise ShardError(f"cannot open shard: {e}", shard=url, offset=offset) from e
        raise AssertionError("unreachable")
