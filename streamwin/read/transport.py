"""How a reader gets bytes of a dataset's shards: the contract every transport keeps, and retries.

A transport reads (shard, offset, destination) runs: ``read_into`` fills the destination
or raises a ShardError naming the shard and the byte offset, counting bytes, requests,
retries and cache hits. Where the shards are local files (``mappable``), ``open_file``
opens one for mapping. ``submit`` starts reading the runs of a block and ``read_many`` reads
them: in the caller's thread, or where reads are latency-bound (object storage) split into
parts on a pool of GET threads (fetch.py), so the runs of later blocks can be in flight
while this one is batched; ``submit_sums`` starts reading ranges of the shards' sums files
(formats/checks.py) the same way. The transports:

- ``local.LocalShards``: the shard files themselves, read (or mapped);
- ``remote.RemoteShards``: objects on remote storage, one ranged GET per run;
- ``cached.CachedShards``: a node-local copy of each shard, fetched whole, then local.
"""
from __future__ import annotations

import time
from typing import BinaryIO, Callable

from streamwin.errors import ShardError
from streamwin.read.counts import Counters
from streamwin.read.fetch import Fetcher, Pending, Run
from streamwin.read.members import Members
from streamwin.storage.deadline import total_limit
from streamwin.storage.ranged import BrokenRead
from streamwin.storage.retry import describe, permanent
from streamwin.storage.urls import join


class Transport:
    """Reads runs of one dataset's shards (under ``root``); subclasses say how (see the module docstring)."""

    mappable = False  # shards are local files that ``open_file`` opens

    def __init__(self, root: str, members: Members, counters: Counters, *, fetcher: Fetcher | None = None):
        self.root, self.members, self.counters, self.fetcher = root, members, counters, fetcher

    def path(self, k: int) -> str:
        """Shard k's path on its filesystem."""
        return join(self.root, self.members.manifest.shards[k].name)

    def begin_block(self) -> None:
        """A new block is read: forget what the last one learnt."""

    def read_into(self, k: int, offset: int, out: memoryview) -> None:
        """Fill ``out`` with bytes of shard k from ``offset``; ShardError naming the shard and offset."""
        raise NotImplementedError

    def open_file(self, k: int, offset: int) -> tuple[BinaryIO, bool]:
        """(open file of shard k, whether the node cache had it) of a ``mappable`` transport."""
        raise NotImplementedError

    def sums_url(self, k: int) -> str:
        """The URL of shard k's sums file, as errors name it."""
        return self.members.shard_url(k) + self.members.manifest.checks.suffix

    def read_sums_into(self, k: int, offset: int, out: memoryview) -> None:
        """Fill ``out`` with bytes of shard k's sums file from ``offset``; ShardError naming that file."""
        raise NotImplementedError

    def submit_sums(self, runs: list[Run]) -> Pending:
        """Start reading ranges of sums files (each one's ShardError or None, once in), as ``submit`` does."""
        return self.submit(runs, self.read_sums_into)

    def try_read(self, run: Run, read: Callable[[int, int, memoryview], None] | None = None) -> ShardError | None:
        """Read one run (with ``read``, default ``read_into``); the ShardError instead of raising it."""
        try:
            (read or self.read_into)(*run)
            return None
        except ShardError as e:
            return e

    def submit(self, runs: list[Run], read: Callable[[int, int, memoryview], None] | None = None) -> Pending:
        """Start reading runs with ``read`` (default ``read_into``): on the fetcher's threads where the transport
        has one (``Pending.wait()`` then waits for them), else now, in this thread."""
        if self.fetcher is None:
            return Pending(len(runs), errors=[self.try_read(r, read) for r in runs])
        return self.fetcher.submit(runs, lambda r: self.try_read(r, read))

    def read_many(self, runs: list[Run], read: Callable[[int, int, memoryview], None] | None = None
                  ) -> list[ShardError | None]:
        """Read runs (each one's ShardError or None) with ``read`` (default ``read_into``), as ``submit`` does."""
        return self.submit(runs, read).wait()

    def shutdown(self, wait: bool = True) -> None:
        """Stop the GET threads (a later read starts new ones); ``wait=False`` lets a GET in flight end on its own."""
        if self.fetcher is not None:
            self.fetcher.shutdown(wait)


class Retrying:
    """Fills a buffer from a shard with ``read_some`` calls, retrying transient errors from the byte that broke.

    Each attempt asks for everything from the first byte not yet in the buffer: a remote read
    is one streamed GET, and when it breaks, the bytes it delivered stay (BrokenRead says how
    many). ``retries`` bounds failures in a row: an attempt that delivered bytes before it
    broke starts the count anew, so a long range on a flaky link goes on as long as it
    advances. Waits ``backoff`` seconds before the first retry, doubling with each failure.
    ``limit(nbytes)``, where given, is the time one attempt may take (storage.deadline): the
    whole range then fails once it has run for its ``total_limit``, however much each attempt
    delivered (a server that trickles, or sends a little and stalls, again and again).
    """

    def __init__(self, members: Members, counters: Counters, retries: int, backoff: float,
                 limit: Callable[[int], float] | None = None):
        self.members, self.counters, self.retries, self.backoff = members, counters, retries, backoff
        self.limit = limit

    def fill(self, read_some: Callable[[str, int, memoryview], int], path: str, where: str, offset: int,
             out: memoryview) -> None:
        """Fill ``out`` from byte ``offset`` of the file at ``path`` (a shard, or a sums file; ``where``: its URL, as
        errors name it) by ``read_some`` calls (0: the file ends)."""
        done = attempt = 0
        budget = total_limit(self.limit(len(out)), self.retries, self.backoff) if self.limit else float("inf")
        started = time.monotonic()
        while done < len(out):
            try:
                n = read_some(path, offset + done, out[done:])
            except (FileNotFoundError, PermissionError) as e:
                raise ShardError(f"cannot open shard: {e}", shard=where, offset=offset + done) from e
            except Exception as e:  # transient storage errors: retry from the byte where it broke
                got = e.delivered if isinstance(e, BrokenRead) else 0
                done += got
                attempt = 1 if got else attempt + 1
                if attempt > self.retries or permanent(e):
                    raise ShardError(f"read {describe(e, self.retries)}", shard=where, offset=offset + done) from e
                if time.monotonic() - started > budget:
                    raise ShardError(f"read gave up after {time.monotonic() - started:.0f} s, past its time limit of "
                                     f"{budget:.0f} s for {len(out):,} bytes ({done:,} arrived): {type(e).__name__}: {e}",
                                     shard=where, offset=offset + done) from e
                self.counters.add(retries=1)
                time.sleep(self.backoff * 2 ** (attempt - 1))
                continue
            if n == 0:
                raise ShardError(f"shard ends early: wanted {len(out)} bytes at offset {offset}, got {done}",
                                 shard=where, offset=offset + done)
            done += n
            attempt = 0  # retries bound failures in a row; a read that keeps advancing goes on


def fill(src, out: memoryview) -> int:
    """Read from stream ``src`` into ``out`` until it is full or the stream ends; the bytes read."""
    got = 0
    while got < len(out):
        n = src.readinto(out[got:])
        if not n:
            break
        got += n
    return got


def read_file(f, offset: int, out: memoryview) -> int:
    """Read into ``out`` from open file ``f`` at ``offset``; returns the bytes read (short at EOF)."""
    f.seek(offset)
    return fill(f, out)
