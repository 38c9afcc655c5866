"""Datasets that grow: the continuation members of extended sequences, and the views of a dataset as it grew.

An append (``pack(..., mode="append")``) adds sequences in shards of a new generation; an
extension (``mode="extend"``) adds steps to sequences already packed, as **continuation
members** in those new shards, never rewriting a byte. A sequence is then a chain of
members, each a whole ``.npy`` file of its own tar member: its first member ``<key>.npy``
and its continuations ``<key>.gGGGGGG.npy`` (written by generation G, in step order).
webdataset splits a member name at the first dot, so it reads a continuation as a member of
the same key with the extension ``gGGGGGG.npy``, never as a sequence of its own.

The manifest keeps one row per sequence (its total length, its first member's offset, size
and header) and the continuations in ``Segments``: per continuation its sequence and shard,
and every member's columns, the sequences' first members first (rows 0..N-1), then the
continuations (rows N..N+S-1, a sequence's in step order). Their names join the key bytes
after the N keys. ``Manifest.members()`` is that table of members as a Manifest the read side
reads (``read/segments.py`` maps a window's steps onto the members that hold them). A manifest
with continuations is version 3 (a columns file), which older streamwin refuses by version.

``Growth`` records the views a dataset went through: view 0 is the dataset as first packed
(its id is that manifest's digest, so states saved before it grew name it), each append
adds one view (rows appended, sequences extended). Appends never rewrite, so the sequences
and lengths of any earlier view follow from the current manifest (``lengths_at``): a state
planned on an earlier view resumes on the data it was planned on. Pure numpy, no I/O.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import numpy as np

import streamwin.formats.fields as checked
from streamwin.formats.meta import encode_column

CONTINUATION = re.compile(r"([^./\\\s]+)\.g(\d{6,})")  # a continuation member's name, without .npy
SEGMENT_COLUMNS = {"segment_seq": "<i8", "segment_shard": "<i8", "seq_length": "<i8"}  # S, S and N rows
GROWTH_COLUMNS = {"grown_seq": "<i8", "grown_view": "<i8", "grown_steps": "<i8"}  # E rows each
MAX_VIEWS = 1 << 20


def continuation_key(key: str, tag: int) -> str:
    """The name (without .npy) of ``key``'s continuation member written by generation ``tag``."""
    return f"{key}.g{tag:06d}"


def parse_continuation(name: str) -> tuple[str, int] | None:
    """(key, generation) of a continuation member's name without .npy, or None for any other name."""
    m = CONTINUATION.fullmatch(name)
    return (m.group(1), int(m.group(2))) if m else None


@dataclass(frozen=True, eq=False)
class Segments:
    """The continuation members of a manifest's sequences, and the columns of every member.

    ``length``, ``offset``, ``size``, ``hlen`` and ``key_ends`` have one row per member: the N
    sequences' first members, then the S continuations; ``seq[j]`` and ``shard[j]`` are
    continuation j's sequence (rising: a sequence's continuations follow each other in step order)
    and shard.
    """

    seq: np.ndarray
    shard: np.ndarray
    length: np.ndarray
    offset: np.ndarray
    size: np.ndarray
    hlen: np.ndarray
    key_ends: np.ndarray

    @property
    def count(self) -> int:
        return len(self.seq)

    @property
    def heads(self) -> int:
        """The sequences (their first members are rows 0..heads-1)."""
        return len(self.length) - len(self.seq)

    def per_sequence(self, n: int) -> np.ndarray:
        """[n + 1]: where each sequence's continuations begin among the S, then S."""
        return np.searchsorted(self.seq, np.arange(n + 1), side="left").astype(np.int64)

    def totals(self) -> np.ndarray:
        """Each sequence's steps over all its members."""
        out = np.asarray(self.length[: self.heads], dtype=np.int64).copy()
        if self.count:
            np.add.at(out, self.seq, np.asarray(self.length[self.heads :], dtype=np.int64))
        return out

    def shard_steps(self, shards: int) -> np.ndarray:
        """Steps of the continuations in each shard."""
        return np.bincount(self.shard, weights=self.length[self.heads :], minlength=shards).astype(np.int64) \
            if self.count else np.zeros(shards, dtype=np.int64)


