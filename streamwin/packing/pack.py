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

Encoding is per source file (unit), the same with one process or many: a unit becomes
`Records`, its sequences' tar members laid out end to end in one buffer with their manifest
columns beside them. Many short sequences read as one `Batch` (an .npz, a table) are encoded
with numpy, tar and npy headers for all of them at once (`encode_batch`); the writer cuts
Records into shards with a few writes per shard, so its cost per sequence is a few bytes of
numpy, not Python objects. The per-sequence index (keys, lengths, offsets) goes to files as
it grows (`_SeqIndex`), so pack's memory does not grow with the number of sequences.

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

from streamwin.formats import npy as npyfmt
from streamwin.formats import tar as tarfmt
from streamwin.errors import ManifestError, PackError
from streamwin.formats.keys import check_key
from streamwin.formats.manifest import INDEX_NAME, Frames, Manifest, NonFinite, ShardEntry, build_manifest
from streamwin.packing.inputs import Batch, Columns, Unit, list_units, read_batches, read_unit
from streamwin.storage.manifests import load_manifest, write_manifest
from streamwin.storage.urls import is_local, join, remove_if_exists, url_to_fs

SPILL_MIN = 256 << 10  # a worker's output for a unit smaller than this comes back through the pipe
FRAME_BYTES = 256 << 10  # a longer zstd member is packed as independent frames of about this many bytes of rows
STREAM_BYTES = 64 << 20  # a larger array (or any array-like that is not an ndarray) is packed chunk by chunk
CHUNK_BYTES = 8 << 20  # rows copied from such a source at a time
RECORD_MAX = 1 << 20  # sequences up to this many bytes are copied into a unit's Records; longer ones are written from their arrays
BATCH_SEQS = 8192  # sequences per Records at most
BATCH_BYTES = 16 << 20  # and about this many bytes of values
_USTAR_MAX_SIZE = 8**11 - 1  # the 11 octal digits of a ustar size field
_TEMPLATE = bytearray(tarfmt.tar_header("_", 0))
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
    """``tarfmt.tar_header(name, size)``, byte for byte, ~20x faster: a template with name, size
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


@dataclass(frozen=True, eq=False)
class Records:
    """Encoded sequences as consecutive tar records in one buffer, with their manifest columns.

    Sequence i's records (its npy member: header, content, padding; then its .json member,
    if any) are ``data[ends[i - 1]:ends[i]]``; its npy content starts ``content[i]`` bytes into
    them. Its key is ``keys[key_ends[i - 1]:key_ends[i]]``. ``frames``: (i, frame ends) of the
    members packed as several zstd frames.
    """

    data: Any  # uint8 buffer: ndarray, bytes or memoryview
    ends: np.ndarray
    content: np.ndarray
    keys: np.ndarray  # uint8, every key end to end
    key_ends: np.ndarray
    length: np.ndarray
    size: np.ndarray
    hlen: np.ndarray
    nan: np.ndarray
    inf: np.ndarray
    dtype: str
    step_shape: tuple[int, ...]
    frames: tuple[tuple[int, tuple[int, ...]], ...] = ()

    def __len__(self) -> int:
        return len(self.ends)

    @property
    def nbytes(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def key(self, i: int) -> str:
        start = int(self.key_ends[i - 1]) if i else 0
        return bytes(self.keys[start : int(self.key_ends[i])]).decode("ascii")


def records_of(seqs: list[EncodedSeq], suffix: str) -> Records:
    """One Records for sequences encoded one by one (``suffix``: ".npy" or ".npy.zst"), laid out as
    `ShardWriter.add` writes them; all must have one dtype and step shape."""
    parts, ends, content, at = [], [], [], 0
    for s in seqs:
        head = tar_header(s.key + suffix, s.size)
        parts += [head, s.head, s.body, tarfmt.tar_padding(s.size)]
        at += len(head) + s.size + (-s.size % tarfmt.BLOCK)
        if s.meta is not None:
            meta_head = tar_header(f"{s.key}.json", len(s.meta))
            parts += [meta_head, s.meta, tarfmt.tar_padding(len(s.meta))]
            at += len(meta_head) + len(s.meta) + (-len(s.meta) % tarfmt.BLOCK)
        content.append(len(head))
        ends.append(at)
    col = lambda name: np.array([getattr(s, name) for s in seqs], dtype=np.int64)  # noqa: E731
    keys = "".join(s.key for s in seqs).encode("ascii")
    return Records(np.frombuffer(b"".join(parts), dtype=np.uint8), np.array(ends, dtype=np.int64),
                   np.array(content, dtype=np.int64), np.frombuffer(keys, dtype=np.uint8),
                   np.cumsum([len(s.key) for s in seqs], dtype=np.int64), col("length"), col("size"), col("hlen"),
                   col("nan"), col("inf"), seqs[0].dtype, seqs[0].step_shape,
                   tuple((i, s.frame_ends) for i, s in enumerate(seqs) if s.frame_ends))


def batch_fits(batch: Batch) -> bool:
    """Whether `encode_batch` takes this batch: every sequence is short (at most RECORD_MAX bytes)."""
    steps = np.diff(batch.bounds)
    step_bytes = batch.values.dtype.itemsize * int(np.prod(batch.values.shape[1:], dtype=np.int64))
    return len(batch) > 0 and int(steps.max()) * step_bytes <= RECORD_MAX


def encode_batch(batch: Batch, *, cast: str | None = None, empty: str = "skip",
                 nan: str = "count") -> tuple[Records | None, int]:
    """(Records, zero-length sequences skipped) for many short uncompressed sequences at once:
    byte for byte what `encode_sequence` and `records_of` make of them one by one, with the
    checks and errors of `encode_sequence`, but headers made with numpy for all of them."""
    values, keys, starts, lengths, skipped = _nonempty(batch, empty)
    if not keys:
        return None, skipped
    if values.dtype.hasobject or values.dtype.kind not in "biufc":
        raise PackError(f"sequence {keys[0]!r}: dtype {values.dtype} is not numeric (object and string arrays are refused)")
    if cast is not None:
        if np.dtype(cast).kind not in "fc" and sum(count_nonfinite(values)):
            nans, infs = _nonfinite_per_sequence(values, starts)
            i = int(np.flatnonzero(nans + infs)[0])
            _check_cast(keys[i], values[starts[i] : starts[i] + lengths[i]], cast)
        values = values.astype(cast)
    values = np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("<") if values.dtype.byteorder == ">" else None)
    nans, infs = _nonfinite_per_sequence(values, starts)
    if nan == "raise" and (nans.any() or infs.any()):
        i = int(np.flatnonzero(nans + infs)[0])
        raise PackError(f"sequence {keys[i]!r} has {nans[i]} NaN and {infs[i]} inf values, the first at step "
                        f"{first_nonfinite_step(values[starts[i] : starts[i] + lengths[i]])}; clean them, or pack "
                        "with nan='count' to count them")
    step_shape = tuple(values.shape[1:])
    step_bytes = values.dtype.itemsize * int(np.prod(step_shape, dtype=np.int64))
    uniq, which = np.unique(lengths, return_inverse=True)
    heads = [np.frombuffer(npyfmt.npy_header_for(values.dtype, (int(t),) + step_shape), dtype=np.uint8) for t in uniq]
    hlen = np.array([len(h) for h in heads], dtype=np.int64)[which]
    size = hlen + lengths * step_bytes
    ends = np.cumsum(tarfmt.BLOCK + size + (-size % tarfmt.BLOCK))
    blob = np.frombuffer("".join(keys).encode("ascii"), dtype=np.uint8)
    key_ends = np.cumsum([len(k) for k in keys], dtype=np.int64)
    out = np.zeros(int(ends[-1]), dtype=np.uint8)
    first = ends - (tarfmt.BLOCK + size + (-size % tarfmt.BLOCK))
    out.reshape(-1, tarfmt.BLOCK)[first // tarfmt.BLOCK] = tar_headers(blob, key_ends, ".npy", size)
    _copy_contents(out, first + tarfmt.BLOCK, heads, which, values.reshape(-1).view(np.uint8),
                   starts * step_bytes, lengths * step_bytes)
    return Records(out, ends, np.full(len(keys), tarfmt.BLOCK, dtype=np.int64), blob, key_ends, lengths, size, hlen,
                   nans, infs, values.dtype.str, step_shape), skipped


def _nonempty(batch: Batch, empty: str) -> tuple[np.ndarray, list[str], np.ndarray, np.ndarray, int]:
    """(values, keys, first steps, lengths) of the batch's non-empty sequences, and how many were empty."""
    lengths = np.diff(batch.bounds)
    keep = lengths > 0
    if keep.all():
        return batch.values, list(batch.keys), batch.bounds[:-1], lengths, 0
    if empty == "error":
        raise PackError(f"sequence {batch.keys[int(np.argmin(keep))]!r} has zero length; pass empty='skip' to skip "
                        "and count such sequences")
    keys = [k for k, ok in zip(batch.keys, keep.tolist()) if ok]
    return batch.values, keys, batch.bounds[:-1][keep], lengths[keep], int((~keep).sum())


