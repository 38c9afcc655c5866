"""Per-sequence fields as pack collects them: from each sequence's meta dict, or a table's meta columns.

A meta value becomes a field value when it is a number, a bool, a string or a timestamp
(``datetime``, ``np.datetime64``, pandas ``Timestamp``: int64 ns since 1970, UTC; a naive
one is taken as UTC) or a duration (``timedelta``, ``np.timedelta64`` of any fixed unit: int64
ns; formats/times.py converts them exactly or says why not). A missing value (None, NaN, NaT, a
null, a CSV's empty cell, a key the meta dict lacks) means the sequence has none. A meta key
is stored as a field only when every sequence of the dataset has a value for it, of one kind (ints and
floats together: float); otherwise it is left out, with the reason, in the manifest
(``fields.left_out``; missing values counted in ``missing``, for pack's warning), and its values
stay in the ``<key>.json`` members as before. Strings are
stored as codes into a sorted vocabulary. `FieldCollector` collects one unit's fields as the
writer appends its sequences; `merge_fields` joins the units' (vocabularies merged, codes
remapped), wherever they ran.
"""
from __future__ import annotations

import datetime as dt
from array import array
from collections.abc import Callable
from typing import Any

import numpy as np

from streamwin.formats.meta import DERIVED, MAX_FIELDS, MAX_VOCABULARY, NAME, SeqFields, classify, is_missing

_TYPECODES = {"int": "q", "float": "d", "bool": "B", "str": "i", "time": "q", "duration": "q"}


