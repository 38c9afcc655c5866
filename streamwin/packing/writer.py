"""ShardWriter: append encoded sequences to numbered tar shards, and record the manifest as it goes.

The writer is the one place that decides where a byte lands: it appends each sequence (an
`EncodedSeq`, or many at once as `Records`) to the current shard and closes the shard once it
holds ``shard_bytes``, so the shards depend only on the order of the sequences, never on how
many processes encoded them. Each shard is written under a temporary name and renamed when
complete (local), or uploaded as one object that becomes visible only when complete (object
stores); `abort` discards the shard being written. Its sha256 is computed on a background
thread as the bytes go out, its chunk and block checksums as they are written, into the sums
file written beside it (``<shard>.sums``, formats/checks.py) once it is complete. `manifest` turns the recorded columns into the Manifest of what
it wrote (one unit's: see ``unit``).
"""
from __future__ import annotations

import hashlib
import os
from array import array
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from streamwin.errors import PackError
from streamwin.formats import tar as tarfmt
from streamwin.formats.checks import SUFFIX, Checks
from streamwin.formats.sums import ShardSumsWriter
from streamwin.formats.manifest import Frames, Manifest, NonFinite, ShardEntry
from streamwin.formats.zstd import frame_rows
from streamwin.packing.columns import SequenceColumns
from streamwin.packing.encode import EncodedSeq, Streamed
from streamwin.packing.fieldcols import FieldCollector
from streamwin.packing.inputs import Columns
from streamwin.packing.inputs.base import cut_fields
from streamwin.packing.records import RECORD_MAX, Records
from streamwin.storage.urls import is_local, join, temp_path, write_atomic


class _Hasher:
    """sha256 of a shard on a background thread (hashlib releases the GIL), in write order.

    Chunks are queued in batches of about ``batch`` bytes, one batch hashing while the next
    fills, so hashing overlaps reading and writing instead of following them. A
    queued chunk must not change until hashed: `wait` before handing control back to an
    input that may reuse its arrays.
    """

    def __init__(self, pool: ThreadPoolExecutor, batch: int = 4 << 20):
        self._pool, self._batch = pool, batch
        self._hash = hashlib.sha256()
        self._chunks: list = []
        self._size = 0
        self._running: Future | None = None

    def update(self, chunk: bytes | np.ndarray | memoryview) -> None:
        """Queue the next bytes of the shard (they must not change until hashed)."""
        self._chunks.append(chunk)
        self._size += len(chunk)
        if self._size >= self._batch:
            self._submit()

    def _submit(self) -> None:
        if self._running is not None:
            self._running.result()
        chunks, self._chunks, self._size = self._chunks, [], 0
        self._running = self._pool.submit(_hash_chunks, self._hash, chunks)

    def wait(self) -> None:
        """Return once every queued chunk is hashed."""
        self._submit()
        self._running.result()

    def hexdigest(self) -> str:
        """The sha256 of everything queued."""
        self.wait()
        return self._hash.hexdigest()


def _hash_chunks(h, chunks: list) -> None:
    for chunk in chunks:
        h.update(chunk)


