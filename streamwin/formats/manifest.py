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
size and checksum. Version 1 manifests (inline columns) are read as before.

Fields added since version 1 was fixed are optional top-level keys, which older streamwin
ignores and which read as None from older manifests: ``value_columns`` (the table columns
the values came from, one per feature) with ``left_out_columns`` (the others, and why), and
``nonfinite`` (NaN and ±inf values counted at pack time, in all and per shard), and
``frames`` (long zstd members packed as independent frames: where each frame ends, so a
reader decompresses only the frames a block needs; see `Frames`).
"""
from __future__ import annotations

import base64
import hashlib
import json
import zlib
from dataclasses import dataclass, field

import numpy as np

from streamwin.errors import ManifestError

FORMAT = "streamwin"
VERSION = 1  # per-sequence columns inline, compressed
COLUMNAR_VERSION = 2  # per-sequence columns in a file of their own (COLUMNS_SUFFIX), memory-mapped
VERSIONS = (VERSION, COLUMNAR_VERSION)
INDEX_NAME = "index.json"
COLUMNS_SUFFIX = ".columns"  # index.json -> index.columns
COLUMNAR_FROM = 100_000  # sequences from which pack, index and merge write the columnar form
COLUMNS = {"length": "<i8", "offset": "<i8", "size": "<i8", "hlen": "<i4"}
_FILE_COLUMNS = {**COLUMNS, "key_ends": "<i8", "keys": "|u1"}  # the columns file, in this order
_ALIGN = 64


@dataclass(frozen=True)
class ShardEntry:
    """One tar shard: its file name relative to the dataset root and what it holds."""

    name: str
    bytes: int
    sha256: str
    num_sequences: int
    num_steps: int


@dataclass(frozen=True)
class NonFinite:
    """NaN and ±inf values in a dataset's arrays, counted by pack (and index); per shard NaN + inf."""

    nan: int
    inf: int
    per_shard: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class Frames:
    """Long zstd members packed as independent frames of ``rows`` steps each (the last may be shorter).

    Frame 0 of a member also holds its npy header. ``seq`` lists the framed sequences (sorted);
    ``ends`` holds, for each in turn, the compressed end offset (from the member's first byte)
    of each of its ``ceil(length / rows)`` frames. Members not listed are one frame.
    """

    rows: int
    seq: np.ndarray
    ends: np.ndarray
    first: np.ndarray = field(repr=False)  # [len(seq) + 1]: where each framed sequence's ends begin

    @classmethod
    def make(cls, rows: int, seq: np.ndarray, ends: np.ndarray, length: np.ndarray) -> "Frames":
        """Frames of the sequences ``seq`` of a dataset whose lengths are ``length``; checked."""
        seq, ends = np.asarray(seq, dtype=np.int64), np.asarray(ends, dtype=np.int64)
        if rows < 1 or (len(seq) and (seq.min() < 0 or seq.max() >= len(length) or np.any(np.diff(seq) <= 0))):
            raise ManifestError(f"manifest frames: rows {rows} or framed sequence numbers out of range")
        first = np.zeros(len(seq) + 1, dtype=np.int64)
        np.cumsum(-(-length[seq] // rows), out=first[1:])
        if first[-1] != len(ends):
            raise ManifestError(f"manifest frames: {len(ends)} frame ends for {first[-1]} frames")
        return cls(int(rows), seq, ends, first)

    def to_doc(self) -> dict:
        return {"rows": self.rows, "seq": _encode(self.seq.astype("<i8")), "ends": _encode(self.ends.astype("<i8"))}


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
    shard_starts: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        counts = np.array([s.num_sequences for s in self.shards], dtype=np.int64)
        object.__setattr__(self, "shard_starts", np.concatenate([[0], np.cumsum(counts)]))
        n = int(self.shard_starts[-1])
        for name in ("length", "offset", "size", "hlen", "key_ends"):
            if len(getattr(self, name)) != n:
                raise ManifestError(f"manifest column {name!r} has {len(getattr(self, name))} rows, shards list {n} sequences")
        features = int(np.prod(self.step_shape, dtype=np.int64))
        if self.value_columns is not None and (len(self.step_shape) > 1 or len(self.value_columns) != features):
            raise ManifestError(f"manifest names {len(self.value_columns)} value columns for step shape {self.step_shape}")
        if self.nonfinite is not None and len(self.nonfinite.per_shard) != len(self.shards):
            raise ManifestError(f"manifest counts NaN/inf for {len(self.nonfinite.per_shard)} shards, "
                                f"it lists {len(self.shards)}")

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
        return int(np.searchsorted(self.shard_starts, i, side="right") - 1)

    def column_parts(self) -> tuple[list, dict[str, list]]:
        """The columns file as byte buffers to write in order, and its layout: name -> [offset, dtype, rows]."""
        parts, layout, at = [], {}, 0
        for name, dt in _FILE_COLUMNS.items():
            data = (np.frombuffer(self.key_blob, dtype=np.uint8) if name == "keys"
                    else np.ascontiguousarray(getattr(self, name), dtype=dt))
            pad = -at % _ALIGN
            if pad:
                parts.append(bytes(pad))
            at += pad
            layout[name] = [at, dt, len(data)]
            parts.append(memoryview(data).cast("B"))
            at += data.nbytes
        return parts, layout

    def to_json(self, columns_file: dict | None = None) -> str:
        """index.json: the columns inline (version 1), or naming the columns file described by ``columns_file``."""
        doc = {
            "format": FORMAT,
            "version": VERSION if columns_file is None else COLUMNAR_VERSION,
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
        return json.dumps(doc, separators=(",", ":"))


def _encode(arr: np.ndarray) -> str:
    # level 1: ~6x faster than 6 at 1M sequences for ~5% more bytes
    return base64.b64encode(zlib.compress(np.ascontiguousarray(arr).tobytes(), 1)).decode("ascii")


def _decode(text: str, dtype: str, n: int, where: str) -> np.ndarray:
    try:
        arr = np.frombuffer(zlib.decompress(base64.b64decode(text)), dtype=dtype)
    except (ValueError, zlib.error) as e:
        raise ManifestError(f"{where}: column cannot be decoded: {e}") from e
    if len(arr) != n:
        raise ManifestError(f"{where}: column has {len(arr)} rows, expected {n}")
    return arr.astype(dtype.replace("<", "="), copy=False)


def columns_name(index_name: str) -> str:
    """The columns file that goes with an index file: index.json -> index.columns."""
    return index_name[: -len(".json")] + COLUMNS_SUFFIX if index_name.endswith(".json") else index_name + COLUMNS_SUFFIX


def columns_file_entry(text: str | bytes, where: str = INDEX_NAME) -> ShardEntry | None:
    """The columns file a version 2 index.json names (name, bytes, sha256), or None for version 1."""
    try:
        doc = json.loads(text)
        spec = doc.get("columns_file") if isinstance(doc, dict) and doc.get("version") == COLUMNAR_VERSION else None
        if spec is None:
            return None
        entry = ShardEntry(spec["name"], int(spec["bytes"]), str(spec["sha256"]), 0, 0)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"{where} is malformed: {type(e).__name__}: {e}") from e
    _check_shard_name(entry.name, where)
    return entry


def parse_manifest(text: str | bytes, where: str = INDEX_NAME, columns=None) -> Manifest:
    """Parse index.json text; raise ManifestError naming ``where`` if it is not a valid manifest.

    A version 2 manifest needs ``columns``: the bytes (or a read-only mmap) of the columns
    file it names; the arrays are views of them, never copies.
    """
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ManifestError(f"{where} is not valid JSON: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ManifestError(f"{where} is not a streamwin manifest (no \"format\": \"{FORMAT}\")")
    if doc.get("version") not in VERSIONS:
        raise ManifestError(f"{where} has manifest version {doc.get('version')}, this streamwin reads versions "
                            f"{' and '.join(map(str, VERSIONS))}")
    try:
        shards = tuple(ShardEntry(**s) for s in doc["shards"])
        n = sum(s.num_sequences for s in shards)
        if doc["version"] == COLUMNAR_VERSION:
            cols = _map_columns(doc["columns_file"], columns, n, where)
            key_ends, blob = cols.pop("key_ends"), cols.pop("keys")
        else:
            cols = {name: _decode(doc["columns"][name], dt, n, f"{where} column {name}") for name, dt in COLUMNS.items()}
            key_ends = _decode(doc["columns"]["key_ends"], "<i8", n, f"{where} column key_ends")
            blob = zlib.decompress(base64.b64decode(doc["keys"]))
        dtype = np.dtype(doc["dtype"])
        step_shape = tuple(int(x) for x in doc["step_shape"])
        optional = _optional_fields(doc)
        optional["frames"] = _frames(doc.get("frames"), cols["length"], where)
    except ManifestError:
        raise
    except (KeyError, TypeError, zlib.error, ValueError) as e:
        raise ManifestError(f"{where} is malformed: {type(e).__name__}: {e}") from e
    if dtype.hasobject or dtype.kind not in "biufc":
        raise ManifestError(f"{where} declares dtype {dtype}, streamwin stores numeric arrays only")
    for s in shards:
        _check_shard_name(s.name, where)
    return Manifest(
        dtype=dtype, step_shape=step_shape, compression=doc.get("compression"), shards=shards,
        key_blob=blob, key_ends=key_ends, dropped_empty=int(doc.get("dropped_empty", 0)),
        digest=hashlib.sha256(text if isinstance(text, bytes) else text.encode()).hexdigest()[:16],
        **cols, **optional,
    )


def _map_columns(spec: dict, columns, n: int, where: str) -> dict:
    """Views of the columns file's arrays; ManifestError naming the file if it is not the one index.json names."""
    name = f"{where.rsplit('/', 1)[0]}/{spec['name']}" if "/" in where else spec["name"]
    if columns is None:
        raise ManifestError(f"{where} keeps its per-sequence columns in {spec['name']}: load it with "
                            "streamwin.load_manifest(url), which maps that file")
    if len(columns) != spec["bytes"]:
        raise ManifestError(f"{name} is damaged: it has {len(columns)} bytes, {where} says {spec['bytes']} "
                            f"(sha256 {str(spec['sha256'])[:16]}...); repack, or rerun `streamwin index`")
    out = {}
    for col, dt in _FILE_COLUMNS.items():
        offset, dtype, rows = spec["layout"][col]
        if dtype != dt or (col != "keys" and rows != n) or offset % _ALIGN or rows < 0:
            raise ManifestError(f"{where} describes column {col} of {name} as {dtype} x {rows} at byte {offset}; "
                                f"expected {dt} x {n if col != 'keys' else 'the key bytes'}, 64-byte aligned")
        if offset + rows * np.dtype(dt).itemsize > len(columns):
            raise ManifestError(f"{name} is damaged: column {col} would end past its {len(columns)} bytes")
        arr = np.frombuffer(columns, dtype=dt, count=rows, offset=offset)
        out[col] = arr if col == "keys" else arr.view(dt.replace("<", "="))
    ends = out["key_ends"]
    if n and (int(ends[-1]) != len(out["keys"]) or int(ends[0]) < 0):
        raise ManifestError(f"{name} is damaged: its key offsets end at {int(ends[-1])}, its key bytes number "
                            f"{len(out['keys'])}")
    out["keys"] = memoryview(out["keys"])
    return out


def _optional_fields(doc: dict) -> dict:
    """The fields a manifest of an older streamwin lacks (None then), checked for type."""
    out: dict = {"value_columns": None, "left_out_columns": None, "nonfinite": None}
    if doc.get("value_columns") is not None:
        names, left_out = doc["value_columns"], doc.get("left_out_columns") or {}
        if not all(isinstance(x, str) for x in [*names, *left_out, *left_out.values()]):
            raise TypeError("value_columns and left_out_columns must hold strings")
        out["value_columns"], out["left_out_columns"] = tuple(names), dict(left_out)
    if doc.get("nonfinite") is not None:
        nf = doc["nonfinite"]
        counts = [nf["nan"], nf["inf"], *nf["per_shard"]]
        if not all(isinstance(c, int) and c >= 0 for c in counts):
            raise ValueError(f"nonfinite counts must be integers >= 0, got {nf}")
        out["nonfinite"] = NonFinite(nf["nan"], nf["inf"], tuple(nf["per_shard"]))
    return out


def _frames(doc: dict | None, length: np.ndarray, where: str) -> Frames | None:
    """The optional ``frames`` field (absent from older manifests and from unframed datasets)."""
    if doc is None:
        return None
    seq = np.frombuffer(zlib.decompress(base64.b64decode(doc["seq"])), dtype="<i8")
    ends = np.frombuffer(zlib.decompress(base64.b64decode(doc["ends"])), dtype="<i8")
    if not isinstance(doc["rows"], int):
        raise ValueError(f"frames rows must be an integer, got {doc['rows']!r}")
    return Frames.make(doc["rows"], seq, ends, length)


def _check_shard_name(name: str, where: str) -> None:
    """Shard names are relative paths below the dataset root: no absolute paths, '..', '\\' or NUL."""
    parts = name.split("/")
    if (not name or name.startswith("/") or "\\" in name or "\0" in name or ":" in parts[0]
            or any(p in ("", ".", "..") for p in parts)):
        raise ManifestError(f"{where} names shard {name!r}: shard names must be relative paths inside the dataset")


def build_manifest(dtype: np.dtype, step_shape: tuple[int, ...], compression: str | None,
                   shards: list[ShardEntry], keys: list[str], columns: dict[str, list[int]],
                   dropped_empty: int = 0, *, value_columns: tuple[str, ...] | None = None,
                   left_out_columns: dict[str, str] | None = None, nonfinite: NonFinite | None = None,
                   frames: tuple[int, list[int], list[int]] | None = None) -> Manifest:
    """Assemble a Manifest from per-sequence lists (used by pack, index and merge)."""
    encoded = [k.encode("ascii") for k in keys]
    lengths = np.fromiter((len(k) for k in encoded), dtype=np.int64, count=len(encoded))
    if frames is not None:  # (rows, framed sequences, their frame ends)
        frames = Frames.make(frames[0], np.asarray(frames[1]), np.asarray(frames[2]), np.asarray(columns["length"]))
    return Manifest(
        dtype=np.dtype(dtype), step_shape=tuple(step_shape), compression=compression, shards=tuple(shards),
        key_blob=b"".join(encoded), key_ends=np.cumsum(lengths),
        dropped_empty=dropped_empty, value_columns=None if value_columns is None else tuple(value_columns),
        left_out_columns=left_out_columns, nonfinite=nonfinite, frames=frames,
        **{name: np.asarray(columns[name], dtype=dt.replace("<", "=")) for name, dt in COLUMNS.items()},
    )
