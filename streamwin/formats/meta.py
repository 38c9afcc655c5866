"""Per-sequence fields: a label, a store, a sensor type, a start time, kept in the manifest beside the lengths.

Pack takes them from each sequence's meta dict (or a table's ``meta_columns``); a loader
asked for ``fields=[...]`` puts one value per window into every batch. They are columns
like the manifest's others: inline (zlib, base64) in a version 1 index.json, arrays of the
columns file in a version 2 one, and so covered by the manifest's seal. Kinds and their
stored dtypes (little-endian):

    int       int64                 float     float64            bool   uint8 (0 or 1)
    str       int32 codes into the field's vocabulary (at most MAX_VOCABULARY strings: sorted when packed,
              an append adds its new strings at the end, so old codes keep their strings)
    time      int64 ns since 1970   duration  int64 ns

A meta key that is not stored (missing in some sequence, a list, mixed kinds) is listed in
``left_out`` with the reason, so a loader asked for it can say why. ``time`` is not a field
name: it is derived per window (start + offset x freq) from the fields ``start`` and ``freq``.
"""
from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import re
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from streamwin.errors import ManifestError
import streamwin.formats.fields as checked
from streamwin.formats.times import scalar_ns

KINDS = {"int": "<i8", "float": "<f8", "bool": "|u1", "str": "<i4", "time": "<i8", "duration": "<i8"}
BATCH_DTYPES = {"int": np.int64, "float": np.float64, "bool": np.bool_, "str": np.int64, "time": np.int64,
                "duration": np.int64}
MAX_VOCABULARY = 1 << 16  # distinct strings of a str field (more: an id, not a category; keys are per sequence)
MAX_FIELDS = 256
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,127}")
DERIVED = "time"  # the window's first step's timestamp: start + offset x freq
LAYOUT_PREFIX = "field:"  # a field's column in the columns file's layout


@dataclass(frozen=True, eq=False)
class SeqFields:
    """The stored fields of a manifest: kind and column (one value per sequence) of each, vocabularies of the
    str ones, and the meta keys left out with why."""

    kinds: dict[str, str]
    columns: dict[str, np.ndarray]
    vocabulary: dict[str, tuple[str, ...]]
    left_out: dict[str, str]
    # fields some sequences have no value for: (how many, the first one's key); counted by pack for its warning,
    # not stored in index.json (a field's reason in ``left_out`` says it)
    missing: dict[str, tuple[int, str]] = dataclasses.field(default_factory=dict)

    def check_rows(self, n: int) -> None:
        """ManifestError unless every column holds one value per sequence."""
        for name, col in self.columns.items():
            if len(col) != n:
                raise ManifestError(f"manifest field {name!r} has {len(col)} values, the shards list {n} sequences")

    def describe(self) -> dict[str, dict]:
        """Per field: kind, and range (min, max) or distinct values of a str field (``streamwin inspect``)."""
        out = {}
        for name, kind in self.kinds.items():
            col = self.columns[name]
            info: dict = {"kind": kind}
            if kind == "str":
                info["values"] = len(self.vocabulary[name])
            elif len(col):
                info["min"], info["max"] = (bool(col.min()), bool(col.max())) if kind == "bool" else \
                    (col.min().item(), col.max().item())
            out[name] = info
        return out

    def to_doc(self, inline: bool) -> dict:
        """The ``fields`` entry of index.json (values inline when ``inline``, else in the columns file)."""
        doc: dict = {"kinds": dict(self.kinds), "vocabulary": {k: list(v) for k, v in self.vocabulary.items()},
                     "left_out": dict(self.left_out)}
        if inline:
            doc["values"] = {name: encode_column(self.columns[name].astype(KINDS[kind]))
                             for name, kind in self.kinds.items()}
        return doc

    def file_columns(self) -> list[tuple[str, str, np.ndarray]]:
        """(layout name, dtype, values) of each column, for the columns file."""
        return [(LAYOUT_PREFIX + name, KINDS[kind], self.columns[name]) for name, kind in self.kinds.items()]


def encode_column(arr: np.ndarray) -> str:
    """A column as index.json holds it inline: base64 of zlib (level 1) of its little-endian bytes."""
    return base64.b64encode(zlib.compress(np.ascontiguousarray(arr).tobytes(), 1)).decode("ascii")


