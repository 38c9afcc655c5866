"""Pack sequences into tar shards plus an index.json manifest, written last.

One writer appends members to the current shard and starts a new one past ``shard_bytes``,
so the output is byte-identical for the same input, however many worker processes
encode (read, convert, compress) the sources in parallel. Every shard is complete before
the manifest names it; the manifest of a previous dataset at the destination is removed
before anything else is written, so an interrupted pack leaves no index.json at all and
rerunning it completes the dataset.
"""
from __future__ import annotations

import hashlib
import io
import json
import multiprocessing as mp
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import numpy as np
from tqdm.auto import tqdm

from . import npyfmt
from .errors import ManifestError, PackError, ShardError
from .keys import check_key
from .manifest import INDEX_NAME, Manifest, ShardEntry, build_manifest, parse_manifest
from .sources import list_units, read_unit
from .storage import is_local, join, load_manifest, remove_if_exists, url_to_fs, write_atomic


@dataclass(frozen=True)
class EncodedSeq:
    """One sequence ready to append to a shard: member bytes plus what the manifest records."""

    key: str
    data: bytes  # .npy bytes, zstd-compressed when compression is on
    meta: bytes | None
    length: int
    dtype: str
    step_shape: tuple[int, ...]
    hlen: int


def encode_sequence(key: str, array: Any, meta: dict | None = None, *, cast: str | None = None,
                    compression: str | None = None) -> EncodedSeq | None:
    """Validate and encode one sequence; None for a zero-length one (the caller counts it)."""
    check_key(key)
    arr = np.asarray(array)
    if arr.dtype.hasobject or arr.dtype.kind not in "biufc":
        raise PackError(f"sequence {key!r}: dtype {arr.dtype} is not numeric (object and string arrays are refused)")
    if arr.ndim == 0:
        raise PackError(f"sequence {key!r}: a 0-d array is not a sequence; give shape [T] or [T, F, ...]")
    if cast is not None:
        arr = arr.astype(cast)
    if arr.shape[0] == 0:
        return None
    arr = np.ascontiguousarray(arr)
    header = npyfmt.npy_header(arr)
    data = header + arr.tobytes()
    if compression == "zstd":
        data = _zstd().compress(data)
    meta_bytes = None
    if meta is not None:
        try:
            meta_bytes = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
        except (TypeError, ValueError) as e:
            raise PackError(f"sequence {key!r}: metadata is not JSON-serializable: {e}") from e
    return EncodedSeq(key, data, meta_bytes, int(arr.shape[0]), arr.dtype.str, tuple(arr.shape[1:]), len(header))


def _zstd():
    try:
        import zstandard
    except ImportError as e:
        raise PackError("compression='zstd' needs the zstandard package: pip install 'streamwin[zstd]'") from e
    return zstandard.ZstdCompressor(level=3)


def _encode_unit(args: tuple) -> tuple[list[EncodedSeq], int]:
    """Worker-process task: read one source unit and encode its sequences."""
    unit, cast, compression = args
    out, empty = [], 0
    for item in read_unit(unit):
        enc = encode_sequence(*_split_item(item), cast=cast, compression=compression)
        if enc is None:
            empty += 1
        else:
            out.append(enc)
    return out, empty


def _split_item(item: Any) -> tuple[str, Any, dict | None]:
    if not isinstance(item, tuple) or len(item) not in (2, 3):
        raise PackError(f"a source item must be (key, array) or (key, array, meta), got {type(item).__name__}")
    return (item[0], item[1], item[2] if len(item) == 3 else None)


