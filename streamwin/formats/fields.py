"""The fields of index.json read one by one, each checked for type and range before anything uses it.

A manifest is input like any other: hand-edited, damaged or hostile, it must fail with one
ManifestError naming the field (``shards[3].bytes``, ``columns.length``, ``checks.chunk``),
never with an IndexError three modules later, a silent coercion (a float where a count
goes), or gigabytes of memory. Compressed columns are inflated only up to the size the rest
of the manifest implies (a zlib bomb stops there), and counts are bounded by what the data
they describe could hold.
"""
from __future__ import annotations

import base64
import binascii
import re
import zlib
from typing import Any

import numpy as np

from streamwin.errors import ManifestError
import streamwin.formats.checks as checks

MAX_BYTES = 1 << 50  # a shard or member larger than this (a petabyte) is a damaged field, not data
MAX_STEP_BYTES = 1 << 31  # one time step of every feature
MAX_DIMS = 32
MAX_KEY_BYTES = 1024  # average key length a manifest may claim (pack's keys have at most 90)
ZLIB_RATIO = 1100  # zlib cannot expand data more than ~1032 times
_SHA256 = re.compile(r"[0-9a-f]{64}")


def fail(where: str, field: str, why: str) -> ManifestError:
    """The error of a bad field: ``<where>: field <field> <why>``."""
    return ManifestError(f"{where}: field {field} {why}; the manifest is damaged (repack, or rerun `streamwin index`)")


def integer(value: Any, where: str, field: str, low: int = 0, high: int = MAX_BYTES) -> int:
    """An int (never a bool or a float) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise fail(where, field, f"must be an integer, got {value!r} ({type(value).__name__})")
    if not low <= value <= high:
        raise fail(where, field, f"must be in {low}..{high}, got {value}")
    return value


def typed(value: Any, kind: type, what: str, where: str, field: str) -> Any:
    """``value`` if it is a ``kind`` (a JSON string, object or array), else the error naming the field."""
    if not isinstance(value, kind):
        raise fail(where, field, f"must be {what}, got {str(value)[:80]!r} ({type(value).__name__})")
    return value


def string(value: Any, where: str, field: str) -> str:
    """A str."""
    return typed(value, str, "a string", where, field)


def mapping(value: Any, where: str, field: str) -> dict:
    """A JSON object."""
    return typed(value, dict, "an object", where, field)


def listing(value: Any, where: str, field: str) -> list:
    """A JSON array."""
    return typed(value, list, "a list", where, field)


def inflate(text: Any, nbytes: int | None, where: str, field: str, most: int | None = None) -> bytes:
    """base64 of zlib of exactly ``nbytes`` bytes (or of at most ``most`` when ``nbytes`` is None)."""
    raw = _base64(text, where, field)
    limit = nbytes if nbytes is not None else most
    if limit > len(raw) * ZLIB_RATIO + 4096:
        raise fail(where, field, f"would inflate to {limit:,} bytes from {len(raw):,}: more than zlib can hold")
    d = zlib.decompressobj()
    try:
        out = d.decompress(raw, limit + 1)
    except zlib.error as e:
        raise fail(where, field, f"cannot be decoded: {e}") from None
    if len(out) > limit or (d.unconsumed_tail and len(out) == limit):
        raise fail(where, field, f"holds more than the {limit:,} bytes the manifest implies")
    if nbytes is not None and len(out) != nbytes:
        raise fail(where, field, f"holds {len(out):,} bytes, the manifest implies {nbytes:,}")
    return out


def _base64(text: Any, where: str, field: str) -> bytes:
    string(text, where, field)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise fail(where, field, f"is not base64: {e}") from None


def column(text: Any, dtype: str, n: int, where: str, field: str) -> np.ndarray:
    """A compressed column of ``n`` little-endian ``dtype`` values, in native byte order."""
    size = np.dtype(dtype).itemsize
    arr = np.frombuffer(inflate(text, n * size, where, field), dtype=dtype)
    return arr.astype(dtype.replace("<", "="), copy=False)


def dtype_of(value: Any, where: str) -> np.dtype:
    """The dataset's dtype: numeric, never an object or structured one."""
    string(value, where, "dtype")
    try:
        dt = np.dtype(value)
    except TypeError:
        raise fail(where, "dtype", f"is not a numpy dtype: {value!r}") from None
    if dt.hasobject or dt.kind not in "biufc" or dt.fields is not None or dt.subdtype is not None:
        raise ManifestError(f"{where} declares dtype {dt}, streamwin stores numeric arrays only")
    return dt


