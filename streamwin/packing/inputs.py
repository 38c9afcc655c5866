"""Sources: turn what the user has into a deterministic stream of sequences ``(key, array, meta)``.

The packer needs two things from a source: a list of independent *units* of work that it
can hand to worker processes, and a way to read one unit. So a source is read in two steps::

    units = list_units("data/ecg/")              # format detected from the file suffixes
    for unit in units:                           # sorted by relative path; picklable
        for key, array, meta in read_unit(unit): # deterministic order inside the unit
            ...

A unit is one input file (or, for an in-memory Python iterable, the iterable itself, read
in-process). ``source`` is a local path (file or directory), a list of paths, an fsspec URL
(``s3://bucket/dir``, ``memory://x``), or an iterable of ``(key, array)`` / ``(key, array,
meta)`` tuples. Directories are walked recursively; hidden files and folders (names starting
with ``.``) are skipped. Keys are derived from paths relative to the source root (for a list,
the deepest folder that holds all its entries), so ``data/a/b.npy`` read from ``data/`` is
``a__b``.

Formats, and the options each accepts (an unknown option is an error):

- ``npy``      one sequence per ``.npy`` file; key from the relative path.
- ``npz``      every array of an ``.npz`` is a sequence; key ``<relpath>__<array name>``, or
               the bare array name when the source is that one file.
- ``parquet``  ``id_column``, ``order_column``, ``value_columns``, ``squeeze``, ``list_column``.
               Long layout (one row per time step): rows grouped by ``id_column``, sorted by
               ``order_column`` (else file order), ``value_columns`` (default: every numeric
               column but the id, the order and a pandas index: ``__index_level_0__``,
               ``Unnamed: 0``, an unnamed column, the index named in parquet's pandas
               metadata) stacked to [T, F] ([T] for one column when ``squeeze``).
               A sequence must lie within one file. Row layout (one row per sequence): chosen
               when ``list_column`` is given or value columns are list-typed; each row's list
               (or list of lists -> [T, F]) is a sequence, keyed by ``id_column`` or
               ``<file>_<row>`` (row counted from 0). Either way the reader reports the
               `Columns` it took (one name per feature) and the ones it left out, and why.
- ``csv``      the long layout of parquet (``id_column`` required); pyarrow.csv if installed,
               else the stdlib csv module.
- ``jsonl``    ``field`` (default "tokens"), ``key_field`` (default "id" when the object has
               one, else ``<file>_<line>``, line counted from 1), ``dtype`` (default int32 for
               integers, float32 otherwise), ``meta_fields`` (default: every other JSON scalar).
               ``.jsonl.gz`` is decompressed.
- ``text``     ``suffixes`` (default: every file). Each file is one uint8 sequence of its bytes;
               the key keeps the suffix (``src/x.c`` -> ``src__x_c``) so that ``x.c`` and
               ``x.h`` stay apart. Empty files give zero-length arrays.
- ``iterable`` no options; keys are checked as given, arrays go through ``np.asarray``.

Options that name columns, fields or suffixes take one name (a string) or a list of names.

For speed, ``read_batches(unit)`` yields the same sequences, but many at a time where the
format allows: a `Batch` holds the arrays of many sequences end to end in one array (an
``.npz`` of stored members, a long-layout table), so the packer encodes them without a Python
object per sequence. Anything a batch reader cannot take in one piece (compressed ``.npz``
members, big-endian or Fortran-ordered arrays, mixed dtypes in one run) falls back to the
sequence-by-sequence reader, so errors read the same either way.

Ids and array names become keys with their dots replaced, never cut as extensions. Keys are
not checked for duplicates here: that needs the whole stream, which only the packer sees.
Everything unreadable or malformed raises PackError naming the file (and line, row, array or
column), raised from the original exception. Arrays must be numeric: object, string and
structured arrays are refused, and nothing is ever unpickled.
"""
from __future__ import annotations

import csv
import functools
import importlib
import io
import json
import os
import posixpath
import re
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from streamwin.errors import PackError
from streamwin.formats import npy as npyfmt
from streamwin.formats.keys import check_key, key_from_name

Item = tuple[str, np.ndarray, dict | None]
FORMATS = ("npy", "npz", "parquet", "csv", "jsonl", "text", "iterable")

_LONG = ("id_column", "order_column", "value_columns", "squeeze")
_OPTIONS: dict[str, tuple[str, ...]] = {
    "npy": (), "npz": (), "parquet": (*_LONG, "list_column"), "csv": _LONG,
    "jsonl": ("field", "key_field", "dtype", "meta_fields"), "text": ("suffixes",), "iterable": (),
}
SOURCE_OPTIONS = tuple(sorted({name for names in _OPTIONS.values() for name in names}))  # every format's options
_SUFFIXES = {
    "npy": (".npy",), "npz": (".npz",), "parquet": (".parquet", ".pq"), "csv": (".csv", ".csv.gz"),
    "jsonl": (".jsonl", ".jsonl.gz", ".ndjson"), "text": (".txt",),
}
_NUMERIC_KINDS = "biufc"  # bool, signed, unsigned, float, complex
_NAME_LISTS = ("suffixes", "value_columns", "list_column", "meta_fields")  # options that take one name or a list


