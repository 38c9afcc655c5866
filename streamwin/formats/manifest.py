"""The dataset manifest, ``index.json``: what the shards hold, written last as the commit marker.

A directory without index.json is not a dataset, whatever shards it holds; pack writes
index.json only after every shard is complete, so a crashed pack is never mistaken for a
finished one.

Per-sequence data (key, length, byte offset, member size, npy header length) is stored
as columns: each one a little-endian numpy array, zlib-compressed and base64-encoded
inside the JSON. That keeps one file, one atomic write, and about 13 bytes per sequence,
so the manifest of a million sequences loads in a fraction of a second.

From ``COLUMNAR_FROM`` sequences on, the columns go to a file of their own instead
(``index.columns`` beside ``index.json``, manifest version 2): fixed-width little-endian
arrays, each starting at a multiple of 64 bytes, their offsets, size and sha256 named in
index.json. Loading maps that file (``numpy.frombuffer`` over ``mmap``), so it costs no
decoding and no private memory, and every process of a node shares one copy of its pages.
index.json stays the commit marker: it is written after the columns file, and names its
size and checksum. Version 1 manifests (inline columns) are read too.

Some top-level keys are optional, so that readers and writers of either version agree; each
reads as None where it is absent: ``value_columns`` (the table columns the values came from,
one per feature) with ``left_out_columns`` (the others, and why); ``nonfinite`` (NaN and ±inf
values counted at pack time, in all and per shard); ``frames`` (long zstd members packed as
independent frames: where each frame ends, so a reader decompresses only the frames a block
needs; see `Frames`); and ``checks`` (checksums of every shard's chunks, which every read
verifies; see formats/checks.py: in sums files beside the shards or, in manifests without
sums files, inline or, past INLINE_SUMS bytes, a column of the columns file). Every field is
checked for type and range when parsed (formats/fields.py).
``content_sha256`` seals the rest against edits (formats/seal.py), written by ``to_json``.

A dataset that grew records its views in ``growth``; one with extended sequences is version 3,
its columns a row per member, continuations after the sequences' first (formats/growth.py).
"""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import zlib
from dataclasses import dataclass, field

import numpy as np

from streamwin.errors import ManifestError
import streamwin.formats.fields as fields
from streamwin.formats.checks import Checks
from streamwin.formats.colfile import ALIGN, file_spec, lay_out, map_column, map_members
from streamwin.formats.colfile import COLUMNS_SUFFIX, columns_name  # noqa: F401  (as before: storage imports them here)
from streamwin.formats.framed import Frames, NonFinite
from streamwin.formats.growth import (GROWTH_COLUMNS, SEGMENT_COLUMNS, Growth, Segments, check_segments,
                                      parse_growth, segment_count)
from streamwin.formats.meta import SeqFields, map_field_columns, parse_fields
from streamwin.formats.seal import CONTENT_FIELD, check_seal, content_checksum

FORMAT = "streamwin"
VERSION = 1  # per-sequence columns inline, compressed
COLUMNAR_VERSION = 2  # per-sequence columns in a file of their own (COLUMNS_SUFFIX), memory-mapped
SEGMENTED_VERSION = 3  # version 2 with continuation members (formats/growth.py)
VERSIONS = (VERSION, COLUMNAR_VERSION, SEGMENTED_VERSION)
INDEX_NAME = "index.json"
COLUMNAR_FROM = 100_000  # sequences from which pack, index and merge write the columnar form
COLUMNS = {"length": "<i8", "offset": "<i8", "size": "<i8", "hlen": "<i4"}
_FILE_COLUMNS = {**COLUMNS, "key_ends": "<i8", "keys": "|u1"}  # the columns file, in this order
INLINE_SUMS = 1 << 20  # chunk checksums past this many bytes (1 GB of shards) go to the columns file


@dataclass(frozen=True)
class ShardEntry:
    """One tar shard: its file name relative to the dataset root and what it holds."""

    name: str
    bytes: int
    sha256: str
    num_sequences: int
    num_steps: int


