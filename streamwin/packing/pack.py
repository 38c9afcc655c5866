"""Pack inputs into tar shards plus an index.json manifest, written last, on this machine or a cluster.

The input is cut into units (`sources`: a file, a run of small files, a partition, a block),
each packed on its own by `unit.pack_unit` into shards named from the unit's number, which
returns its index fragment; `fragments` merges the fragments in unit order and `dest`
commits the manifest. Where the units run is the only thing ``engine`` changes: here or in
``workers`` processes (`parallel`), as Ray tasks or as Dask tasks (`engines`). The output is
byte-identical whichever runs them.

``mode="append"`` and ``"extend"`` add to the dataset at ``dest`` instead (append.py): only
the new sequences' shards, and the continuation members of the ones extended, are written.

Crash safety: a pack holds the destination's lock (`lock`) from start to commit (a part its own
lock, which gives way to a pack's), writes a new generation of shards whose names cannot
collide with the live dataset's, and commits by replacing index.json atomically
(`dest.commit`), keeping the replaced generation for its readers and removing older ones only
then. A pack that fails or is killed at any moment leaves the old dataset readable and
unchanged; the next pack removes what it left.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable

import numpy as np

from streamwin.arguments import check_keywords
from streamwin.errors import PackError
from streamwin.formats.manifest import Manifest
from streamwin.packing.dest import committed, prepare, refuse_foreign, survey
from streamwin.packing.encode import EncodeOptions
from streamwin.packing.engines import run_units
from streamwin.packing.append import GROW_MODES, append, growing_part, new_generation
from streamwin.packing.fragments import FragmentMerger
from streamwin.packing.grow import GAPS, ExistingKeys
from streamwin.packing.lock import PackLock, part_lock_name, yield_to_pack
from streamwin.packing.parts import merge, parse_part, part_generation, unpublish_part, write_part
from streamwin.packing.sources import Source, open_dest, source_of
from streamwin.packing.unit import UnitJob
from streamwin.progress import progress_bar

__all__ = ["MissingValuesWarning", "NonFiniteWarning", "merge", "pack"]


class NonFiniteWarning(UserWarning):
    """pack wrote NaN or inf values (counted in ``manifest.nonfinite``)."""


class MissingValuesWarning(UserWarning):
    """Some sequences have no value for a meta key (None, NaN, NaT, a null, an empty cell): it is no field."""


def _check_sizes(shard_bytes: int, workers: int) -> None:
    if not _is_int(shard_bytes) or shard_bytes <= 0:
        raise PackError(f"shard_bytes must be a positive integer, got {shard_bytes!r}")
    if not _is_int(workers) or workers < 1:
        raise PackError(f"workers must be an integer >= 1, got {workers!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _accepts_source(func: Callable[..., Manifest]) -> Callable[..., Manifest]:
    """``source=``, an older name of pack's first parameter, is taken as ``inputs`` with a
    DeprecationWarning (``inspect.signature`` and ``help`` show the current signature)."""
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
@check_keywords(PackError)
def pack(inputs: Any, dest: str, *, shard_bytes: int = 256 << 20, format: str | None = None,
         workers: int = 1, compression: str | None = None, cast: str | None = None,
         empty: str = "skip", nan: str = "count", part: str | tuple[int, int] | None = None,
         storage_options: dict | None = None, progress: bool = True, engine: str | None = None,
         address: str | None = None, overwrite: bool = False, create_bucket: bool = False,
         mode: str | None = None, gaps: str = "error", **input_options: Any) -> Manifest:
    """Pack inputs (files of sequences, a dataset object, or an iterable) into tar shards and an index.json at ``dest``.

    Args:
        inputs: a directory, file or fsspec URL (.npy dir, .npz, parquet, .arrow/.feather, csv,
            jsonl, text), a list of them, a dataset object (``ray.data.Dataset``,
            ``dask.dataframe.DataFrame``, ``datasets.Dataset`` / ``IterableDataset``, a pyarrow
            Table or pandas DataFrame), or an iterable of ``(key, array)`` / ``(key, array, meta)``.
            ``source=`` is an older name of it, taken with a DeprecationWarning.
        dest: the dataset root (any fsspec URL). A dataset already there is replaced atomically:
            readers see the old one until the new one is complete (unless ``mode`` appends to it).
        shard_bytes: a shard is closed once it holds at least this many bytes.
        format: the input format when it cannot be detected (see ``streamwin.packing.inputs.FORMATS``).
        workers: processes that pack units in parallel on this machine (output is identical).
        compression: None or "zstd" (per member, ``<key>.npy.zst``; byte ranges stay addressable).
        cast: convert every array to this dtype instead of refusing a dtype mismatch.
        empty: "skip" zero-length sequences (counted in ``manifest.dropped_empty``) or "error".
        nan: "count" NaN and inf values (``manifest.nonfinite``) or "raise" (naming the first).
        part: ``"i/n"`` packs the i-th of n disjoint parts of the units into a part index;
            `merge` then writes the combined index.json (byte-identical to one pack).
        storage_options: fsspec options for ``dest`` (credentials, endpoint_url, ...).
        progress: show a tqdm bar on stderr (bytes, MB/s, sequences, shards).
        engine: None (this machine), "ray" or "dask": run the units as tasks on that cluster
            (``address``, else the running one, else a local one). A Ray or Dask input uses its
            own engine. The output is byte-identical whichever engine runs it.
        overwrite: replace files at ``dest`` that are not this dataset's (else refused, named).
        create_bucket: create the object-store bucket of ``dest`` when it does not exist.
        mode: None (write the dataset, replacing one there), "append" (add sequences of new keys to the
            dataset there, writing only their shards; a key it holds is an error) or "extend" (as
            "append", and a key it holds gets the new steps as a continuation of its sequence).
            Either commits one manifest for old and new, atomically; see docs/packing.md.
        gaps: "error" (an extension whose ``start`` is not where its sequence's steps end, or whose
            ``freq`` differs, is refused, naming the key and both times) or "allow".
        input_options: passed to the input format's reader (e.g. ``id_column=``, ``field=``,
            ``variates_first=``). The value columns are recorded (``manifest.value_columns``).

    Returns:
        The manifest written to ``dest``.
    """
    _check_sizes(shard_bytes, workers)
    if mode not in (None, *GROW_MODES):
        raise PackError(f"mode must be None, 'append' or 'extend', got {mode!r}")
    if gaps not in GAPS:
        raise PackError(f"gaps must be 'error' or 'allow', got {gaps!r}")
    options = EncodeOptions(cast=cast, compression=compression, empty=empty, nan=nan)
    part_ = parse_part(part)
    source = source_of(inputs, format, input_options, engine, part_, shard_bytes)
    fs, root = open_dest(dest, storage_options, create_bucket)
    prepare(fs, root)
    run = functools.partial(_pack_units, source, dest, storage_options, shard_bytes, options, workers, address,
                            progress)
    if part_ is not None:
        manifest, written = _pack_part(fs, root, dest, part_, run, overwrite, mode, gaps, storage_options)
    elif mode is not None:
        manifest, written = append(fs, root, dest, storage_options, run, mode=mode, gaps=gaps, overwrite=overwrite)
    else:
        with new_generation(fs, root, dest, overwrite) as (lock, start, gen):
            manifest = committed(fs, root, dest, lambda: run(gen), gen, start, lock, overwrite)
    nan, inf = (sum(m.nonfinite.nan for m in written), sum(m.nonfinite.inf for m in written)) if mode is not None \
        else (manifest.nonfinite.nan, manifest.nonfinite.inf)
    if nan or inf:
        warnings.warn(f"streamwin: packed {nan:,} NaN and {inf:,} inf values into {dest} (manifest.nonfinite counts "
                      "them; nan='raise' refuses them)", NonFiniteWarning, stacklevel=3)  # the caller of pack
    if manifest.fields is not None and manifest.fields.missing:
        warnings.warn(missing_values(manifest), MissingValuesWarning, stacklevel=4)  # the caller of pack
    return manifest


def missing_values(manifest: Manifest) -> str:
    """What pack's MissingValuesWarning says: per field, the sequences without a value and the first of them."""
    n, missing = manifest.num_sequences, manifest.fields.missing
    each = "; ".join(f"{name!r} in {count:,} of {n:,} (the first {key!r})" for name, (count, key) in missing.items())
    return (f"streamwin: left out {len(missing)} field(s) that some sequences have no value for (None, NaN, NaT, a "
            f"null, an empty CSV cell, or no such key): {each}. A field is stored only when every sequence has a "
            "value; give those sequences one to keep it")


