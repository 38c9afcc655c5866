"""Checksums a reader can afford: one per 4 KiB chunk of every shard, verified on every read.

A shard's sha256 (in the manifest) proves a whole shard, but a reader reads a few windows of
it, so it could only check what it never reads whole. Instead every shard is cut into chunks
of ``CHUNK`` bytes from its first byte (the last one shorter), and the manifest keeps one
checksum per chunk: the low 32 bits of xxh3_64 (``ALGORITHM``). A read of bytes [lo, hi)
verifies the chunks those bytes lie in, which means reading up to a chunk more at either end
(a local file mapped by the page is read by the page anyway). xxh3 verifies a 4 KiB chunk at
~12 GB/s here with its call (~20 GB/s for long runs of them) and releases the GIL while it
hashes, so the reading threads verify beside the training step.

Chunks are counted from the shard's first byte, not per member: what pack writes, what
`verify` and `index` scan and what a reader reads are all runs of shard bytes, so each needs
only ``ChunkSums`` over the bytes as they go by, and a run of short members is one run of
chunks. The sums of every shard sit end to end in shard order (``Checks.first[k]`` is shard
k's first), stored like the manifest's columns. Manifests written before this have none:
readers then verify nothing (and say so once).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import xxhash

ALGORITHM = "xxh3_64_low32"  # the low 32 bits of XXH3_64bits(chunk), seed 0, little-endian uint32
CHUNK = 4096  # bytes per chunk: the page of a local mapping; a read's extra is at most one chunk at either end
MIN_CHUNK, MAX_CHUNK = 512, 1 << 30  # chunk sizes a manifest may declare
_MASK = 0xFFFFFFFF
_hash = xxhash.xxh3_64_intdigest


def chunk_count(nbytes: int, chunk: int) -> int:
    """Chunks of a shard of ``nbytes`` bytes (the last may be shorter; an empty shard has none)."""
    return -(-nbytes // chunk)


def sums_of(data, chunk: int = CHUNK) -> np.ndarray:
    """The checksum of each ``chunk``-byte piece of ``data`` (any bytes-like), the last one possibly shorter."""
    raw = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    whole = len(raw) // chunk
    sums = np.empty(whole + (len(raw) > whole * chunk), dtype=np.uint64)
    # the one Python step per chunk: rows of a 2-D view cost less to hand over than memoryview slices (~1.4x)
    sums[:whole] = np.fromiter(map(_hash, raw[: whole * chunk].reshape(whole, chunk)), dtype=np.uint64, count=whole)
    if len(sums) > whole:
        sums[whole] = _hash(raw[whole * chunk :])
    return sums.astype(np.uint32)  # the low 32 bits


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


@dataclass(frozen=True, eq=False)
class Checks:
    """The chunk checksums of a dataset's shards: ``sums[first[k]:first[k + 1]]`` are shard k's."""

    algorithm: str
    chunk: int
    sums: np.ndarray = field(repr=False)  # uint32, every shard's chunks end to end
    first: np.ndarray = field(repr=False)  # [shards + 1]: where each shard's sums begin
    sizes: np.ndarray = field(repr=False)  # [shards]: each shard's bytes

    @classmethod
    def make(cls, algorithm: str, chunk: int, sums: np.ndarray, shard_bytes) -> "Checks":
        """Checks of shards of ``shard_bytes`` bytes; ValueError naming the field that is wrong."""
        if algorithm != ALGORITHM:
            raise ValueError(f"checks.algorithm is {algorithm!r}; this streamwin verifies {ALGORITHM!r}")
        if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or not MIN_CHUNK <= chunk <= MAX_CHUNK:
            raise ValueError(f"checks.chunk must be an integer of {MIN_CHUNK}..{MAX_CHUNK} bytes, got {chunk!r}")
        sizes = np.asarray(shard_bytes, dtype=np.int64)
        first = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(-(-sizes // int(chunk)), out=first[1:])
        sums = np.asarray(sums)
        if sums.dtype != np.uint32 or sums.ndim != 1 or len(sums) != first[-1]:
            raise ValueError(f"checks.sums holds {len(sums)} checksums, the shards' sizes make {int(first[-1])} "
                             f"chunks of {chunk} bytes")
        return cls(algorithm, int(chunk), sums, first, sizes)

    @classmethod
    def of_shards(cls, per_shard: list[np.ndarray], shard_bytes, chunk: int = CHUNK) -> "Checks":
        """Checks from each shard's sums (ChunkSums.finish), in shard order."""
        sums = np.concatenate(per_shard).astype(np.uint32) if per_shard else np.zeros(0, np.uint32)
        return cls.make(ALGORITHM, chunk, sums, shard_bytes)

    @staticmethod
    def concat(parts: list["Checks | None"]) -> "Checks | None":
        """The checks of datasets whose shards are listed one after the other (None if one has none)."""
        if not parts or any(p is None for p in parts) or len({p.chunk for p in parts}) > 1:
            return None
        return Checks.make(ALGORITHM, parts[0].chunk, np.concatenate([p.sums for p in parts]),
                           np.concatenate([p.sizes for p in parts]))

    def first_bad(self, k: int, sums: np.ndarray) -> int | None:
        """The first chunk of shard k whose checksum in ``sums`` (all of the shard's) differs, or None."""
        want = self.shard(k)
        if len(sums) != len(want):
            return min(len(sums), len(want))
        wrong = np.flatnonzero(sums != want)
        return int(wrong[0]) if len(wrong) else None

    def shard(self, k: int) -> np.ndarray:
        """Shard k's checksums."""
        return self.sums[self.first[k] : self.first[k + 1]]

    def span(self, k: int, lo, hi):
        """The chunk-aligned bytes of shard k that hold [lo, hi) (elementwise for arrays): what a read must verify."""
        c = self.chunk
        return lo // c * c, np.minimum(-(-hi // c) * c, self.sizes[k])

    def bad(self, k: int, at: int, data) -> list[tuple[int, int]]:
        """Byte ranges [a, b) of shard k whose bytes in ``data`` (shard bytes from ``at``, a chunk boundary, up to
        a chunk boundary or the shard's end) differ from what was packed, neighbouring chunks merged."""
        c = self.chunk
        if at % c or at < 0:
            raise ValueError(f"a verified range starts at a chunk boundary, not at byte {at}")
        got = sums_of(data, c)
        j0 = at // c
        want = self.shard(k)[j0 : j0 + len(got)]
        if len(want) < len(got):
            raise ValueError(f"bytes {at}..{at + len(memoryview(data).cast('B'))} run past the end of shard {k}")
        wrong = np.flatnonzero(got != want)
        if not len(wrong):
            return []
        out: list[tuple[int, int]] = []
        end = at + len(memoryview(data).cast("B"))
        for j in wrong.tolist():
            a, b = at + j * c, min(at + (j + 1) * c, end)
            if out and out[-1][1] == a:
                out[-1] = (out[-1][0], b)
            else:
                out.append((a, b))
        return out

    def to_doc(self) -> dict:
        """The manifest field, without the sums (which the caller stores as a column)."""
        return {"algorithm": self.algorithm, "chunk": self.chunk}
