"""Pack sequences into tar shards plus an index.json manifest, written last.

One writer appends members to the current shard and starts a new one past ``shard_bytes``,
so the output is byte-identical for the same input, however many worker processes
encode (read, convert, compress) the sources in parallel.

Crash safety, step by step:

1. The index this pack will write (index.json, or its part index) is removed before
   anything else, so from then on the destination reads as "not finished".
2. Each shard is written to a temporary name and renamed when complete (local), or
   uploaded in one object PUT that becomes visible only when complete (object stores);
   an error discards the shard being written.
3. index.json is written atomically after every shard is complete: it is the commit marker.
4. Only then are leftovers of earlier runs removed (shards past the new count, temporaries).

So an interrupted pack leaves no index.json at all, and rerunning it completes the dataset.

With ``workers > 1``, forked processes read and encode whole source files (units), at most
two per worker ahead of the writer; their output comes back through a spill file in
/dev/shm, in unit order, so the shards are the same as with one process.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
import multiprocessing as mp
import os
import re
import shutil
import sys
import tarfile
import tempfile
import warnings
from array import array
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
from tqdm.auto import tqdm

from . import npyfmt
from .errors import ManifestError, PackError
from .keys import check_key
from .manifest import INDEX_NAME, Manifest, NonFinite, ShardEntry, build_manifest
from .sources import Columns, Unit, list_units, read_unit
from .storage import is_local, join, load_manifest, remove_if_exists, url_to_fs, write_manifest

SPILL_MIN = 256 << 10  # a worker's output for a unit smaller than this comes back through the pipe
FRAME_BYTES = 256 << 10  # a longer zstd member is packed as independent frames of about this many bytes of rows
STREAM_BYTES = 64 << 20  # a larger array (or any array-like that is not an ndarray) is packed chunk by chunk
CHUNK_BYTES = 8 << 20  # rows copied from such a source at a time
_USTAR_MAX_SIZE = 8**11 - 1  # the 11 octal digits of a ustar size field
_TEMPLATE = bytearray(npyfmt.tar_header("_", 0))
_TEMPLATE[0:100] = bytes(100)
_TEMPLATE[124:136] = bytes(12)
_TEMPLATE[148:156] = b" " * 8
_TEMPLATE_SUM = sum(_TEMPLATE)


class NonFiniteWarning(UserWarning):
    """pack wrote NaN or inf values (counted in ``manifest.nonfinite``)."""


@dataclass(frozen=True)
class EncodedSeq:
    """One sequence ready to append to a shard: the member's content plus what the manifest records.

    The content is ``head + body``: the npy header and the array's bytes (a uint8 view, never
    copied in-process), or, with zstd, empty ``head`` and the compressed member as ``body``.
    """

    key: str
    head: bytes
    body: bytes | np.ndarray
    meta: bytes | None
    length: int
    dtype: str
    step_shape: tuple[int, ...]
    hlen: int
    nan: int = 0  # NaN values in the array
    inf: int = 0  # +-inf values in the array
    frame_ends: tuple[int, ...] | None = None  # zstd frames of a long member: where each ends in ``body``

    @property
    def size(self) -> int:
        return len(self.head) + len(self.body)


def encode_sequence(key: str, array: Any, meta: dict | None = None, *, cast: str | None = None,
                    compression: str | None = None, empty: str = "skip", nan: str = "count") -> EncodedSeq | None:
    """Validate and encode one sequence; None for a zero-length one when ``empty="skip"``.

    Multi-byte dtypes are stored little-endian (values unchanged), so a big-endian source
    array packs together with little-endian ones. NaN and inf values are counted, or refused
    with ``nan="raise"``.
    """
    check_key(key)
    arr = array if isinstance(array, np.ndarray) or _slices(array) else np.asarray(array)
    if not isinstance(arr, np.ndarray) or arr.nbytes > STREAM_BYTES:
        return _encode_streamed(key, arr, meta, cast=cast, compression=compression, empty=empty, nan=nan)
    if arr.dtype.hasobject or arr.dtype.kind not in "biufc":
        raise PackError(f"sequence {key!r}: dtype {arr.dtype} is not numeric (object and string arrays are refused)")
    if arr.ndim == 0:
        raise PackError(f"sequence {key!r}: a 0-d array is not a sequence; give shape [T] or [T, F, ...]")
    if cast is not None:
        _check_cast(key, arr, cast)
        arr = arr.astype(cast)
    if arr.shape[0] == 0:
        if empty == "error":
            raise PackError(f"sequence {key!r} has zero length; pass empty='skip' to skip and count such sequences")
        return None
    arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else None)
    head = npyfmt.npy_header_for(arr.dtype, arr.shape)
    body = arr.reshape(-1).view(np.uint8)
    hlen = len(head)
    frame_ends = None
    if compression == "zstd":
        body, frame_ends = compress_member(head, body, int(arr.shape[0]))
        head = b""
    meta_bytes = _meta_bytes(key, meta)
    nans, infs = count_nonfinite(arr)
    if nan == "raise" and nans + infs:
        raise PackError(f"sequence {key!r} has {nans} NaN and {infs} inf values, the first at step "
                        f"{first_nonfinite_step(arr)}; clean them, or pack with nan='count' to count them")
    return EncodedSeq(key, head, body, meta_bytes, int(arr.shape[0]), arr.dtype.str, tuple(arr.shape[1:]), hlen,
                      nans, infs, frame_ends)


def _meta_bytes(key: str, meta: dict | None) -> bytes | None:
    if meta is None:
        return None
    try:
        return json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    except (TypeError, ValueError) as e:
        raise PackError(f"sequence {key!r}: metadata is not JSON-serializable: {e}") from e


def _slices(array: Any) -> bool:
    """True for a large array-like that reads by slices (h5py, zarr, ...): it is packed chunk by chunk.

    Small ones, pandas objects and ones whose dtype numpy does not know (torch) are converted whole.
    """
    if isinstance(array, np.generic) or hasattr(array, "iloc") or not all(
            hasattr(array, a) for a in ("shape", "dtype", "__getitem__")):
        return False
    try:
        itemsize = np.dtype(array.dtype).itemsize
    except TypeError:
        return False
    return itemsize * int(np.prod(array.shape, dtype=np.int64)) > STREAM_BYTES


class Streamed:
    """A member's content made chunk by chunk when written (``len`` bytes), for a sequence too large to hold."""

    def __init__(self, nbytes: int, chunks: Callable[[], Iterator[Any]]):
        self.nbytes, self._chunks = nbytes, chunks

    def __len__(self) -> int:
        return self.nbytes

    def __iter__(self) -> Iterator[Any]:
        return self._chunks()


