"""Run unit jobs on this machine: in this process, or in worker processes that write their own shards.

With one worker (or one unit) the units are packed here, one after the other, and the
progress bar moves with every sequence. With ``workers > 1``, a pool of forked processes packs
whole units (`unit.pack_unit`): each worker writes its unit's shards itself and sends back
only the unit's index fragment (a few bytes per sequence), so nothing is spilled anywhere
and the parent only merges. At most two units per worker are in flight, and fragments come
back in unit order. A worker dies with the pack (Linux: PR_SET_PDEATHSIG), so a killed pack
leaves no process behind; a worker that dies raises a PackError here instead of a hang.
"""
from __future__ import annotations

import collections
import ctypes
import multiprocessing as mp
import signal
import sys
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Iterator

from streamwin.errors import PackError
from streamwin.packing.fragments import Fragment
from streamwin.packing.unit import Progress, UnitJob, pack_unit

Job = tuple[UnitJob, Any]  # a unit job and the in-memory data the task gets with it (None for files)


def run_local(jobs: Iterator[Job], workers: int, progress: Progress) -> Iterator[Fragment]:
    """Pack every job here (``workers`` 1) or in ``workers`` processes; fragments in unit order."""
    jobs = iter(jobs)
    first = next(jobs, None)
    if first is None:
        return
    second = next(jobs, None)
    if workers <= 1 or second is None or first[0].inputs[0].format == "iterable":
        for job, data in (j for j in (first, second) if j is not None):
            yield pack_unit(job, data, progress)
        for job, data in jobs:
            yield pack_unit(job, data, progress)
        return
    yield from _in_processes(_chain(first, second, jobs), workers, progress)


def _chain(*heads_and_rest) -> Iterator[Job]:
    *heads, rest = heads_and_rest
    yield from heads
    yield from rest


def _in_processes(jobs: Iterator[Job], workers: int, progress: Progress) -> Iterator[Fragment]:
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_die_with_parent)
    pending: collections.deque[Future] = collections.deque()
    try:
        for job, data in jobs:
            pending.append(pool.submit(pack_unit, job, data))
            if len(pending) >= 2 * workers:
                yield _done(pending.popleft(), progress)
        while pending:
            yield _done(pending.popleft(), progress)
    finally:
        for f in pending:
            f.cancel()
        pool.shutdown(wait=True, cancel_futures=True)


def _done(future: Future, progress: Progress) -> Fragment:
    try:
        fragment = future.result()
    except BrokenProcessPool as e:
        raise PackError(f"a pack worker process died ({e}); the dataset at the destination is unchanged") from e
    progress(fragment.nbytes, fragment.sequences)
    return fragment


def _die_with_parent() -> None:
    """In a worker: be killed when the pack process dies (Linux), so a killed pack leaves no worker writing."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the parent, which ends the pool
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