def step_shape_of(value: Any, dtype: np.dtype, where: str) -> tuple[int, ...]:
    """The feature shape of one step: at most MAX_DIMS dimensions of >= 1, at most MAX_STEP_BYTES a step."""
    dims = listing(value, where, "step_shape")
    if len(dims) > MAX_DIMS:
        raise fail(where, "step_shape", f"has {len(dims)} dimensions, at most {MAX_DIMS}")
    shape = tuple(integer(d, where, f"step_shape[{i}]", 1, MAX_STEP_BYTES) for i, d in enumerate(dims))
    if int(np.prod(shape, dtype=object)) * dtype.itemsize > MAX_STEP_BYTES:
        raise fail(where, "step_shape", f"{list(shape)} makes steps of more than {MAX_STEP_BYTES:,} bytes")
    return shape


def shard_fields(value: Any, where: str, i: int) -> dict:
    """Shard i's entry: name, bytes, sha256, num_sequences, num_steps (checked; the name's form is checked later)."""
    s = mapping(value, where, f"shards[{i}]")
    extra = set(s) - {"name", "bytes", "sha256", "num_sequences", "num_steps"}
    if extra:
        raise fail(where, f"shards[{i}]", f"has unknown keys {sorted(extra)}")
    try:
        out = {"name": string(s["name"], where, f"shards[{i}].name"),
               "bytes": integer(s["bytes"], where, f"shards[{i}].bytes"),
               "sha256": string(s["sha256"], where, f"shards[{i}].sha256"),
               "num_sequences": integer(s["num_sequences"], where, f"shards[{i}].num_sequences"),
               "num_steps": integer(s["num_steps"], where, f"shards[{i}].num_steps")}
    except KeyError as e:
        raise fail(where, f"shards[{i}]", f"lacks {e}") from None
    if not _SHA256.fullmatch(out["sha256"]):
        raise fail(where, f"shards[{i}].sha256", f"must be 64 lowercase hex digits, got {out['sha256'][:80]!r}")
    if out["num_sequences"] * 512 > out["bytes"]:  # a member takes a 512-byte tar header at least
        raise fail(where, f"shards[{i}].num_sequences", f"{out['num_sequences']:,} cannot fit in "
                   f"{out['bytes']:,} bytes")
    return out


def shard_name(name: str, where: str) -> None:
    """Shard names are relative paths below the dataset root: no absolute paths, '..', '\\' or NUL."""
    parts = name.split("/")
    if (not name or name.startswith("/") or "\\" in name or "\0" in name or ":" in parts[0]
            or any(p in ("", ".", "..") for p in parts)):
        raise ManifestError(f"{where} names shard {name!r}: shard names must be relative paths inside the dataset")