def _pack_part(fs, root: str, dest: str, part: tuple[int, int], run: Callable[..., Manifest], overwrite: bool,
               mode: str | None, gaps: str, storage_options: dict | None) -> tuple[Manifest, list[Manifest]]:
    """Pack part i of n under its part lock, beside the other parts of its job and never beside a pack (which it
    gives way to), into their generation; then publish its part index (of an append: with what it grows).
    (the part's index, the indexes of what it wrote)."""
    i, n = part
    with PackLock(fs, root, dest, what=f"pack --part {i}/{n}", name=part_lock_name(i, n)) as lock:
        dead = yield_to_pack(fs, root, dest, lock)
        start = survey(fs, root)
        refuse_foreign(start, dest, overwrite)
        gen = part_generation(fs, root, dest, start, part, dead)
        lock.set_generation(gen)
        unpublish_part(fs, root, part)
        try:
            grows = conts = None
            if mode is None:
                manifest = run(gen)
            else:
                (manifest, conts), grows = growing_part(dest, storage_options, run, gen, mode, gaps, start)
            lock.check()
        except BaseException as e:
            if isinstance(e, Exception) and not isinstance(e, PackError) and not lock.holds():
                lock.check()  # say that it lost its lock, not the symptom
            raise
        write_part(fs, root, manifest, part, grows=grows, continued=conts)
    return manifest or conts, [m for m in (manifest, conts) if m is not None]


