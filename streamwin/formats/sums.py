"""One shard's checksums: hashed as pack writes it, laid out in its sums file, and checked against bytes read.

Every shard is cut into chunks of ``CHUNK`` bytes and into blocks of ``BLOCK`` bytes from
its first byte (the last of each shorter), each with a checksum: the low 32 bits of xxh3_64
(``ALGORITHM``). ``ShardSumsWriter`` hashes a shard as its bytes go by and lays its sums out
as its sums file (``<shard>.sums``): a table of page digests, then the pages. Page p holds
the records of blocks [p * PAGE_BLOCKS, (p + 1) * PAGE_BLOCKS) (4 MiB of shard), and block
j's record is its block sum followed by the sums of its chunks, all little-endian::

    [xxh3_64 of page 0, page 1, ...: uint64 each] [block 0, chunk 0..63] [block 1, chunk 64..127] ...

``Layout`` says where each page lies, ``parse_pages`` checks pages against the table and
takes their sums out, and ``SumsSpan.bad`` checks bytes read against them: the blocks a read
covers whole with one xxh3 call each, the chunks at its ends (and of a block that failed)
one by one. Pure numpy and xxhash, no I/O (formats/checks.py says how a dataset names them).
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field

import numpy as np
import xxhash

ALGORITHM = "xxh3_64_low32"  # the low 32 bits of XXH3_64bits(bytes), seed 0, little-endian uint32
CHUNK = 4096  # bytes per chunk: the page of a local mapping; a read's extra is at most one chunk at either end
BLOCK = 256 << 10  # bytes per block: verified in one call where a read covers it whole
PAGE_BLOCKS = 16  # blocks per page of a sums file: 4 MiB of shard, 4,160 bytes of sums
SUFFIX = ".sums"  # shard-...tar -> shard-...tar.sums
UNLOCKED = 64 << 10  # pieces at least this long are hashed with the GIL released (see sums_of)
_MASK = 0xFFFFFFFF
_hash = xxhash.xxh3_64_intdigest


def chunk_count(nbytes: int, chunk: int) -> int:
    """Chunks of a shard of ``nbytes`` bytes (the last may be shorter; an empty shard has none)."""
    return -(-nbytes // chunk)


def _hash_unlocked(piece) -> int:
    """xxh3_64 of ``piece`` with the GIL released while it hashes, so a reading thread verifies beside the thread
    that gathers batches: xxhash's hasher objects release it from 64 KiB (xxhash 4.1's one-shot functions do too,
    read in its binary; not every version we accept does)."""
    return xxhash.xxh3_64(piece).intdigest()


def sums_of(data, chunk: int = CHUNK) -> np.ndarray:
    """The checksum of each ``chunk``-byte piece of ``data`` (any bytes-like), the last one possibly shorter.

    Pieces of UNLOCKED bytes or more are hashed with the GIL released; smaller ones (a chunk) with
    it held, since hashing a chunk costs less than handing the GIL over and back."""
    return (_digests(_raw(data), chunk) & _MASK).astype(np.uint32)  # the low 32 bits


def _raw(data) -> np.ndarray:
    """``data`` (any bytes-like) as a 1-D uint8 array, without a copy (a uint8 array is taken as it is)."""
    if isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 1:
        return data
    return np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)


def _digests(raw: np.ndarray, piece: int) -> np.ndarray:
    """The full xxh3_64 of each ``piece``-byte piece of ``raw`` (the last possibly shorter), one call each."""
    whole = len(raw) // piece
    hash_ = _hash if piece < UNLOCKED else _hash_unlocked
    # the one Python step per piece: rows of a 2-D view cost less to hand over than memoryview slices
    got = np.fromiter(map(hash_, raw[: whole * piece].reshape(whole, piece)), dtype=np.uint64, count=whole)
    if len(raw) > whole * piece:
        got = np.append(got, np.uint64(hash_(raw[whole * piece :])))
    return got


def digest_of(data) -> str:
    """The digest index.json keeps of a sums file's page table (and the table of each page): xxh3_64, hex."""
    return f"{_hash(data):016x}"