class ShardWriter:
    """Appends encoded sequences to numbered tar shards and records the manifest columns."""

    def __init__(self, fs, root: str, *, shard_bytes: int, prefix: str = "shard-"):
        self.fs, self.root, self.shard_bytes, self.prefix = fs, root, shard_bytes, prefix
        self.shards: list[ShardEntry] = []
        self.keys: list[str] = []
        self.columns: dict[str, list[int]] = {"length": [], "offset": [], "size": [], "hlen": []}
        self.dtype: str | None = None
        self.step_shape: tuple[int, ...] | None = None
        self._seen: dict[str, str] = {}
        self._file = None

    def add(self, seq: EncodedSeq) -> int:
        """Append one sequence; returns the bytes written."""
        self._check_consistent(seq)
        if self._file is None:
            self._open_next()
        written = self._member(f"{seq.key}.npy" + (".zst" if self._zst else ""), seq.data, record=seq)
        if seq.meta is not None:
            written += self._member(f"{seq.key}.json", seq.meta)
        self._seen[seq.key] = self._name
        if self._pos >= self.shard_bytes:
            self._close_current()
        return written

    def close(self) -> None:
        if self._file is not None:
            self._close_current()

    def _check_consistent(self, seq: EncodedSeq) -> None:
        if seq.key in self._seen:
            raise PackError(f"duplicate sequence key {seq.key!r} (first written to {self._seen[seq.key]}); keys must be unique in a dataset")
        if self.dtype is None:
            self.dtype, self.step_shape = seq.dtype, seq.step_shape
            self._zst = seq.data[:4] == b"\x28\xb5\x2f\xfd"
        elif (seq.dtype, seq.step_shape) != (self.dtype, self.step_shape):
            first = next(iter(self._seen), "?")
            raise PackError(
                f"sequence {seq.key!r} has dtype {np.dtype(seq.dtype)} and step shape {seq.step_shape}, but "
                f"{first!r} and the others have dtype {np.dtype(self.dtype)} and step shape {self.step_shape}; "
                "pass cast='float32' (--cast) to convert, or pack them as separate datasets"
            )

    def _open_next(self) -> None:
        self._name = f"{self.prefix}{len(self.shards):06d}.tar"
        path = join(self.root, self._name)
        self._tmp = f"{path}.tmp-{os.getpid()}" if is_local(self.fs) else None
        self._file = open(self._tmp, "wb") if self._tmp else self.fs.open(path, "wb")
        self._hash = hashlib.sha256()
        self._pos = 0
        self._count = 0
        self._steps = 0

    def _write(self, data: bytes) -> None:
        self._file.write(data)
        self._hash.update(data)
        self._pos += len(data)

    def _member(self, name: str, data: bytes, record: EncodedSeq | None = None) -> int:
        start = self._pos
        self._write(npyfmt.tar_header(name, len(data)))
        if record is not None:
            self.keys.append(record.key)
            cols = self.columns
            cols["length"].append(record.length)
            cols["offset"].append(self._pos)
            cols["size"].append(len(data))
            cols["hlen"].append(record.hlen)
            self._count += 1
            self._steps += record.length
        self._write(data)
        self._write(npyfmt.tar_padding(len(data)))
        return self._pos - start

    def _close_current(self) -> None:
        self._write(npyfmt.TAR_END)
        if self._tmp:
            self._file.flush()
            os.fsync(self._file.fileno())
        self._file.close()
        if self._tmp:
            os.replace(self._tmp, join(self.root, self._name))
        self.shards.append(ShardEntry(self._name, self._pos, self._hash.hexdigest(), self._count, self._steps))
        self._file = None

    def manifest(self, compression: str | None, dropped_empty: int) -> Manifest:
        if self.dtype is None:
            raise PackError("the source yielded no non-empty sequence: nothing to pack")
        return build_manifest(np.dtype(self.dtype), self.step_shape, compression, self.shards,
                              self.keys, self.columns, dropped_empty)


def _parse_part(part: str | tuple[int, int] | None) -> tuple[int, int] | None:
    if part is None:
        return None
    if isinstance(part, str):
        m = re.fullmatch(r"(\d+)/(\d+)", part)
        if not m:
            raise PackError(f"part must look like 'i/n' (0 <= i < n), got {part!r}")
        part = (int(m.group(1)), int(m.group(2)))
    i, n = part
    if not 0 <= i < n:
        raise PackError(f"part {i}/{n}: need 0 <= i < n")
    return i, n


def part_index_name(i: int, n: int) -> str:
    return f"index.part{i:05d}-of-{n:05d}.json"


