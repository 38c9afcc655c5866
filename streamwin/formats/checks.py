"""Checksums a reader can afford: one per 4 KiB chunk and one per 256 KiB block of every shard.

A shard's sha256 (in the manifest) proves a whole shard, but a reader reads a few windows of
it, so it could only check what it never reads whole. Instead every shard has a checksum
per 4 KiB chunk and per 256 KiB block (formats/sums.py: the low 32 bits of xxh3), and a read
of bytes [lo, hi) verifies the chunks those bytes lie in, reading up to a chunk more at
either end: the blocks it covers whole with one xxh3 call each (about twice as fast as a call
per 4 KiB chunk), the chunks at its ends one by one. A block that
fails is looked at chunk by chunk, so damage is found (and, with on_error="skip", lost) to the chunk.

Where the sums live. Each shard has a sums file beside it, ``<shard>.sums`` (``SUFFIX``),
written by whatever writes the shard (pack, on this machine or a Ray or Dask worker; index),
and index.json keeps per shard only the xxh3_64 of its page table (``Checks.digests``). A
reader reads a shard's table when a block of it first needs it (checked against the
digest), and then only the pages its reads cover (each checked against the table), so what
a process holds follows the shards in flight, not the corpus: 8 bytes of index.json per
shard, a few KiB per shard being read, instead of 1 GB per TB. A damaged, truncated or
swapped sums file fails its digest.

Manifests without sums files (an older form) keep every shard's chunk sums (no blocks) in
index.json or its columns file, end to end in shard order (``Checks.sums``); they load and
verify. Manifests without chunk checksums have none: readers verify nothing (and say so).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from streamwin.formats.sums import (ALGORITHM, BLOCK, CHUNK, PAGE_BLOCKS, SUFFIX, Layout, SumsSpan, chunk_count,
                                    digest_of, layout_of, parse_pages)

__all__ = ["ALGORITHM", "BLOCK", "CHUNK", "MAX_CHUNK", "MAX_PAGE_BLOCKS", "MIN_CHUNK", "PAGE_BLOCKS", "SUFFIX",
           "Checks", "chunk_count"]

MIN_CHUNK, MAX_CHUNK = 512, 1 << 30  # chunk sizes a manifest may declare
MAX_PAGE_BLOCKS = 1 << 16
_HEX16, _HEX64 = re.compile(r"[0-9a-f]{16}"), re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, eq=False)
class Checks:
    """The checksums of a dataset's shards: in sums files beside them (per shard ``digests``, the xxh3_64 of
    its sums file's page table, which a reader reading parts of it checks, and ``sha256``, of the whole file,
    which the node cache fetching it whole checks), or, in manifests without sums files, every shard's
    chunk sums in memory (``sums[first[k]:first[k + 1]]`` are shard k's)."""

    algorithm: str
    chunk: int
    sizes: np.ndarray = field(repr=False)  # [shards]: each shard's bytes
    sums: np.ndarray | None = field(default=None, repr=False)  # uint32, every shard's chunks end to end (older)
    first: np.ndarray | None = field(default=None, repr=False)  # [shards + 1]: where each shard's sums begin
    digests: np.ndarray | None = field(default=None, repr=False)  # uint64 per shard: its sums file's table
    sha256: np.ndarray | None = field(default=None, repr=False)  # [shards, 32] uint8: its whole sums file
    block: int = 0  # bytes per block sum (sums files only)
    page_blocks: int = 0
    suffix: str = SUFFIX

    @classmethod
    def make(cls, algorithm: str, chunk: int, sums: np.ndarray, shard_bytes) -> "Checks":
        """Checks held in memory (manifests without sums files); ValueError naming the field that is wrong."""
        _check(algorithm, chunk)
        sizes = np.asarray(shard_bytes, dtype=np.int64)
        first = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(-(-sizes // int(chunk)), out=first[1:])
        sums = np.asarray(sums)
        if sums.dtype != np.uint32 or sums.ndim != 1 or len(sums) != first[-1]:
            raise ValueError(f"checks.sums holds {len(sums)} checksums, the shards' sizes make {int(first[-1])} "
                             f"chunks of {chunk} bytes")
        return cls(algorithm, int(chunk), sizes, sums, first)

    @classmethod
    def stored(cls, algorithm: str, chunk: int, block: int, page_blocks: int, digests, sha256, shard_bytes,
               suffix: str = SUFFIX) -> "Checks":
        """Checks in sums files beside the shards, ``digests`` naming each one's page table and ``sha256`` each
        whole file (hex strings, or arrays as ``Checks`` holds them); ValueError naming the field that is wrong."""
        _check(algorithm, chunk)
        if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < chunk or block % chunk:
            raise ValueError(f"checks.block must be a multiple of checks.chunk ({chunk}), got {block!r}")
        if isinstance(page_blocks, bool) or not isinstance(page_blocks, (int, np.integer)) \
                or not 1 <= page_blocks <= MAX_PAGE_BLOCKS:
            raise ValueError(f"checks.page_blocks must be an integer of 1..{MAX_PAGE_BLOCKS}, got {page_blocks!r}")
        if suffix != SUFFIX:
            raise ValueError(f"checks.suffix is {suffix!r}; this streamwin reads sums files named <shard>{SUFFIX}")
        sizes = np.asarray(shard_bytes, dtype=np.int64)
        tables = digests.astype(np.uint64) if isinstance(digests, np.ndarray) else \
            np.array([int(d, 16) for d in _hex(digests, 16, "digests", len(sizes))], dtype=np.uint64)
        files = sha256.astype(np.uint8) if isinstance(sha256, np.ndarray) else \
            np.frombuffer(b"".join(bytes.fromhex(d) for d in _hex(sha256, 64, "sha256", len(sizes))),
                          dtype=np.uint8).reshape(len(sizes), 32)
        if len(tables) != len(sizes) or files.shape != (len(sizes), 32):
            raise ValueError(f"checks.digests and checks.sha256 must name one sums file per shard ({len(sizes)})")
        return cls(algorithm, int(chunk), sizes, digests=tables, sha256=files, block=int(block),
                   page_blocks=int(page_blocks))

    @classmethod
    def of_shards(cls, written: list[tuple[str, str]], shard_bytes, chunk: int = CHUNK, block: int = BLOCK) -> "Checks":
        """Checks of the sums files a writer wrote, in shard order: each one's (table digest, sha256), as
        ``ShardSumsWriter.file`` gives them."""
        return cls.stored(ALGORITHM, chunk, block, PAGE_BLOCKS, [d for d, _ in written], [h for _, h in written],
                          shard_bytes)

    @property
    def in_files(self) -> bool:
        """Whether the sums are in sums files beside the shards (else in memory)."""
        return self.digests is not None

    @staticmethod
    def concat(parts: list["Checks | None"]) -> "Checks | None":
        """The checks of datasets whose shards are listed one after the other (None if one has none, or they
        keep their sums differently)."""
        if not parts or any(p is None for p in parts):
            return None
        kinds = {(p.chunk, p.in_files, p.block, p.page_blocks) for p in parts}
        if len(kinds) > 1:
            return None
        sizes = np.concatenate([p.sizes for p in parts])
        if parts[0].in_files:
            return Checks.stored(ALGORITHM, parts[0].chunk, parts[0].block, parts[0].page_blocks,
                                 np.concatenate([p.digests for p in parts]), np.concatenate([p.sha256 for p in parts]),
                                 sizes)
        return Checks.make(ALGORITHM, parts[0].chunk, np.concatenate([p.sums for p in parts]), sizes)

    def layout(self, k: int) -> Layout:
        """Where shard k's sums lie in its sums file."""
        return layout_of(int(self.sizes[k]), self.chunk, self.block, self.page_blocks)

    def digest(self, k: int) -> str:
        """The digest index.json keeps of shard k's sums file's page table."""
        return f"{int(self.digests[k]):016x}"

    def file_sha256(self, k: int) -> str:
        """The sha256 index.json keeps of shard k's whole sums file."""
        return bytes(self.sha256[k]).hex()

    def table(self, k: int, data) -> np.ndarray:
        """The page table of shard k's sums file, from its bytes ``data``; ValueError when it is not the one
        index.json names (damaged, or another shard's)."""
        layout = self.layout(k)
        raw = memoryview(data).cast("B")
        if len(raw) != layout.table_bytes or digest_of(raw) != self.digest(k):
            raise ValueError(f"its page table is not the one index.json names (xxh3 {digest_of(raw)} of "
                             f"{len(raw)} bytes, index.json says {self.digest(k)} of {layout.table_bytes}): the "
                             "file is damaged, or another shard's")
        return np.frombuffer(raw, dtype="<u8")

    def parse_file(self, k: int, data) -> tuple[np.ndarray, np.ndarray]:
        """(block sums, chunk sums) of shard k from its whole sums file ``data``; ValueError saying what is wrong."""
        layout = self.layout(k)
        raw = memoryview(data).cast("B")
        if len(raw) != layout.file_bytes:
            raise ValueError(f"it has {len(raw)} bytes, the shard's {layout.nbytes} bytes make {layout.file_bytes}")
        table = self.table(k, raw[: layout.table_bytes])
        return parse_pages(raw[layout.table_bytes :], layout, 0, table)

    def shard(self, k: int) -> np.ndarray:
        """Shard k's chunk sums, held in memory (manifests without sums files)."""
        return self.sums[self.first[k] : self.first[k + 1]]

    def span(self, k: int) -> SumsSpan:
        """Shard k's sums held in memory, as a SumsSpan (manifests without sums files)."""
        return SumsSpan(int(self.sizes[k]), self.chunk, 0, self.shard(k))

    def to_doc(self) -> dict:
        """The manifest field, without inline sums (which the caller stores as a column)."""
        doc = {"algorithm": self.algorithm, "chunk": self.chunk}
        if self.in_files:
            doc.update(block=self.block, page_blocks=self.page_blocks, suffix=self.suffix,
                       digests=[self.digest(k) for k in range(len(self.sizes))],
                       sha256=[self.file_sha256(k) for k in range(len(self.sizes))])
        return doc


def _hex(values, digits: int, name: str, shards: int) -> list[str]:
    """``values`` if it is a list of one ``digits``-digit lowercase hex string per shard, else the ValueError."""
    pattern = _HEX16 if digits == 16 else _HEX64
    if not isinstance(values, (list, tuple)) or not all(isinstance(d, str) and pattern.fullmatch(d) for d in values):
        raise ValueError(f"checks.{name} must be a list of {digits}-digit lowercase hex digests")
    if len(values) != shards:
        raise ValueError(f"checks.{name} holds {len(values)} digests, the manifest lists {shards} shards")
    return values


def _check(algorithm: str, chunk) -> None:
    if algorithm != ALGORITHM:
        raise ValueError(f"checks.algorithm is {algorithm!r}; this streamwin verifies {ALGORITHM!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or not MIN_CHUNK <= chunk <= MAX_CHUNK:
        raise ValueError(f"checks.chunk must be an integer of {MIN_CHUNK}..{MAX_CHUNK} bytes, got {chunk!r}")
