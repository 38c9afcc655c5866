"""Read one tar shard front to back: its size, its sha256 and the npy members it holds.

`scan_shard` streams a shard once: the bytes are hashed as they go by, and the tar structure
is walked with ``tarfile`` in stream mode (so pax and GNU long-name headers work, and
``offset_data`` is where a member's content starts). For each ``.npy`` / ``.npy.zst`` member it
parses the npy header (decompressing a zstd member as a stream) without ever unpickling
anything, checks that the content holds exactly the array the header declares, and counts
NaN and inf values as pack does. A member's key is taken as webdataset takes it: its path up
to the first dot of its base name; a continuation member (``<key>.gGGGGGG.npy``, formats/growth.py)
is keyed ``<key>.gGGGGGG``. `scan_all` scans many shards on a few threads and hands
the results over in shard order; ``verify`` and ``index_shards`` (`scan`) are built on it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import tarfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

try:
    import zstandard
except ImportError:  # only .npy.zst members need it
    zstandard = None

from streamwin.errors import ShardError
from streamwin.formats import npy as npyfmt
from streamwin.formats.sums import ShardSumsWriter
from streamwin.packing.nonfinite import count_nonfinite
from streamwin.progress import progress_bar
from streamwin.storage.urls import join

_ZSTD_ERRORS = (zstandard.ZstdError,) if zstandard is not None else ()
CHUNK = 4 << 20  # bytes fetched (and hashed) per read of a shard
THREADS = 4  # shards scanned at once: hashing and I/O release the GIL
_WDS_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's split of a member name: key, extension
_CONTINUATION = re.compile(r"g(\d{6,})\.(npy|npy\.zst)")  # a continuation member's extension: <key>.gGGGGGG.npy


@dataclass(frozen=True)
class NpyMember:
    """One ``.npy`` / ``.npy.zst`` member as found in a shard."""

    name: str
    key: str
    offset: int  # byte offset of the member content in the shard
    size: int  # bytes of content in the tar (compressed size for .npy.zst)
    compressed: bool
    dtype: np.dtype
    shape: tuple[int, ...]
    hlen: int  # npy header length (of the decompressed content)
    nan: int = 0  # NaN values in the array
    inf: int = 0  # +-inf values in the array
    meta: dict | None = None  # its ``<key>.json`` member's object (what pack wrote of its meta dict)


@dataclass(frozen=True)
class ShardScan:
    """What one read of a shard found."""

    name: str
    nbytes: int
    sha256: str
    members: list[NpyMember]
    sums: ShardSumsWriter | None = None  # its chunk and block checksums (formats.checks)


class _HashingReader:
    """A sequential reader that hashes and counts every byte it hands out, and reports progress."""

    def __init__(self, f, on_bytes: Callable[[int], None]):
        self.f, self.on_bytes = f, on_bytes
        self.hash = hashlib.sha256()
        self.sums = ShardSumsWriter()
        self.nbytes = 0
        self._chunk = memoryview(b"")
        self._at = 0

    def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (the rest of the current chunk at most), as a file's read."""
        if self._at >= len(self._chunk):
            data = self.f.read(CHUNK)
            if not data:
                return b""
            self.hash.update(data)
            self.sums.update(data)
            self.nbytes += len(data)
            self.on_bytes(len(data))
            self._chunk, self._at = memoryview(data), 0
        end = len(self._chunk) if n is None or n < 0 else min(len(self._chunk), self._at + n)
        out = bytes(self._chunk[self._at : end])
        self._at = end
        return out

    def drain(self) -> None:
        """Read (and hash) whatever follows the tar's end-of-archive blocks."""
        self._at = len(self._chunk)
        while self.read():
            self._at = len(self._chunk)


class _NonFiniteCounter:
    """Counts the NaN and inf values of array data that arrives in chunks of any size."""

    def __init__(self, dtype: np.dtype):
        self.dtype = dtype if dtype.kind in "fc" else None  # None: integers, nothing to count
        self.nan = self.inf = 0
        self._rest = b""

    def feed(self, data: bytes) -> None:
        """Count the values of the next bytes (a value split across calls is counted once whole)."""
        if self.dtype is None or not data:
            return
        data = self._rest + data
        whole = len(data) - len(data) % self.dtype.itemsize
        nan, inf = count_nonfinite(np.frombuffer(memoryview(data)[:whole], dtype=self.dtype))
        self.nan, self.inf, self._rest = self.nan + nan, self.inf + inf, data[whole:]


def _npy_member(tf: tarfile.TarFile, info: tarfile.TarInfo, key: str, compressed: bool, shard: str) -> NpyMember:
    """Parse a member's npy header and check that the content holds exactly the array it declares.

    A compressed member is decompressed as a stream and only counted past its header, so a
    corrupt or hostile one cannot make the scanner hold more than one chunk. The NaN and inf
    values of float data are counted on the way.
    """
    where = dict(shard=shard, member=info.name, offset=info.offset_data)
    src = tf.extractfile(info)
    if compressed:
        if zstandard is None:
            raise ShardError("reading .npy.zst members needs the zstandard package: pip install 'streamwin[zstd]'", **where)
        src = zstandard.ZstdDecompressor().stream_reader(src, read_across_frames=True)
    try:
        head, dtype, shape, hlen = _read_header(src, where)
        data_bytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        counter = _NonFiniteCounter(dtype)
        counter.feed(head[hlen:])
        if compressed:
            have = len(head) - hlen
            while have <= data_bytes and (chunk := src.read(CHUNK)):
                have += len(chunk)
                counter.feed(chunk)
        else:
            have = info.size - hlen
            while counter.dtype is not None and (chunk := src.read(CHUNK)):  # integers: tarfile skips the data
                counter.feed(chunk)
    except _ZSTD_ERRORS as e:
        raise ShardError(f"cannot decompress member: {e}", **where) from e
    if have != data_bytes:
        more = " or more" if compressed and have > data_bytes else ""
        raise ShardError(f"member holds {have}{more} bytes of array data, its header (dtype {dtype}, shape {shape}) "
                         f"declares {data_bytes}", **where)
    return NpyMember(info.name, key, info.offset_data, info.size, compressed, dtype, shape, hlen,
                     counter.nan, counter.inf)


