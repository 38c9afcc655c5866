"""Encode one sequence: validate an array and turn it into the content of its tar member.

``encode_sequence(key, array, meta)`` checks the key, the dtype (numeric only), the shape
(at least one dimension) and the values (NaN and inf counted, or refused), stores multi-byte
values little-endian, and returns an `EncodedSeq`: the member's npy header and the array's
bytes (a view, never copied), or, with zstd, the compressed member and where its frames end.
The writer appends it to a shard; nothing here does I/O.

An array too large to copy at once (over STREAM_BYTES), or an array-like that reads by
slices (h5py, zarr), is encoded as a `Streamed` body instead: its rows are read CHUNK_BYTES
at a time once to count NaN and inf (and, with zstd, to compress frames into a temporary
file), and again when the writer writes them, so pack's memory does not grow with the
sequence. A memory-mapped array gives its pages back after each chunk.
"""
from __future__ import annotations

import functools
import json
import mmap
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from streamwin.errors import PackError
from streamwin.formats import npy as npyfmt
from streamwin.formats import zstd
from streamwin.formats.keys import check_key
from streamwin.packing.fieldcols import json_default
from streamwin.packing.nonfinite import check_cast, count_nonfinite, first_nonfinite_step, refused

STREAM_BYTES = 64 << 20  # a larger array (or any array-like that is not an ndarray) is packed chunk by chunk
CHUNK_BYTES = 8 << 20  # rows copied from such an array at a time


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
    fields: dict | None = None  # the meta dict, whose values become the manifest's fields (packing.fieldcols)

    @property
    def size(self) -> int:
        """Bytes of the member's content."""
        return len(self.head) + len(self.body)


@dataclass(frozen=True)
class EncodeOptions:
    """How every sequence of a pack is encoded; checked when made (PackError naming the argument).

    Args:
        cast: convert every array to this numeric dtype (None: keep each array's dtype).
        compression: None, or "zstd" (members ``<key>.npy.zst``, long ones in frames).
        empty: "skip" zero-length sequences (counted) or "error".
        nan: "count" NaN and inf values or "raise".
    """

    cast: str | None = None
    compression: str | None = None
    empty: str = "skip"
    nan: str = "count"

    def __post_init__(self) -> None:
        if self.nan not in ("count", "raise"):
            raise PackError(f"nan must be 'count' or 'raise', got {self.nan!r}")
        if self.compression not in (None, "zstd"):
            raise PackError(f"compression must be None or 'zstd', got {self.compression!r}")
        if self.compression == "zstd":
            zstd.compressor()  # PackError now, not at the first sequence, when zstandard is missing
        if self.empty not in ("skip", "error"):
            raise PackError(f"empty must be 'skip' or 'error', got {self.empty!r}")
        if self.cast is not None:
            try:
                dt = np.dtype(self.cast)
            except TypeError as e:
                raise PackError(f"cast={self.cast!r} is not a numpy dtype") from e
            if dt.hasobject or dt.kind not in "biufc":
                raise PackError(f"cast={self.cast!r}: only numeric dtypes can be packed")

    @property
    def suffix(self) -> str:
        """The extension of the members: ".npy", or ".npy.zst" with zstd."""
        return ".npy.zst" if self.compression == "zstd" else ".npy"

    def encode(self, key: str, array: Any, meta: dict | None = None) -> EncodedSeq | None:
        """`encode_sequence` with these options."""
        return encode_sequence(key, array, meta, cast=self.cast, compression=self.compression, empty=self.empty,
                               nan=self.nan)


class Streamed:
    """A member's content made chunk by chunk when written (``len`` bytes), for a sequence too large to hold."""

    def __init__(self, nbytes: int, chunks: Callable[[], Iterator[Any]]):
        self.nbytes, self._chunks = nbytes, chunks

    def __len__(self) -> int:
        return self.nbytes

    def __iter__(self) -> Iterator[Any]:
        return self._chunks()