def segment_count(doc: dict, version: int, where: str) -> int:
    """The continuation members a manifest of ``version`` (3) lists (0 for the others)."""
    if doc["version"] != version:
        if "segments" in doc:
            raise checked.fail(where, "segments", f"belongs to manifest version {version} only")
        return 0
    spec = checked.mapping(doc.get("segments"), where, "segments")
    return checked.integer(spec.get("count"), where, "segments.count", 1, 1 << 40)


def check_segments(seg: Segments, totals: np.ndarray, nkeys: int, shard_bytes: np.ndarray, step_bytes: int,
                   compressed: bool, where: str) -> None:
    """The continuations against their shards and sequences (ManifestError naming the field): rising sequence
    numbers, members inside their shard, headers and sizes, keys that end where the key bytes do, and each
    sequence's total the sum of its members."""
    n, s = seg.heads, seg.count
    seq, shard = np.asarray(seg.seq, dtype=np.int64), np.asarray(seg.shard, dtype=np.int64)
    if s and (seq.min() < 0 or seq.max() >= n or np.any(np.diff(seq) < 0)):
        raise checked.fail(where, "columns_file.layout.segment_seq", f"must hold sequence numbers below {n}, rising")
    if s and (shard.min() < 0 or shard.max() >= len(shard_bytes)):
        raise checked.fail(where, "columns_file.layout.segment_shard", f"must hold shard numbers below "
                           f"{len(shard_bytes)}")
    length, offset, size, hlen = (np.asarray(c[n:], dtype=np.int64) for c in (seg.length, seg.offset, seg.size,
                                                                                  seg.hlen))
    bad = (length < 1) | (offset < 512) | (size < 0) | (offset + size > shard_bytes[shard] if s else False) | \
        (hlen < 10) | (hlen > (1 << 20))
    if not compressed:
        bad |= size != hlen + length * step_bytes
    if np.any(bad):
        j = int(np.flatnonzero(bad)[0])
        raise checked.fail(where, "columns.length, offset, size and hlen", f"are out of range for continuation {j} "
                           f"(length {length[j]}, offset {offset[j]}, size {size[j]}, header {hlen[j]})")
    ends = np.asarray(seg.key_ends[n - 1 if n else 0 :], dtype=np.int64)
    if (s and np.any(np.diff(ends) < 1)) or (int(seg.key_ends[-1]) if len(seg.key_ends) else 0) != nkeys:
        raise checked.fail(where, "columns.key_ends", f"must rise by at least 1 per member and end at the {nkeys:,} "
                           "key bytes")
    if not np.array_equal(seg.totals(), np.asarray(totals, dtype=np.int64)):
        i = int(np.flatnonzero(seg.totals() != totals)[0])
        raise checked.fail(where, "columns_file.layout.seq_length", f"says {int(totals[i]):,} steps for sequence {i}, "
                           f"its members hold {int(seg.totals()[i]):,}")