@dataclass(frozen=True)
class Unit:
    """One independent piece of a source, cheap to pickle and send to a worker.

    Args:
        format: one of FORMATS.
        path: what fsspec opens: a local path or a URL ("<iterable>" for iterables).
        name: the path relative to the source root; keys are derived from it.
        options: the format's options, sorted (key, value) pairs with lists made tuples.
        single: the source named this one file (npz keys are then the bare array names).
        data: the Python iterable of an "iterable" unit, else None.
    """

    format: str
    path: str
    name: str
    options: tuple[tuple[str, Any], ...] = ()
    single: bool = False
    data: Any = field(default=None, compare=False, repr=False)


# ---- listing ---------------------------------------------------------------------------------

def detect_format(source: Any) -> str:
    """Name the format of ``source``: "iterable" for Python objects, else from file suffixes."""
    if _is_paths(source):
        return _detect(_find_files(source), source)
    if isinstance(source, Iterable):
        return "iterable"
    raise PackError(f"source of type {type(source).__name__} is not a path, URL or iterable")


def list_units(source: Any, *, format: str | None = None, **options: Any) -> list[Unit]:
    """Deterministic list of the independent work units of ``source`` (one per input file).

    Files of a directory are sorted by relative path; entries of a list keep their order.
    An in-memory iterable becomes a single unit that carries it (read in-process; a
    generator can be read only once).
    """
    if format is not None and format not in FORMATS:
        raise PackError(f"unknown format {format!r}; known formats: {', '.join(FORMATS)}")
    if not _is_paths(source):
        if format not in (None, "iterable") or not isinstance(source, Iterable):
            raise PackError(f"source of type {type(source).__name__} is not a path, URL or iterable")
        return [Unit("iterable", "<iterable>", "", _check_options("iterable", options), data=source)]
    files = _find_files(source)
    fmt = format or _detect(files, source)
    if fmt == "iterable":
        raise PackError(f"format 'iterable' needs a Python iterable, not the path {source!r}")
    opts = _check_options(fmt, options)
    suffixes = dict(opts).get("suffixes") if fmt == "text" else _SUFFIXES[fmt]
    single = not isinstance(source, (list, tuple))
    units = [Unit(fmt, url, rel, opts, single and named) for url, rel, named in files
             if named or suffixes is None or rel.lower().endswith(suffixes)]
    if not units:
        raise PackError(f"no {fmt} files in {source!r} (suffixes {suffixes})")
    return units


def _is_paths(source: Any) -> bool:
    if isinstance(source, (str, os.PathLike)):
        return True
    return isinstance(source, (list, tuple)) and bool(source) and all(
        isinstance(s, (str, os.PathLike)) for s in source)


def _find_files(source: Any) -> list[tuple[str, str, bool]]:
    """(url, path relative to the root, named directly) of every file of a path source."""
    entries = [os.fspath(s) for s in source] if isinstance(source, (list, tuple)) else [os.fspath(source)]
    located = [fsspec.core.url_to_fs(e) for e in entries]
    fs = located[0][0]
    if any(type(other) is not type(fs) for other, _ in located):
        raise PackError(f"all paths of a list source must be on one filesystem: {entries}")
    dirs = []
    for entry, (_, path) in zip(entries, located):
        if not fs.exists(path):
            raise PackError(f"no such file or directory: {entry}")
        dirs.append(fs.isdir(path))
    root = posixpath.commonpath([p if d else posixpath.dirname(p) for (_, p), d in zip(located, dirs)])
    found = []
    for (_, path), is_dir in zip(located, dirs):
        if not is_dir:
            found.append((_url(fs, path), posixpath.relpath(path, root), True))
            continue
        inside = [p for p in fs.find(path) if not any(
            part.startswith(".") for part in posixpath.relpath(p, path).split("/"))]
        found += sorted((_url(fs, p), posixpath.relpath(p, root), False) for p in inside)
    return found


def _url(fs: Any, path: str) -> str:
    return path if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(path)


def _detect(files: list[tuple[str, str, bool]], source: Any) -> str:
    found = {fmt for _, rel, _ in files for fmt, suffixes in _SUFFIXES.items() if rel.lower().endswith(suffixes)}
    data = found - {"text"}
    if len(data) == 1:
        return data.pop()
    if not data and found:
        return "text"
    raise PackError(f"cannot tell the format of {source!r} (found: {sorted(found) or 'no known suffix'}); "
                    f"pass format= one of {', '.join(FORMATS)}")


