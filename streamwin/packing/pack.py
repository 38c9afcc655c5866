"""Pack inputs into tar shards plus an index.json manifest, written last.

One writer appends members to the current shard and starts a new one past ``shard_bytes``,
so the output is byte-identical for the same input, however many worker processes
encode (read, convert, compress) the input files in parallel.

Crash safety, step by step:

1. The index this pack will write (index.json, or its part index) is removed before
   anything else, so from then on the destination reads as "not finished".
2. Each shard is written to a temporary name and renamed when complete (local), or
   uploaded in one object PUT that becomes visible only when complete (object stores);
   an error discards the shard being written.
3. index.json is written atomically after every shard is complete: it is the commit marker.
4. Only then are leftovers of earlier runs removed (shards past the new count, temporaries).

So an interrupted pack leaves no index.json at all, and rerunning it completes the dataset.

The stages, each a module of ``streamwin.packing``: ``inputs`` lists the input's units (one
per file) and reads them; ``tasks`` groups units into tasks and encodes a task into parts
(``encode`` one sequence, ``records`` many short ones at once); ``parallel`` runs tasks in
worker processes; ``writer`` appends parts to shards and records the manifest's columns
(``columns``, kept in files); ``parts`` packs a part of the input and merges part indexes.
"""
from __future__ import annotations

import functools
import sys
import warnings
from typing import Any, Callable, Iterator

import numpy as np
from tqdm.auto import tqdm

from streamwin.errors import PackError
from streamwin.formats.manifest import INDEX_NAME, Manifest
from streamwin.packing.encode import EncodedSeq, EncodeOptions
from streamwin.packing.inputs import Columns, list_units
from streamwin.packing.parallel import encoded
from streamwin.packing.parts import merge, parse_part, part_index_name, part_units
from streamwin.packing.records import Records
from streamwin.packing.writer import ShardWriter
from streamwin.storage.manifests import write_manifest
from streamwin.storage.urls import join, remove_if_exists, url_to_fs

__all__ = ["NonFiniteWarning", "merge", "pack"]


class NonFiniteWarning(UserWarning):
    """pack wrote NaN or inf values (counted in ``manifest.nonfinite``)."""


