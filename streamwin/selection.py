"""``where=``: which sequences a dataset keeps, checked strictly against the fields it names.

``where={"label": [1, 3], "site": ["kobe"]}`` keeps the sequences whose every named field holds
one of its values; the plan then has no window of the others (seqfields.keep_mask). The values
are checked against each field's kind in every source when the dataset is made, and nothing is
converted, so a value either means one stored value or is refused:

    int        ints (Python's or numpy's); not bools, floats or strings
    float      floats and ints (ints up to 2**53, which a float holds exactly)
    bool       True or False (Python's or numpy's); not 0 or 1
    str        strings
    time       datetime, date, np.datetime64, pandas Timestamp
    duration   timedelta, np.timedelta64, pandas Timedelta

A value of another type is a TypeError naming ``where``, the field, its kind and the value; a
value that no sequence of any source holds (a typo beside a valid label) is a ValueError naming
it, with the values the field holds; a source that keeps no sequence is a ValueError saying that
the selection is empty there (not that windows are too long).
"""
from __future__ import annotations

import datetime as dt
import difflib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from streamwin.formats.meta import SeqFields, classify
from streamwin.seqfields import keep_mask

TAKES = {"int": "ints (Python's or numpy's), not bools, floats or strings",
         "float": "floats and ints", "bool": "True or False, not 0 or 1", "str": "strings",
         "time": "timestamps (datetime, date, np.datetime64, pandas Timestamp)",
         "duration": "durations (timedelta, np.timedelta64, pandas Timedelta)"}


def where_of(where: Any) -> dict[str, tuple] | None:
    """``where`` as {field: values kept, as stored (JSON-able)}, its form checked as the user typed it (the values
    against the fields' kinds: `check_where`, once the manifests are loaded)."""
    if where is None:
        return None
    if not isinstance(where, Mapping) or not where or not all(isinstance(k, str) for k in where):
        raise TypeError(f"where must be a dict {{field: [values kept]}}, got {where!r}")
    out = {}
    for name, values in where.items():
        if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray, set, frozenset)):
            raise TypeError(f"where[{name!r}] must be a list of the values kept, got {values!r}")
        for v in values:
            kind, got = classify(v)
            if kind == "missing":
                raise TypeError(f"where[{name!r}] holds {v!r}, a missing value: no sequence holds one (a field "
                                "some sequences have no value for is not stored, see docs/fields.md)")
            if kind is None:
                raise TypeError(f"where[{name!r}] holds {v!r}: values are numbers, bools, strings or timestamps "
                                f"({got})")
        out[name] = tuple(sorted({classify(v)[1] for v in values}, key=repr))
    return out


def check_where(given: Mapping[str, Any], where: dict[str, tuple], sources: Sequence[Any]) -> None:
    """Refuse ``where`` (as ``given``, and as stored by `where_of`) unless each value is of its field's kind in every
    source, some sequence holds it, and every source keeps a sequence. ``sources``: each with url, manifest.fields
    and fill."""
    for name, values in given.items():
        kind = _kind_of(name, sources)
        for v in values:
            if not _fits(kind, v):
                raise TypeError(f"where[{name!r}] holds {v!r} ({type(v).__name__}), but field {name!r} is {kind}: "
                                f"it takes {TAKES[kind]}; nothing is converted")
        stored = [classify(v)[1] for v in values]
        held = np.logical_or.reduce([_holds(s, name, stored) for s in sources])
        unmatched = [v for v, h in zip(values, held) if not h]
        if unmatched:
            raise ValueError(f"where[{name!r}]: no sequence holds {', '.join(map(repr, unmatched))} (field {name!r} "
                             f"is {kind}; {_held(name, kind, sources, unmatched)})")
    for s in sources:
        keep = keep_mask(where, s.manifest.fields, s.url, s.fill)
        if not np.any(keep):
            raise ValueError(f"where={dict(given)!r} keeps no sequence of {s.url}: {_counts(given, where, s)}; the "
                             "selection is empty there, whatever the window (leave the source out, or widen where=)")