def parse_fields(doc, n: int, where: str, mapped: dict[str, np.ndarray] | None = None) -> SeqFields | None:
    """The ``fields`` entry of index.json, every part checked (kinds, names, vocabularies, value ranges);
    ``mapped``: the columns file's field arrays by name (version 2), else the values are inline."""
    if doc is None:
        return None
    doc = checked.mapping(doc, where, "fields")
    kinds = checked.mapping(doc.get("kinds"), where, "fields.kinds")
    vocab = checked.mapping(doc.get("vocabulary", {}), where, "fields.vocabulary")
    left_out = checked.mapping(doc.get("left_out", {}), where, "fields.left_out")
    if len(kinds) > MAX_FIELDS:
        raise checked.fail(where, "fields.kinds", f"names {len(kinds)} fields, at most {MAX_FIELDS}")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in left_out.items()):
        raise checked.fail(where, "fields.left_out", "must map names to reasons (strings)")
    inline = None if mapped is not None else checked.mapping(doc.get("values"), where, "fields.values")
    columns, vocabulary = {}, {}
    for name, kind in kinds.items():
        field = f"fields.kinds.{name}"
        if not NAME.fullmatch(name) or name == DERIVED:
            raise checked.fail(where, field, "is not a field name (letters, digits, _ . -; not 'time')")
        if kind not in KINDS:
            raise checked.fail(where, field, f"must be one of {sorted(KINDS)}, got {kind!r}")
        dt = KINDS[kind]
        if mapped is not None:
            if name not in mapped:
                raise checked.fail(where, f"columns_file.layout.{LAYOUT_PREFIX}{name}", "is missing")
            col = mapped[name]
        else:
            col = checked.column(inline.get(name), dt, n, where, f"fields.values.{name}")
        if len(col) != n:
            raise checked.fail(where, f"fields.values.{name}", f"holds {len(col)} values for {n} sequences")
        if kind == "bool" and n and int(col.max()) > 1:
            raise checked.fail(where, f"fields.values.{name}", "must hold 0 or 1 (a bool field)")
        if kind == "str":
            words = checked.listing(vocab.get(name), where, f"fields.vocabulary.{name}")
            if len(words) > MAX_VOCABULARY or not all(isinstance(w, str) for w in words) or len(set(words)) < len(words):
                raise checked.fail(where, f"fields.vocabulary.{name}", f"must be at most {MAX_VOCABULARY} distinct "
                                   "strings")
            if n and (int(col.min()) < 0 or int(col.max()) >= len(words)):
                raise checked.fail(where, f"fields.values.{name}", f"holds codes outside its vocabulary of "
                                   f"{len(words)} strings")
            vocabulary[name] = tuple(words)
        columns[name] = col
    if set(vocab) - set(vocabulary):
        raise checked.fail(where, "fields.vocabulary", f"names fields that are no str fields: "
                           f"{sorted(set(vocab) - set(vocabulary))}")
    return SeqFields(dict(kinds), columns, vocabulary, dict(left_out))


def map_field_columns(layout: dict, kinds: dict, columns, n: int, align: int, where: str) -> dict[str, np.ndarray]:
    """The field arrays of a version 2 columns file (views of ``columns``), each entry of the layout checked."""
    out = {}
    for key, spec in layout.items():
        if not key.startswith(LAYOUT_PREFIX):
            continue
        name = key[len(LAYOUT_PREFIX):]
        field = f"columns_file.layout.{key}"
        kind = kinds.get(name) if isinstance(kinds, dict) else None
        got = checked.listing(spec, where, field)
        if kind not in KINDS or len(got) != 3 or got[1] != KINDS[kind]:
            raise checked.fail(where, field, f"must be [offset, {KINDS.get(kind)!r}, {n}] of a field named in "
                               f"fields.kinds, got {got!r}")
        offset = checked.integer(got[0], where, f"{field}[0]")
        rows = checked.integer(got[2], where, f"{field}[2]")
        if rows != n or offset % align or offset + n * np.dtype(got[1]).itemsize > len(columns):
            raise ManifestError(f"{where} describes field column {name} as {rows} values at byte {offset}: expected "
                                f"{n}, {align}-byte aligned, inside the columns file's {len(columns)} bytes")
        dt = got[1]
        out[name] = np.frombuffer(columns, dtype=dt, count=n, offset=offset).view(dt.replace("<", "="))
    return out


def is_missing(value: Any) -> bool:
    """Whether a meta value is missing: None (a JSON null, a table's null, an empty CSV cell), NaN or NaT."""
    if value is None or (isinstance(value, (float, np.floating)) and value != value):
        return True
    if isinstance(value, (np.datetime64, np.timedelta64)):
        return bool(np.isnat(value))
    return type(value).__name__ in ("NaTType", "NAType")  # pandas' NaT and NA


def classify(value: Any) -> tuple[str | None, Any]:
    """(kind, stored value) of a meta value, or (None, why) when it cannot be a field value."""
    if isinstance(value, (bool, np.bool_)):
        return "bool", int(bool(value))
    if isinstance(value, (np.datetime64, np.timedelta64, dt.date, dt.timedelta)):  # before int: timedelta64 is one
        return ("missing", None) if is_missing(value) else scalar_ns(value)
    if isinstance(value, (int, np.integer)):
        v = int(value)
        return ("int", v) if -(1 << 63) <= v < (1 << 63) else (None, f"{v} is outside int64")
    if isinstance(value, (float, np.floating)):
        return ("missing", None) if value != value else ("float", float(value))
    if isinstance(value, str):
        return "str", value
    if is_missing(value):
        return "missing", None
    return None, f"a {type(value).__name__}, not a number, bool, string or timestamp"
