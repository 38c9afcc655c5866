"""Tasks: the inputs cut into pieces of work, and what encoding one piece yields.

pack lists its input units (one per file) and groups them into tasks (`tasks_of`): runs of
up to TASK_FILES one-sequence files (.npy, text), any other unit alone; each task is one unit
of packing (see ``unit``), numbered in order. `encode_units`
reads a task's units and yields the parts the writer appends, in order: Records of short
sequences (a Batch of an input, encoded BATCH_SEQS at a time; sequences read one by one,
gathered up to BATCH_SEQS), and each long sequence on its own as an EncodedSeq, written from
its array. The same tasks give the same parts in one process or in many (see `parallel`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from streamwin.packing.encode import EncodedSeq, EncodeOptions, Streamed
from streamwin.packing.inputs import Batch, Columns, InputUnit, format_of, read_batches, read_unit
from streamwin.packing.records import RECORD_MAX, Records, batch_fits, encode_batch, records_of

BATCH_SEQS = 8192  # sequences per Records at most
BATCH_BYTES = 16 << 20  # and about this many bytes of values
TASK_FILES = 256  # files of one sequence each (npy, text) per task


@dataclass
class Tally:
    """What `encode_units` learns besides the parts: zero-length sequences skipped, a table's value columns."""

    skipped: int = 0
    columns: Columns | None = None


def tasks_of(units: list[InputUnit], task_bytes: int = 256 << 20) -> list[list[InputUnit]]:
    """Units in tasks, in order: runs of one-sequence files, up to TASK_FILES files and about ``task_bytes``
    bytes each (so a task writes about one shard), any other unit alone (a table reports its own value columns)."""
    tasks: list[list[InputUnit]] = []
    size = 0
    for unit in units:
        last = tasks[-1] if tasks else None
        grouped = (last and format_of(last[-1]).one_per_file and len(last) < TASK_FILES
                   and size + unit.size <= task_bytes)
        if grouped and format_of(unit).one_per_file:
            last.append(unit)
            size += unit.size
        else:
            tasks.append([unit])
            size = unit.size
    return tasks


Continued = Callable[[list[str]], np.ndarray]  # which of some keys a dataset being extended holds already


def encode_units(units: list[InputUnit], options: EncodeOptions, tally: Tally,
                 continued: Continued | None = None) -> Iterator[EncodedSeq | Records]:
    """The parts of a task's units (`encode_batches`), or, for an in-memory iterable, its items encoded one by
    one (a generator may reuse its arrays, so none is held past its write; the iterable is never held whole).
    ``continued``: keys of sequences that extend ones packed already come one by one, as EncodedSeq, never in
    Records (their members are named and written apart: unit.py)."""
    if len(units) == 1 and units[0].format == "iterable":
        for key, arr, meta in read_unit(units[0]):
            enc = options.encode(key, arr, meta)
            if enc is None:
                tally.skipped += 1
            else:
                yield enc
        return
    yield from encode_batches(units, options, tally, continued)


def encode_batches(units: list[InputUnit], options: EncodeOptions, tally: Tally,
                   continued: Continued | None = None) -> Iterator[EncodedSeq | Records]:
    """The parts of some input files (a task: see `tasks_of`) to write, in order: Records of their
    short sequences (made by `encode_batch`, BATCH_SEQS at a time, where an input gives a Batch),
    and long ones as EncodedSeq, written from their arrays. Counts skipped sequences and value
    columns in ``tally``."""
    suffix = options.suffix
    pending: list[EncodedSeq] = []
    found: list[Columns] = []
    for got in (got for unit in units for got in read_batches(unit, found.append)):
        if found:
            tally.columns = found.pop()
        extends = continued(list(got.keys) if isinstance(got, Batch) else [got[0]]) if continued is not None else None
        if isinstance(got, Batch) and options.compression is None and batch_fits(got) and \
                (extends is None or not extends.any()):
            if pending:
                yield records_of(pending, suffix)
                pending = []
            for part in _sub_batches(got):
                rec, empties = encode_batch(part, cast=options.cast, empty=options.empty, nan=options.nan)
                tally.skipped += empties
                if rec is not None:
                    yield rec
            continue
        for i, (key, arr, meta) in enumerate(got.items() if isinstance(got, Batch) else (got,)):
            enc = options.encode(key, arr, meta)
            if enc is not None and isinstance(got, Batch) and got.fields:  # meta columns: fields, no json member
                enc = dataclasses.replace(enc, fields=got.meta(i))
            if enc is None:
                tally.skipped += 1
                continue
            small = not isinstance(enc.body, Streamed) and enc.size <= RECORD_MAX and \
                (extends is None or not extends[i])
            # one dtype per Records (the writer then names the first sequence of another); bounded buffers
            if pending and (not small or (enc.dtype, enc.step_shape) != (pending[0].dtype, pending[0].step_shape)
                            or len(pending) >= BATCH_SEQS):
                yield records_of(pending, suffix)
                pending = []
            if small:
                pending.append(enc)
            else:
                yield enc
    if pending:
        yield records_of(pending, suffix)


def _sub_batches(batch: Batch) -> Iterator[Batch]:
    """The batch in pieces of at most BATCH_SEQS sequences and about BATCH_BYTES of values."""
    rows = max(1, BATCH_BYTES // max(1, batch.values[:1].nbytes))
    bounds, i = batch.bounds, 0
    while i < len(batch):
        j = min(len(batch), i + BATCH_SEQS, int(np.searchsorted(bounds, bounds[i] + rows, side="right")) - 1)
        j = max(j, i + 1)
        yield batch.slice(i, j)
        i = j