def check_numeric(key: str, dtype: np.dtype) -> None:
    """PackError unless ``dtype`` is numeric (bool, integer, float, complex)."""
    if dtype.hasobject or dtype.kind not in "biufc":
        raise PackError(f"sequence {key!r}: dtype {dtype} is not numeric (object and string arrays are refused)")


def check_empty(key: str, empty: str) -> None:
    """For a zero-length sequence: PackError with ``empty="error"``, else nothing (it is skipped)."""
    if empty == "error":
        raise PackError(f"sequence {key!r} has zero length; pass empty='skip' to skip and count such sequences")


def encode_sequence(key: str, array: Any, meta: dict | None = None, *, cast: str | None = None,
                    compression: str | None = None, empty: str = "skip", nan: str = "count") -> EncodedSeq | None:
    """Validate and encode one sequence; None for a zero-length one when ``empty="skip"``.

    Multi-byte dtypes are stored little-endian (values unchanged), so a big-endian input
    array packs together with little-endian ones. NaN and inf values are counted, or refused
    with ``nan="raise"``.
    """
    check_key(key)
    arr = array if isinstance(array, np.ndarray) or _slices(array) else np.asarray(array)
    if not isinstance(arr, np.ndarray) or arr.nbytes > STREAM_BYTES:
        return _encode_streamed(key, arr, meta, cast=cast, compression=compression, empty=empty, nan=nan)
    check_numeric(key, arr.dtype)
    _check_shape(key, arr.shape)
    if cast is not None:
        check_cast(key, arr, cast)
        arr = arr.astype(cast)
    if arr.shape[0] == 0:
        check_empty(key, empty)
        return None
    arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else None)
    head = npyfmt.npy_header_for(arr.dtype, arr.shape)
    body = arr.reshape(-1).view(np.uint8)
    hlen = len(head)
    frame_ends = None
    if compression == "zstd":
        body, frame_ends = zstd.compress_member(head, body, int(arr.shape[0]))
        head = b""
    meta_bytes = _meta_bytes(key, meta)
    nans, infs = count_nonfinite(arr)
    if nan == "raise" and nans + infs:
        raise refused(key, nans, infs, first_nonfinite_step(arr))
    return EncodedSeq(key, head, body, meta_bytes, int(arr.shape[0]), arr.dtype.str, tuple(arr.shape[1:]), hlen,
                      nans, infs, frame_ends, meta)


def _check_shape(key: str, shape: tuple[int, ...]) -> None:
    if len(shape) == 0:
        raise PackError(f"sequence {key!r}: a 0-d array is not a sequence; give shape [T] or [T, F, ...]")


def _meta_bytes(key: str, meta: dict | None) -> bytes | None:
    if meta is None:
        return None
    try:
        return json.dumps(meta, sort_keys=True, separators=(",", ":"), default=json_default).encode()
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