def _encode_streamed(key: str, arr: Any, meta: dict | None, *, cast: str | None, compression: str | None,
                     empty: str, nan: str) -> EncodedSeq | None:
    """`encode_sequence` for a large or lazy array: rows are copied a chunk at a time, never all at once.

    One pass counts NaN and inf (and, with zstd, compresses frames into a temporary file); the
    member is then written from the source again (or from that file). A memory-mapped source
    gives its pages back after each chunk, so pack's memory does not grow with the sequence.
    """
    src = np.dtype(arr.dtype)
    if src.hasobject or src.kind not in "biufc":
        raise PackError(f"sequence {key!r}: dtype {src} is not numeric (object and string arrays are refused)")
    if len(arr.shape) == 0:
        raise PackError(f"sequence {key!r}: a 0-d array is not a sequence; give shape [T] or [T, F, ...]")
    length = int(arr.shape[0])
    if length == 0:
        if empty == "error":
            raise PackError(f"sequence {key!r} has zero length; pass empty='skip' to skip and count such sequences")
        return None
    dtype = np.dtype(cast) if cast is not None else src.newbyteorder("<") if src.byteorder == ">" else src
    shape = (length,) + tuple(int(d) for d in arr.shape[1:])
    head = npyfmt.npy_header_for(dtype, shape)
    hlen = len(head)
    step = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
    rows = frame_rows(step) if compression == "zstd" else max(1, CHUNK_BYTES // max(step, 1))
    chunks = functools.partial(_row_chunks, arr, dtype, rows, key, cast)
    nans = infs = 0
    first_bad = None
    spill, ends = (tempfile.TemporaryFile(), []) if compression == "zstd" else (None, None)
    for a, chunk in chunks():
        n, i = count_nonfinite(chunk)
        if n + i and first_bad is None:
            first_bad = a + first_nonfinite_step(chunk)
        nans, infs = nans + n, infs + i
        if spill is not None:
            data = chunk.reshape(-1).view(np.uint8)
            spill.write(_zstd().compress(head + data.tobytes() if a == 0 else data))
            ends.append(spill.tell())
    if nan == "raise" and nans + infs:
        raise PackError(f"sequence {key!r} has {nans} NaN and {infs} inf values, the first at step {first_bad}; "
                        "clean them, or pack with nan='count' to count them")
    if spill is not None:
        body = Streamed(ends[-1], functools.partial(_file_chunks, spill))
        frame_ends = tuple(ends) if len(ends) > 1 else None
        head = b""
    else:
        body = Streamed(length * step, lambda: (c.reshape(-1).view(np.uint8) for _, c in chunks()))
        frame_ends = None
    return EncodedSeq(key, head, body, _meta_bytes(key, meta), length, dtype.str, shape[1:], hlen, nans, infs,
                      frame_ends)


def _row_chunks(arr: Any, dtype: np.dtype, rows: int, key: str, cast: str | None) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, contiguous little-endian copy of ``rows`` rows) of ``arr``; a memory map lets go of each."""
    pages = _mapped_pages(arr)
    for a in range(0, int(arr.shape[0]), rows):
        part = np.asarray(arr[a : a + rows])
        if cast is not None:
            _check_cast(key, part, cast)
        yield a, np.array(part, dtype=dtype, order="C", copy=True)
        if pages is not None:
            pages(a + len(part))


def _mapped_pages(arr: Any) -> Callable[[int], None] | None:
    """For an ndarray on a shared (not copy-on-write) numpy memmap: ``f(row)`` drops the map's pages
    before that row from this process (the page cache keeps them); else None."""
    mm = arr
    while mm is not None and not (isinstance(mm, np.memmap) and getattr(mm, "_mmap", None) is not None):
        mm = getattr(mm, "base", None)
    if mm is None or mm.mode in ("c", "copyonwrite") or not hasattr(mm._mmap, "madvise") or arr.strides[0] <= 0:
        return None
    import mmap

    origin = np.frombuffer(mm._mmap, dtype=np.uint8).ctypes.data
    start = arr.__array_interface__["data"][0] - origin
    done = [0]  # bytes of the map given back so far

    def let_go(row: int) -> None:
        end = (start + row * arr.strides[0]) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > done[0]:
            mm._mmap.madvise(mmap.MADV_DONTNEED, done[0], end - done[0])
            done[0] = end
    return let_go


def _file_chunks(f) -> Iterator[bytes]:
    """The content of open file ``f`` from its start, CHUNK_BYTES at a time."""
    f.seek(0)
    while chunk := f.read(CHUNK_BYTES):
        yield chunk


def frame_rows(step_bytes: int) -> int:
    """Steps per zstd frame of a long member: about FRAME_BYTES of rows."""
    return max(1, FRAME_BYTES // max(step_bytes, 1))


def compress_member(head: bytes, body: np.ndarray, length: int) -> tuple[bytes, tuple[int, ...] | None]:
    """(zstd member, frame ends): one frame, or independent frames of ``frame_rows`` steps for a long one.

    Frame 0 holds the npy header and the first rows. A reader decompresses only the frames
    that hold the steps it needs, so its memory does not grow with the sequence.
    """
    z = _zstd()
    step = len(body) // max(length, 1)
    rows = frame_rows(step)
    if length <= rows:
        return z.compress(head + body.tobytes()), None
    frames = [z.compress(head + body[: rows * step].tobytes())]
    frames += [z.compress(body[a * step : (a + rows) * step].tobytes()) for a in range(rows, length, rows)]
    return b"".join(frames), tuple(np.cumsum([len(f) for f in frames]).tolist())


_FINITE_CHUNK = 1 << 24  # values checked per vectorized call: bounds the temporary mask to 16 MB


def count_nonfinite(arr: np.ndarray) -> tuple[int, int]:
    """(NaN values, +-inf values) of an array; integers have none.

    One vectorized pass, a sum, with no temporary array: NaN and inf make any sum non-finite,
    and a sum of finite values is non-finite only when it overflows. Only then are the values
    counted one by one.
    """
    if arr.dtype.kind not in "fc":
        return 0, 0
    flat = arr.reshape(-1)
    with np.errstate(all="ignore"):  # inf - inf and overflow are expected here, not worth a warning
        total = flat.sum(dtype=np.float32 if flat.dtype == np.float16 else None)
    if np.isfinite(total):
        return 0, 0
    bad = sum(len(c) - int(np.count_nonzero(np.isfinite(c)))
              for c in (flat[i : i + _FINITE_CHUNK] for i in range(0, len(flat), _FINITE_CHUNK)))
    if not bad:
        return 0, 0
    nans = int(np.count_nonzero(np.isnan(flat)))
    return nans, bad - nans


def first_nonfinite_step(arr: np.ndarray) -> int | None:
    """The first step (index along the first axis) holding a NaN or inf, or None."""
    finite = np.isfinite(arr).reshape(len(arr), -1).all(axis=1)
    return None if finite.all() else int(np.argmin(finite))


def _check_cast(key: str, arr: np.ndarray, cast: str) -> None:
    """NaN and inf have no integer value: casting them would pack arbitrary numbers."""
    if np.dtype(cast).kind not in "fc" and sum(count_nonfinite(arr)):
        raise PackError(f"sequence {key!r} has NaN or inf values (the first at step {first_nonfinite_step(arr)}), "
                        f"which cast={cast!r} cannot represent")


@functools.cache
def _zstd():
    try:
        import zstandard
    except ImportError as e:
        raise PackError("compression='zstd' needs the zstandard package: pip install 'streamwin[zstd]'") from e
    return zstandard.ZstdCompressor(level=3)


def tar_header(name: str, size: int) -> bytes:
    """``npyfmt.tar_header(name, size)``, byte for byte, ~20x faster: a template with name, size
    and checksum patched in (tests/test_pack.py checks the equality). Members too large for
    ustar get a pax header."""
    raw = name.encode("ascii")
    if len(raw) > 100 or size > _USTAR_MAX_SIZE:
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = size, 0o644, 0
        return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8")
    size_field = b"%011o\0" % size
    buf = bytearray(_TEMPLATE)
    buf[0 : len(raw)] = raw
    buf[124:136] = size_field
    buf[148:155] = b"%06o\0" % (_TEMPLATE_SUM + sum(raw) + sum(size_field))
    return bytes(buf)


def _encode_unit(args: tuple) -> tuple[list[EncodedSeq], int, str | None, list[int], Columns | None]:
    """Worker-process task: read one source unit and encode its sequences.

    Unless the unit is small, the member contents travel back through one spill file in
    ``spill_dir`` (RAM-backed /dev/shm where there is one), about twice as fast as through the
    result pipe; the sequences then come back with empty ``head`` and ``body``, and their
    content sizes in order (see `_unspill`).
    """
    unit, cast, compression, empty, nan, spill_dir = args
    out, skipped, found = [], 0, []
    for key, arr, meta in read_unit(unit, found.append):
        enc = encode_sequence(key, arr, meta, cast=cast, compression=compression, empty=empty, nan=nan)
        if enc is None:
            skipped += 1
        else:
            out.append(enc)
    columns = found[0] if found else None
    sizes = [s.size for s in out]
    if sum(sizes) < SPILL_MIN:
        return out, skipped, None, sizes, columns
    fd, path = tempfile.mkstemp(dir=spill_dir, suffix=".spill")
    with os.fdopen(fd, "wb") as f:
        for s in out:
            f.write(s.head)
            for part in (s.body if isinstance(s.body, Streamed) else (s.body,)):
                f.write(part)
    return [dataclasses.replace(s, head=b"", body=b"") for s in out], skipped, path, sizes, columns


def _unspill(seqs: list[EncodedSeq], path: str | None, sizes: list[int]) -> list[EncodedSeq]:
    """The sequences of `_encode_unit` with their contents back (views of the spill file, read whole)."""
    if path is None:
        return seqs
    with open(path, "rb") as f:
        view = memoryview(f.read())
    os.unlink(path)
    bounds = np.cumsum([0] + sizes).tolist()
    return [dataclasses.replace(s, body=view[a:b]) for s, a, b in zip(seqs, bounds, bounds[1:])]


class _Hasher:
    """sha256 of a shard on a background thread (hashlib releases the GIL), in write order.

    Chunks are queued in batches of about ``batch`` bytes, one batch hashing while the next
    fills, so hashing overlaps reading and writing (~25% faster packing on two cores). A
    queued chunk must not change until hashed: `wait` before handing control back to a
    source that may reuse its arrays.
    """

    def __init__(self, pool: ThreadPoolExecutor, batch: int = 4 << 20):
        self._pool, self._batch = pool, batch
        self._hash = hashlib.sha256()
        self._chunks: list = []
        self._size = 0
        self._running: Future | None = None

    def update(self, chunk) -> None:
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
        self._submit()
        self._running.result()

    def hexdigest(self) -> str:
        self.wait()
        return self._hash.hexdigest()


def _hash_chunks(h, chunks: list) -> None:
    for chunk in chunks:
        h.update(chunk)


class ShardWriter:
    """Appends encoded sequences to numbered tar shards and records the manifest columns."""

    def __init__(self, fs, root: str, *, shard_bytes: int, prefix: str = "shard-", compression: str | None = None):
        self.fs, self.root, self.shard_bytes, self.prefix = fs, root, shard_bytes, prefix
        self.suffix = ".npy.zst" if compression == "zstd" else ".npy"
        self.shards: list[ShardEntry] = []
        self.keys: list[str] = []
        self.columns = {"length": array("q"), "offset": array("q"), "size": array("q"), "hlen": array("q")}
        self.dtype: str | None = None
        self.step_shape: tuple[int, ...] | None = None
        self.nan = self.inf = 0
        self.shard_nonfinite: list[int] = []  # NaN + inf values per finished shard
        self.framed: list[int] = []  # sequences packed as several zstd frames
        self.frame_ends = array("q")  # their frames' ends, in order
        self._first_key = ""
        self._seen: dict[str, int] = {}  # key -> shard number
        self._file = None
        self._hash_pool = ThreadPoolExecutor(1, thread_name_prefix="streamwin-sha256")

    @property
    def open_shards(self) -> int:
        return len(self.shards) + (self._file is not None)

    def add(self, seq: EncodedSeq, *, borrowed: bool = False) -> int:
        """Append one sequence; returns the bytes written. ``borrowed``: its array belongs to
        a caller that may reuse it afterwards, so it is hashed before this returns."""
        self._check_consistent(seq)
        if self._file is None:
            self._open_next()
        written = self._member(seq.key + self.suffix, (seq.head, seq.body), seq.size, record=seq)
        if seq.meta is not None:
            written += self._member(f"{seq.key}.json", (seq.meta,), len(seq.meta))
        self._seen[seq.key] = len(self.shards)
        if self._pos >= self.shard_bytes:
            self._close_current()
        elif borrowed:
            self._hash.wait()
        return written

    def close(self) -> None:
        if self._file is not None:
            self._close_current()
        self._hash_pool.shutdown()

    def abort(self) -> None:
        """Drop the shard being written: a temporary file is removed, an upload is discarded."""
        self._hash_pool.shutdown(cancel_futures=True)
        f, self._file = self._file, None
        if f is None:
            return
        if self._tmp:
            f.close()
            os.unlink(self._tmp)
        elif hasattr(f, "discard"):
            f.discard()  # fsspec buffered file: abort the (multipart) upload, commit nothing
            f.closed = True  # and never flush it when it is collected

    def _check_consistent(self, seq: EncodedSeq) -> None:
        if seq.key in self._seen:
            raise PackError(f"duplicate sequence key {seq.key!r} (first written to {self._shard_name(self._seen[seq.key])}); "
                            "keys must be unique in a dataset")
        if self.dtype is None:
            self.dtype, self.step_shape, self._first_key = seq.dtype, seq.step_shape, seq.key
        elif (seq.dtype, seq.step_shape) != (self.dtype, self.step_shape):
            raise PackError(
                f"sequence {seq.key!r} has dtype {seq.dtype} and step shape {seq.step_shape}, but "
                f"{self._first_key!r} and the ones before it have dtype {self.dtype} and step shape {self.step_shape}; "
                "pass cast= to convert the dtype, or pack them as separate datasets"
            )

    def _shard_name(self, k: int) -> str:
        return f"{self.prefix}{k:06d}.tar"

    def _open_next(self) -> None:
        self._name = self._shard_name(len(self.shards))
        path = join(self.root, self._name)
        self._tmp = f"{path}.tmp-{os.getpid()}" if is_local(self.fs) else None
        self._file = open(self._tmp, "wb", buffering=1 << 20) if self._tmp else self.fs.open(path, "wb")
        self._hash = _Hasher(self._hash_pool)
        self._pos = self._count = self._steps = self._nonfinite = 0

    def _write(self, data) -> None:
        self._file.write(data)
        self._hash.update(data)

    def _member(self, name: str, chunks: tuple, size: int, record: EncodedSeq | None = None) -> int:
        start = self._pos
        header = tar_header(name, size)
        self._write(header)
        self._pos += len(header)
        if record is not None:
            self.keys.append(record.key)
            cols = self.columns
            cols["length"].append(record.length)
            cols["offset"].append(self._pos)
            cols["size"].append(size)
            cols["hlen"].append(record.hlen)
            if record.frame_ends:
                self.framed.append(len(self.keys) - 1)
                self.frame_ends.extend(record.frame_ends)
            self._count += 1
            self._steps += record.length
            self._nonfinite += record.nan + record.inf
            self.nan, self.inf = self.nan + record.nan, self.inf + record.inf
        for chunk in chunks:
            for part in (chunk if isinstance(chunk, Streamed) else (chunk,)):
                if len(part):
                    self._write(part)
        self._write(npyfmt.tar_padding(size))
        self._pos += size + (-size % npyfmt.BLOCK)
        return self._pos - start

    def _close_current(self) -> None:
        self._write(npyfmt.TAR_END)
        self._pos += len(npyfmt.TAR_END)
        f = self._file
        if self._tmp:
            f.flush()
            os.fsync(f.fileno())
        f.close()
        self._file = None
        if self._tmp:
            os.replace(self._tmp, join(self.root, self._name))
        self.shards.append(ShardEntry(self._name, self._pos, self._hash.hexdigest(), self._count, self._steps))
        self.shard_nonfinite.append(self._nonfinite)

    def manifest(self, compression: str | None, dropped_empty: int, columns: Columns | None) -> Manifest:
        if self.dtype is None:
            raise PackError(f"the source yielded no non-empty sequence ({dropped_empty} empty ones): nothing to pack")
        return build_manifest(np.dtype(self.dtype), self.step_shape, compression, self.shards,
                              self.keys, self.columns, dropped_empty,
                              value_columns=columns.taken if columns else None,
                              left_out_columns=dict(columns.left_out) if columns else None,
                              nonfinite=NonFinite(self.nan, self.inf, tuple(self.shard_nonfinite)),
                              frames=self._frames())

    def _frames(self) -> tuple[int, list[int], array] | None:
        """The manifest's frames field: (steps per frame, framed sequences, frame ends), or None."""
        if not self.framed:
            return None
        step = np.dtype(self.dtype).itemsize * int(np.prod(self.step_shape, dtype=np.int64))
        return frame_rows(step), self.framed, self.frame_ends

    def remove_leftovers(self) -> None:
        """Remove this prefix's shards past the ones just written and temporaries of crashed runs."""
        pattern = re.compile(re.escape(self.prefix) + r"(\d{6})\.tar(\.tmp-\d+)?")
        for path in self.fs.glob(join(self.root, f"{self.prefix}*")):
            m = pattern.fullmatch(path.rsplit("/", 1)[-1])
            if m and (m.group(2) or int(m.group(1)) >= len(self.shards)):
                remove_if_exists(self.fs, path)


