"""List an input's units, detect its format, and read a unit with its format's reader.

A unit is one input file (or, for an in-memory Python iterable, the iterable itself). Files
of a directory are listed recursively, sorted by relative path, hidden files and folders
(names starting with ``.``) skipped; the entries of a list keep their order, and keys are
derived from paths relative to the deepest folder that holds them all. The format comes
from the file suffixes unless ``format=`` names it; the options are checked against the
ones the format accepts (an unknown option is an error).
"""
from __future__ import annotations

import glob
import os
import posixpath
from collections.abc import Iterable, Iterator
from typing import Any

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from streamwin.arguments import did_you_mean
from streamwin.errors import PackError
from streamwin.packing.inputs.base import NUMERIC_KINDS, Batch, Columns, InputFormat, InputUnit, Item, Report
from streamwin.packing.inputs.arrow import ARROW
from streamwin.packing.inputs.csv import CSV
from streamwin.packing.inputs.frames import TABLE
from streamwin.packing.inputs.iterable import ITERABLE
from streamwin.packing.inputs.jsonl import JSONL
from streamwin.packing.inputs.npy import NPY, NPZ
from streamwin.packing.inputs.parquet import PARQUET
from streamwin.packing.inputs.text import TEXT

# every input format, in the order errors list them; a new format is a module declaring one, added here
_FORMATS = (NPY, NPZ, PARQUET, ARROW, CSV, JSONL, TEXT, ITERABLE, TABLE)
_BY_NAME = {f.name: f for f in _FORMATS}
FORMATS = tuple(_BY_NAME)
INPUT_OPTIONS = tuple(sorted({name for f in _FORMATS for name in f.options}))  # every format's options
_NAME_LISTS = ("suffixes", "value_columns", "list_column", "meta_fields", "meta_columns")  # options that take one name or a list


def format_of(unit: InputUnit) -> InputFormat:
    """The format a unit is read with."""
    return _BY_NAME[unit.format]


# ---- listing ---------------------------------------------------------------------------------

def detect_format(inputs: Any) -> str:
    """Name the format of ``inputs``: "iterable" for Python objects, else from file suffixes."""
    if _is_paths(inputs):
        return _detect(_find_files(inputs), inputs)
    if isinstance(inputs, Iterable):
        return "iterable"
    raise PackError(f"input of type {type(inputs).__name__} is not a path, URL or iterable")


def list_units(inputs: Any, *, format: str | None = None, **options: Any) -> list[InputUnit]:
    """Deterministic list of the independent work units of ``inputs`` (one per input file).

    Files of a directory are sorted by relative path; entries of a list keep their order.
    An in-memory iterable becomes a single unit that carries it (read in-process; a
    generator can be read only once).
    """
    if format is not None and format not in FORMATS:
        raise PackError(f"unknown format {format!r}; known formats: {', '.join(FORMATS)}")
    if not _is_paths(inputs):
        if format not in (None, "iterable") or not isinstance(inputs, Iterable):
            raise PackError(f"input of type {type(inputs).__name__} is not a path, URL or iterable")
        return [InputUnit("iterable", "<iterable>", "", _check_options("iterable", options), data=inputs)]
    files = _find_files(inputs)
    fmt = format or _detect(files, inputs)
    if fmt in ("iterable", "table"):
        raise PackError(f"format {fmt!r} needs a Python object, not the path {inputs!r}")
    opts = _check_options(fmt, options)
    spec = _BY_NAME[fmt]
    suffixes = dict(opts).get("suffixes") if "suffixes" in spec.options else spec.suffixes
    single = not isinstance(inputs, (list, tuple)) and not glob.has_magic(os.fspath(inputs))
    units = [InputUnit(fmt, url, rel, opts, single and named, size=size) for url, rel, named, size in files
             if named or suffixes is None or rel.lower().endswith(suffixes)]
    if not units:
        raise PackError(f"no {fmt} files in {inputs!r} (suffixes {suffixes})")
    return units


def _is_paths(inputs: Any) -> bool:
    if isinstance(inputs, (str, os.PathLike)):
        return True
    return isinstance(inputs, (list, tuple)) and bool(inputs) and all(
        isinstance(s, (str, os.PathLike)) for s in inputs)