def _pack_units(source: Source, dest: str, storage_options: dict | None, shard_bytes: int, options: EncodeOptions,
                workers: int, address: str | None, progress: bool, gen: int, extend: ExistingKeys | None = None,
                growing: bool = False) -> Manifest | tuple[Manifest | None, Manifest | None]:
    """Pack every unit of ``source`` as generation ``gen`` and merge their fragments (in unit order). ``growing``
    (an append): (the new sequences' index, the continuation members' index), each None when none was written."""
    jobs = ((UnitJob(number, task, dest, storage_options, gen, shard_bytes, options, extend), data)
            for number, task, data in source.units())
    merger, continued = FragmentMerger(), FragmentMerger()
    bar = progress_bar(desc=f"pack {dest}", unit="B", unit_scale=True, unit_divisor=1024, disable=not progress)
    counts = [0, 0]  # sequences, units

    def moved(nbytes: int, sequences: int) -> None:
        bar.update(nbytes)
        counts[0] += sequences
        # strings: tqdm would print 10000 as 1e+4
        bar.set_postfix(sequences=f"{counts[0]:,}", units=f"{counts[1]:,}", refresh=False)

    try:
        with contextlib.closing(run_units(source.engine, jobs, workers, address, moved)) as fragments:
            for fragment in fragments:  # closed on any error: the engine's tasks in flight end first
                counts[1] += 1
                merger.add_fragment(fragment)
                if fragment.continued is not None:
                    continued.add(fragment.continuations, 0, None, fragment.where)
        return (merger.result(), continued.result()) if growing else merger.finish()
    except BaseException:
        merger.discard()
        continued.discard()
        raise
    finally:
        bar.close()

