"""Run unit jobs on this machine: in this process, or in worker processes that write their own shards.

With one worker (or one unit) the units are packed here, one after the other, and the
progress bar moves with every sequence. With ``workers > 1``, a pool of forked processes packs
whole units (`unit.pack_unit`): each worker writes its unit's shards itself and sends back
only the unit's index fragment (a few bytes per sequence), so nothing is spilled anywhere
and the parent only merges. At most two units per worker are in flight, and fragments come
back in unit order. A worker that dies raises a PackError here instead of a hang.

A worker dies with the pack, whatever moment the pack is killed. On Linux a worker asks for
SIGKILL when its parent dies (PR_SET_PDEATHSIG) in the fork itself, before any other code
runs in it (an ``os.register_at_fork`` hook that acts only for this pack's own forks), then
checks that its parent is still the pack: a pack killed before that, even mid-fork, leaves a
worker that exits at once. Elsewhere (spawned workers) a thread in each worker watches its
parent and ends the worker when the parent is gone.
"""
from __future__ import annotations

import collections
import ctypes
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
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
    _load_prctl()
    _FORKING[threading.get_ident()] = os.getpid()  # the pool forks its workers in this thread (at the first submit)
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_die_with_parent, initargs=(os.getpid(),))
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
        _FORKING.pop(threading.get_ident(), None)


def _done(future: Future, progress: Progress) -> Fragment:
    try:
        fragment = future.result()
    except BrokenProcessPool as e:
        raise PackError(f"a pack worker process died ({e}); the dataset at the destination is unchanged") from e
    progress(fragment.nbytes, fragment.sequences)
    return fragment


_FORKING: dict[int, int] = {}  # thread -> pid of the pack whose workers that thread forks now
_PRCTL = None  # libc's prctl, loaded before the fork (nothing to load in the child)
PR_SET_PDEATHSIG = 1


def _load_prctl() -> None:
    global _PRCTL
    if _PRCTL is None and sys.platform.startswith("linux"):
        try:
            _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            _PRCTL = False


def _after_fork_in_child() -> None:
    """In a process just forked: if it is a worker of a pack (forked by the pack's thread), die with the pack."""
    pack = _FORKING.get(threading.get_ident())
    _FORKING.clear()  # (a worker's own forks are not a pack's)
    if pack is None:
        return  # another fork of this process: not ours to change
    if _PRCTL:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != pack:  # the pack died before the line above: nothing would signal this worker
        os._exit(1)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _die_with_parent(parent: int) -> None:
    """In a worker, first thing: let Ctrl-C stop the parent only (which ends the pool); tie the worker to the pack
    again (for a fork the hook did not see); where there is no PR_SET_PDEATHSIG, watch the parent from a thread."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if _PRCTL:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)
    if not _PRCTL:
        threading.Thread(target=_watch_parent, args=(parent,), name="streamwin-pack-parent", daemon=True).start()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)
