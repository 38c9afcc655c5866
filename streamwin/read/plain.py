"""Plain (uncompressed) members: a block's byte runs mapped or read into its buffer, failures recovered.

The runs come from runs.py. Where the shards are local files (the dataset's own, or the
node cache's copies) each run is mapped into one reserved address range, so the batch
gather is the only copy a window's bytes make; with more than MAX_MAPPED_RUNS runs, or when
the system refuses a mapping, the runs are read into anonymous memory instead. Every npy
header a run covers is checked against the manifest before any window is cut from it.
"""
from __future__ import annotations

import numpy as np

from streamwin.errors import ShardError
from streamwin.read.block import READABLE
from streamwin.read.counts import Counters
from streamwin.read.local import map_range
from streamwin.read.members import Members
from streamwin.read.pieces import Pieces
from streamwin.read.runs import PlainRuns, packed, paged, plain_runs
from streamwin.read.transport import Transport
from streamwin.storage import mapped

MAX_MAPPED_RUNS = 1024  # a block of more separate runs is read, not mapped (mappings per process are limited)


class PlainReads:
    """Reads the pieces of a block of plain members through ``shards``; maps them where ``map_files``."""

    def __init__(self, shards: Transport, members: Members, counters: Counters, *, map_files: bool):
        self.shards, self.members, self.counters, self.map_files = shards, members, counters, map_files

    def read(self, p: Pieces, tail: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(buffer, where each piece's sequence has its step 0 in it, steps readable per piece).

        The buffer ends in ``tail`` zero bytes. Each run's headers are checked once it is in
        (after ``_recover`` read again what a failed run lost, with on_error="skip").
        """
        runs = plain_runs(self.members.manifest, p)
        buf, run_at, errors, refill = self._fetch(runs, tail)
        base, header_at = runs.land(run_at)
        at, hlens, bounds = header_at.tolist(), runs.hlen.tolist(), runs.first.tolist()
        heads = runs.covers_header().tolist()
        good = np.full(len(runs.seq), READABLE, dtype=np.int64)
        for j, err in enumerate(errors):
            k, u0, u1 = int(runs.shard[j]), bounds[j], bounds[j + 1]
            if err is not None:  # skip mode: keep what the run delivered, read the rest member by member
                self._recover(err, runs, j, run_at, refill, good)
            for u in range(u0, u1):
                if heads[u] and good[u] > 0:  # the read covers this member's .npy header: check it
                    try:
                        self.members.check_header(buf[at[u] : at[u] + hlens[u]].tobytes(), int(runs.seq[u]), k)
                    except ShardError as e:
                        self.counters.skip_or_raise(e)
                        good[u] = 0
        return buf, base, good

    def _fetch(self, runs: PlainRuns, tail: int):
        """The runs mapped (local files, up to MAX_MAPPED_RUNS of them) or else read: see ``_read_runs``."""
        if self.map_files and len(runs) <= MAX_MAPPED_RUNS:
            try:
                return self._map_runs(runs, tail)
            except OSError:  # out of address space or mappings: read instead
                pass
        return self._read_runs(runs, tail)

    def _recover(self, err: ShardError, runs: PlainRuns, j: int, run_at: np.ndarray, refill,
                 good: np.ndarray) -> None:
        """After run j failed: the steps each member got before the failure; the rest read again.

        A failed read leaves every byte before the error's offset in place. The member holding
        that offset keeps the steps before it; the members after it are read again, from the
        next one's first byte, until a read gets to the end. An error at no place in the range
        (a shard the cache could not fetch), or a read again that gets no byte at all (a file
        cut short, an object gone), loses the rest of the run at once: each try would fail
        alike. Each failure is one skipped range.
        """
        u, u1, again = int(runs.first[j]), int(runs.first[j + 1]), False
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
            into = int(run_at[j] + runs.lo[v] - runs.run_lo[j])  # member v's place in the buffer
            err, u, again = refill(int(runs.shard[j]), int(runs.lo[v]), int(runs.run_hi[j]), into), v, True

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