def _check_options(fmt: str, options: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Refuse unknown options; return the given ones as sorted, hashable pairs."""
    accepted = _OPTIONS[fmt]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise PackError(f"unknown option(s) {unknown} for format {fmt!r}; accepted: {list(accepted) or 'none'}")
    opts = {k: (tuple(v) if isinstance(v, list) else v) for k, v in options.items() if v is not None}
    for name in _NAME_LISTS:  # one name given as a string is one name, not a list of letters
        if isinstance(opts.get(name), str):
            opts[name] = (opts[name],)
    if "dtype" in opts:
        try:
            opts["dtype"] = np.dtype(opts["dtype"]).name
        except TypeError as e:
            raise PackError(f"jsonl option dtype={options['dtype']!r} is not a numpy dtype") from e
        if np.dtype(opts["dtype"]).kind not in _NUMERIC_KINDS:
            raise PackError(f"jsonl option dtype={opts['dtype']!r} is not numeric")
    if fmt == "csv" and "id_column" not in opts:
        raise PackError("csv sources are long format: pass id_column= (the column naming each sequence)")
    return tuple(sorted(opts.items()))


# ---- reading ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Columns:
    """The columns of a table that became the values of its sequences (one per feature, in
    order), and each column left out with the reason, as ``(name, why)`` pairs."""

    taken: tuple[str, ...]
    left_out: tuple[tuple[str, str], ...]
    where: str


Report = Callable[[Columns], None]
_PANDAS_INDEX = re.compile(r"__index_level_\d+__|Unnamed: \d+|")  # what pandas writes for its index; "" too


def _ignore(columns: Columns) -> None:
    pass


def _choose_columns(kinds: dict[str, str], opts: dict, where: str, index_columns: Iterable[str] = ()) -> Columns:
    """Which columns hold the values: ``value_columns`` when given, else every numeric column
    (numpy dtype ``kinds``) but the id and order columns and a pandas index."""
    id_col, order_col, chosen = opts.get("id_column"), opts.get("order_column"), opts.get("value_columns")
    index = set(index_columns)
    left_out = []
    for name, kind in kinds.items():
        if chosen is not None and name in chosen:
            continue
        why = ("id column" if name == id_col else "order column" if name == order_col
               else "not in value_columns" if chosen is not None
               else "pandas index" if name in index or _PANDAS_INDEX.fullmatch(name)
               else "not numeric" if kind not in _NUMERIC_KINDS else None)
        if why is not None:
            left_out.append((name, why))
    out = {name for name, _ in left_out}
    taken = tuple(chosen) if chosen is not None else tuple(n for n in kinds if n not in out)
    return Columns(taken, tuple(left_out), where)


@dataclass(frozen=True, eq=False)
class Batch:
    """Many sequences of one dtype and step shape, end to end: sequence i is
    ``values[bounds[i]:bounds[i + 1]]`` and is keyed ``keys[i]`` (keys already valid)."""

    keys: list[str]
    values: np.ndarray
    bounds: np.ndarray

    def __len__(self) -> int:
        return len(self.keys)

    def items(self) -> Iterator[Item]:
        """The batch as ``(key, array, None)`` items, as `read_unit` yields them."""
        ends = self.bounds.tolist()
        for key, a, b in zip(self.keys, ends, ends[1:]):
            yield key, self.values[a:b], None


def read_batches(unit: Unit, report: Report | None = None) -> Iterator[Batch | Item]:
    """The sequences of one unit in a deterministic order: Batches where the format allows
    (.npz, long-layout tables), else ``(key, array, meta)`` items.

    A table (parquet, csv) calls ``report`` once, before its first sequence, with the
    `Columns` its values come from.
    """
    reader = _READERS[unit.format]
    try:
        yield from reader(unit, dict(unit.options), report or _ignore)
    except PackError:
        raise
    except Exception as e:
        raise PackError(f"cannot read {unit.path}: {type(e).__name__}: {e}") from e


def read_unit(unit: Unit, report: Report | None = None) -> Iterator[Item]:
    """Yield the sequences ``(key, array, meta)`` of one unit, in a deterministic order (`read_batches`, item by item)."""
    for got in read_batches(unit, report):
        yield from got.items() if isinstance(got, Batch) else (got,)


def _open(unit: Unit, mode: str = "rb") -> Any:
    encoding = "utf-8" if "t" in mode else None
    return fsspec.open(unit.path, mode, compression="infer", encoding=encoding)


_PLAIN_KEY = re.compile(r"[!-\-0-\[\]-~]{1,90}")  # already a valid key: printable ASCII but . / \\


def _text_key(text: str) -> str:
    """A key from free text (an id, an array name): dots are replaced, never cut as an extension."""
    if _PLAIN_KEY.fullmatch(text):  # most ids and names: nothing to replace (~10x faster)
        return text
    return key_from_name(text + ".")  # key_from_name strips only the last suffix, here the empty one


def _file_key(unit: Unit) -> str:
    """The key part of a file name: ``dir/b.jsonl.gz`` -> ``dir__b``."""
    name = unit.name[:-3] if unit.name.endswith(".gz") else unit.name
    return key_from_name(name)


def _check_array(arr: Any, where: str) -> np.ndarray:
    if not isinstance(arr, np.ndarray):
        raise PackError(f"{where}: expected a numpy array, got {type(arr).__name__}")
    if arr.dtype.kind not in _NUMERIC_KINDS:
        raise PackError(f"{where}: dtype {arr.dtype} is not numeric (object, string and structured "
                        "arrays are refused)")
    if arr.ndim == 0:
        raise PackError(f"{where}: a sequence needs shape [T] or [T, F, ...], got a scalar")
    return arr


def _read_npy(unit: Unit, opts: dict, report: Report) -> Iterator[Item]:
    if "://" not in unit.path and os.path.isfile(unit.path):  # local: read the file in one go
        with open(unit.path, "rb") as f:
            data = f.read()
    else:
        with _open(unit) as f:
            data = f.read()
    arr = _plain_npy_array(data)
    if arr is None:  # anything but a plain little-endian C-order array: numpy's reader and errors
        arr = np.load(io.BytesIO(data), allow_pickle=False)
    yield key_from_name(unit.name), _check_array(arr, unit.path), None


def _plain_npy_array(data: bytes) -> np.ndarray | None:
    """The array of .npy bytes whose v1 header `_plain_npy` takes (headers repeat: they are parsed
    once each), read-only over ``data``; None for any other."""
    if len(data) < 10 or data[6] != 1:
        return None
    hlen = 10 + int.from_bytes(data[8:10], "little")
    parsed = _plain_npy_cached(data[:hlen])
    if parsed is None or len(data) != hlen + parsed[2]:
        return None
    dtype, shape, _ = parsed
    return np.frombuffer(data, dtype=dtype, offset=hlen).reshape(shape)


def _read_npz(unit: Unit, opts: dict, report: Report) -> Iterator[Item]:
    prefix = "" if unit.single else posixpath.splitext(unit.name)[0] + "__"
    with _open(unit) as f:
        npz = np.load(f, allow_pickle=False)
        if not isinstance(npz, np.lib.npyio.NpzFile):
            raise PackError(f"{unit.path}: not an .npz archive")
        with npz:
            for name in npz.files:  # archive order, which is the order they were saved in
                where = f"{unit.path}, array {name!r}"
                try:
                    arr = npz[name]
                except Exception as e:
                    raise PackError(f"{where}: {type(e).__name__}: {e}") from e
                yield _text_key(prefix + name), _check_array(arr, where), None


NPZ_READ_WHOLE = 256 << 20  # .npz archives up to this size are read whole and batched


def _npz_batches(unit: Unit, opts: dict, report: Report) -> Iterator[Batch | Item]:
    """An .npz whose members are stored (np.savez) as plain little-endian C-order arrays, read as
    runs of one dtype and step shape without a zipfile read per member; else `_read_npz`."""
    with _open(unit) as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(0)
        data = f.read() if size <= NPZ_READ_WHOLE else b""
    runs = _stored_npz_runs(data) if data else None
    if runs is None:  # numpy's reader: member by member, so a huge archive is never held whole
        yield from _read_npz(unit, opts, report)
        return
    prefix = "" if unit.single else posixpath.splitext(unit.name)[0] + "__"
    buf = memoryview(data)
    for dtype, step, names, starts, nbytes, bounds in runs:
        values = np.frombuffer(b"".join([buf[a : a + n] for a, n in zip(starts, nbytes)]), dtype=dtype)
        keys = [_text_key(prefix + name) for name in names]
        yield Batch(keys, values.reshape((-1,) + step), np.asarray(bounds, dtype=np.int64))


def _stored_npz_runs(data: bytes) -> list[tuple] | None:
    """(dtype, step shape, names, data starts, data bytes, step bounds) per run of members with one
    dtype and step shape; None when any member needs the general reader (compressed,
    encrypted, not a plain .npy, a bad CRC, a header this fast path does not take)."""
    found = _zip_members(data)
    if found is None or not found[0]:
        return None
    names, (flags, method, crc, size, csize, local) = found[0], found[1].T
    if (len(set(names)) != len(names) or (method != zipfile.ZIP_STORED).any() or (flags & 1).any()
            or (size != csize).any() or not all(name.endswith(".npy") for name in names)):
        return None
    raw = np.frombuffer(data, dtype=np.uint8)
    if local.max() + 30 > len(raw) or (raw[local] != 0x50).any() or (raw[local + 1] != 0x4B).any():
        return None
    at = local + 30 + _u16(raw, local + 26) + _u16(raw, local + 28)  # each member's data: its .npy bytes
    if (at + size > len(raw)).any() or (size < 10).any() or (raw[at + 6] != 1).any():
        return None  # truncated, or not a version 1.0 .npy header
    hlen = 10 + _u16(raw, at + 8)
    view = memoryview(data)
    if [zlib.crc32(view[a : a + n]) for a, n in zip(at.tolist(), size.tolist())] != crc.tolist():
        return None
    parsed = _headers(raw, at, hlen)
    if parsed is None:
        return None
    kind, steps, nbytes, kinds = parsed
    if (hlen + nbytes != size).any():
        return None
    cuts = [0, *(np.flatnonzero(kind[1:] != kind[:-1]) + 1).tolist(), len(names)]
    runs = []
    for a, b in zip(cuts, cuts[1:]):
        bounds = np.zeros(b - a + 1, dtype=np.int64)
        np.cumsum(steps[a:b], out=bounds[1:])
        runs.append((*kinds[int(kind[a])], [n[:-4] for n in names[a:b]], (at + hlen)[a:b].tolist(),
                     nbytes[a:b].tolist(), bounds))
    return runs


def _u16(raw: np.ndarray, at: np.ndarray) -> np.ndarray:
    return raw[at].astype(np.int64) | raw[at + 1].astype(np.int64) << 8


def _headers(raw: np.ndarray, at: np.ndarray, hlen: np.ndarray, chunk: int = 1 << 14) -> tuple | None:
    """Per member: (kind, steps, data bytes) of its .npy header at ``raw[at:at + hlen]``, and the
    kinds as (dtype, step shape); each distinct header is parsed once. None if one is not plain.
    Members are grouped by header with numpy, ``chunk`` at a time (a [chunk, header] matrix)."""
    seen: dict[bytes, int] = {}  # header -> its number
    parsed: list[tuple] = []
    ids = np.empty(len(at), dtype=np.int64)
    for c in range(0, len(at), chunk):
        a, h = at[c : c + chunk], hlen[c : c + chunk]
        width = int(h.max())
        cols = np.arange(width)
        rows = np.where(cols < h[:, None], raw[np.minimum(a[:, None] + cols, len(raw) - 1)], 0).astype(np.uint8)
        first, inverse = np.unique(np.ascontiguousarray(rows).view(f"V{width}").ravel(), return_index=True,
                                   return_inverse=True)[1:]
        local = []
        for i in first.tolist():
            head = bytes(rows[i, : h[i]])
            if head not in seen:
                seen[head] = len(parsed)
                parsed.append(_plain_npy_cached(head))
                if parsed[-1] is None:
                    return None
            local.append(seen[head])
        ids[c : c + chunk] = np.array(local, dtype=np.int64)[inverse.ravel()]
    kinds = list(dict.fromkeys((dtype, shape[1:]) for dtype, shape, _ in parsed))
    kind = np.array([kinds.index((dtype, shape[1:])) for dtype, shape, _ in parsed])[ids]
    steps = np.array([shape[0] for _, shape, _ in parsed], dtype=np.int64)[ids]
    return kind, steps, np.array([n for _, _, n in parsed], dtype=np.int64)[ids], kinds


_EOCD = struct.Struct("<4s4H2LH")  # end of central directory record
_CDIR = struct.Struct("<4s4xHH4xLLLHHH8xL")  # central directory file header, the fields read here


def _zip_members(data: bytes) -> tuple[list[str], np.ndarray] | None:
    """(member names, [n, 6] int64: flags, method, crc32, size, compressed size, local header
    offset) of a zip archive, from its central directory; zip64 through zipfile; None if not a zip."""
    end = data.rfind(b"PK\x05\x06", max(0, len(data) - (1 << 16) - _EOCD.size))
    if end < 0 or end + _EOCD.size > len(data):
        return None
    _, _, _, _, count, _, start, _ = _EOCD.unpack_from(data, end)
    if count == 0xFFFF or start == 0xFFFFFFFF or data[end - 20 : end - 16] == b"PK\x06\x07":
        return _zipfile_members(data)
    return _directory(data, start, end, count) or _directory_entries(data, start, count)


def _directory(data: bytes, start: int, end: int, count: int) -> tuple[list[str], np.ndarray] | None:
    """`_zip_members` with numpy: every "PK\\1\\2" in the directory, kept if they chain from its
    start to its end entry by entry (a name could hold those bytes too: then None)."""
    raw = np.frombuffer(data, dtype=np.uint8)[start:end]
    if len(raw) < _CDIR.size:
        return None
    sig = np.flatnonzero((raw[:-3] == 0x50) & (raw[1:-2] == 0x4B) & (raw[2:-1] == 1) & (raw[3:] == 2))
    sig = sig[sig + _CDIR.size <= len(raw)]
    lens = [_u16(raw, sig + k) for k in (28, 30, 32)]
    after = sig + _CDIR.size + lens[0] + lens[1] + lens[2]
    if len(sig) != count or not count or sig[0] != 0 or (after[:-1] != sig[1:]).any() or after[-1] != len(raw):
        return None
    u32 = lambda k: _u16(raw, sig + k) | _u16(raw, sig + k + 2) << 16  # noqa: E731
    cols = np.stack([_u16(raw, sig + 8), _u16(raw, sig + 10), u32(16), u32(24), u32(20), u32(42)], axis=1)
    if (cols[:, 3:] == 0xFFFFFFFF).any():
        return None
    names = [data[start + a : start + a + n].decode("utf-8" if f & 0x800 else "cp437")
             for a, n, f in zip((sig + _CDIR.size).tolist(), lens[0].tolist(), cols[:, 0].tolist())]
    return names, cols


def _directory_entries(data: bytes, start: int, count: int) -> tuple[list[str], np.ndarray] | None:
    """`_zip_members` entry by entry."""
    names, rows, at = [], [], start
    for _ in range(count):
        if at + _CDIR.size > len(data):
            return None
        sig, flags, method, crc, csize, size, nlen, elen, clen, local = _CDIR.unpack_from(data, at)
        if sig != b"PK\x01\x02" or 0xFFFFFFFF in (csize, size, local):
            return _zipfile_members(data)
        names.append(data[at + _CDIR.size : at + _CDIR.size + nlen].decode("utf-8" if flags & 0x800 else "cp437"))
        rows.append((flags, method, crc, size, csize, local))
        at += _CDIR.size + nlen + elen + clen
    return names, np.array(rows, dtype=np.int64).reshape(-1, 6)


def _zipfile_members(data: bytes) -> tuple[list[str], np.ndarray] | None:
    try:
        infos = zipfile.ZipFile(io.BytesIO(data)).infolist()
    except zipfile.BadZipFile:
        return None
    rows = [(i.flag_bits, i.compress_type, i.CRC, i.file_size, i.compress_size, i.header_offset) for i in infos]
    return [i.filename for i in infos], np.array(rows, dtype=np.int64).reshape(-1, 6)


@functools.lru_cache(maxsize=4096)
def _plain_npy_cached(head: bytes) -> tuple | None:
    return _plain_npy(head)


def _plain_npy(head: bytes) -> tuple | None:
    """(dtype, shape, data bytes) of a v1 .npy header of a plain numeric little-endian array of
    at least one dimension in C order (`npyfmt.parse_npy_header` refuses the others); None for any other."""
    try:
        dtype, shape, _ = npyfmt.parse_npy_header(head)
    except ValueError:
        return None
    if not shape:
        return None
    return dtype, shape, dtype.itemsize * int(np.prod(shape, dtype=np.int64))


def _read_text(unit: Unit, opts: dict, report: Report) -> Iterator[Item]:
    with _open(unit) as f:
        data = f.read()
    yield _text_key(unit.name), np.frombuffer(data, dtype=np.uint8), None


def _read_iterable(unit: Unit, opts: dict, report: Report) -> Iterator[Item]:
    for i, item in enumerate(unit.data):
        where = f"iterable item {i}"
        if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
            raise PackError(f"{where}: expected (key, array) or (key, array, meta), got {type(item).__name__}")
        try:
            key = check_key(item[0])
        except PackError as e:
            raise PackError(f"{where}: {e}") from e
        meta = item[2] if len(item) == 3 else None
        if meta is not None and not isinstance(meta, dict):
            raise PackError(f"{where} (key {key!r}): meta must be a dict or None, got {type(meta).__name__}")
        try:
            arr = np.asarray(item[1])
        except Exception as e:
            raise PackError(f"{where} (key {key!r}): cannot make an array: {e}") from e
        yield key, _check_array(arr, f"{where} (key {key!r})"), meta


# ---- jsonl -----------------------------------------------------------------------------------

def _read_jsonl(unit: Unit, opts: dict, report: Report) -> Iterator[Item]:
    field_name = opts.get("field", "tokens")
    with _open(unit, "rt") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{unit.path}, line {lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise PackError(f"{where}: invalid JSON: {e}") from e
            if not isinstance(obj, dict) or field_name not in obj:
                raise PackError(f"{where}: expected a JSON object with field {field_name!r}")
            key_field = opts.get("key_field", "id" if "id" in obj else None)
            if key_field is None:
                key = _text_key(f"{_file_key(unit)}_{lineno}")
            elif key_field in obj:
                key = _text_key(str(obj[key_field]))
            else:
                raise PackError(f"{where}: no key field {key_field!r}")
            arr = _json_array(obj[field_name], opts.get("dtype"), f"{where}, field {field_name!r}")
            yield key, arr, _json_meta(obj, {field_name, key_field}, opts.get("meta_fields"))


def _json_array(value: Any, dtype: str | None, where: str) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except ValueError as e:  # ragged lists
        raise PackError(f"{where}: {e}") from e
    if arr.size and arr.dtype.kind not in "iuf":
        raise PackError(f"{where}: expected a list of numbers, got dtype {arr.dtype}")
    floats = arr.size and arr.dtype.kind == "f"  # an empty list counts as integers
    target = np.dtype(dtype or (np.float32 if floats else np.int32))
    out = _check_array(arr, where).astype(target)
    if target.kind in "iu" and not np.array_equal(out, arr):
        raise PackError(f"{where}: values do not fit {target} exactly; pass a wider dtype= (e.g. 'int64')")
    return out


def _json_meta(obj: dict, used: set, meta_fields: tuple | None) -> dict | None:
    if meta_fields is not None:
        meta = {k: obj[k] for k in meta_fields if k in obj}
    else:
        scalar = (str, int, float, bool, type(None))
        meta = {k: v for k, v in obj.items() if k not in used and isinstance(v, scalar)}
    return meta or None


# ---- tables: long layout (parquet, csv) and row layout (parquet) --------------------------------

def _read_csv(unit: Unit, opts: dict, report: Report) -> Iterator[Item]:
    with _open(unit) as f:
        try:
            pacsv = importlib.import_module("pyarrow.csv")
        except ImportError:
            columns = _csv_columns_stdlib(f, unit.path)
        else:
            table = pacsv.read_csv(_arrow_owned(f.read()))
            columns = {c: table.column(c).to_numpy() for c in table.column_names}
    yield _long_sequences(columns, opts, unit.path, report)


def _arrow_owned(data: bytes) -> Any:
    """A reader over a copy of ``data`` in memory pyarrow allocated. pyarrow's threaded readers
    (csv, parquet) release their input on one of their own threads after the read returns; if
    that input is a Python object (a file, bytes) and the interpreter is exiting by then, the
    process aborts ("terminate called without an active exception")."""
    import pyarrow as pa

    buf = pa.allocate_buffer(len(data))
    memoryview(buf).cast("B")[:] = data
    return pa.BufferReader(buf)


def _csv_columns_stdlib(f: Any, where: str) -> dict[str, np.ndarray]:
    """Columns of a CSV file, each int64 or float64 when all its cells parse (empty -> NaN), else str."""
    reader = csv.reader(io.TextIOWrapper(f, encoding="utf-8", newline=""))
    header = next(reader, [])
    rows = []
    for lineno, row in enumerate(reader, 2):
        if len(row) != len(header):
            raise PackError(f"{where}, line {lineno}: {len(row)} fields, the header has {len(header)}")
        rows.append(row)
    columns = {}
    for name, cells in zip(header, zip(*rows) if rows else [()] * len(header)):
        text = np.asarray(cells, dtype=str)
        columns[name] = text
        for dtype, cells_as in ((np.int64, text), (np.float64, np.where(text == "", "nan", text))):
            try:
                columns[name] = cells_as.astype(dtype)
                break
            except ValueError:
                continue
    return columns


def _long_sequences(columns: dict[str, np.ndarray], opts: dict, where: str, report: Report,
                    index_columns: Iterable[str] = ()) -> Batch:
    """One sequence per id: its rows, sorted by the order column (stable: file order on ties);
    ids in order of first appearance in the file."""
    id_col, order_col = opts.get("id_column"), opts.get("order_column")
    if id_col is None:
        raise PackError(f"{where}: long layout needs id_column= (or list columns for one row per sequence)")
    for name in filter(None, (id_col, order_col)):
        if name not in columns:
            raise PackError(f"{where}: no column {name!r} (columns: {list(columns)})")
    chosen = _choose_columns({c: a.dtype.kind for c, a in columns.items()}, opts, where, index_columns)
    values = _value_matrix(columns, chosen.taken, opts, where)
    report(chosen)
    uniq, first, inverse = np.unique(columns[id_col], return_index=True, return_inverse=True)
    order = np.argsort(first)  # group ranks: by first appearance
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    row_rank = rank[inverse.reshape(-1)]
    sort_keys = (row_rank,) if order_col is None else (columns[order_col], row_rank)
    rows = np.lexsort(sort_keys)  # grouped by rank (last key is primary), then by order, stable
    bounds = np.zeros(len(uniq) + 1, dtype=np.int64)
    np.cumsum(np.bincount(row_rank, minlength=len(uniq)), out=bounds[1:])
    return Batch([_text_key(str(uniq[g])) for g in order.tolist()], values[rows], bounds)


def _value_matrix(columns: dict[str, np.ndarray], names: tuple[str, ...], opts: dict, where: str) -> np.ndarray:
    """The value columns stacked to [N, F], or [N] for one column when squeeze (default True)."""
    if not names:
        raise PackError(f"{where}: no numeric value columns (columns: {list(columns)})")
    for name in names:
        if name not in columns:
            raise PackError(f"{where}: no column {name!r} (columns: {list(columns)})")
        if columns[name].dtype.kind not in _NUMERIC_KINDS:
            raise PackError(f"{where}: column {name!r} is not numeric (dtype {columns[name].dtype})")
    if len(names) == 1 and opts.get("squeeze", True):
        return columns[names[0]]
    return np.column_stack([columns[n] for n in names])


def _read_parquet(unit: Unit, opts: dict, report: Report) -> Iterator[Item]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise PackError(f"{unit.path}: reading parquet needs pyarrow: pip install 'streamwin[parquet]'") from e
    with _open(unit) as f:
        table = pq.read_table(_arrow_owned(f.read()))
    skip = {opts.get("id_column"), opts.get("order_column")}
    candidates = opts.get("value_columns") or [c for c in table.column_names if c not in skip]
    list_cols = opts.get("list_column") or [
        c for c in candidates if c in table.column_names and _is_list(pa, table.schema.field(c).type)]
    if list_cols:
        yield _row_sequences(table, list(list_cols), opts, unit, report)
    else:
        columns = {c: table.column(c).to_numpy() for c in table.column_names}
        index = [c for c in (table.schema.pandas_metadata or {}).get("index_columns", []) if isinstance(c, str)]
        yield _long_sequences(columns, opts, unit.path, report, index)


def _is_list(pa: Any, t: Any) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _row_sequences(table: Any, names: list[str], opts: dict, unit: Unit, report: Report) -> Batch:
    """One sequence per row: the row's list(s); several list columns are stacked as features."""
    import pyarrow as pa

    id_col = opts.get("id_column")
    for name in names + ([id_col] if id_col else []):
        if name not in table.column_names:
            raise PackError(f"{unit.path}: no column {name!r} (columns: {table.column_names})")
    per_column = [_list_values(table, name, unit.path) for name in names]
    if not any(_is_list(pa, table.schema.field(n).type.value_type) for n in names):  # one name per feature
        left_out = [(c, "id column" if c == id_col else "not a list column") for c in table.column_names
                    if c not in names]
        report(Columns(tuple(names), tuple(left_out), unit.path))
    lengths = per_column[0][1]
    if len(per_column) > 1:
        nested = any(values.ndim != 1 for values, _ in per_column)
        bad = np.flatnonzero(np.logical_or.reduce([np.full(len(lengths), nested)] +
                                                  [other != lengths for _, other in per_column[1:]]))
        if len(bad):
            raise PackError(f"{unit.path}, row {bad[0]}: list columns {names} differ in length or are nested")
    values = per_column[0][0] if len(per_column) == 1 else np.stack([v for v, _ in per_column], axis=1)
    if id_col:
        keys = [_text_key(str(i)) for i in table.column(id_col).to_pylist()]
    else:
        file_key = _file_key(unit)
        keys = [_text_key(f"{file_key}_{row}") for row in range(table.num_rows)]
    bounds = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=bounds[1:])
    return Batch(keys, values, bounds)


