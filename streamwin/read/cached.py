"""Shards through the node cache: each fetched whole once per node (verified), then read or mapped locally."""
from __future__ import annotations

from typing import BinaryIO

import fsspec

from streamwin.errors import ShardError
from streamwin.read.counts import Counters
from streamwin.read.fetch import Fetcher
from streamwin.read.members import Members
from streamwin.formats.manifest import ShardEntry
from streamwin.read.remote import RemoteShards
from streamwin.read.transport import Transport, read_file
from streamwin.storage.cache import ShardCache
from streamwin.storage.urls import is_local

FETCHES = 8  # shards fetched into the cache at once
WHOLE = 1 << 62  # runs are read whole, not in parts: a shard is fetched whole first


class CachedShards(Transport):
    """The shards of a dataset on ``fs`` (under ``root``), read from their copies in ``cache``.

    A shard that fails to fetch is not fetched again for the same block (each of its runs
    would fail alike). Runs of remote shards are read concurrently: several shards are
    fetched at once. The shards' sums files are cached the same way (fetched whole, checked
    against their sha256), then read in ranges like the shards. A read that fails on a copy
    (of a shard or of its sums file) that no longer holds what was packed (``repair``) drops
    it, so that the block is read again from a fresh copy.
    """

    mappable = True

    def __init__(self, cache: ShardCache, fs: fsspec.AbstractFileSystem, root: str, members: Members,
                 counters: Counters, *, retries: int = 5, backoff: float = 0.2):
        super().__init__(root, members, counters, fetcher=None if is_local(fs) else Fetcher(FETCHES, part=WHOLE))
        self.cache, self.fs = cache, fs
        # a remote shard is fetched as parts, many GETs in flight (a stream of fsspec's waits a round trip a read)
        self.remote = None if is_local(fs) else RemoteShards(fs, root, members, counters, retries=retries,
                                                             backoff=backoff)
        self._unfetchable: dict[int, ShardError] = {}  # shards that failed to fetch for the current block
        self._whole: set[int] = set()  # shards whose copy was checked whole after a failed read: not again
        self._by_url: dict[str, int] | None = None

    def read_sums_into(self, k: int, offset: int, out: memoryview) -> None:
        """Read from the sums file's cached copy, fetched first if needed; fetched again, once, if it was evicted
        between fetch and open (by a shard fetched meanwhile: the sums are read while the block's shards are)."""
        entry = self._sums_entry(k)
        for attempt in (0, 1):
            path = self.path(k) + self.members.manifest.checks.suffix
            local = self.cache.fetch(self.sums_url(k), self.fs, path, entry, self._copier(path, self.sums_url(k), entry))
            try:
                with open(local, "rb", buffering=0) as f:
                    got = read_file(f, offset, out)
                break
            except FileNotFoundError:
                if attempt:
                    raise
        if got < len(out):
            raise ShardError(f"cached sums file ends early: wanted {len(out)} bytes at offset {offset}, got {got}",
                             shard=self.sums_url(k), offset=offset + got)
        self.counters.add(bytes_sums=len(out))

    def begin_block(self) -> None:
        self._unfetchable.clear()

    def repair(self, err: ShardError) -> bool:
        """After a read failed with ``err``: drop the cached copy of the shard it names if that copy is damaged
        (ShardCache.repair, with a warning naming the file); True if dropped (read again: it is fetched anew)."""
        if self._by_url is None:
            shards = range(len(self.members.manifest.shards))
            self._by_url = {self.members.shard_url(k): k for k in shards}
            if self.members.manifest.checks is not None and self.members.manifest.checks.in_files:
                self._by_url.update({self.sums_url(k): ~k for k in shards})  # a sums file's copy: ~k
        k = self._by_url.get(err.shard)
        if k is None or k in self._whole or (k >= 0 and k in self._unfetchable):
            return False
        entry = self.members.manifest.shards[k] if k >= 0 else self._sums_entry(~k)
        if self.cache.repair(err.shard, entry):
            return True
        self._whole.add(k)  # the copy holds what was packed: the error is the file's own
        return False

    def _copier(self, path: str, url: str, entry: ShardEntry):
        """How the cache writes a copy of the object at ``path``: parts in parallel for a remote one, else its own."""
        if self.remote is None:
            return None
        return lambda dest: self.remote.download(path, url, entry.bytes, dest)

    def shutdown(self, wait: bool = True) -> None:
        """Stop the fetching threads and the GET threads (closing their connections)."""
        super().shutdown(wait)
        if self.remote is not None:
            self.remote.shutdown(wait)

    def _sums_entry(self, k: int) -> ShardEntry:
        """Shard k's sums file as the node cache fetches it: its name, size and sha256."""
        checks = self.members.manifest.checks
        return ShardEntry(self.members.manifest.shards[k].name + checks.suffix, checks.layout(k).file_bytes,
                          checks.file_sha256(k), 0, 0)

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
                local = self.cache.fetch(url, self.fs, self.path(k), entry, self._copier(self.path(k), url, entry))
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