class ShardWriter:
    """Appends encoded sequences to numbered tar shards and records the manifest columns."""

    def __init__(self, fs, root: str, *, shard_bytes: int, prefix: str = "shard-", compression: str | None = None):
        self.fs, self.root, self.shard_bytes, self.prefix = fs, root, shard_bytes, prefix
        self.compression = compression
        self.suffix = ".npy.zst" if compression == "zstd" else ".npy"
        self.shards: list[ShardEntry] = []
        self.sequences = SequenceColumns()
        self.fields = FieldCollector()  # per-sequence fields from the meta dicts (formats/meta.py)
        self.dtype: str | None = None
        self.step_shape: tuple[int, ...] | None = None
        self.nan = self.inf = 0
        self.shard_nonfinite: list[int] = []  # NaN + inf values per finished shard
        self.framed: list[int] = []  # sequences packed as several zstd frames
        self.frame_ends = array("q")  # their frames' ends, in order
        self.sums_digests: list[tuple[str, str]] = []  # per finished shard: its sums file's digests (formats.checks)
        self._first_key = ""
        self._file = None
        self._hash_pool = ThreadPoolExecutor(1, thread_name_prefix="streamwin-sha256")

    @property
    def open_shards(self) -> int:
        """Shards finished or being written."""
        return len(self.shards) + (self._file is not None)

    @property
    def count(self) -> int:
        """Sequences written so far."""
        return len(self.sequences)

    def add(self, part: EncodedSeq | Records, *, borrowed: bool = False) -> int:
        """Append one sequence, or many (Records); returns the bytes written. ``borrowed``: the
        sequence's array belongs to a caller that may reuse it afterwards, so it is hashed before
        this returns."""
        if isinstance(part, Records):
            return self._add_records(part)
        seq, body = part, part.body
        self._check_consistent(seq.key, seq.dtype, seq.step_shape)
        if self._file is None:
            self._open_next()
        if borrowed and not isinstance(body, Streamed) and seq.size <= RECORD_MAX:
            body, borrowed = bytes(body), False  # a copy is cheaper than waiting for the hash thread
        written = self._member(seq.key + self.suffix, (seq.head, body), seq.size, record=seq)
        if seq.meta is not None:
            written += self._member(f"{seq.key}.json", (seq.meta,), len(seq.meta))
        if self._pos >= self.shard_bytes:
            self._close_current()
        elif borrowed:
            self._hash.wait()
        return written

    def _add_records(self, rec: Records) -> int:
        """Write Records in as few writes as shards they span; a shard closes after the sequence
        that brings it to ``shard_bytes``, as with `add` one by one."""
        if not len(rec):
            return 0
        self._check_consistent(rec.key(0), rec.dtype, rec.step_shape)
        starts = rec.ends - np.diff(rec.ends, prepend=0)
        i, written = 0, 0
        while i < len(rec):
            if self._file is None:
                self._open_next()
            base = int(starts[i])
            stop = min(int(np.searchsorted(rec.ends, self.shard_bytes - self._pos + base)) + 1, len(rec))
            end = int(rec.ends[stop - 1])
            self._write(rec.data[base:end])
            self._record_rows(rec, i, stop, self._pos - base)
            self._pos += end - base
            written += end - base
            if self._pos >= self.shard_bytes:
                self._close_current()
            i = stop
        return written

    def _record_rows(self, rec: Records, i: int, stop: int, shift: int) -> None:
        """Record sequences i..stop-1 of ``rec``, whose records start ``shift`` bytes into the shard."""
        first = self.count
        for k, ends in rec.frames:
            if i <= k < stop:
                self.framed.append(first + k - i)
                self.frame_ends.extend(ends)
        k0 = int(rec.key_ends[i - 1]) if i else 0
        begin = (rec.ends - np.diff(rec.ends, prepend=0))[i:stop]
        self.sequences.extend(rec.keys[k0 : int(rec.key_ends[stop - 1])], rec.key_ends[i:stop] - k0,
                          length=rec.length[i:stop], offset=shift + begin + rec.content[i:stop],
                          size=rec.size[i:stop], hlen=rec.hlen[i:stop])
        if isinstance(rec.fields, tuple):
            for k in range(i, stop):
                self.fields.add(rec.key(k), rec.fields[k])
        else:
            self.fields.add_columns(lambda j: rec.key(i + j), stop - i, cut_fields(rec.fields, slice(i, stop)) or {})
        nan, inf = int(rec.nan[i:stop].sum()), int(rec.inf[i:stop].sum())
        self._count += stop - i
        self._steps += int(rec.length[i:stop].sum())
        self._nonfinite += nan + inf
        self.nan, self.inf = self.nan + nan, self.inf + inf

    def close(self) -> None:
        """Finish the shard being written and stop the hash thread."""
        if self._file is not None:
            self._close_current()
        self._hash_pool.shutdown()

    def abort(self) -> None:
        """Drop the shard being written: a temporary file is removed, an upload is discarded."""
        self._hash_pool.shutdown(cancel_futures=True)
        self.sequences.discard()
        f, self._file = self._file, None
        if f is None:
            return
        if self._tmp:
            f.close()
            os.unlink(self._tmp)
        elif hasattr(f, "discard"):
            f.discard()  # fsspec buffered file: abort the (multipart) upload, commit nothing
            f.closed = True  # and never flush it when it is collected

    def _check_consistent(self, key: str, dtype: str, step_shape: tuple[int, ...]) -> None:
        if self.dtype is None:
            self.dtype, self.step_shape, self._first_key = dtype, step_shape, key
        elif (dtype, step_shape) != (self.dtype, self.step_shape):
            raise PackError(
                f"sequence {key!r} has dtype {dtype} and step shape {step_shape}, but "
                f"{self._first_key!r} and the ones before it have dtype {self.dtype} and step shape {self.step_shape}; "
                "pass cast= to convert the dtype, or pack them as separate datasets"
            )

    def _shard_name(self, k: int) -> str:
        return f"{self.prefix}{k:06d}.tar"

    def _open_next(self) -> None:
        self._name = self._shard_name(len(self.shards))
        path = join(self.root, self._name)
        # unique per writer: two tasks of one unit (a retry, a duplicate) may run at once in one process
        self._tmp = temp_path(path) if is_local(self.fs) else None
        self._file = open(self._tmp, "wb", buffering=1 << 20) if self._tmp else self.fs.open(path, "wb")
        self._hash = _Hasher(self._hash_pool)
        self._sums = ShardSumsWriter()
        self._pos = self._count = self._steps = self._nonfinite = 0

    def _write(self, data) -> None:
        self._file.write(data)
        self._hash.update(data)
        self._sums.update(data)

    def _member(self, name: str, chunks: tuple, size: int, record: EncodedSeq | None = None) -> int:
        start = self._pos
        header = tarfmt.tar_header(name, size)
        self._write(header)
        self._pos += len(header)
        if record is not None:
            if record.frame_ends:
                self.framed.append(self.count)
                self.frame_ends.extend(record.frame_ends)
            self.sequences.append(record.key, record.length, self._pos, size, record.hlen)
            self.fields.add(record.key, record.fields)
            self._count += 1
            self._steps += record.length
            self._nonfinite += record.nan + record.inf
            self.nan, self.inf = self.nan + record.nan, self.inf + record.inf
        for chunk in chunks:
            for part in (chunk if isinstance(chunk, Streamed) else (chunk,)):
                if len(part):
                    self._write(part)
        self._write(tarfmt.tar_padding(size))
        self._pos += size + (-size % tarfmt.BLOCK)
        return self._pos - start

    def _close_current(self) -> None:
        self._write(tarfmt.TAR_END)
        self._pos += len(tarfmt.TAR_END)
        f = self._file
        if self._tmp:
            f.flush()
            os.fsync(f.fileno())
        f.close()
        self._file = None
        if self._tmp:
            os.replace(self._tmp, join(self.root, self._name))
        sums, digest = self._sums.file()  # its chunk and block checksums, beside it (formats.checks)
        write_atomic(self.fs, join(self.root, self._name + SUFFIX), sums)
        self.sums_digests.append(digest)
        self.shards.append(ShardEntry(self._name, self._pos, self._hash.hexdigest(), self._count, self._steps))
        self.shard_nonfinite.append(self._nonfinite)

    def manifest(self, dropped_empty: int, columns: Columns | None) -> Manifest:
        """The manifest of what was written (after `close`): PackError if nothing was. Keys are checked
        for duplicates where the units' manifests are merged (``fragments``)."""
        if self.dtype is None:
            raise PackError(f"the input yielded no non-empty sequence ({dropped_empty} empty ones): nothing to pack")
        cols = self.sequences.columns()
        keys, key_ends = cols.pop("keys"), cols.pop("key_ends")
        frames = None
        if self.framed:
            step = np.dtype(self.dtype).itemsize * int(np.prod(self.step_shape, dtype=np.int64))
            frames = Frames.make(frame_rows(step), np.asarray(self.framed), np.asarray(self.frame_ends), cols["length"])
        return Manifest(dtype=np.dtype(self.dtype), step_shape=tuple(self.step_shape), compression=self.compression,
                        shards=tuple(self.shards), key_blob=memoryview(keys), key_ends=key_ends,
                        dropped_empty=dropped_empty, value_columns=columns.taken if columns else None,
                        left_out_columns=dict(columns.left_out) if columns else None,
                        nonfinite=NonFinite(self.nan, self.inf, tuple(self.shard_nonfinite)), frames=frames,
                        checks=Checks.of_shards(self.sums_digests, [s.bytes for s in self.shards]),
                        fields=self.fields.result(), **cols)