def check_columns(cols: dict[str, np.ndarray], key_ends: np.ndarray, nkeys: int, shard_starts: np.ndarray,
                  shard_bytes: np.ndarray, shard_steps: np.ndarray, step_bytes: int, compressed: bool,
                  where: str) -> None:
    """Per-sequence columns against each other and their shards: members inside their shard, npy header
    lengths, lengths that the member bytes can hold, keys that end where the key bytes do, step counts."""
    n = len(key_ends)
    if not n:
        return
    length, offset, size, hlen = (np.asarray(cols[c], dtype=np.int64) for c in ("length", "offset", "size", "hlen"))
    shard = np.repeat(np.arange(len(shard_bytes)), np.diff(shard_starts))
    bad = {
        "length": (length < 0) | (length > MAX_BYTES // max(step_bytes, 1)),
        "offset": (offset < 512) | (offset > MAX_BYTES),
        "size": (size < 0) | (size > shard_bytes[shard] - np.minimum(offset, MAX_BYTES)),
        "hlen": (hlen < 10) | (hlen > (1 << 20)),
    }
    if compressed:  # a zstd member holds what it declares, at no more than ZLIB_RATIO-like expansion
        bad["length"] |= length * step_bytes > np.maximum(size, 1) * (1 << 20)
    for name, wrong in bad.items():
        if wrong.any():
            i = int(np.flatnonzero(wrong)[0])
            raise fail(where, f"columns.{name}", f"is out of range for sequence {i} (length {length[i]}, offset "
                       f"{offset[i]}, size {size[i]}, header {hlen[i]}, shard bytes {int(shard_bytes[shard[i]])})")
    wrong = np.flatnonzero(size != hlen + length * step_bytes) if not compressed else []
    if len(wrong):  # a plain member is its npy header and its steps, exactly
        i = int(wrong[0])
        raise fail(where, "columns.length, size and hlen", f"disagree for sequence {i}: size {size[i]}, but header "
                   f"{hlen[i]} + {length[i]} steps of {step_bytes} bytes make {hlen[i] + length[i] * step_bytes}")
    ends = np.asarray(key_ends, dtype=np.int64)
    if ends[0] < 1 or np.any(np.diff(ends) < 1) or ends[-1] != nkeys:
        raise fail(where, "columns.key_ends", f"must rise by at least 1 per key and end at the {nkeys:,} key bytes")
    steps = np.add.reduceat(length, shard_starts[:-1]) if len(shard_starts) > 1 else np.zeros(0, np.int64)
    steps = np.where(np.diff(shard_starts) > 0, steps, 0)
    wrong = np.flatnonzero(steps != shard_steps)
    if len(wrong):
        k = int(wrong[0])
        raise fail(where, f"shards[{k}].num_steps", f"says {int(shard_steps[k]):,}, its sequences' lengths sum to "
                   f"{int(steps[k]):,}")


def check_totals(doc: dict, shards: tuple, where: str) -> None:
    """The top-level counts (num_shards, num_sequences, num_steps, num_bytes), where present, against the shards
    listed: a count that disagrees is a damaged manifest, not a hint to ignore."""
    totals = {"num_shards": len(shards), "num_sequences": sum(s.num_sequences for s in shards),
              "num_steps": sum(s.num_steps for s in shards), "num_bytes": sum(s.bytes for s in shards)}
    for name, want in totals.items():
        if name in doc and integer(doc[name], where, name, 0, 1 << 62) != want:
            raise fail(where, name, f"says {doc[name]:,}, the shards it lists hold {want:,}")


# -- the optional fields (absent from manifests of older streamwin) ---------------------------------

def value_columns(doc: dict, where: str) -> tuple[tuple[str, ...] | None, dict[str, str] | None]:
    """(value_columns, left_out_columns): the table columns the values came from, and the others with why."""
    if doc.get("value_columns") is None:
        return None, None
    names = listing(doc["value_columns"], where, "value_columns")
    left_out = mapping(doc.get("left_out_columns") or {}, where, "left_out_columns")
    if not all(isinstance(x, str) for x in [*names, *left_out, *left_out.values()]):
        raise fail(where, "value_columns", "and left_out_columns must hold strings")
    return tuple(names), dict(left_out)


def nonfinite(doc: Any, shards: int, where: str) -> tuple[int, int, tuple[int, ...]] | None:
    """(NaN count, inf count, NaN + inf per shard) of the ``nonfinite`` field."""
    if doc is None:
        return None
    nf = mapping(doc, where, "nonfinite")
    per = tuple(integer(c, where, f"nonfinite.per_shard[{i}]")
                for i, c in enumerate(listing(nf.get("per_shard"), where, "nonfinite.per_shard")))
    if len(per) != shards:
        raise fail(where, "nonfinite.per_shard", f"counts {len(per)} shards, the manifest lists {shards}")
    return integer(nf.get("nan"), where, "nonfinite.nan"), integer(nf.get("inf"), where, "nonfinite.inf"), per


def frames(doc: Any, length: np.ndarray, size: np.ndarray, where: str) -> tuple[int, np.ndarray, np.ndarray] | None:
    """(rows, framed sequences, their frame ends) of the ``frames`` field: frames that rise within each member."""
    if doc is None:
        return None
    doc = mapping(doc, where, "frames")
    rows = integer(doc.get("rows"), where, "frames.rows", 1)
    seq = np.frombuffer(inflate(doc.get("seq"), None, where, "frames.seq", most=8 * len(length)), dtype="<i8")
    if len(seq) and (seq.min() < 0 or seq.max() >= len(length) or np.any(np.diff(seq) <= 0)):
        raise fail(where, "frames.seq", "must list sequence numbers of the manifest, rising")
    counts = -(-length[seq].astype(np.int64) // rows)
    ends = np.frombuffer(inflate(doc.get("ends"), 8 * int(counts.sum()), where, "frames.ends"), dtype="<i8")
    at = 0
    for i, c in zip(seq.tolist(), counts.tolist()):
        e = ends[at : at + c]
        at += c
        if len(e) and (e[0] <= 0 or np.any(np.diff(e) <= 0) or e[-1] > size[i]):
            raise fail(where, "frames.ends", f"of sequence {i} must rise within its {int(size[i])} bytes")
    return rows, seq, ends


def chunk_checks(doc: Any, sums: np.ndarray | None, shard_bytes: list[int], where: str) -> checks.Checks | None:
    """The ``checks`` field: chunk checksums, inline (``sums`` None) or a column of the columns file."""
    if doc is None:
        return None
    doc = mapping(doc, where, "checks")
    chunk = integer(doc.get("chunk"), where, "checks.chunk", checks.MIN_CHUNK, checks.MAX_CHUNK)
    if sums is None:
        total = sum(checks.chunk_count(b, chunk) for b in shard_bytes)
        sums = np.frombuffer(inflate(doc.get("sums"), 4 * total, where, "checks.sums"), dtype="<u4")
    try:
        return checks.Checks.make(doc.get("algorithm"), chunk, sums.astype(np.uint32, copy=False), shard_bytes)
    except ValueError as e:
        raise ManifestError(f"{where}: {e}") from None