def _merged_frames(parts: list[Manifest]) -> tuple[int, np.ndarray, np.ndarray] | None:
    """The frames fields of part manifests as one (sequence numbers shifted past the parts before)."""
    framed = [(m, before) for m, before in zip(parts, np.cumsum([0] + [m.num_sequences for m in parts]))
              if m.frames is not None]
    if not framed:
        return None
    rows = {m.frames.rows for m, _ in framed}
    if len(rows) > 1:
        raise ManifestError(f"cannot merge: the parts' zstd frames hold different step counts {sorted(rows)}")
    return (rows.pop(), np.concatenate([m.frames.seq + before for m, before in framed]),
            np.concatenate([m.frames.ends for m, _ in framed]))


def parse_part(part: str | tuple[int, int] | None) -> tuple[int, int] | None:
    """``"i/n"`` or ``(i, n)`` -> (i, n) with 0 <= i < n; None stays None."""
    if part is None:
        return None
    if isinstance(part, str):
        m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", part)
        if not m:
            raise PackError(f"part must look like 'i/n' (0 <= i < n), got {part!r}")
        part = (int(m.group(1)), int(m.group(2)))
    i, n = part
    if not 0 <= i < n:
        raise PackError(f"part {i}/{n}: need 0 <= i < n")
    return i, n