def json_default(value: Any) -> Any:
    """How a ``<key>.json`` member writes what json cannot: numpy scalars as numbers, timestamps in ISO 8601,
    durations as ns (as they are written in their own unit, when they have no int64 ns)."""
    if isinstance(value, np.generic) and not isinstance(value, (np.datetime64, np.timedelta64)):
        return value.item()
    if isinstance(value, (dt.datetime, dt.date, np.datetime64)):
        if not isinstance(value, np.datetime64):
            return value.isoformat()
        return str(np.datetime64(value, "ns")) if classify(value)[0] == "time" else str(value)
    if isinstance(value, (dt.timedelta, np.timedelta64)):
        kind, ns = classify(value)
        return ns if kind == "duration" else str(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


class FieldCollector:
    """One unit's fields, as the writer appends its sequences (one by one, or many at once from a table).

    A missing value (None, NaN, NaT, or no such key; formats/meta.py ``is_missing``) means the sequence has none
    for the field: the field is then left out, and counted in ``missing`` for pack's warning."""

    def __init__(self):
        self.n = 0
        self.kinds: dict[str, str] = {}
        self.values: dict[str, array] = {}
        self.words: dict[str, dict[str, int]] = {}  # str fields: string -> code, in order of first sight
        self.left_out: dict[str, str] = {}
        self.present: dict[str, int] = {}  # per field name seen: the sequences with a value for it
        self.first_missing: dict[str, str] = {}  # per field: the first sequence without a value
        self.first_key: str | None = None

    def add(self, key: str, meta: dict | None) -> None:
        """The fields of one sequence (its meta dict, or None)."""
        meta = meta or {}
        self.first_key = key if self.first_key is None else self.first_key
        for name, value in meta.items():
            if not isinstance(name, str):
                self._leave(str(name), "not a field name (a letter or _, then letters, digits, _ . -; at most 128)")
                continue
            kind, got = classify(value)
            self._seen(name, kind != "missing")
            if kind == "missing":
                continue
            if name in self.left_out:
                continue
            if kind is None:
                self._leave(name, f"{got} (sequence {key!r})")
            elif self._admit(name, kind, key):
                if kind == "str":
                    got = self.words[name].setdefault(got, len(self.words[name]))
                self.values[name].append(got)
        for name in self.present:
            if not (name in meta and not is_missing(meta[name])):
                self.first_missing.setdefault(name, key)
                self._leave(name, f"missing in sequence {key!r}")
        self.n += 1

    def add_columns(self, key_of: Callable[[int], str], n: int,
                    columns: dict[str, tuple[str, np.ndarray, tuple[str, ...] | None]]) -> None:
        """The fields of ``n`` sequences at once (sequence i keyed ``key_of(i)``): name -> (kind, values, vocabulary
        of the codes of a str field), values masked where missing (a masked array), or ("left", why, None)."""
        self.first_key = key_of(0) if self.first_key is None else self.first_key
        for name, (kind, values, vocab) in columns.items():
            if kind == "left":  # left out by the table's reader: ``values`` says why
                self._leave(name, values)
                continue
            lacking = np.flatnonzero(np.ma.getmaskarray(values))
            self._seen(name, n - len(lacking))
            if len(lacking):
                self.first_missing.setdefault(name, key_of(int(lacking[0])))
                self._leave(name, f"missing in sequence {key_of(int(lacking[0]))!r}")
            if name in self.left_out or not self._admit(name, kind, key_of(0)):
                continue
            values = np.ma.getdata(values)
            if kind == "str":
                codes = self.words[name]
                remap = np.array([codes.setdefault(w, len(codes)) for w in vocab], dtype=np.int64)
                values = remap[values] if len(remap) else values
            self.values[name].extend(np.asarray(values).astype(_dtype(self.kinds[name]), copy=False).tolist())
        for name in [k for k in self.present if k not in columns]:
            self.first_missing.setdefault(name, key_of(0))
            self._leave(name, f"missing in sequence {key_of(0)!r}")
        self.n += n

    def _seen(self, name: str, sequences: int) -> None:
        """``sequences`` more sequences have a value for ``name`` (the ones before a name's first sight had none)."""
        if name not in self.present:
            self.present[name] = 0
            if self.n:
                self.first_missing.setdefault(name, self.first_key)
        self.present[name] += sequences

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
        missing = {name: (self.n - self.present[name], self.first_missing[name]) for name in sorted(self.present)
                   if self.present[name] < self.n and NAME.fullmatch(name) and name != DERIVED}
        return SeqFields(kinds, columns, vocab, dict(sorted(self.left_out.items())), missing)


def _dtype(kind: str) -> np.dtype:
    return np.dtype({"q": np.int64, "d": np.float64, "B": np.uint8, "i": np.int32}[_TYPECODES[kind]])


def merge_fields(parts: list[tuple[SeqFields | None, int, str, str]]) -> SeqFields | None:
    """The fields of units appended in order: ``(fields, sequences, where, first key)`` each. A field every unit
    with sequences stores is kept (ints and floats: float; vocabularies merged, codes remapped), else left out."""
    firsts = [p[3] for p in parts if p[1]]
    parts = [p[:3] for p in parts if p[1]]
    if not parts or all(f is None for f, _, _ in parts):
        return None
    left: dict[str, str] = {}
    for f, _, _ in parts:
        for name, why in (f.left_out.items() if f is not None else ()):
            left.setdefault(name, why)
    lacking = _merge_missing(parts, firsts)
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
    return SeqFields(kinds, columns, vocab, dict(sorted(left.items())), lacking)


def _merge_missing(parts: list[tuple[SeqFields | None, int, str]], firsts: list[str]) -> dict[str, tuple[int, str]]:
    """Per field some sequence of some unit has no value for: (how many, the first one's key), over all units
    (a unit without the field at all: each of its sequences)."""
    names = {name for f, _, _ in parts if f is not None for name in [*f.kinds, *f.missing]}
    out = {}
    for name in sorted(names):
        count, first = 0, None
        for (f, n, _), key in zip(parts, firsts):
            if f is None or not (name in f.kinds or name in f.left_out):
                count, first = count + n, first or key
            elif name in f.missing:
                count, first = count + f.missing[name][0], first or f.missing[name][1]
        if count:
            out[name] = (count, first)
    return out


def grow_fields(old: SeqFields | None, n_old: int, new: SeqFields | None, n_new: int, old_first: str, new_first: str,
                view: int) -> SeqFields | None:
    """The fields of a dataset of ``n_old`` sequences once ``n_new`` are appended to it (its view ``view``).

    A field both store joins its columns (ints and floats: float); a str field's vocabulary
    grows at its end, so every old code keeps its string; a field one side stores and the
    other lacks follows the rule for missing values (left out, counted for pack's warning);
    one left out on either side stays left out.
    """
    if old is None and new is None:
        return None
    left: dict[str, str] = {}
    for f in (old, new):
        left.update(f.left_out if f is not None else {})
    missing = dict(new.missing) if new is not None else {}
    names = set(old.kinds if old is not None else ()) | set(new.kinds if new is not None else ())
    kinds, columns, vocab = {}, {}, {}
    for name in sorted(names - set(left)):
        a, b = (f.kinds.get(name) if f is not None else None for f in (old, new))
        if a is None or b is None:
            count, first = (n_old, old_first) if a is None else (n_new, new_first)
            left[name], missing[name] = f"missing in sequence {first!r}", (count, first)
            continue
        if a != b and {a, b} != {"int", "float"}:
            left[name] = f"{a} in the sequences before view {view}, {b} in the ones it appended"
            continue
        kind = a if a == b else "float"
        if kind == "str":
            words = list(old.vocabulary[name])
            index = {w: i for i, w in enumerate(words)}
            for w in sorted(set(new.vocabulary[name]) - set(index)):
                index[w] = len(words)
                words.append(w)
            if len(words) > MAX_VOCABULARY:
                left[name] = f"{len(words):,} distinct strings, more than {MAX_VOCABULARY:,}"
                continue
            remap = np.array([index[w] for w in new.vocabulary[name]], dtype=np.int32)
            added = remap[new.columns[name]] if len(remap) else np.asarray(new.columns[name], dtype=np.int32)
            col = np.concatenate([np.asarray(old.columns[name], dtype=np.int32), added])
            vocab[name] = tuple(words)
        else:
            col = np.concatenate([np.asarray(f.columns[name]).astype(_dtype(kind)) for f in (old, new)])
        kinds[name], columns[name] = kind, col
    return SeqFields(kinds, columns, vocab, dict(sorted(left.items())), missing)