@dataclass(frozen=True, eq=False)
class Manifest:
    """The whole index, with per-sequence columns as numpy arrays in shard order.

    Sequence ``i`` lives in shard ``shard_of(i)``; its ``.npy`` member content starts at byte
    ``offset[i]`` of that shard and is ``size[i]`` bytes long (compressed size when
    ``compression`` is "zstd"); its array data starts ``hlen[i]`` bytes into the
    (decompressed) npy content and holds ``length[i]`` steps of ``step_shape``.
    """

    dtype: np.dtype
    step_shape: tuple[int, ...]
    compression: str | None
    shards: tuple[ShardEntry, ...]
    length: np.ndarray
    offset: np.ndarray
    size: np.ndarray
    hlen: np.ndarray
    key_blob: bytes
    key_ends: np.ndarray
    dropped_empty: int = 0
    digest: str = ""
    value_columns: tuple[str, ...] | None = None
    left_out_columns: dict[str, str] | None = None
    nonfinite: NonFinite | None = None
    frames: Frames | None = None
    checks: Checks | None = None
    fields: SeqFields | None = None  # per-sequence fields (formats/meta.py): a label, a store, a start time
    sealed: bool = True  # False: read from an index.json without content_sha256 (an older streamwin's)
    segments: Segments | None = None  # continuation members of extended sequences (formats/growth.py)
    growth: Growth | None = None  # the views the dataset went through, None for one packed once
    member_shards: np.ndarray | None = None  # ``members()`` only: the shard of each row past the sequences
    shard_starts: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        counts = np.array([s.num_sequences for s in self.shards], dtype=np.int64)
        object.__setattr__(self, "shard_starts", np.concatenate([[0], np.cumsum(counts)]))
        n = int(self.shard_starts[-1])
        rows = n + (len(self.member_shards) if self.member_shards is not None else 0)
        for name in ("length", "offset", "size", "hlen", "key_ends"):
            if len(getattr(self, name)) != rows:
                raise ManifestError(f"manifest column {name!r} has {len(getattr(self, name))} rows, shards list {n} sequences")
        if self.segments is not None and self.segments.heads != n:
            raise ManifestError(f"manifest continuations are of {self.segments.heads} sequences, shards list {n}")
        features = int(np.prod(self.step_shape, dtype=np.int64))
        if self.value_columns is not None and (len(self.step_shape) > 1 or len(self.value_columns) != features):
            raise ManifestError(f"manifest names {len(self.value_columns)} value columns for step shape {self.step_shape}")
        if self.nonfinite is not None and len(self.nonfinite.per_shard) != len(self.shards):
            raise ManifestError(f"manifest counts NaN/inf for {len(self.nonfinite.per_shard)} shards, "
                                f"it lists {len(self.shards)}")
        if self.fields is not None:
            self.fields.check_rows(n)
        if self.checks is not None and self.checks.sizes.tolist() != [s.bytes for s in self.shards]:
            raise ManifestError("manifest checks were computed for other shard sizes than the shards it lists")

    @property
    def num_sequences(self) -> int:
        return int(self.shard_starts[-1])

    @property
    def num_steps(self) -> int:
        return int(self.length.sum())

    @property
    def step_bytes(self) -> int:
        """Bytes of one time step (all features) in the array data."""
        return int(self.dtype.itemsize * int(np.prod(self.step_shape, dtype=np.int64)))

    def key(self, i: int) -> str:
        start = int(self.key_ends[i - 1]) if i > 0 else 0
        return bytes(self.key_blob[start : int(self.key_ends[i])]).decode("ascii")

    def keys(self, indices) -> list[str]:
        """Keys of many sequences at once (the batch's ``key`` field)."""
        uniq, inv = np.unique(np.asarray(indices, dtype=np.int64), return_inverse=True)
        ends = self.key_ends[uniq].tolist()
        starts = np.where(uniq > 0, self.key_ends[np.maximum(uniq - 1, 0)], 0).tolist()
        blob = self.key_blob
        names = [bytes(blob[a:b]).decode("ascii") for a, b in zip(starts, ends)]
        return [names[i] for i in inv.tolist()]

    def shard_of(self, i: int) -> int:
        return int(self.shards_of(np.array([i]))[0])

    def shards_of(self, rows: np.ndarray) -> np.ndarray:
        """The shard of each of ``rows`` (sequences; in ``members()``, members)."""
        rows = np.asarray(rows, dtype=np.int64)
        n = int(self.shard_starts[-1])
        heads = np.searchsorted(self.shard_starts, np.minimum(rows, n - 1), side="right") - 1
        if self.member_shards is None:
            return heads
        return np.where(rows < n, heads, self.member_shards[np.maximum(rows - n, 0)] if len(self.member_shards)
                        else heads)

    @property
    def num_members(self) -> int:
        """The tar members the rows describe: the sequences, or in ``members()`` every member."""
        return len(self.length)

    def members(self) -> "Manifest":
        """The table of members the read side reads: this manifest, or with continuations one row per member
        (the sequences' first members, then the continuations; formats/growth.py). Views, never copies."""
        if self.segments is None:
            return self
        s = self.segments
        return dataclasses.replace(self, length=s.length, offset=s.offset, size=s.size, hlen=s.hlen,
                                   key_ends=s.key_ends, fields=None, segments=None, growth=None,
                                   member_shards=np.asarray(s.shard, dtype=np.int64))

    def view_id(self) -> str:
        """The id of the data this manifest holds now: its last view's, or (packed once) its digest."""
        return self.growth.views[-1] if self.growth is not None else self.digest

    def lineage(self) -> str:
        """The id of the dataset as first packed (states name it): its first view's, or its digest."""
        return self.growth.views[0] if self.growth is not None else self.digest

    def sums_inline(self) -> bool:
        """Whether index.json can hold the chunk checksums itself (else they go to the columns file)."""
        return self.checks is None or self.checks.in_files or self.checks.sums.nbytes <= INLINE_SUMS

    def column_parts(self) -> tuple[list, dict[str, list]]:
        """The columns file as byte buffers to write in order, and its layout: name -> [offset, dtype, rows]."""
        rows = self.segments if self.segments is not None else self  # with continuations: a row per member
        named = [(name, dt, np.frombuffer(self.key_blob, dtype=np.uint8) if name == "keys" else getattr(rows, name))
                 for name, dt in _FILE_COLUMNS.items()]
        if self.checks is not None and not self.checks.in_files:  # sums kept in the manifest (older form)
            named.append(("check_sums", "<u4", self.checks.sums))
        if self.segments is not None:
            named += [("segment_seq", "<i8", self.segments.seq), ("segment_shard", "<i8", self.segments.shard),
                      ("seq_length", "<i8", self.length)]
        named += self.growth.file_columns() if self.growth is not None else []
        named += self.fields.file_columns() if self.fields is not None else []
        return lay_out(named)

    def to_json(self, columns_file: dict | None = None) -> str:
        """index.json: the columns inline (version 1), or naming the columns file described by ``columns_file``."""
        doc = {
            "format": FORMAT,
            "version": VERSION if columns_file is None else SEGMENTED_VERSION if self.segments is not None
            else COLUMNAR_VERSION,
            "dtype": self.dtype.str,
            "step_shape": list(self.step_shape),
            "compression": self.compression,
            "num_shards": len(self.shards),
            "num_sequences": self.num_sequences,
            "num_steps": self.num_steps,
            "num_bytes": sum(s.bytes for s in self.shards),
            "dropped_empty": self.dropped_empty,
            "shards": [vars(s) for s in self.shards],
        }
        if columns_file is None:
            if self.segments is not None:
                raise ManifestError("a manifest with continuation members is written with a columns file")
            doc["columns"] = {name: _encode(getattr(self, name).astype(dt)) for name, dt in COLUMNS.items()}
            doc["columns"]["key_ends"] = _encode(self.key_ends.astype("<i8"))
            doc["keys"] = base64.b64encode(zlib.compress(bytes(self.key_blob), 1)).decode("ascii")
        else:
            doc["columns_file"] = columns_file
        if self.value_columns is not None:
            doc["value_columns"] = list(self.value_columns)
            doc["left_out_columns"] = dict(self.left_out_columns or {})
        if self.nonfinite is not None:
            doc["nonfinite"] = {"nan": self.nonfinite.nan, "inf": self.nonfinite.inf,
                                "per_shard": list(self.nonfinite.per_shard)}
        if self.frames is not None:
            doc["frames"] = self.frames.to_doc()
        if self.fields is not None:
            doc["fields"] = self.fields.to_doc(inline=columns_file is None)
        if self.segments is not None:
            doc["segments"] = {"count": self.segments.count}
        if self.growth is not None:
            doc["growth"] = self.growth.to_doc(inline=columns_file is None)
        if self.checks is not None:
            doc["checks"] = self.checks.to_doc()
            if columns_file is None and not self.checks.in_files:
                doc["checks"]["sums"] = _encode(self.checks.sums.astype("<u4"))
        doc[CONTENT_FIELD] = content_checksum(doc)
        return json.dumps(doc, separators=(",", ":"))