def part_index_name(i: int, n: int) -> str:
    return f"index.part{i:05d}-of-{n:05d}.json"


def part_indexes(dest: str, *, storage_options: dict | None = None) -> list[str]:
    """Names of the part indexes (``index.partIIIII-of-NNNNN.json``) at ``dest``, sorted."""
    fs, root = url_to_fs(dest, storage_options)
    return sorted(p.rsplit("/", 1)[-1] for p in fs.glob(join(root, "index.part*-of-*.json")))


def _check_options(shard_bytes: int, compression: str | None, empty: str, cast: str | None, workers: int,
                   nan: str) -> None:
    if not _is_int(shard_bytes) or shard_bytes <= 0:
        raise PackError(f"shard_bytes must be a positive integer, got {shard_bytes!r}")
    if nan not in ("count", "raise"):
        raise PackError(f"nan must be 'count' or 'raise', got {nan!r}")
    if compression not in (None, "zstd"):
        raise PackError(f"compression must be None or 'zstd', got {compression!r}")
    if compression == "zstd":
        _zstd()
    if empty not in ("skip", "error"):
        raise PackError(f"empty must be 'skip' or 'error', got {empty!r}")
    if not _is_int(workers) or workers < 1:
        raise PackError(f"workers must be an integer >= 1, got {workers!r}")
    if cast is not None:
        try:
            dt = np.dtype(cast)
        except TypeError as e:
            raise PackError(f"cast={cast!r} is not a numpy dtype") from e
        if dt.hasobject or dt.kind not in "biufc":
            raise PackError(f"cast={cast!r}: only numeric dtypes can be packed")


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def pack(source: Any, dest: str, *, shard_bytes: int = 256 << 20, format: str | None = None,
         workers: int = 1, compression: str | None = None, cast: str | None = None,
         empty: str = "skip", nan: str = "count", part: str | tuple[int, int] | None = None,
         storage_options: dict | None = None, progress: bool = True, **source_options: Any) -> Manifest:
    """Pack a source of sequences into tar shards and an index.json at ``dest`` (any fsspec URL).

    Args:
        source: a directory or file (.npy dir, .npz, parquet, csv, jsonl, text), or an iterable of
            ``(key, array)`` / ``(key, array, meta)``.
        dest: the dataset root. A dataset already there is replaced (its index.json is removed
            first, so a crash in between leaves no dataset rather than a wrong one).
        shard_bytes: a shard is closed once it holds at least this many bytes.
        format: the source format when it cannot be detected (see ``streamwin.sources.FORMATS``).
        workers: processes that read and encode source files in parallel (output is identical).
        compression: None or "zstd" (per member, ``<key>.npy.zst``; byte ranges stay addressable).
        cast: convert every array to this dtype instead of refusing a dtype mismatch.
        empty: "skip" zero-length sequences (counted in ``manifest.dropped_empty``; the
            default) or "error" (PackError naming the first one).
        nan: "count" NaN and inf values (``manifest.nonfinite``: in all and per shard; the
            default) or "raise" (PackError naming the sequence and the step of the first one).
        part: ``"i/n"`` packs the i-th of n disjoint parts of the source (contiguous runs of its
            files; every n-th item of an iterable) into its own shard range and part index;
            `merge` then writes the combined index.json.
        storage_options: fsspec options for ``dest`` (credentials, endpoint_url, ...).
        progress: show a tqdm bar on stderr (bytes, MB/s, sequences, shards).
        source_options: passed to the source reader (e.g. ``id_column=``, ``field=``). The value
            columns a table's values came from are recorded (``manifest.value_columns``), and the
            ones left out with the reason (``manifest.left_out_columns``).

    Returns:
        The manifest written to ``dest``.
    """
    _check_options(shard_bytes, compression, empty, cast, workers, nan)
    part_ = parse_part(part)
    units = _part_units(list_units(source, format=format, **source_options), part_)
    fs, root = url_to_fs(dest, storage_options)
    fs.makedirs(root, exist_ok=True)
    index_name = INDEX_NAME if part_ is None else part_index_name(*part_)
    # from here on the destination is "not finished": a part rewrites shards a merged index may name
    remove_if_exists(fs, join(root, index_name))
    if part_ is not None:
        remove_if_exists(fs, join(root, INDEX_NAME))

    prefix = "shard-" if part_ is None else f"part{part_[0]:05d}-shard-"
    writer = ShardWriter(fs, root, shard_bytes=shard_bytes, prefix=prefix, compression=compression)
    dropped, shown, columns = 0, 0, None
    bar = tqdm(desc=f"pack {dest}", unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    try:
        borrowed = any(u.format == "iterable" for u in units)  # a generator may reuse its arrays
        for batch, skipped, found in _encoded(units, cast, compression, empty, nan, workers):
            dropped += skipped
            columns = _same_columns(columns, found)
            for seq in batch:
                bar.update(writer.add(seq, borrowed=borrowed))
            if len(writer.keys) - shown >= 1000 or len(batch) > 1:
                shown = len(writer.keys)
                # strings: tqdm would print 10000 as 1e+4
                bar.set_postfix(sequences=f"{shown:,}", shards=f"{writer.open_shards:,}", refresh=False)
        writer.close()
        manifest = writer.manifest(compression, dropped, columns)
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    write_manifest(fs, root, manifest, index_name)
    writer.remove_leftovers()
    if manifest.nonfinite.nan or manifest.nonfinite.inf:
        warnings.warn(f"streamwin: packed {manifest.nonfinite.nan:,} NaN and {manifest.nonfinite.inf:,} inf values "
                      f"into {dest} (manifest.nonfinite counts them; nan='raise' refuses them)",
                      NonFiniteWarning, stacklevel=2)
    return manifest


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


def _part_units(units: list[Unit], part: tuple[int, int] | None) -> list[Unit]:
    """The units of part i of n: a contiguous run of files, or every n-th item of an iterable."""
    if part is None:
        return units
    i, n = part
    if len(units) == 1 and units[0].format == "iterable":
        u = units[0]
        return [Unit(u.format, u.path, u.name, u.options, data=_every_nth(u.data, i, n))]
    mine = units[i * len(units) // n : (i + 1) * len(units) // n]
    if not mine:
        raise PackError(f"part {i}/{n} is empty: the source has only {len(units)} file(s); use at most that many parts")
    return mine


def _every_nth(items, i: int, n: int) -> Iterator:
    for j, item in enumerate(items):
        if j % n == i:
            yield item


def _encoded(units: list[Unit], cast: str | None, compression: str | None, empty: str, nan: str,
             workers: int) -> Iterator[tuple[list[EncodedSeq], int, Columns | None]]:
    """(encoded sequences, zero-length ones skipped, a table's value columns when first known)
    per unit or item, in source order."""
    if workers <= 1 or len(units) <= 1:
        for unit in units:  # item by item, so that a huge in-memory iterable is never held whole
            found: list[Columns] = []
            for key, arr, meta in read_unit(unit, found.append):
                enc = encode_sequence(key, arr, meta, cast=cast, compression=compression, empty=empty, nan=nan)
                yield ([enc] if enc is not None else []), int(enc is None), (found.pop() if found else None)
        return
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    spill_dir = tempfile.mkdtemp(prefix="streamwin-pack-", dir=shm)
    tasks = iter([(u, cast, compression, empty, nan, spill_dir) for u in units])
    try:
        with ctx.Pool(workers) as pool:
            # a bounded window of tasks in flight: a slow destination never piles results up in memory
            pending = collections.deque(pool.apply_async(_encode_unit, (t,)) for _, t in zip(range(2 * workers), tasks))
            while pending:
                seqs, skipped, path, sizes, columns = pending.popleft().get()
                for t in tasks:
                    pending.append(pool.apply_async(_encode_unit, (t,)))
                    break
                yield _unspill(seqs, path, sizes), skipped, columns
    finally:
        shutil.rmtree(spill_dir, ignore_errors=True)


def merge(dest: str, *, storage_options: dict | None = None) -> Manifest:
    """Combine the part indexes written by ``pack(..., part="i/n")`` into one index.json.

    Refuses (ManifestError) when a part index is missing, the parts disagree on n, dtype,
    step shape or compression, a key is in two parts, or a shard a part names is missing.
    """
    fs, root = url_to_fs(dest, storage_options)
    names = part_indexes(dest, storage_options=storage_options)
    if not names:
        raise ManifestError(f"no part indexes (index.partIIIII-of-NNNNN.json) at {dest}: run pack with --part i/n first")
    counts = sorted({int(re.search(r"-of-(\d+)", name).group(1)) for name in names})
    if len(counts) > 1:
        raise ManifestError(f"part indexes at {dest} are for different part counts {counts}; remove the stale ones")
    n = counts[0]
    expected = [part_index_name(i, n) for i in range(n)]
    missing = [name for name in expected if name not in names]
    if missing:
        raise ManifestError(f"cannot merge {dest}: {len(missing)} of {n} parts are not finished: {', '.join(missing[:5])}")
    parts = [load_manifest(dest, storage_options, name=name) for name in expected]
    first = parts[0]
    for name, m in zip(expected, parts):
        if (m.dtype, m.step_shape, m.compression) != (first.dtype, first.step_shape, first.compression):
            raise ManifestError(f"{name} has dtype {m.dtype}, step shape {m.step_shape}, compression {m.compression}; "
                                f"{expected[0]} has {first.dtype}, {first.step_shape}, {first.compression}")
        if m.value_columns != first.value_columns:
            raise ManifestError(f"{name} has value columns {m.value_columns}, {expected[0]} has {first.value_columns}")
    present = {p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)}
    absent = [s.name for m in parts for s in m.shards if s.name not in present]
    if absent:
        raise ManifestError(f"cannot merge {dest}: {len(absent)} shard(s) named by the part indexes are missing: {', '.join(absent[:5])}")
    keys = [k for m in parts for k in m.keys(np.arange(m.num_sequences))]
    if len(set(keys)) != len(keys):
        seen: set[str] = set()
        dup = next(k for k in keys if k in seen or seen.add(k))
        raise ManifestError(f"cannot merge {dest}: key {dup!r} appears in more than one part")
    cols = {c: np.concatenate([getattr(m, c) for m in parts]) for c in ("length", "offset", "size", "hlen")}
    counted = all(m.nonfinite is not None for m in parts)
    nonfinite = NonFinite(sum(m.nonfinite.nan for m in parts), sum(m.nonfinite.inf for m in parts),
                          tuple(n for m in parts for n in m.nonfinite.per_shard)) if counted else None
    left_out = {k: v for m in parts for k, v in (m.left_out_columns or {}).items()}
    manifest = build_manifest(first.dtype, first.step_shape, first.compression,
                              [s for m in parts for s in m.shards], keys, cols,
                              sum(m.dropped_empty for m in parts), value_columns=first.value_columns,
                              left_out_columns=left_out if first.value_columns is not None else None,
                              nonfinite=nonfinite, frames=_merged_frames(parts))
    write_manifest(fs, root, manifest)
    return manifest