def _find_files(inputs: Any) -> list[tuple[str, str, bool, int]]:
    """(url, path relative to the root, named directly, size in bytes) of every file of a path or a list of paths."""
    entries = [os.fspath(s) for s in inputs] if isinstance(inputs, (list, tuple)) else [os.fspath(inputs)]
    located = [fsspec.core.url_to_fs(e) for e in entries]
    fs = located[0][0]
    if any(type(other) is not type(fs) for other, _ in located):
        raise PackError(f"all paths of a list of inputs must be on one filesystem: {entries}")
    entries, located = _expand_globs(fs, entries, located)
    infos = []
    for entry, (_, path) in zip(entries, located):
        try:
            infos.append(fs.info(path))
        except FileNotFoundError:
            raise PackError(f"no such file or directory: {entry}") from None
    dirs = [info["type"] == "directory" for info in infos]
    root = posixpath.commonpath([p if d else posixpath.dirname(p) for (_, p), d in zip(located, dirs)])
    found = []
    for (_, path), is_dir, info in zip(located, dirs, infos):
        if not is_dir:
            found.append((_url(fs, path), posixpath.relpath(path, root), True, int(info.get("size") or 0)))
            continue
        inside = {p: i for p, i in fs.find(path, detail=True).items() if not any(
            part.startswith(".") for part in posixpath.relpath(p, path).split("/"))}
        found += sorted((_url(fs, p), posixpath.relpath(p, root), False, int(i.get("size") or 0))
                        for p, i in inside.items())
    return found


def _expand_globs(fs: Any, entries: list[str], located: list) -> tuple[list[str], list]:
    """Entries with glob characters (``hf://datasets/org/name/*/train-*.parquet``) replaced by the files they match."""
    out_entries, out_located = [], []
    for entry, (other, path) in zip(entries, located):
        if not glob.has_magic(path):
            out_entries.append(entry)
            out_located.append((other, path))
            continue
        matches = sorted(p for p in fs.glob(path) if not fs.isdir(p))
        if not matches:
            raise PackError(f"no file matches {entry}")
        out_entries += [entry] * len(matches)
        out_located += [(fs, p) for p in matches]
    return out_entries, out_located


def _url(fs: Any, path: str) -> str:
    return path if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(path)


def _detect(files: list[tuple[str, str, bool]], inputs: Any) -> str:
    found = {f.name for _, rel, _, _ in files for f in _FORMATS if f.suffixes and rel.lower().endswith(f.suffixes)}
    data = found - {TEXT.name}
    if len(data) == 1:
        return data.pop()
    if not data and found:
        return "text"
    raise PackError(f"cannot tell the format of {inputs!r} (found: {sorted(found) or 'no known suffix'}); "
                    f"pass format= one of {', '.join(FORMATS)}")


def check_table_options(options: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The options of an in-memory table or dataset object, checked as `list_units` checks a format's."""
    return _check_options("table", options)


def _check_options(fmt: str, options: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Refuse unknown options; return the given ones as sorted, hashable pairs."""
    spec = _BY_NAME[fmt]
    accepted = spec.options
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        hints = "".join(did_you_mean(name, accepted) for name in unknown)
        raise PackError(f"unknown option(s) {unknown} for format {fmt!r}; accepted: {list(accepted) or 'none'}{hints}")
    opts = {k: (tuple(v) if isinstance(v, list) else v) for k, v in options.items() if v is not None}
    for name in _NAME_LISTS:  # one name given as a string is one name, not a list of letters
        if isinstance(opts.get(name), str):
            opts[name] = (opts[name],)
    if "dtype" in opts:
        try:
            opts["dtype"] = np.dtype(opts["dtype"]).name
        except TypeError as e:
            raise PackError(f"{fmt} option dtype={options['dtype']!r} is not a numpy dtype") from e
        if np.dtype(opts["dtype"]).kind not in NUMERIC_KINDS:
            raise PackError(f"{fmt} option dtype={opts['dtype']!r} is not numeric")
    if spec.check is not None:
        spec.check(opts)
    return tuple(sorted(opts.items()))


# ---- reading ---------------------------------------------------------------------------------

def _ignore(columns: Columns) -> None:
    pass


def read_batches(unit: InputUnit, report: Report | None = None) -> Iterator[Batch | Item]:
    """The sequences of one unit in a deterministic order: Batches where the format allows
    (.npz, long-layout tables), else ``(key, array, meta)`` items.

    A table (parquet, csv) calls ``report`` once, before its first sequence, with the
    `Columns` its values come from.
    """
    read = _BY_NAME[unit.format].read
    try:
        yield from read(unit, dict(unit.options), report or _ignore)
    except PackError:
        raise
    except Exception as e:
        raise PackError(f"cannot read {unit.path}: {type(e).__name__}: {e}") from e


def read_unit(unit: InputUnit, report: Report | None = None) -> Iterator[Item]:
    """Yield the sequences ``(key, array, meta)`` of one unit, in a deterministic order (`read_batches`, item by item)."""
    for got in read_batches(unit, report):
        yield from got.items() if isinstance(got, Batch) else (got,)