def _kind_of(name: str, sources: Sequence[Any]) -> str:
    """The field's kind in every source (a source without it: its fill's); int and float together: float."""
    kinds = {}
    for s in sources:
        f: SeqFields | None = s.manifest.fields
        if f is not None and name in f.kinds:
            kinds[s.url] = f.kinds[name]
        elif s.fill is not None and name in s.fill:
            kinds[s.url] = classify(s.fill[name])[0]
        else:
            why = f"left out when packing: {f.left_out[name]}" if f is not None and name in f.left_out \
                else f"its fields are {', '.join(sorted(f.kinds)) if f is not None and f.kinds else 'none'}"
            raise ValueError(f"where: {s.url} has no field {name!r} ({why})")
    found = set(kinds.values())
    if len(found) > 1 and found != {"int", "float"}:
        raise ValueError(f"where[{name!r}]: the field is {', '.join(f'{k} in {u}' for u, k in kinds.items())}")
    return "float" if len(found) > 1 else found.pop()


def _fits(kind: str, v: Any) -> bool:
    """Whether value ``v`` is of a type field kind ``kind`` takes (TAKES)."""
    if isinstance(v, (bool, np.bool_)):
        return kind == "bool"
    if isinstance(v, (np.timedelta64, dt.timedelta)):  # before int: np.timedelta64 is an np.integer
        return kind == "duration"
    if isinstance(v, (np.datetime64, dt.date)):
        return kind == "time"
    if isinstance(v, (int, np.integer)):
        return kind == "int" or (kind == "float" and abs(int(v)) <= 1 << 53)
    if isinstance(v, (float, np.floating)):
        return kind == "float"
    return isinstance(v, str) and kind == "str"


def _holds(s: Any, name: str, stored: list) -> np.ndarray:
    """Whether some sequence of source ``s`` holds each of the stored values ``stored`` in field ``name``."""
    f: SeqFields | None = s.manifest.fields
    if f is None or name not in f.kinds:
        return np.array([classify(s.fill[name])[1] == v for v in stored], dtype=bool)
    if f.kinds[name] == "str":
        words = set(f.vocabulary[name])
        return np.array([v in words for v in stored], dtype=bool)
    return np.isin(np.array(stored), f.columns[name]) if stored else np.zeros(0, dtype=bool)


def _held(name: str, kind: str, sources: Sequence[Any], unmatched: list) -> str:
    """What the field holds, in words: its strings (and the closest to a typo), or its distinct values or range."""
    if kind == "str":
        words = sorted(set().union(*(s.manifest.fields.vocabulary[name] for s in sources
                                     if s.manifest.fields is not None and name in s.manifest.fields.kinds)))
        close = difflib.get_close_matches(str(unmatched[0]), words, n=1)
        shown = ", ".join(map(repr, words[:12])) + (f" and {len(words) - 12:,} more" if len(words) > 12 else "")
        return f"its strings: {shown}" + (f"; did you mean {close[0]!r}?" if close else "")
    cols = [s.manifest.fields.columns[name] for s in sources
            if s.manifest.fields is not None and name in s.manifest.fields.kinds]
    held = np.unique(np.concatenate(cols)) if cols else np.zeros(0)
    show = {"time": lambda v: str(np.datetime64(int(v), "ns")), "duration": lambda v: str(np.timedelta64(int(v), "ns")),
            "bool": lambda v: repr(bool(v))}.get(kind, lambda v: repr(v.item()))
    if len(held) <= 12:
        return f"its values: {', '.join(show(v) for v in held)}"
    return f"{len(held):,} distinct values from {show(held[0])} to {show(held[-1])}"


def _counts(given: Mapping[str, Any], where: dict[str, tuple], s: Any) -> str:
    """How many of a source's sequences each field of ``where`` keeps, and that no sequence has them all."""
    f: SeqFields | None = s.manifest.fields
    n = s.manifest.num_sequences
    parts = []
    for name in where:
        kept = keep_mask({name: where[name]}, f, s.url, s.fill)
        count = int(np.sum(kept)) if not isinstance(kept, bool) else (n if kept else 0)
        parts.append(f"{name} in {list(given[name])!r}: {count:,} of its {n:,} sequences")
    return "; ".join(parts) + (", none in all of them" if len(parts) > 1 else "")
