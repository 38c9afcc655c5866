"""Packing one unit of input: a pure function from the unit to its shards and its index fragment.

A *unit* is an independent piece of the input: one file (parquet, npz, csv, jsonl, arrow), a
run of small one-sequence files (.npy, text; up to TASK_FILES), a partition of a Dask
DataFrame, a block of a Ray Dataset, a range of rows of a Hugging Face dataset. Units are
numbered in input order, and unit ``u`` of generation ``g`` writes its shards as
``shard-gGGGGGG-uUUUUUU-KKKKKK.tar`` (``dest.shard_prefix``): names derived from the unit's
identity alone. So packing a unit twice (a retried task, a duplicated one, a task whose
worker died midway) writes the same bytes under the same names, each shard replaced whole
(a rename on a local disk, one PUT on object storage), and the merge takes one fragment per
unit: no sequence is ever duplicated or lost, and the result does not depend on where or in
which order the units ran. When the pack extends a dataset (``mode="extend"``), the sequences
of keys it holds already are written as continuation members (``<key>.gGGGGGG.npy``, no json
member) into shards of their own, ``shard-gGGGGGG-uUUUUUU-cKKKKKK.tar``, with an index of their own.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from streamwin.errors import PackError
from streamwin.packing.dest import shard_prefix
from streamwin.packing.encode import EncodedSeq, EncodeOptions
from streamwin.packing.fragments import Fragment
from streamwin.packing.grow import ExistingKeys
from streamwin.packing.inputs import InputUnit
from streamwin.packing.tasks import Tally, encode_units
from streamwin.packing.writer import ShardWriter
from streamwin.storage.urls import url_to_fs

Progress = Callable[[int, int], None]  # (bytes written, sequences written) since the last call


@dataclass(frozen=True)
class UnitJob:
    """Everything a task needs to pack one unit: picklable, and the same wherever it runs.

    Args:
        unit: the unit's number (its shards' names derive from it).
        inputs: the input files of the unit (several only for one-sequence files), or one
            in-memory unit whose data the engine supplies (see `pack_unit`'s ``data``).
        dest: the dataset root URL; storage_options: fsspec options for it.
        gen: the generation being written.
        shard_bytes: a shard is closed once it holds this many bytes.
        options: how sequences are encoded.
        extend: the keys of the dataset being extended (``mode="extend"``), else None.
    """

    unit: int
    inputs: tuple[InputUnit, ...]
    dest: str
    storage_options: dict | None
    gen: int
    shard_bytes: int
    options: EncodeOptions
    extend: ExistingKeys | None = None

    @property
    def where(self) -> str:
        """The unit, as error messages and fragments name it."""
        first = self.inputs[0].path
        return first if len(self.inputs) == 1 else f"{first} and {len(self.inputs) - 1} more files"


def pack_unit(job: UnitJob, data: Any = None, progress: Progress | None = None) -> Fragment:
    """Write the shards of one unit and return its fragment; on any error the shard being written is discarded.

    ``data``: the in-memory data of the job's one unit (a pyarrow Table, a block, a partition),
    when the engine hands it over separately (Ray resolves an ObjectRef only as an argument).
    """
    inputs = job.inputs if data is None else tuple(dataclasses.replace(u, data=data) for u in job.inputs)
    fs, root = url_to_fs(job.dest, job.storage_options)
    writer = ShardWriter(fs, root, shard_bytes=job.shard_bytes, prefix=shard_prefix(job.gen, job.unit),
                         compression=job.options.compression)
    existing = job.extend
    cont = ShardWriter(fs, root, shard_bytes=job.shard_bytes, prefix=shard_prefix(job.gen, job.unit) + "c",
                       compression=job.options.compression) if existing is not None else None
    borrowed = any(u.format == "iterable" for u in inputs)  # a generator may reuse its arrays
    tally = Tally()
    try:
        found = (lambda keys: existing.find(keys) >= 0) if existing is not None else None
        for part in encode_units(list(inputs), job.options, tally, found):
            at = existing.find([part.key])[0] if existing is not None and isinstance(part, EncodedSeq) else -1
            if at >= 0:  # the next steps of a sequence packed already: a continuation member
                part = dataclasses.replace(part, key=existing.continuation(part.key, int(at), part.fields), meta=None,
                                           fields=None)
            written = (cont if at >= 0 else writer).add(part, borrowed=borrowed)
            if progress is not None:
                progress(written, 1 if isinstance(part, EncodedSeq) else len(part))
        writer.close()
        if cont is not None:
            cont.close()
    except BaseException:
        writer.abort()
        if cont is not None:
            cont.abort()
        raise
    for w in (writer, cont):
        if w is not None and w.dtype is None:
            w.abort()  # wrote nothing: drop its (empty) columns' files
    try:
        manifest = writer.manifest(tally.skipped, tally.columns) if writer.dtype is not None else None
        continued = cont.manifest(0, None) if cont is not None and cont.dtype is not None else None
    except PackError as e:
        raise PackError(f"{job.where}: {e}") from e
    nbytes = sum(s.bytes for m in (manifest, continued) if m is not None for s in m.shards)
    return Fragment(job.unit, manifest, tally.skipped, tally.columns, job.where, nbytes,
                    manifest.num_sequences if manifest is not None else 0, continued=continued)