def _encode(arr: np.ndarray) -> str:
    # zlib level 1: several times faster than the default level, for a few percent more bytes
    return base64.b64encode(zlib.compress(np.ascontiguousarray(arr).tobytes(), 1)).decode("ascii")


def columns_file_entry(text: str | bytes, where: str = INDEX_NAME) -> ShardEntry | None:
    """The columns file a version 2 or 3 index.json names (name, bytes, sha256), or None for version 1."""
    spec = file_spec(text, where)
    if spec is None:
        return None
    try:
        entry = ShardEntry(fields.string(spec["name"], where, "columns_file.name"),
                           fields.integer(spec["bytes"], where, "columns_file.bytes"),
                           fields.string(spec["sha256"], where, "columns_file.sha256"), 0, 0)
    except KeyError as e:
        raise fields.fail(where, "columns_file", f"lacks {e}") from None
    fields.shard_name(entry.name, where)
    return entry


def parse_manifest(text: str | bytes, where: str = INDEX_NAME, columns=None) -> Manifest:
    """Parse index.json text; raise ManifestError naming ``where`` and the field if it is not a valid manifest.

    A version 2 manifest needs ``columns``: the bytes (or a read-only mmap) of the columns
    file it names; the arrays are views of them, never copies. Every field is checked before
    use (formats.fields): types, ranges, and sizes against the shards and sane limits.
    """
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ManifestError(f"{where} is not valid JSON: {type(e).__name__}: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ManifestError(f"{where} is not a streamwin manifest (no \"format\": \"{FORMAT}\")")
    if doc.get("version") not in VERSIONS or isinstance(doc.get("version"), bool):
        raise ManifestError(f"{where} has manifest version {doc.get('version')!r}, this streamwin reads versions "
                            f"{' and '.join(map(str, VERSIONS))}")
    dtype = fields.dtype_of(doc.get("dtype"), where)
    step_shape = fields.step_shape_of(doc.get("step_shape"), dtype, where)
    compression = doc.get("compression")
    if compression not in (None, "zstd"):
        raise fields.fail(where, "compression", f"must be null or \"zstd\", got {compression!r}")
    shards = tuple(ShardEntry(**fields.shard_fields(s, where, i))
                   for i, s in enumerate(fields.listing(doc.get("shards"), where, "shards")))
    for s in shards:
        fields.shard_name(s.name, where)
    n = sum(s.num_sequences for s in shards)
    segments = growth = None
    if doc["version"] in (COLUMNAR_VERSION, SEGMENTED_VERSION):
        spec = fields.mapping(doc.get("columns_file"), where, "columns_file")
        count = segment_count(doc, SEGMENTED_VERSION, where)
        cols, path = map_members(spec, columns, n + count, _FILE_COLUMNS, where)
        layout = fields.mapping(spec.get("layout"), where, "columns_file.layout")
        key_ends, blob = cols.pop("key_ends"), cols.pop("keys")
        sums = cols.pop("check_sums", None)
        kinds = doc["fields"].get("kinds") if isinstance(doc.get("fields"), dict) else None
        mapped = map_field_columns(layout, kinds, columns, n, ALIGN, where)
        if doc["version"] == SEGMENTED_VERSION:
            seg = {name: map_column(layout, name, dt, count if name != "seq_length" else n, columns, where, path)
                   for name, dt in SEGMENT_COLUMNS.items()}
            segments = Segments(seg["segment_seq"], seg["segment_shard"], key_ends=key_ends, **cols)
            total = seg["seq_length"]
            cols, key_ends = {**{k: v[:n] for k, v in cols.items()}, "length": total}, key_ends[:n]
        if isinstance(doc.get("growth"), dict):
            e = fields.integer(doc["growth"].get("extensions", 0), where, "growth.extensions", 0, 1 << 40)
            growth = {name: map_column(layout, name, dt, e, columns, where, path) for name, dt in GROWTH_COLUMNS.items()}
    else:
        inline = fields.mapping(doc.get("columns"), where, "columns")
        cols = {name: fields.column(inline.get(name), dt, n, where, f"columns.{name}") for name, dt in COLUMNS.items()}
        key_ends = fields.column(inline.get("key_ends"), "<i8", n, where, "columns.key_ends")
        blob = fields.inflate(doc.get("keys"), None, where, "keys", most=n * fields.MAX_KEY_BYTES)
        sums = mapped = None
    step_bytes = int(dtype.itemsize * np.prod(step_shape, dtype=np.int64))
    starts = np.concatenate([[0], np.cumsum([s.num_sequences for s in shards], dtype=np.int64)])
    shard_bytes = np.array([s.bytes for s in shards], dtype=np.int64)
    shard_steps = np.array([s.num_steps for s in shards], dtype=np.int64)
    heads = {**cols, "length": segments.length[:n]} if segments is not None else cols
    if segments is not None:  # the continuations first: the rest is checked over the sequences' first members
        check_segments(segments, cols["length"], len(blob), shard_bytes, step_bytes, compression is not None, where)
        shard_steps = shard_steps - segments.shard_steps(len(shards))
    fields.check_columns(heads, key_ends, int(key_ends[-1]) if segments is not None and n else len(blob), starts,
                         shard_bytes, shard_steps, step_bytes, compression is not None, where)
    members = segments if segments is not None else cols  # frames are of members
    optional = _optional_fields(doc, shards, _col(members, "length"), _col(members, "size"), sums, where)
    optional["fields"] = parse_fields(doc.get("fields"), n, where, mapped)
    optional["growth"] = parse_growth(doc.get("growth"), n, growth, where)
    fields.check_totals(doc, shards, where)
    sealed = check_seal(doc, where)  # after every field: a damaged field is named as such, a valid one edited here
    return Manifest(
        dtype=dtype, step_shape=step_shape, compression=compression, shards=shards,
        key_blob=blob, key_ends=key_ends,
        dropped_empty=fields.integer(doc.get("dropped_empty", 0), where, "dropped_empty"),
        digest=hashlib.sha256(text if isinstance(text, bytes) else text.encode()).hexdigest()[:16],
        sealed=sealed, segments=segments, **cols, **optional,
    )


def _col(table, name: str) -> np.ndarray:  # a column of a dict of them, or of Segments
    return table[name] if isinstance(table, dict) else getattr(table, name)


def _optional_fields(doc: dict, shards: tuple[ShardEntry, ...], length: np.ndarray, size: np.ndarray, sums,
                     where: str) -> dict:
    """The fields a manifest of an older streamwin lacks (None then), each checked (formats.fields)."""
    named = fields.value_columns(doc, where)
    counts = fields.nonfinite(doc.get("nonfinite"), len(shards), where)
    frames = fields.frames(doc.get("frames"), length, size, where)
    return {"value_columns": named[0], "left_out_columns": named[1],
            "nonfinite": None if counts is None else NonFinite(*counts),
            "frames": None if frames is None else Frames.make(*frames, length),
            "checks": fields.chunk_checks(doc.get("checks"), sums, [s.bytes for s in shards], where)}


def check_mixable(urls: list[str], manifests: list[Manifest]) -> None:
    """Datasets mixed into one batch share dtype and feature shape: else a ValueError naming both URLs and what
    differs (WindowDataset and ``streamwin inspect`` refuse alike)."""
    for url, m in zip(urls[1:], manifests[1:]):
        for what, x, y in (("dtype", np.dtype(manifests[0].dtype), np.dtype(m.dtype)),
                           ("feature shape", tuple(manifests[0].step_shape), tuple(m.step_shape))):
            if x != y:
                raise ValueError(f"mixed datasets must share dtype and feature shape: {urls[0]!r} has {what} {x}, "
                                 f"{url!r} has {what} {y}")


def build_manifest(dtype: np.dtype, step_shape: tuple[int, ...], compression: str | None,
                   shards: list[ShardEntry], keys: list[str], columns: dict[str, list[int]],
                   dropped_empty: int = 0, *, value_columns: tuple[str, ...] | None = None,
                   left_out_columns: dict[str, str] | None = None, nonfinite: NonFinite | None = None,
                   frames: tuple[int, list[int], list[int]] | None = None, checks: Checks | None = None,
                   fields: SeqFields | None = None) -> Manifest:
    """Assemble a Manifest from per-sequence lists (used by pack, index and merge)."""
    encoded = [k.encode("ascii") for k in keys]
    lengths = np.fromiter((len(k) for k in encoded), dtype=np.int64, count=len(encoded))
    if frames is not None:  # (rows, framed sequences, their frame ends)
        frames = Frames.make(frames[0], np.asarray(frames[1]), np.asarray(frames[2]), np.asarray(columns["length"]))
    return Manifest(
        dtype=np.dtype(dtype), step_shape=tuple(step_shape), compression=compression, shards=tuple(shards),
        key_blob=b"".join(encoded), key_ends=np.cumsum(lengths),
        dropped_empty=dropped_empty, value_columns=None if value_columns is None else tuple(value_columns),
        left_out_columns=left_out_columns, nonfinite=nonfinite, frames=frames, checks=checks, fields=fields,
        **{name: np.asarray(columns[name], dtype=dt.replace("<", "=")) for name, dt in COLUMNS.items()},
    )