@dataclass(frozen=True, eq=False)
class Growth:
    """The views a dataset went through: ``views[v]`` the id of view v (view 0: the first pack's manifest
    digest), ``sequences[v]`` its sequences; and each extension: sequence ``seq[e]`` got ``steps[e]`` steps in
    view ``view[e]`` (>= 1). The current view is the last."""

    views: tuple[str, ...]
    sequences: tuple[int, ...]
    seq: np.ndarray
    view: np.ndarray
    steps: np.ndarray

    @classmethod
    def first(cls, digest: str, sequences: int) -> "Growth":
        """The growth record of a dataset packed once (view 0 alone)."""
        empty = np.zeros(0, dtype=np.int64)
        return cls((digest,), (sequences,), empty, empty, empty)

    @property
    def current(self) -> int:
        return len(self.views) - 1

    def index(self, view_id: str) -> int | None:
        """The view of that id, or None when this dataset never was it."""
        return self.views.index(view_id) if view_id in self.views else None

    def lengths_at(self, length: np.ndarray, v: int) -> np.ndarray:
        """Each sequence's steps in view ``v`` (0 for sequences appended after it), from the current lengths."""
        if v == self.current:
            return length
        out = np.array(length, dtype=np.int64)
        later = self.view > v
        if later.any():
            np.subtract.at(out, self.seq[later], self.steps[later])
        out[self.sequences[v] :] = 0
        return out

    def grown(self, view_id: str, sequences: int, seq: np.ndarray, steps: np.ndarray) -> "Growth":
        """This record and one more view: ``sequences`` in all, sequences ``seq`` extended by ``steps``."""
        v = len(self.views)
        return Growth(self.views + (view_id,), self.sequences + (int(sequences),),
                      np.concatenate([self.seq, np.asarray(seq, dtype=np.int64)]),
                      np.concatenate([self.view, np.full(len(seq), v, dtype=np.int64)]),
                      np.concatenate([self.steps, np.asarray(steps, dtype=np.int64)]))

    def file_columns(self) -> list[tuple[str, str, np.ndarray]]:
        return [(name, dt, getattr(self, name[len("grown_"):])) for name, dt in GROWTH_COLUMNS.items()]

    def to_doc(self, inline: bool) -> dict:
        """The ``growth`` entry of index.json (the extensions inline when ``inline``, else in the columns file)."""
        doc = {"views": list(self.views), "sequences": list(self.sequences), "extensions": len(self.seq)}
        if inline:
            doc["columns"] = {name: encode_column(np.asarray(values, dtype=dt)) for name, dt, values in
                              self.file_columns()}
        return doc


def view_id(previous: str, shard_sha256: list[str]) -> str:
    """The id of the view an append makes: a digest of the view before it and of the shards it adds."""
    return hashlib.sha256((previous + ":" + ",".join(shard_sha256)).encode()).hexdigest()[:16]


def parse_growth(doc, n: int, mapped: dict[str, np.ndarray] | None, where: str) -> Growth | None:
    """The ``growth`` entry of index.json, every part checked; ``mapped``: its columns from the columns file."""
    if doc is None:
        return None
    doc = checked.mapping(doc, where, "growth")
    views = checked.listing(doc.get("views"), where, "growth.views")
    sequences = checked.listing(doc.get("sequences"), where, "growth.sequences")
    if not 1 <= len(views) <= MAX_VIEWS or len(sequences) != len(views) or \
            not all(isinstance(v, str) and re.fullmatch(r"[0-9a-f]{16}", v) for v in views):
        raise checked.fail(where, "growth.views", "must list one 16-digit hex id per view, as growth.sequences does")
    counts = [checked.integer(c, where, f"growth.sequences[{i}]") for i, c in enumerate(sequences)]
    if counts[-1] != n or any(a > b for a, b in zip(counts, counts[1:])):
        raise checked.fail(where, "growth.sequences", f"must rise to the {n:,} sequences of the manifest")
    e = checked.integer(doc.get("extensions", 0), where, "growth.extensions", 0, 1 << 40)
    if mapped is None:
        inline = checked.mapping(doc.get("columns"), where, "growth.columns")
        cols = {name: checked.column(inline.get(name), dt, e, where, f"growth.columns.{name}")
                for name, dt in GROWTH_COLUMNS.items()}
    else:
        cols = mapped
        if any(len(cols[name]) != e for name in GROWTH_COLUMNS):
            raise checked.fail(where, "growth.extensions", f"says {e:,}, the columns file holds another count")
    seq, view, steps = (np.asarray(cols[name], dtype=np.int64) for name in GROWTH_COLUMNS)
    if e and (seq.min() < 0 or seq.max() >= n or view.min() < 1 or view.max() >= len(views) or steps.min() < 1):
        raise checked.fail(where, "growth.columns", "hold a sequence, view or step count out of range")
    return Growth(tuple(views), tuple(counts), seq, view, steps)