def _check_sizes(shard_bytes: int, workers: int) -> None:
    if not _is_int(shard_bytes) or shard_bytes <= 0:
        raise PackError(f"shard_bytes must be a positive integer, got {shard_bytes!r}")
    if not _is_int(workers) or workers < 1:
        raise PackError(f"workers must be an integer >= 1, got {workers!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _accepts_source(func: Callable[..., Manifest]) -> Callable[..., Manifest]:
    """pack's first parameter was called ``source``: a call that names it still works, with a
    DeprecationWarning (``inspect.signature`` and ``help`` show the new signature)."""
    @functools.wraps(func)
    def call(*args: Any, **kwargs: Any) -> Manifest:
        if "source" in kwargs:
            if args or "inputs" in kwargs:
                raise TypeError("pack() got both inputs and source=, the old name of inputs")
            warnings.warn("pack(source=...) is deprecated: the parameter is called inputs now (pass it first, "
                          "or inputs=...)", DeprecationWarning, stacklevel=2)
            kwargs["inputs"] = kwargs.pop("source")
        return func(*args, **kwargs)
    return call


@_accepts_source
def pack(inputs: Any, dest: str, *, shard_bytes: int = 256 << 20, format: str | None = None,
         workers: int = 1, compression: str | None = None, cast: str | None = None,
         empty: str = "skip", nan: str = "count", part: str | tuple[int, int] | None = None,
         storage_options: dict | None = None, progress: bool = True, **input_options: Any) -> Manifest:
    """Pack inputs (files of sequences, or an iterable) into tar shards and an index.json at ``dest`` (any fsspec URL).

    Args:
        inputs: a directory or file (.npy dir, .npz, parquet, csv, jsonl, text), a list of them,
            or an iterable of ``(key, array)`` / ``(key, array, meta)``. (Called ``source``
            before: ``source=`` still works, with a DeprecationWarning.)
        dest: the dataset root. A dataset already there is replaced (its index.json is removed
            first, so a crash in between leaves no dataset rather than a wrong one).
        shard_bytes: a shard is closed once it holds at least this many bytes.
        format: the input format when it cannot be detected (see ``streamwin.packing.inputs.FORMATS``).
        workers: processes that read and encode input files in parallel (output is identical).
        compression: None or "zstd" (per member, ``<key>.npy.zst``; byte ranges stay addressable).
        cast: convert every array to this dtype instead of refusing a dtype mismatch.
        empty: "skip" zero-length sequences (counted in ``manifest.dropped_empty``; the
            default) or "error" (PackError naming the first one).
        nan: "count" NaN and inf values (``manifest.nonfinite``: in all and per shard; the
            default) or "raise" (PackError naming the sequence and the step of the first one).
        part: ``"i/n"`` packs the i-th of n disjoint parts of the inputs (contiguous runs of
            their files; every n-th item of an iterable) into its own shard range and part index;
            `merge` then writes the combined index.json.
        storage_options: fsspec options for ``dest`` (credentials, endpoint_url, ...).
        progress: show a tqdm bar on stderr (bytes, MB/s, sequences, shards).
        input_options: passed to the input format's reader (e.g. ``id_column=``, ``field=``). The
            value columns a table's values came from are recorded (``manifest.value_columns``), and
            the ones left out with the reason (``manifest.left_out_columns``).

    Returns:
        The manifest written to ``dest``.
    """
    _check_sizes(shard_bytes, workers)
    options = EncodeOptions(cast=cast, compression=compression, empty=empty, nan=nan)
    part_ = parse_part(part)
    units = part_units(list_units(inputs, format=format, **input_options), part_)
    fs, root = url_to_fs(dest, storage_options)
    index_name = _unpublish(fs, root, part_)
    prefix = "shard-" if part_ is None else f"part{part_[0]:05d}-shard-"
    writer = ShardWriter(fs, root, shard_bytes=shard_bytes, prefix=prefix, compression=compression)
    borrowed = any(u.format == "iterable" for u in units)  # a generator may reuse its arrays
    manifest = _write(writer, encoded(units, options, workers), borrowed, f"pack {dest}", progress)
    write_manifest(fs, root, manifest, index_name)
    writer.remove_leftovers()
    if manifest.nonfinite.nan or manifest.nonfinite.inf:
        warnings.warn(f"streamwin: packed {manifest.nonfinite.nan:,} NaN and {manifest.nonfinite.inf:,} inf values "
                      f"into {dest} (manifest.nonfinite counts them; nan='raise' refuses them)",
                      NonFiniteWarning, stacklevel=3)  # the caller of pack, past _accepts_source
    return manifest


def _unpublish(fs, root: str, part: tuple[int, int] | None) -> str:
    """Remove the index this pack will write, so that from now on the destination reads as "not
    finished"; a part also removes index.json, which names shards the part rewrites. Returns its name."""
    fs.makedirs(root, exist_ok=True)
    index_name = INDEX_NAME if part is None else part_index_name(*part)
    remove_if_exists(fs, join(root, index_name))
    if part is not None:
        remove_if_exists(fs, join(root, INDEX_NAME))
    return index_name


def _write(writer: ShardWriter, tasks: Iterator[tuple[list[EncodedSeq | Records], int, Columns | None]],
           borrowed: bool, desc: str, progress: bool) -> Manifest:
    """Append every part to the shards and return the manifest; on any error the shard being
    written is discarded."""
    dropped, shown, columns = 0, 0, None
    bar = tqdm(desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    try:
        for parts, skipped, found in tasks:
            dropped += skipped
            columns = _same_columns(columns, found)
            for part in parts:
                bar.update(writer.add(part, borrowed=borrowed))
            if writer.count - shown >= 1000 or parts and not isinstance(parts[0], EncodedSeq):
                shown = writer.count
                # strings: tqdm would print 10000 as 1e+4
                bar.set_postfix(sequences=f"{shown:,}", shards=f"{writer.open_shards:,}", refresh=False)
        writer.close()
        return writer.manifest(dropped, columns)
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()


def _same_columns(current: Columns | None, found: Columns | None) -> Columns | None:
    """Every table file must give the same value columns; the left-out ones of all files are kept."""
    if found is None:
        return current
    if current is None:
        return found
    if found.taken != current.taken:
        raise PackError(f"{found.where} gives value columns {list(found.taken)}, but {current.where} gave "
                        f"{list(current.taken)}; pass value_columns= to take the same columns from every file")
    left_out = dict(current.left_out) | dict(found.left_out)
    return Columns(current.taken, tuple(left_out.items()), current.where)