def _read_header(src, where: dict) -> tuple[bytes, np.dtype, tuple[int, ...], int]:
    """(bytes read, dtype, shape, header length) of the npy header at the start of ``src``; ShardError
    naming ``where`` if it is not one of a plain numeric array of at least one dimension."""
    head = _read_upto(src, 12)
    if len(head) < 10 or head[:6] != b"\x93NUMPY":
        raise ShardError("member is not a .npy array (bad magic bytes or too short)", **where)
    hlen = (10 + int.from_bytes(head[8:10], "little")) if head[6] == 1 else (12 + int.from_bytes(head[8:12], "little"))
    head += _read_upto(src, min(hlen, 1 << 20) - len(head))
    try:
        dtype, shape, hlen = npyfmt.parse_npy_header(head)
    except ValueError as e:
        raise ShardError(str(e), **where) from e
    if not shape:
        raise ShardError("member holds a 0-d array, not a sequence", **where)
    return head, dtype, shape, hlen


def _read_upto(f, n: int) -> bytes:
    """Up to ``n`` bytes, fewer only at the end of ``f``."""
    parts, got = [], 0
    while got < n:
        chunk = f.read(n - got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


MAX_META_BYTES = 1 << 20  # a larger .json member is not read for fields


def _json_object(data: bytes) -> dict | None:
    """A JSON object (never anything else: no code, no pickle), or None when the bytes hold none."""
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def _walk(tf: tarfile.TarFile, shard: str, members: list[NpyMember], current: list) -> None:
    """Append the shard's npy members to ``members``; ``current[0]`` is the member being read."""
    for info in tf:
        current[0] = info
        if not info.isreg():
            continue
        m = _WDS_KEY.match(info.name)
        if m is not None and m.group(2) == "json" and members and members[-1].key == m.group(1) \
                and info.size <= MAX_META_BYTES:  # the meta of the sequence before it: its fields (index)
            meta = _json_object(tf.extractfile(info).read())
            if meta is not None:
                members[-1] = dataclasses.replace(members[-1], meta=meta)
            continue
        cont = _CONTINUATION.fullmatch(m.group(2)) if m is not None else None
        if cont is not None:  # a continuation member of a sequence extended by an append (formats/growth.py)
            members.append(_npy_member(tf, info, f"{m.group(1)}.g{cont.group(1)}", cont.group(2) == "npy.zst", shard))
            continue
        if m is None or m.group(2) not in ("npy", "npy.zst"):
            continue
        members.append(_npy_member(tf, info, m.group(1), m.group(2) == "npy.zst", shard))
    current[0] = None
    # tarfile ends quietly when a header cannot be read whole: a complete shard ends with a zero block
    if tf.fileobj.pos < tf.offset + tarfile.BLOCKSIZE:
        raise ShardError(f"shard ends early, at byte {tf.fileobj.pos}, inside or before the tar header at "
                         f"byte {tf.offset} (no end-of-archive marker)", shard=shard, offset=tf.offset)


def scan_shard(fs: Any, path: str, name: str, url: str, on_bytes: Callable[[int], None] = lambda n: None) -> ShardScan:
    """Read one shard front to back: its size, sha256 and ``.npy`` members (ShardError if malformed)."""
    try:
        f = fs.open(path, "rb")
    except (FileNotFoundError, PermissionError, IsADirectoryError) as e:
        raise ShardError(f"cannot open shard: {e}", shard=url) from e
    with f:
        reader = _HashingReader(f, on_bytes)
        members: list[NpyMember] = []
        current: list = [None]
        tf = None
        try:
            tf = tarfile.open(fileobj=reader, mode="r|")
            _walk(tf, url, members, current)
        except (tarfile.TarError, EOFError, OSError) as e:
            info = current[0]
            raise ShardError(f"not a readable tar shard: {type(e).__name__}: {e}", shard=url,
                             member=info.name if info is not None else None,
                             offset=info.offset_data if info is not None else (tf.offset if tf else 0)) from e
        reader.drain()
    return ShardScan(name, reader.nbytes, reader.hash.hexdigest(), members, reader.sums)


def scan_all(fs: Any, root: str, url: str, names: list[str], total: int, progress: bool, desc: str,
              on_done: Callable[[int, ShardScan | ShardError], None]) -> None:
    """Scan shards on a few threads; call ``on_done(k, scan or error)`` in shard order."""
    bar = progress_bar(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress)

    def scan(k: int) -> ShardScan | ShardError:
        try:
            return scan_shard(fs, join(root, names[k]), names[k], f"{url}/{names[k]}", bar.update)
        except ShardError as e:
            return e

    try:
        with ThreadPoolExecutor(min(THREADS, max(1, len(names)))) as pool:
            for k, result in enumerate(pool.map(scan, range(len(names)))):
                on_done(k, result)
    finally:
        bar.close()
