"""Per-sequence fields as pack collects them: from each sequence's meta dict, or a table's meta columns.

A meta value becomes a field value when it is a number, a bool, a string or a timestamp
(``datetime``, ``np.datetime64``, pandas ``Timestamp``: int64 ns since 1970, UTC; a naive
one is taken as UTC) or a duration (``timedelta``, ``np.timedelta64``: int64 ns). A meta key
is stored as a field only when every sequence of the dataset has it, with one kind (ints and
floats together: float); otherwise it is left out, with the reason, in the manifest
(``fields.left_out``), and its values stay in the ``<key>.json`` members as before. Strings are
stored as codes into a sorted vocabulary. `FieldCollector` collects one unit's fields as the
writer appends its sequences; `merge_fields` joins the units' (vocabularies merged, codes
remapped), wherever they ran.
"""
from __future__ import annotations

import datetime as dt
from array import array
from typing import Any

import numpy as np

from streamwin.formats.meta import DERIVED, MAX_FIELDS, MAX_VOCABULARY, NAME, SeqFields, classify

_TYPECODES = {"int": "q", "float": "d", "bool": "B", "str": "i", "time": "q", "duration": "q"}
def json_default(value: Any) -> Any:
    """How a ``<key>.json`` member writes what json cannot: numpy scalars as numbers, timestamps in ISO 8601."""
    if isinstance(value, np.generic) and not isinstance(value, (np.datetime64, np.timedelta64)):
        return value.item()
    if isinstance(value, (dt.datetime, dt.date, np.datetime64)):
        return str(np.datetime64(value, "ns")) if isinstance(value, np.datetime64) else value.isoformat()
    if isinstance(value, (dt.timedelta, np.timedelta64)):
        kind, ns = classify(value)
        return ns
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


class FieldCollector:
    """One unit's fields, as the writer appends its sequences (one by one, or many at once from a table)."""

    def __init__(self):
        self.n = 0
        self.kinds: dict[str, str] = {}
        self.values: dict[str, array] = {}
        self.words: dict[str, dict[str, int]] = {}  # str fields: string -> code, in order of first sight
        self.left_out: dict[str, str] = {}

    def add(self, key: str, meta: dict | None) -> None:
        """The fields of one sequence (its meta dict, or None)."""
        meta = meta or {}
        for name, value in meta.items():
            if name in self.left_out:
                continue
            kind, got = classify(value)
            if kind is None:
                self._leave(name, f"{got} (sequence {key!r})")
            elif self._admit(name, kind, key):
                if kind == "str":
                    got = self.words[name].setdefault(got, len(self.words[name]))
                self.values[name].append(got)
        for name in [n for n in self.kinds if n not in meta]:
            self._leave(name, f"missing in sequence {key!r}")
        self.n += 1

    def add_columns(self, key: str, n: int, columns: dict[str, tuple[str, np.ndarray, tuple[str, ...] | None]]) -> None:
        """The fields of ``n`` sequences at once (the first keyed ``key``): name -> (kind, values, vocabulary of
        the codes of a str field), or ("left", why, None)."""
        for name, (kind, values, vocab) in columns.items():
            if kind == "left":  # left out by the table's reader: ``values`` says why
                self._leave(name, values)
                continue
            if name in self.left_out or not self._admit(name, kind, key):
                continue
            if kind == "str":
                codes = self.words[name]
                remap = np.array([codes.setdefault(w, len(codes)) for w in vocab], dtype=np.int64)
                values = remap[values] if len(remap) else values
            self.values[name].extend(np.asarray(values).astype(_dtype(self.kinds[name]), copy=False).tolist())
        for name in [k for k in self.kinds if k not in columns]:
            self._leave(name, f"missing in sequence {key!r}")
        self.n += n

    def _admit(self, name: str, kind: str, key: str) -> bool:
        """Whether this sequence's ``name`` value of ``kind`` is stored (a new field, or one of its kind)."""
        have = self.kinds.get(name)
        if have is None:
            if not isinstance(name, str) or not NAME.fullmatch(name) or name == DERIVED:
                why = "'time' is the window timestamp loaders derive from start and freq" if name == DERIVED else \
                    "not a field name (a letter or _, then letters, digits, _ . -; at most 128)"
                self._leave(str(name), why)
                return False
            if self.n:
                self._leave(name, f"missing in the sequences before {key!r}")
                return False
            if len(self.kinds) >= MAX_FIELDS:
                self._leave(name, f"more than {MAX_FIELDS} fields")
                return False
            self.kinds[name], self.values[name] = kind, array(_TYPECODES[kind])
            if kind == "str":
                self.words[name] = {}
            return True
        if have == kind:
            return True
        if {have, kind} == {"int", "float"}:
            if have == "int":
                self.kinds[name], self.values[name] = "float", array("d", self.values[name])
            return True
        self._leave(name, f"{have} in some sequences, {kind} in {key!r}")
        return False

    def _leave(self, name: str, why: str) -> None:
        self.left_out.setdefault(name, why)
        for table in (self.kinds, self.values, self.words):
            table.pop(name, None)

    def result(self) -> SeqFields | None:
        """The unit's SeqFields (str fields with sorted vocabularies), or None when no sequence had meta."""
        kinds, columns, vocab = {}, {}, {}
        for name in sorted(self.kinds):
            kind = self.kinds[name]
            col = np.frombuffer(self.values[name], dtype=_dtype(kind)) if len(self.values[name]) else \
                np.zeros(0, _dtype(kind))
            if kind == "str":
                words = self.words[name]
                if len(words) > MAX_VOCABULARY:
                    self.left_out[name] = f"{len(words):,} distinct strings, more than {MAX_VOCABULARY:,}"
                    continue
                order = sorted(words)
                remap = np.empty(len(words), dtype=np.int32)
                remap[[words[w] for w in order]] = np.arange(len(order), dtype=np.int32)
                col, vocab[name] = remap[col] if len(col) else col, tuple(order)
            kinds[name], columns[name] = kind, col
        if not kinds and not self.left_out:
            return None
        return SeqFields(kinds, columns, vocab, dict(sorted(self.left_out.items())))