def _encode_streamed(key: str, arr: Any, meta: dict | None, *, cast: str | None, compression: str | None,
                     empty: str, nan: str) -> EncodedSeq | None:
    """`encode_sequence` for a large or lazy array: rows are copied a chunk at a time, never all at once.

    One pass counts NaN and inf (and, with zstd, compresses frames into a temporary file); the
    member is then written from the input again (or from that file). A memory-mapped input
    gives its pages back after each chunk, so pack's memory does not grow with the sequence.
    """
    src = np.dtype(arr.dtype)
    check_numeric(key, src)
    _check_shape(key, arr.shape)
    length = int(arr.shape[0])
    if length == 0:
        check_empty(key, empty)
        return None
    dtype = np.dtype(cast) if cast is not None else src.newbyteorder("<") if src.byteorder == ">" else src
    shape = (length,) + tuple(int(d) for d in arr.shape[1:])
    head = npyfmt.npy_header_for(dtype, shape)
    hlen = len(head)
    step = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
    rows = zstd.frame_rows(step) if compression == "zstd" else max(1, CHUNK_BYTES // max(step, 1))
    chunks = functools.partial(_row_chunks, arr, dtype, rows, key, cast)
    nans, infs, first_bad, spill, ends = _first_pass(chunks, head if compression == "zstd" else None)
    if nan == "raise" and nans + infs:
        raise refused(key, nans, infs, first_bad)
    if spill is not None:
        body = Streamed(ends[-1], functools.partial(_file_chunks, spill))
        frame_ends = tuple(ends) if len(ends) > 1 else None
        head = b""
    else:
        body = Streamed(length * step, lambda: (c.reshape(-1).view(np.uint8) for _, c in chunks()))
        frame_ends = None
    return EncodedSeq(key, head, body, _meta_bytes(key, meta), length, dtype.str, shape[1:], hlen, nans, infs,
                      frame_ends, meta)


def _first_pass(chunks: Callable[[], Iterator[tuple[int, np.ndarray]]],
                zstd_head: bytes | None) -> tuple[int, int, int | None, Any, list[int] | None]:
    """One pass over the rows: (NaN values, inf values, the first step holding one, and with zstd
    (``zstd_head``: the npy header frame 0 starts with) the frames in a temporary file and their ends)."""
    nans = infs = 0
    first_bad = None
    spill, ends = (tempfile.TemporaryFile(), []) if zstd_head is not None else (None, None)
    for a, chunk in chunks():
        n, i = count_nonfinite(chunk)
        if n + i and first_bad is None:
            first_bad = a + first_nonfinite_step(chunk)
        nans, infs = nans + n, infs + i
        if spill is not None:
            data = chunk.reshape(-1).view(np.uint8)
            spill.write(zstd.compress_frame(zstd_head + data.tobytes() if a == 0 else data))
            ends.append(spill.tell())
    return nans, infs, first_bad, spill, ends


def _row_chunks(arr: Any, dtype: np.dtype, rows: int, key: str, cast: str | None) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, contiguous little-endian copy of ``rows`` rows) of ``arr``; a memory map lets go of each."""
    pages = _mapped_pages(arr)
    for a in range(0, int(arr.shape[0]), rows):
        part = np.asarray(arr[a : a + rows])
        if cast is not None:
            check_cast(key, part, cast)
        yield a, np.array(part, dtype=dtype, order="C", copy=True)
        if pages is not None:
            pages(a + len(part))


def _mapped_pages(arr: Any) -> Callable[[int], None] | None:
    """For an ndarray on a shared (not copy-on-write) numpy memmap: ``f(row)`` drops the map's pages
    before that row from this process (the page cache keeps them); else None."""
    mapping, memmap = _mapping_of(arr)
    if mapping is None or memmap.mode in ("c", "copyonwrite") or not hasattr(mapping, "madvise") or arr.strides[0] <= 0:
        return None
    origin = np.frombuffer(mapping, dtype=np.uint8).ctypes.data
    start = arr.__array_interface__["data"][0] - origin
    done = [0]  # bytes of the map given back so far

    def let_go(row: int) -> None:
        end = (start + row * arr.strides[0]) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > done[0]:
            mapping.madvise(mmap.MADV_DONTNEED, done[0], end - done[0])
            done[0] = end
    return let_go


def _mapping_of(arr: Any) -> tuple[mmap.mmap | None, np.memmap | None]:
    """(the mmap under ``arr``, the numpy memmap made on it), found through ``.base``; (None, None) if none."""
    owner, memmap = arr, None
    while owner is not None and not isinstance(owner, mmap.mmap):
        if isinstance(owner, np.memmap):
            memmap = owner
        owner = getattr(owner, "base", None)
    return (owner, memmap) if memmap is not None else (None, None)


def _file_chunks(f) -> Iterator[bytes]:
    """The content of open file ``f`` from its start, CHUNK_BYTES at a time."""
    f.seek(0)
    while chunk := f.read(CHUNK_BYTES):
        yield chunk