def _list_values(table: Any, name: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(values end to end, list length per row) of a list<number> column ([N] values) or a
    list<list<number>> column ([N, F] values)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    col = table.column(name).combine_chunks()
    where = f"{where}, column {name!r}"
    if not _is_list(pa, col.type):
        raise PackError(f"{where}: not a list column (type {col.type})")
    if col.null_count:
        raise PackError(f"{where}: {col.null_count} rows are null")
    lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)
    inner = col.flatten()
    if _is_list(pa, inner.type):  # [T, F]: every step must have the same width F
        widths = pc.list_value_length(inner).to_numpy(zero_copy_only=False)
        width = int(widths[0]) if len(widths) else 0
        if inner.null_count or (widths != width).any():
            raise PackError(f"{where}: inner lists must all have one length (got {sorted(set(widths))[:5]})")
        values = inner.flatten().to_numpy(zero_copy_only=False).reshape(len(widths), width)
    else:
        values = inner.to_numpy(zero_copy_only=False)
    if values.dtype.kind not in _NUMERIC_KINDS:
        raise PackError(f"{where}: values are not numeric (dtype {values.dtype})")
    return values, lengths


_READERS = {
    "npy": _read_npy, "npz": _npz_batches, "parquet": _read_parquet, "csv": _read_csv,
    "jsonl": _read_jsonl, "text": _read_text, "iterable": _read_iterable,
}