class ChunkSums:
    """Checksums of a stream of bytes that arrives in pieces of any size (a shard as pack writes it).

    ``update`` takes the next bytes; ``finish`` returns one checksum per ``chunk`` bytes seen,
    the last chunk possibly shorter. Whole chunks are hashed straight from the caller's
    buffer; only a chunk split across calls is copied.
    """

    def __init__(self, chunk: int = CHUNK):
        self.chunk = chunk
        self._sums: list[int] = []
        self._part = bytearray()  # the start of a chunk split across calls

    def update(self, data) -> None:
        """Hash the next bytes of the stream."""
        view = memoryview(data).cast("B")
        at, c = 0, self.chunk
        if self._part:
            at = min(c - len(self._part), len(view))
            self._part += view[:at]
            if len(self._part) < c:
                return
            self._sums.append(_hash(bytes(self._part)) & _MASK)
            self._part.clear()
        whole = at + (len(view) - at) // c * c
        if whole > at:
            self._sums.extend(sums_of(view[at:whole], c).tolist())
        self._part += view[whole:]

    def finish(self) -> np.ndarray:
        """Every chunk's checksum (the last chunk may be short); the stream ends here."""
        if self._part:
            self._sums.append(_hash(bytes(self._part)) & _MASK)
            self._part.clear()
        return np.asarray(self._sums, dtype=np.uint32)


@dataclass(frozen=True)
class Layout:
    """Where a shard's sums lie in its sums file (see the module docstring): pure arithmetic, no I/O."""

    nbytes: int  # the shard's bytes
    chunk: int = CHUNK
    block: int = BLOCK
    page_blocks: int = PAGE_BLOCKS
    blocks: int = field(init=False)  # block sums (the last block may be short)
    pages: int = field(init=False)
    record_words: int = field(init=False)  # uint32 words of a whole block's record: its sum and its chunks' sums
    table_bytes: int = field(init=False)
    page_bytes: int = field(init=False)  # bytes of a whole page
    file_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        blocks = chunk_count(self.nbytes, self.block)
        pages = chunk_count(blocks, self.page_blocks)
        words = 1 + self.block // self.chunk
        for name, value in (("blocks", blocks), ("pages", pages), ("record_words", words), ("table_bytes", 8 * pages),
                            ("page_bytes", 4 * self.page_blocks * words),
                            ("file_bytes", 8 * pages + 4 * (blocks + chunk_count(self.nbytes, self.chunk)))):
            object.__setattr__(self, name, value)

    def page_range(self, p: int) -> tuple[int, int]:
        """Bytes [a, b) of page p in the sums file."""
        a = self.table_bytes + p * self.page_bytes
        return a, min(a + self.page_bytes, self.file_bytes)

    def pages_of(self, lo: int, hi: int) -> tuple[int, int]:
        """Pages [p0, p1) that hold the sums of shard bytes [lo, hi)."""
        span = self.block * self.page_blocks
        return lo // span, max(chunk_count(hi, span), lo // span + 1)


@functools.lru_cache(maxsize=1024)
def layout_of(nbytes: int, chunk: int, block: int, page_blocks: int) -> Layout:
    """The Layout of a shard's sums file, made once per size (shards of a dataset mostly share one)."""
    return Layout(nbytes, chunk, block, page_blocks)