def _nonfinite_per_sequence(values: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(NaN values, inf values) of each sequence, the sequences starting at ``starts`` and tiling
    ``values``: one vectorized pass when all are finite."""
    zeros = np.zeros(len(starts), dtype=np.int64)
    if not sum(count_nonfinite(values)):
        return zeros, zeros.copy()
    rows = values.reshape(len(values), -1)
    nans = np.add.reduceat(np.isnan(rows).sum(axis=1), starts)
    bad = np.add.reduceat((~np.isfinite(rows)).sum(axis=1), starts)
    return nans.astype(np.int64), (bad - nans).astype(np.int64)


def tar_headers(keys: np.ndarray, key_ends: np.ndarray, suffix: str, sizes: np.ndarray) -> np.ndarray:
    """[n, 512] ustar headers of members ``<key><suffix>`` of these sizes: `tar_header` of each, byte
    for byte (names up to 100 bytes, sizes below 8 GiB), made for all at once with numpy."""
    n = len(sizes)
    hdr = np.tile(np.frombuffer(bytes(_TEMPLATE), dtype=np.uint8), (n, 1))
    klen = np.diff(key_ends, prepend=0)
    rows = np.repeat(np.arange(n), klen)
    hdr[rows, np.arange(len(keys)) - np.repeat(key_ends - klen, klen)] = keys
    for k, ch in enumerate(suffix.encode("ascii")):
        hdr[np.arange(n), klen + k] = ch
    for k in range(11):  # size: 11 octal digits and a NUL
        hdr[:, 124 + k] = ord("0") + ((sizes >> (3 * (10 - k))) & 7)
    checksum = hdr.sum(axis=1, dtype=np.int64)  # with the checksum field as 8 spaces
    for k in range(6):  # "%06o\0", the eighth byte stays a space
        hdr[:, 148 + k] = ord("0") + ((checksum >> (3 * (5 - k))) & 7)
    hdr[:, 154] = 0
    return hdr


def _copy_contents(out: np.ndarray, at: np.ndarray, heads: list[np.ndarray], which: np.ndarray,
                   data: np.ndarray, src: np.ndarray, nbytes: np.ndarray) -> None:
    """Each sequence's npy header ``heads[which[i]]`` and its ``nbytes[i]`` bytes of ``data`` from ``src[i]``, at ``out[at[i]:]``."""
    for a, h, s, n in zip(at.tolist(), which.tolist(), src.tolist(), nbytes.tolist()):
        head = heads[h]
        b = a + len(head)
        out[a:b] = head
        out[b : b + n] = data[s : s + n]


class _SeqIndex:
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
        self._dir = tempfile.mkdtemp(prefix="streamwin-index-")
        self._files = {name: open(os.path.join(self._dir, name), "wb") for name in self.COLUMNS}
        self._rows: list[tuple[bytes, int, int, int, int]] = []

    def __len__(self) -> int:
        return self._flushed + len(self._rows)

    def append(self, key: str, length: int, offset: int, size: int, hlen: int) -> None:
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
        for f in self._files.values():
            f.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def duplicate_key(keys: np.ndarray, key_ends: np.ndarray, chunk: int = 1 << 16) -> tuple[int, int] | None:
    """(i, j), i < j, two sequences with the same key, or None: a 64-bit hash of every key,
    sorted in place (8 bytes per key), and keys of equal hashes compared byte for byte."""
    n = len(key_ends)
    hashes = np.empty(n, dtype=np.uint64)
    for a in range(0, n, chunk):
        hashes[a : a + chunk] = _key_hashes(keys, key_ends, a, min(a + chunk, n))
    hashes.sort()
    twice = np.unique(hashes[1:][hashes[1:] == hashes[:-1]])
    if not len(twice):
        return None
    del hashes
    found: dict[bytes, int] = {}
    for a in range(0, n, chunk):  # rare: find the sequences of those hashes again
        for i in (a + np.flatnonzero(np.isin(_key_hashes(keys, key_ends, a, min(a + chunk, n)), twice))).tolist():
            key = bytes(keys[(int(key_ends[i - 1]) if i else 0) : int(key_ends[i])])
            if key in found:
                return found[key], i
            found[key] = i
    return None


def _key_hashes(keys: np.ndarray, key_ends: np.ndarray, a: int, b: int) -> np.ndarray:
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


@dataclass
class Tally:
    """What `encode_units` learns besides the parts: zero-length sequences skipped, a table's value columns."""

    skipped: int = 0
    columns: Columns | None = None


def encode_units(units: list[Unit], cast: str | None, compression: str | None, empty: str, nan: str,
                 tally: Tally) -> Iterator[EncodedSeq | Records]:
    """The parts of some source files (a task: see `tasks_of`) to write, in order: Records of their
    short sequences (made by `encode_batch`, BATCH_SEQS at a time, where a source gives a Batch),
    and long ones as EncodedSeq, written from their arrays. Counts skipped sequences and value
    columns in ``tally``."""
    suffix = ".npy.zst" if compression == "zstd" else ".npy"
    pending: list[EncodedSeq] = []
    found: list[Columns] = []
    for got in (got for unit in units for got in read_batches(unit, found.append)):
        if found:
            tally.columns = found.pop()
        if isinstance(got, Batch) and compression is None and batch_fits(got):
            if pending:
                yield records_of(pending, suffix)
                pending = []
            for part in _sub_batches(got):
                rec, empties = encode_batch(part, cast=cast, empty=empty, nan=nan)
                tally.skipped += empties
                if rec is not None:
                    yield rec
            continue
        for key, arr, meta in got.items() if isinstance(got, Batch) else (got,):
            enc = encode_sequence(key, arr, meta, cast=cast, compression=compression, empty=empty, nan=nan)
            if enc is None:
                tally.skipped += 1
                continue
            small = not isinstance(enc.body, Streamed) and enc.size <= RECORD_MAX
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
        yield Batch(batch.keys[i:j], batch.values[bounds[i] : bounds[j]], bounds[i : j + 1] - bounds[i])
        i = j


def _encode_unit(args: tuple) -> tuple[list[EncodedSeq | Records], int, str | None, list[int], Columns | None]:
    """Worker-process task: `encode_units` of a task's source units.

    Unless the unit is small, the parts' contents travel back through one spill file in
    ``spill_dir`` (RAM-backed /dev/shm where there is one), about twice as fast as through the
    result pipe; the parts then come back empty, with their content sizes in order (see `_unspill`).
    """
    units, cast, compression, empty, nan, spill_dir = args
    tally = Tally()
    parts = list(encode_units(units, cast, compression, empty, nan, tally))
    skipped, columns = tally.skipped, tally.columns
    sizes = [p.nbytes if isinstance(p, Records) else p.size for p in parts]
    if sum(sizes) < SPILL_MIN:
        return parts, skipped, None, sizes, columns
    fd, path = tempfile.mkstemp(dir=spill_dir, suffix=".spill")
    with os.fdopen(fd, "wb") as f:
        for p in parts:
            for chunk in (p.data,) if isinstance(p, Records) else (p.head, p.body):
                for piece in (chunk if isinstance(chunk, Streamed) else (chunk,)):
                    f.write(piece)
    empty_parts = [dataclasses.replace(p, data=b"") if isinstance(p, Records) else dataclasses.replace(p, head=b"", body=b"")
                   for p in parts]
    return empty_parts, skipped, path, sizes, columns


def _unspill(parts: list[EncodedSeq | Records], path: str | None, sizes: list[int]) -> list[EncodedSeq | Records]:
    """The parts of `_encode_unit` with their contents back (views of the spill file, read whole)."""
    if path is None:
        return parts
    with open(path, "rb") as f:
        view = memoryview(f.read())
    os.unlink(path)
    bounds = np.cumsum([0] + sizes).tolist()
    return [dataclasses.replace(p, data=view[a:b]) if isinstance(p, Records) else dataclasses.replace(p, body=view[a:b])
            for p, a, b in zip(parts, bounds, bounds[1:])]


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
        self.index = _SeqIndex()
        self.dtype: str | None = None
        self.step_shape: tuple[int, ...] | None = None
        self.nan = self.inf = 0
        self.shard_nonfinite: list[int] = []  # NaN + inf values per finished shard
        self.framed: list[int] = []  # sequences packed as several zstd frames
        self.frame_ends = array("q")  # their frames' ends, in order
        self._first_key = ""
        self._file = None
        self._hash_pool = ThreadPoolExecutor(1, thread_name_prefix="streamwin-sha256")

    @property
    def open_shards(self) -> int:
        return len(self.shards) + (self._file is not None)

    @property
    def count(self) -> int:
        """Sequences written so far."""
        return len(self.index)

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
            self._index_rows(rec, i, stop, self._pos - base)
            self._pos += end - base
            written += end - base
            if self._pos >= self.shard_bytes:
                self._close_current()
            i = stop
        return written

    def _index_rows(self, rec: Records, i: int, stop: int, shift: int) -> None:
        """Record sequences i..stop-1 of ``rec``, whose records start ``shift`` bytes into the shard."""
        first = self.count
        for k, ends in rec.frames:
            if i <= k < stop:
                self.framed.append(first + k - i)
                self.frame_ends.extend(ends)
        k0 = int(rec.key_ends[i - 1]) if i else 0
        begin = (rec.ends - np.diff(rec.ends, prepend=0))[i:stop]
        self.index.extend(rec.keys[k0 : int(rec.key_ends[stop - 1])], rec.key_ends[i:stop] - k0,
                          length=rec.length[i:stop], offset=shift + begin + rec.content[i:stop],
                          size=rec.size[i:stop], hlen=rec.hlen[i:stop])
        nan, inf = int(rec.nan[i:stop].sum()), int(rec.inf[i:stop].sum())
        self._count += stop - i
        self._steps += int(rec.length[i:stop].sum())
        self._nonfinite += nan + inf
        self.nan, self.inf = self.nan + nan, self.inf + inf

    def close(self) -> None:
        if self._file is not None:
            self._close_current()
        self._hash_pool.shutdown()

    def abort(self) -> None:
        """Drop the shard being written: a temporary file is removed, an upload is discarded."""
        self._hash_pool.shutdown(cancel_futures=True)
        self.index.discard()
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
            if record.frame_ends:
                self.framed.append(self.count)
                self.frame_ends.extend(record.frame_ends)
            self.index.append(record.key, record.length, self._pos, size, record.hlen)
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
        self.shards.append(ShardEntry(self._name, self._pos, self._hash.hexdigest(), self._count, self._steps))
        self.shard_nonfinite.append(self._nonfinite)

    def manifest(self, compression: str | None, dropped_empty: int, columns: Columns | None) -> Manifest:
        if self.dtype is None:
            raise PackError(f"the source yielded no non-empty sequence ({dropped_empty} empty ones): nothing to pack")
        cols = self.index.columns()
        keys, key_ends = cols.pop("keys"), cols.pop("key_ends")
        twice = duplicate_key(keys, key_ends)
        if twice is not None:
            starts = np.cumsum([0] + [s.num_sequences for s in self.shards])
            i, j = (self._shard_name(int(np.searchsorted(starts, k, side="right")) - 1) for k in twice)
            key = bytes(keys[(int(key_ends[twice[1] - 1])) : int(key_ends[twice[1]])]).decode("ascii")
            raise PackError(f"duplicate sequence key {key!r} (first written to {i}, again to {j}); "
                            "keys must be unique in a dataset")
        frames = None
        if self.framed:
            step = np.dtype(self.dtype).itemsize * int(np.prod(self.step_shape, dtype=np.int64))
            frames = Frames.make(frame_rows(step), np.asarray(self.framed), np.asarray(self.frame_ends), cols["length"])
        return Manifest(dtype=np.dtype(self.dtype), step_shape=tuple(self.step_shape), compression=compression,
                        shards=tuple(self.shards), key_blob=memoryview(keys), key_ends=key_ends,
                        dropped_empty=dropped_empty, value_columns=columns.taken if columns else None,
                        left_out_columns=dict(columns.left_out) if columns else None,
                        nonfinite=NonFinite(self.nan, self.inf, tuple(self.shard_nonfinite)), frames=frames, **cols)

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
        for parts, skipped, found in _encoded(units, cast, compression, empty, nan, workers):
            dropped += skipped
            columns = _same_columns(columns, found)
            for part in parts:
                bar.update(writer.add(part, borrowed=borrowed))
            if writer.count - shown >= 1000 or parts and not isinstance(parts[0], EncodedSeq):
                shown = writer.count
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


GROUP_FORMATS = ("npy", "text")  # one sequence per file: files are encoded TASK_FILES at a time
TASK_FILES = 256


def tasks_of(units: list[Unit]) -> list[list[Unit]]:
    """Units in tasks, in order: runs of up to TASK_FILES one-sequence files, any other unit alone
    (a table reports its own value columns)."""
    tasks: list[list[Unit]] = []
    for unit in units:
        if tasks and unit.format in GROUP_FORMATS and tasks[-1][-1].format in GROUP_FORMATS and len(tasks[-1]) < TASK_FILES:
            tasks[-1].append(unit)
        else:
            tasks.append([unit])
    return tasks


def _encoded(units: list[Unit], cast: str | None, compression: str | None, empty: str, nan: str,
             workers: int) -> Iterator[tuple[list[EncodedSeq | Records], int, Columns | None]]:
    """(parts to write, zero-length sequences skipped, a table's value columns when first known)
    per task of source files (`encode_units`), or per item of an iterable, in source order."""
    tasks = tasks_of(units)
    if workers <= 1 or len(tasks) <= 1:
        for task in tasks:
            if task[0].format != "iterable":
                tally = Tally()
                for part in encode_units(task, cast, compression, empty, nan, tally):
                    yield [part], 0, None
                yield [], tally.skipped, tally.columns
                continue
            for key, arr, meta in read_unit(task[0]):  # item by item: a huge in-memory iterable is never held whole
                enc = encode_sequence(key, arr, meta, cast=cast, compression=compression, empty=empty, nan=nan)
                yield ([enc] if enc is not None else []), int(enc is None), None
        return
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    spill_dir = tempfile.mkdtemp(prefix="streamwin-pack-", dir=shm)
    args = iter([(t, cast, compression, empty, nan, spill_dir) for t in tasks])
    try:
        with ctx.Pool(workers) as pool:
            # a bounded window of tasks in flight: a slow destination never piles results up in memory
            pending = collections.deque(pool.apply_async(_encode_unit, (a,)) for _, a in zip(range(2 * workers), args))
            while pending:
                parts, skipped, path, sizes, columns = pending.popleft().get()
                for a in args:
                    pending.append(pool.apply_async(_encode_unit, (a,)))
                    break
                yield _unspill(parts, path, sizes), skipped, columns
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
