"""Encode tasks in this process or in worker processes, and hand their parts over in input order.

With one worker (or one task), tasks are encoded here, part by part, and an in-memory
iterable item by item (it is never held whole). With ``workers > 1``, forked processes encode
whole tasks, at most two per worker ahead of the writer, so a slow destination never piles
results up in memory. A worker's parts come back through one spill file in /dev/shm
(RAM-backed, about twice as fast as the result pipe) unless they are small, and are handed
over in task order, so the shards are the same as with one process.
"""
from __future__ import annotations

import collections
import dataclasses
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
from typing import Iterator

import numpy as np

from streamwin.packing.encode import EncodedSeq, EncodeOptions, Streamed
from streamwin.packing.inputs import Columns, InputUnit, read_unit
from streamwin.packing.records import Records
from streamwin.packing.tasks import Tally, encode_units, tasks_of

SPILL_MIN = 256 << 10  # a worker's output for a task smaller than this comes back through the pipe


def encode_task(args: tuple) -> tuple[list[EncodedSeq | Records], int, str | None, list[int], Columns | None]:
    """Worker-process task: `encode_units` of a task's input units.

    Unless the unit is small, the parts' contents travel back through one spill file in
    ``spill_dir`` (RAM-backed /dev/shm where there is one), about twice as fast as through the
    result pipe; the parts then come back empty, with their content sizes in order (see `unspill`).
    """
    units, options, spill_dir = args
    tally = Tally()
    parts = list(encode_units(units, options, tally))
    skipped, columns = tally.skipped, tally.columns
    sizes = [p.nbytes if isinstance(p, Records) else p.size for p in parts]
    if sum(sizes) < SPILL_MIN:
        return parts, skipped, None, sizes, columns
    fd, path = tempfile.mkstemp(dir=spill_dir, suffix=".spill")
    with os.fdopen(fd, "wb") as f:
        for p in parts:
            for chunk in (p.data,) if isinstance(p, Records) else (p.head, p.body):
                for piece in (chunk if isinstance(chunk, Streamed) else (chunk,)):
                    f.write(piece)
    empty_parts = [dataclasses.replace(p, data=b"") if isinstance(p, Records) else dataclasses.replace(p, head=b"", body=b"")
                   for p in parts]
    return empty_parts, skipped, path, sizes, columns


def unspill(parts: list[EncodedSeq | Records], path: str | None, sizes: list[int]) -> list[EncodedSeq | Records]:
    """The parts of `encode_task` with their contents back (views of the spill file, read whole)."""
    if path is None:
        return parts
    with open(path, "rb") as f:
        view = memoryview(f.read())
    os.unlink(path)
    bounds = np.cumsum([0] + sizes).tolist()
    return [dataclasses.replace(p, data=view[a:b]) if isinstance(p, Records) else dataclasses.replace(p, body=view[a:b])
            for p, a, b in zip(parts, bounds, bounds[1:])]


def encoded(units: list[InputUnit], options: EncodeOptions, workers: int) -> Iterator[tuple[list[EncodedSeq | Records], int, Columns | None]]:
    """(parts to write, zero-length sequences skipped, a table's value columns when first known)
    per task of input files (`encode_units`), or per item of an iterable, in input order."""
    tasks = tasks_of(units)
    if workers <= 1 or len(tasks) <= 1:
        for task in tasks:
            if task[0].format != "iterable":
                tally = Tally()
                for part in encode_units(task, options, tally):
                    yield [part], 0, None
                yield [], tally.skipped, tally.columns
                continue
            for key, arr, meta in read_unit(task[0]):  # item by item: a huge in-memory iterable is never held whole
                enc = options.encode(key, arr, meta)
                yield ([enc] if enc is not None else []), int(enc is None), None
        return
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    spill_dir = tempfile.mkdtemp(prefix="streamwin-pack-", dir=shm)
    args = iter([(t, options, spill_dir) for t in tasks])
    try:
        with ctx.Pool(workers) as pool:
            # a bounded window of tasks in flight: a slow destination never piles results up in memory
            pending = collections.deque(pool.apply_async(encode_task, (a,)) for _, a in zip(range(2 * workers), args))
            while pending:
                parts, skipped, path, sizes, columns = pending.popleft().get()
                for a in args:
                    pending.append(pool.apply_async(encode_task, (a,)))
                    break
                yield unspill(parts, path, sizes), skipped, columns
    finally:
        shutil.rmtree(spill_dir, ignore_errors=True)