def sums_file(fine: np.ndarray, coarse: np.ndarray, layout: Layout) -> bytes:
    """The sums file of a shard whose chunk sums are ``fine`` and block sums ``coarse``."""
    per = layout.block // layout.chunk
    words = np.empty(len(coarse) + len(fine), dtype="<u4")
    words[np.arange(len(coarse)) * (per + 1)] = coarse
    i = np.arange(len(fine))
    words[i // per * (per + 1) + 1 + i % per] = fine
    body = words.tobytes()
    base = layout.table_bytes
    table = np.array([_hash(body[a - base : b - base]) for a, b in map(layout.page_range, range(layout.pages))],
                     dtype="<u8")
    return table.tobytes() + body


def parse_pages(data, layout: Layout, p0: int, table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(block sums, chunk sums) of pages p0.. of a sums file, whose bytes (whole pages) are ``data``; ValueError
    naming the first page whose xxh3 differs from the page table ``table``."""
    raw = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    pages = max(0, min(-(-len(raw) // layout.page_bytes), len(table) - p0))
    end = layout.page_range(p0 + pages - 1)[1] - layout.page_range(p0)[0] if pages > 0 else 0
    digests = np.empty(pages, dtype=np.uint64)  # a page's full xxh3_64, one call per page
    whole = min(len(raw) // layout.page_bytes, pages)
    digests[:whole] = np.fromiter(map(_hash, raw[: whole * layout.page_bytes].reshape(whole, layout.page_bytes)),
                                  dtype=np.uint64, count=whole)
    if whole < pages:
        digests[whole] = _hash(raw[whole * layout.page_bytes :])
    wrong = np.flatnonzero(digests != table[p0 : p0 + pages])
    if len(raw) != end or len(wrong):
        p = p0 + (int(wrong[0]) if len(wrong) else max(pages - 1, 0))
        a, b = layout.page_range(p)
        raise ValueError(f"page {p} (bytes {a}..{b}) differs from what its page table says")
    words = np.frombuffer(raw, dtype="<u4")
    per = layout.record_words
    full = len(words) // per
    records = words[: full * per].reshape(full, per)
    coarse, fine = np.ascontiguousarray(records[:, 0]), records[:, 1:].ravel()  # copies: ``data`` is not held
    if full * per < len(words):  # the shard's last block, shorter
        coarse = np.append(coarse, words[full * per])
        fine = np.concatenate([fine, words[full * per + 1 :]])
    return coarse.astype(np.uint32, copy=False), fine.astype(np.uint32, copy=False)


@dataclass(frozen=True, eq=False)
class SumsSpan:
    """The checksums that cover some bytes of one shard: ``fine[i]`` is chunk ``fine_at + i``'s, ``coarse[i]``
    block ``coarse_at + i``'s (no blocks: ``block`` 0, as in manifests without sums files)."""

    nbytes: int  # the shard's bytes
    chunk: int
    fine_at: int
    fine: np.ndarray
    block: int = 0
    coarse_at: int = 0
    coarse: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint32))

    def bad(self, at: int, data) -> list[tuple[int, int]]:
        """Byte ranges [a, b) of the shard whose bytes in ``data`` (shard bytes from ``at``, a chunk boundary, up to
        a chunk boundary or the shard's end) differ from what was packed, to the chunk, neighbours merged.

        The blocks ``data`` covers whole are hashed in one call each; the chunks at either
        end, and those of a block that failed, one call each. Each hash is compared as it
        is, with no copy of ``data`` (a mapped range is hashed where it lies).
        """
        c, B = self.chunk, self.block
        raw = _raw(data)
        end = at + len(raw)
        if at % c or at < 0 or end > self.nbytes:
            raise ValueError(f"a verified range starts at a chunk boundary inside the shard, not bytes {at}..{end}")
        if not B:
            return self._chunks(raw, at, at, end)
        a = -(-at // B) * B
        z = end if end == self.nbytes else end // B * B
        if z <= a:
            return self._chunks(raw, at, at, end)
        got = _digests(raw[a - at : z - at], B)
        j = a // B - self.coarse_at
        want = self.coarse[j : j + len(got)]
        if j < 0 or len(want) < len(got):
            raise ValueError(f"bytes {a}..{z} lie past the block sums held ({len(self.coarse)} from {self.coarse_at})")
        out = self._chunks(raw, at, at, a) if a > at else []
        for j in np.flatnonzero((got & _MASK) != want).tolist():
            out += self._chunks(raw, at, a + j * B, min(a + (j + 1) * B, z))
        if end > z:
            out += self._chunks(raw, at, z, end)
        return _merged(out) if len(out) > 1 else out

    def _chunks(self, raw: np.ndarray, at: int, a: int, b: int) -> list[tuple[int, int]]:
        """The damaged chunks of shard bytes [a, b) (``raw`` holds the bytes from ``at``)."""
        if b <= a:
            return []
        c = self.chunk
        got = _digests(raw[a - at : b - at], c)
        j0 = a // c - self.fine_at
        want = self.fine[j0 : j0 + len(got)]
        if j0 < 0 or len(want) < len(got):
            raise ValueError(f"bytes {a}..{b} lie past the chunk sums held ({len(self.fine)} from {self.fine_at})")
        wrong = np.flatnonzero((got & _MASK) != want)
        if not len(wrong):
            return []
        return _merged([(a + j * c, min(a + (j + 1) * c, b)) for j in wrong.tolist()])


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


class ShardSumsWriter:
    """The sums of one shard as pack (or index) writes it, bytes in pieces of any size: ``file`` at the end."""

    def __init__(self, chunk: int = CHUNK, block: int = BLOCK):
        self.chunk, self.block = chunk, block
        self._fine, self._coarse = ChunkSums(chunk), ChunkSums(block)
        self.nbytes = 0

    def update(self, data) -> None:
        """Hash the next bytes of the shard."""
        self._fine.update(data)
        self._coarse.update(data)
        self.nbytes += memoryview(data).nbytes

    def finish(self) -> tuple[np.ndarray, np.ndarray]:
        """(chunk sums, block sums) of the whole shard."""
        return self._fine.finish(), self._coarse.finish()

    def file(self) -> tuple[bytes, tuple[str, str]]:
        """(the shard's sums file, (the digest of its page table, its sha256): what index.json keeps of it); the
        shard ends here."""
        fine, coarse = self.finish()
        layout = Layout(self.nbytes, self.chunk, self.block)
        data = sums_file(fine, coarse, layout)
        return data, (digest_of(memoryview(data)[: layout.table_bytes]), hashlib.sha256(data).hexdigest())
