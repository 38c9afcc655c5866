"""Shards on remote storage (http, s3, any fsspec filesystem): ranged GETs in parts, retried at the byte."""
from __future__ import annotations

import hashlib
import mmap

import fsspec


from streamwin.read.counts import Counters
from streamwin.read.fetch import Fetcher, Throttle
from streamwin.read.members import Members
from streamwin.read.transport import Retrying, Transport
from streamwin.storage.ranged import CONNECTIONS, BrokenRead, RangeReader


class RemoteShards(Transport):
    """The shard objects of a dataset on ``fs`` (under ``root``), read with pooled, streamed GETs.

    Runs are split into parts read on ``connections`` threads (fetch.py), each straight into
    its place in the block buffer; a GET that breaks is resumed at the byte it got to. The
    ``throttle`` bounds the GETs in flight, halving them when the store answers 503 or 429.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, members: Members, counters: Counters, *,
                 retries: int, backoff: float, connections: int | None = None):
        connections = connections or CONNECTIONS
        super().__init__(root, members, counters, fetcher=Fetcher(connections))
        self.ranges = RangeReader(fs, connections)  # streamed GETs, pooled connections
        self.throttle = Throttle(connections)
        self.retrying = Retrying(members, counters, retries, backoff, limit=self.ranges.attempt_limit)

    def read_into(self, k: int, offset: int, out: memoryview) -> None:
        self.retrying.fill(self._get, self.path(k), self.members.shard_url(k), offset, out)
        self.counters.read(len(out))

    def read_sums_into(self, k: int, offset: int, out: memoryview) -> None:
        self.retrying.fill(self._get, self.path(k) + self.members.manifest.checks.suffix, self.sums_url(k), offset,
                           out)
        self.counters.add(bytes_sums=len(out))

    def download(self, path: str, where: str, size: int, dest: str) -> str:
        """Write the ``size`` bytes of the object at ``path`` (``where``: its URL, as errors name it) to the local
        file ``dest`` as parts on the GET threads, each straight into its place and retried at the byte; their
        sha256. The node cache's fetch of a whole shard: as many GETs in flight as a block's reads."""
        def fill(k: int, offset: int, part: memoryview) -> None:
            self.retrying.fill(self._get, path, where, offset, part)
        with open(dest, "w+b") as f:
            if not size:
                return hashlib.sha256().hexdigest()
            f.truncate(size)
            with mmap.mmap(f.fileno(), size) as mapped:
                out = memoryview(mapped)
                try:
                    err = self.read_many([(0, 0, out)], fill)[0]  # as parts on the GET threads
                    if err is not None:
                        raise err
                    return hashlib.sha256(out).hexdigest()
                finally:
                    out.release()

    def latency(self) -> float:
        """Seconds a part of a block takes to arrive, lately: its GET's wait for the first byte, and its bytes at the
        best rate a connection carried them (the time its transfer takes alone, not shared with others: a store
        whose bandwidth the GETs share does not send more for more of them in flight)."""
        r = self.ranges
        return r.latency + (r.part / r.speed if r.speed else 0.0)

    def _get(self, path: str, offset: int, out: memoryview) -> int:
        """One GET into ``out`` within the throttle's bound, telling it whether the store asked for fewer."""
        with self.throttle:
            try:
                n = self.ranges.read_into(path, offset, out)
            except BrokenRead as e:
                if e.throttled:
                    self.throttle.slow_down()
                    self.counters.add(throttled=1)
                raise
        self.throttle.succeeded()
        return n

    def shutdown(self, wait: bool = True) -> None:
        """Stop the GET threads and close the pooled connections."""
        super().shutdown(wait)
        self.ranges.close()