def _dtype(kind: str) -> np.dtype:
    return np.dtype({"q": np.int64, "d": np.float64, "B": np.uint8, "i": np.int32}[_TYPECODES[kind]])


def merge_fields(parts: list[tuple[SeqFields | None, int, str]]) -> SeqFields | None:
    """The fields of units appended in order: ``(fields, sequences, where)`` each. A field every unit with
    sequences stores is kept (ints and floats: float; vocabularies merged, codes remapped), else left out."""
    parts = [p for p in parts if p[1]]
    if not parts or all(f is None for f, _, _ in parts):
        return None
    left: dict[str, str] = {}
    for f, _, _ in parts:
        for name, why in (f.left_out.items() if f is not None else ()):
            left.setdefault(name, why)
    names = sorted({name for f, _, _ in parts if f is not None for name in f.kinds} - set(left))
    kinds, columns, vocab = {}, {}, {}
    for name in names:
        found = [(f.kinds.get(name) if f is not None else None, where) for f, _, where in parts]
        missing = next((where for kind, where in found if kind is None), None)
        got = {kind for kind, _ in found}
        if missing is not None:
            left[name] = f"missing in {missing}"
            continue
        if len(got) > 1 and got != {"int", "float"}:
            left[name] = f"{' and '.join(sorted(got))} in different units"
            continue
        kind = got.pop() if len(got) == 1 else "float"
        if kind == "str":
            words = sorted(set().union(*(f.vocabulary[name] for f, _, _ in parts)))
            if len(words) > MAX_VOCABULARY:
                left[name] = f"{len(words):,} distinct strings, more than {MAX_VOCABULARY:,}"
                continue
            index = {w: i for i, w in enumerate(words)}
            pieces = [np.array([index[w] for w in f.vocabulary[name]], dtype=np.int32)[f.columns[name]]
                      if len(f.vocabulary[name]) else f.columns[name] for f, _, _ in parts]
            vocab[name] = tuple(words)
        else:
            pieces = [f.columns[name].astype(_dtype(kind), copy=False) for f, _, _ in parts]
        kinds[name], columns[name] = kind, np.concatenate(pieces).astype(_dtype(kind), copy=False)
    return SeqFields(kinds, columns, vocab, dict(sorted(left.items())))
