"""How many workers and slots a loader may have, and the memory they take: checked before anything starts.

A worker pool maps, per worker, ``prefetch_factor + 2`` batch slots plus 3 to 24 spare ones
(``spare_slots``: the trainer takes the batches at hand in runs; up to a chunk of them when it takes
chunks of batches from each worker in turn, canonical streams), and the trainer keeps up to
``BufferPool.KEEP`` batches of its own (gathered in-process, or copied out of slots when batches
are kept). Arguments whose processes or memory this machine cannot give fail here, naming them,
instead of as a raw ``OSError`` halfway through starting the workers.
"""
from __future__ import annotations

import sys
from typing import Any

import numpy as np

from streamwin.arguments import check_fits
from streamwin.buffers import BufferPool
from streamwin.feed.protocol import ring_size
from streamwin.feed.slots import SlotLayout
from streamwin.plan.canon import CanonPlan, shares_batches, worker_chunk

SPARE_BYTES = 64 << 20  # the workers' spare slots take up to this much memory, all of them together
CHUNK_BYTES = 256 << 20  # with canonical streams' chunks, up to this much (a chunk of batches a worker)
MIN_SPARE, MAX_SPARE = 3, 24  # spare slots per worker, whatever the batch
MAX_PREFETCH = 1024  # batches a worker may keep ready ahead of the trainer
FDS_PER_WORKER = 2  # the trainer's end of a worker's pipe and its process sentinel


def chunk_of(dataset, num_workers: int, world_size: int | None = None) -> int:
    """Batches in a row the loader takes from one worker: Q (a chunk) with canonical streams of one phase whose
    workers do not share batches (plan/canon.py ``shares_batches``), else 1."""
    cfg = dataset.config(num_workers, world_size)
    return 1 if not cfg.chunked or num_workers < 2 or shared_batches(dataset, num_workers, world_size) else \
        worker_chunk(cfg)


def shared_batches(dataset, num_workers: int, world_size: int | None = None) -> bool:
    """Whether a rank's workers share each batch, each writing its rows (plan/canon.py ``shares_batches``): the
    plans of its passes say the same (``Plan.shared``)."""
    cfg = dataset.config(num_workers, world_size)
    return shares_batches(cfg, len(dataset.sources), dataset.transform is not None)


