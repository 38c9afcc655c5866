"""The manifest's per-sequence columns as pack writes them, kept in files rather than in memory.

A dataset may hold hundreds of millions of sequences; a Python list of their keys, lengths
and offsets would grow pack's memory by hundreds of bytes per sequence. `SequenceColumns`
appends rows to one file per column (4096 rows at a time, or a Records' worth at once) and
hands the finished columns back as read-only maps of those files, so the manifest's arrays
are page cache. `duplicate_key` then finds a key written twice with 8 bytes of memory per key.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np


class SequenceColumns:
    """The manifest's per-sequence columns as pack appends them, kept in files, not in memory.

    Rows are appended one by one (sequences written from their arrays) or many at once (from
    Records); they reach the files 4096 at a time. `columns` maps the files, so the manifest's
    arrays are page cache, and pack's private memory does not grow with the number of sequences.
    """

    COLUMNS = {"length": "<i8", "offset": "<i8", "size": "<i8", "hlen": "<i4", "key_ends": "<i8", "keys": "|u1"}
    FLUSH = 4096

    def __init__(self):
        self._flushed = 0
        self._key_bytes = 0
        self._dir = tempfile.mkdtemp(prefix="streamwin-columns-")
        self._files = {name: open(os.path.join(self._dir, name), "wb") for name in self.COLUMNS}
        self._rows: list[tuple[bytes, int, int, int, int]] = []

    def __len__(self) -> int:
        return self._flushed + len(self._rows)

    def append(self, key: str, length: int, offset: int, size: int, hlen: int) -> None:
        """One row: a sequence written from its array."""
        self._rows.append((key.encode("ascii"), length, offset, size, hlen))
        if len(self._rows) >= self.FLUSH:
            self._flush()

    def extend(self, keys: np.ndarray, key_ends: np.ndarray, **columns: np.ndarray) -> None:
        """Many rows: key bytes end to end with their ends (counted from ``keys[0]``), and the columns."""
        self._flush()
        files = self._files
        for name in ("length", "offset", "size", "hlen"):
            files[name].write(np.ascontiguousarray(columns[name], dtype=self.COLUMNS[name]))
        files["key_ends"].write(np.ascontiguousarray(key_ends + self._key_bytes, dtype="<i8"))
        files["keys"].write(np.ascontiguousarray(keys))
        self._flushed += len(key_ends)
        self._key_bytes += len(keys)

    def _flush(self) -> None:
        if not self._rows:
            return
        rows, self._rows = self._rows, []
        keys = b"".join(r[0] for r in rows)
        cols = np.array([r[1:] for r in rows], dtype=np.int64)
        self.extend(np.frombuffer(keys, dtype=np.uint8), np.cumsum([len(r[0]) for r in rows], dtype=np.int64),
                    length=cols[:, 0], offset=cols[:, 1], size=cols[:, 2], hlen=cols[:, 3])

    def columns(self) -> dict[str, np.ndarray]:
        """Every column, read-only maps of the files (removed at once: the maps keep them while in use)."""
        self._flush()
        out = {}
        for name, dt in self.COLUMNS.items():
            self._files[name].close()
            path = os.path.join(self._dir, name)
            out[name] = np.memmap(path, dtype=dt, mode="r") if os.path.getsize(path) else np.zeros(0, dt)
        self.discard()
        return out

    def discard(self) -> None:
        """Close and remove the files (after `columns`, or when the pack fails)."""
        for f in self._files.values():
            f.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def duplicate_key(keys: np.ndarray, key_ends: np.ndarray, chunk: int = 1 << 16) -> tuple[int, int] | None:
    """(i, j), i < j, two sequences with the same key, or None: a 64-bit hash of every key,
    sorted in place (8 bytes per key), and keys of equal hashes compared byte for byte."""
    n = len(key_ends)
    hashes = np.empty(n, dtype=np.uint64)
    for a in range(0, n, chunk):
        hashes[a : a + chunk] = key_hashes(keys, key_ends, a, min(a + chunk, n))
    hashes.sort()
    twice = np.unique(hashes[1:][hashes[1:] == hashes[:-1]])
    if not len(twice):
        return None
    del hashes
    found: dict[bytes, int] = {}
    for a in range(0, n, chunk):  # rare: find the sequences of those hashes again
        for i in (a + np.flatnonzero(np.isin(key_hashes(keys, key_ends, a, min(a + chunk, n)), twice))).tolist():
            key = bytes(keys[(int(key_ends[i - 1]) if i else 0) : int(key_ends[i])])
            if key in found:
                return found[key], i
            found[key] = i
    return None


def key_hashes(keys: np.ndarray, key_ends: np.ndarray, a: int, b: int) -> np.ndarray:
    """FNV-1a hashes of keys a..b-1, column by column over the key bytes."""
    ends = np.asarray(key_ends[a:b], dtype=np.int64)
    starts = np.concatenate([[int(key_ends[a - 1]) if a else 0], ends[:-1]])
    lens = ends - starts
    h = np.full(len(ends), 0xCBF29CE484222325, dtype=np.uint64)
    for j in range(int(lens.max()) if len(lens) else 0):
        live = lens > j
        byte = np.asarray(keys)[np.where(live, starts + j, 0)].astype(np.uint64)
        h = np.where(live, (h ^ byte) * np.uint64(0x100000001B3), h)
    return h ^ lens.astype(np.uint64)