def pack(source: Any, dest: str, *, shard_bytes: int = 256 << 20, format: str | None = None,
         workers: int = 1, compression: str | None = None, cast: str | None = None,
         empty: str = "skip", part: str | tuple[int, int] | None = None,
         storage_options: dict | None = None, progress: bool = True, **source_options: Any) -> Manifest:
    """Pack a source of sequences into tar shards and an index.json at ``dest`` (any fsspec URL).

    Args:
        source: a directory or file (.npy dir, .npz, parquet, csv, jsonl, text), or an iterable of
            ``(key, array)`` / ``(key, array, meta)``.
        shard_bytes: a shard is closed once it holds at least this many bytes.
        format: the source format when it cannot be detected (see ``streamwin.sources.FORMATS``).
        workers: processes that read and encode source files in parallel (output is identical).
        compression: None or "zstd" (per member, ``<key>.npy.zst``; byte ranges stay addressable).
        cast: convert every array to this dtype instead of refusing a dtype mismatch.
        empty: "skip" zero-length sequences (counted in the manifest) or "error".
        part: ``"i/n"`` packs the i-th of n disjoint parts of the source files into its own shard
            range and part index; `merge` then writes the combined index.json.
        source_options: passed to the source reader (e.g. ``id_column=``, ``field=``).
    """
    if shard_bytes <= 0:
        raise PackError(f"shard_bytes must be positive, got {shard_bytes}")
    if compression not in (None, "zstd"):
        raise PackError(f"compression must be None or 'zstd', got {compression!r}")
    if empty not in ("skip", "error"):
        raise PackError(f"empty must be 'skip' or 'error', got {empty!r}")
    part_ = _parse_part(part)
    fs, root = url_to_fs(dest, storage_options)
    fs.makedirs(root, exist_ok=True)
    index_name = INDEX_NAME if part_ is None else part_index_name(*part_)
    remove_if_exists(fs, join(root, index_name))  # from here on, the destination is "not finished"

    units = list_units(source, format=format, **source_options)
    if part_ is not None:
        i, n = part_
        units = units[i * len(units) // n : (i + 1) * len(units) // n]
    prefix = "shard-" if part_ is None else f"part{part_[0]:05d}-shard-"
    writer = ShardWriter(fs, root, shard_bytes=shard_bytes, prefix=prefix)
    dropped = 0
    bar = tqdm(desc=f"pack -> {dest}", unit="B", unit_scale=True, disable=not progress, file=sys.stderr)
    try:
        for batch, empties in _encoded_units(units, cast, compression, workers):
            if empties and empty == "error":
                raise PackError(f"{empties} zero-length sequence(s) in the source; pass empty='skip' to skip and count them")
            dropped += empties
            for seq in batch:
                bar.update(writer.add(seq))
            bar.set_postfix(sequences=len(writer.keys), shards=len(writer.shards) + (writer._file is not None))
        writer.close()
    finally:
        bar.close()
    manifest = writer.manifest(compression, dropped)
    write_atomic(fs, join(root, index_name), manifest.to_json().encode())
    return manifest


def _encoded_units(units: list, cast: str | None, compression: str | None, workers: int) -> Iterator[tuple[list[EncodedSeq], int]]:
    tasks = [(u, cast, compression) for u in units]
    if workers <= 1 or len(units) <= 1:
        for t in tasks:
            # stream item by item so that one huge in-memory iterable is never held whole
            unit = t[0]
            for item in read_unit(unit):
                enc = encode_sequence(*_split_item(item), cast=cast, compression=compression)
                yield ([enc], 0) if enc is not None else ([], 1)
        return
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    with ctx.Pool(workers) as pool:
        yield from pool.imap(_encode_unit, tasks, chunksize=1)


def merge(dest: str, *, storage_options: dict | None = None) -> Manifest:
    """Combine the part indexes written by ``pack(..., part="i/n")`` into one index.json."""
    fs, root = url_to_fs(dest, storage_options)
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.glob(join(root, "index.part*-of-*.json")))
    if not names:
        raise ManifestError(f"no part indexes (index.partIIIII-of-NNNNN.json) at {dest}")
    n = int(re.search(r"-of-(\d+)", names[0]).group(1))
    expected = [part_index_name(i, n) for i in range(n)]
    missing = sorted(set(expected) - set(names))
    if missing:
        raise ManifestError(f"cannot merge {dest}: {len(missing)} of {n} parts are not finished: {', '.join(missing[:5])}")
    parts = [parse_manifest(fs.cat_file(join(root, name)), where=name) for name in expected]
    first = parts[0]
    for name, m in zip(expected, parts):
        if (m.dtype, m.step_shape, m.compression) != (first.dtype, first.step_shape, first.compression):
            raise ManifestError(f"{name} has dtype {m.dtype}, step shape {m.step_shape}, compression {m.compression}; "
                                f"{expected[0]} has {first.dtype}, {first.step_shape}, {first.compression}")
    keys = [m.key(i) for m in parts for i in range(m.num_sequences)]
    if len(set(keys)) != len(keys):
        seen: set[str] = set()
        dup = next(k for k in keys if k in seen or seen.add(k))
        raise ManifestError(f"cannot merge {dest}: key {dup!r} appears in more than one part")
    cols = {c: np.concatenate([getattr(m, c) for m in parts]) for c in ("length", "offset", "size", "hlen")}
    manifest = build_manifest(first.dtype, first.step_shape, first.compression,
                              [s for m in parts for s in m.shards], keys, cols,
                              sum(m.dropped_empty for m in parts))
    write_atomic(fs, join(root, INDEX_NAME), manifest.to_json().encode())
    return manifest