def spare_slots(slot_bytes: int, num_workers: int = 1, chunk: int = 1) -> int:
    """Slots a worker has beyond ``prefetch_factor + 2``: the trainer takes every batch at hand in one go (a run, from
    every worker in turn) and gives slots back once per go, so a worker's share of a run averages about
    (prefetch_factor + spare + 1) / 2 batches, and a run's cost (Python run with cold caches after a step) is shared by
    them. Small batches (short steps, where that cost counts) get up to MAX_SPARE, within SPARE_BYTES for all
    ``num_workers`` together. When the loader takes ``chunk`` batches in a row from each worker (canonical streams),
    a worker fills its slots with its next chunk while the others' are taken: it gets up to a chunk of them,
    within CHUNK_BYTES for all the workers together (fewer, and the trainer waits on the worker whose turn it is)."""
    spare = max(MIN_SPARE, min(MAX_SPARE, SPARE_BYTES // max(1, slot_bytes * max(1, num_workers))))
    if chunk > 1:
        spare = max(spare, min(chunk, CHUNK_BYTES // max(1, slot_bytes * max(1, num_workers))))
    return spare


def pool_slots(slots: int, slot_bytes: int, num_workers: int = 1, chunk: int = 1) -> int:
    """Slots per worker of a pool of ``num_workers`` asked for ``slots`` of ``slot_bytes``: the spare ones added."""
    return slots + spare_slots(slot_bytes, num_workers, chunk)


def pool_bytes(num_workers: int, slots: int, slot_bytes: int, chunk: int = 1) -> int:
    """Bytes of shared memory a pool of ``num_workers`` workers with ``slots`` slots of ``slot_bytes`` maps."""
    n = pool_slots(slots, slot_bytes, num_workers, chunk)
    return SlotLayout(num_workers, n, slot_bytes, ring_size(n)).nbytes  # (shared: the same slots, all workers')


def max_workers() -> tuple[int, str]:
    """How many worker processes this process may start, and the limit that says so ("" if none does)."""
    try:
        import resource
    except ImportError:  # not on this platform
        return sys.maxsize, ""
    found = [(sys.maxsize, "")]
    procs, files = resource.getrlimit(resource.RLIMIT_NPROC)[0], resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if procs != resource.RLIM_INFINITY:
        found.append((procs, f"the process limit (ulimit -u: {procs})"))
    if files != resource.RLIM_INFINITY:
        found.append((max(0, files - 64) // FDS_PER_WORKER,
                      f"the open-file limit (ulimit -n: {files}; {FDS_PER_WORKER} per worker)"))
    return min(found)


def check_workers(num_workers: Any, prefetch_factor: Any) -> tuple[int, int]:
    """(num_workers, prefetch_factor) as ints; ValueError naming either when it is no integer, ``num_workers``
    beyond what this process may start, or ``prefetch_factor`` beyond MAX_PREFETCH."""
    if isinstance(num_workers, bool) or not isinstance(num_workers, (int, np.integer)) or num_workers < 0:
        raise ValueError(f"num_workers must be an integer >= 0, got {num_workers!r}")
    if isinstance(prefetch_factor, bool) or not isinstance(prefetch_factor, (int, np.integer)):
        raise ValueError(f"prefetch_factor must be an integer from 1 to {MAX_PREFETCH}, got {prefetch_factor!r}")
    num_workers, prefetch_factor = int(num_workers), int(prefetch_factor)
    most, limit = max_workers()
    if num_workers > most:
        raise ValueError(f"num_workers={num_workers} is more worker processes than this process may start: "
                         f"{most} by {limit}")
    if not 1 <= prefetch_factor <= MAX_PREFETCH:
        raise ValueError(f"prefetch_factor must be an integer from 1 to {MAX_PREFETCH} (batches each worker keeps "
                         f"ready; more only takes memory), got {prefetch_factor!r}")
    return num_workers, prefetch_factor


def slots_text(dataset, num_workers: int, prefetch_factor: int) -> str:
    """The arguments that size a loader's batch memory, as the user typed them."""
    per = f"batch_size={dataset.batch_size} windows ({dataset.layout().nbytes / 1e6:,.1f} MB)"
    if not num_workers:
        return f"batches of {per}"
    extra = pool_slots(2, dataset.layout().nbytes, num_workers, chunk_of(dataset, num_workers))
    return f"num_workers={num_workers} x (prefetch_factor={prefetch_factor} + {extra}) batch slots of {per}"


def check_memory(dataset, num_workers: int, prefetch_factor: int) -> None:
    """ValueError naming the arguments if the slots and the trainer's own batches exceed this machine's memory."""
    batch = dataset.layout().nbytes
    need = BufferPool.KEEP * batch
    if num_workers:
        need += pool_bytes(num_workers, prefetch_factor + 2, batch, chunk_of(dataset, num_workers))
    check_fits(need, f"{slots_text(dataset, num_workers, prefetch_factor)}, and {BufferPool.KEEP} batches of this "
               "process")


def idle_workers(dataset, plan, num_workers: int) -> str | None:
    """A warning's text when some of a rank's workers get no batch of ``plan``, saying why, else None.

    With canonical streams of one phase, a rank's workers either share each batch (``shared_batches``) or
    take chunks of Q steps in turn, worker w chunks w, w + n, ... (Q: shuffle_buffer / the global batch, one
    block of the order; packed rows, about two blocks' rows a slot): an epoch of K steps then keeps only
    min(n, ceil(K / Q)) of n workers busy."""
    if num_workers < 2 or not isinstance(plan, CanonPlan) or plan.shared or plan.chunk <= 1:
        return None
    steps, q, cfg = plan.batches_per_rank, plan.chunk, plan.config
    idle = [w for w in range(num_workers) if plan.worker_taken(steps, num_workers, w) == 0]
    if not idle or not steps:
        return None
    slots = cfg.canonical[0] // cfg.world_size
    why = ("a transform sees whole batches, so the rank's workers do not share them" if dataset.transform is not None
           else "the workers of a mix do not share batches" if len(dataset.sources) > 1
           else "the workers of packed rows do not share batches" if cfg.pack_length is not None
           else f"{num_workers} workers are more than the rank's {slots} canonical slots, so they do not share batches"
           if num_workers > slots else "the workers do not share batches")
    size = "" if cfg.pack_length is not None else \
        f" = shuffle_buffer {cfg.block_windows} / global batch {cfg.world_size * cfg.batch_size}"
    return (f"streamwin: {len(idle)} of this rank's {num_workers} workers get no batch this epoch: {why}, and "
            f"take chunks of {q} steps{size} in turn (worker w: chunks w, w + {num_workers}, ...); this epoch has "
            f"{steps} steps, {-(-steps // q)} chunk(s), so its batches come from {num_workers - len(idle)} "
            "worker(s). A smaller shuffle_buffer makes more chunks (and another order: give every job that should "
            "share the order the same), or fewer workers do the same work")
