"""A long table's per-sequence fields: ``meta_columns`` (one value per id), and ``start``/``freq`` from its order column.

``meta_columns=[...]`` names columns that hold one value per id (a label, a store, a sensor
type): each becomes a field of the manifest (formats/meta.py), never a feature of every step; a
column whose value changes within an id is refused, naming the id and the column. With an
``order_column`` of timestamps or integers, each sequence's ``start`` (its first order value)
and ``freq`` (the step between its order values) are fields too, when every id steps
regularly (an id of one row: freq 0). An irregular one leaves them out with the reason (a
loader asked for ``time`` says it), or with ``regular_order=True`` is refused, naming the id.
To keep an irregular time column as a per-step feature instead, name it in ``value_columns``.
"""
from __future__ import annotations

import numpy as np

from streamwin.errors import PackError
from streamwin.formats.meta import is_missing
from streamwin.formats.times import column_ns

Fields = dict[str, tuple[str, np.ndarray, tuple[str, ...] | None]]


def _kind(values: np.ndarray) -> str | None:
    k = values.dtype.kind
    if k == "O":  # a table's column with nulls (None), or of Python objects: the kind of the values there
        present = [v for v in values.tolist() if not is_missing(v)]
        if present and all(isinstance(v, (bool, np.bool_)) for v in present):
            return "bool"
        if present and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in present):
            return "int"
        return "str"
    return {"b": "bool", "i": "int", "u": "int", "f": "float", "M": "time", "m": "duration", "U": "str",
            "S": "str"}.get(k)


def _missing(values: np.ndarray) -> np.ndarray:
    """Which values are missing (formats/meta.py ``is_missing``: None, NaN, NaT; a CSV's empty cell is None)."""
    k = values.dtype.kind
    if k == "f":
        return np.isnan(values)
    if k in "mM":
        return np.isnat(values)
    if k == "O":
        return np.fromiter((is_missing(v) for v in values.tolist()), dtype=bool, count=len(values))
    return np.zeros(len(values), dtype=bool)


def meta_fields(columns: dict[str, np.ndarray], opts: dict, keys: list[str], rows: np.ndarray, bounds: np.ndarray,
                where: str) -> tuple[Fields, dict[str, str]]:
    """(fields, left out with why) of the sequences of a long table: rows ``rows`` grouped by sequence
    (``bounds``), keyed ``keys``. A sequence whose value is missing has none: its field's values are masked."""
    fields: Fields = {}
    left: dict[str, str] = {}
    first = bounds[:-1]
    for name in opts.get("meta_columns") or ():
        if name not in columns:
            raise PackError(f"{where}: meta_columns names no column {name!r} (columns: {list(columns)})")
        col = columns[name][rows]
        kind = _kind(col)
        if kind is None:
            raise PackError(f"{where}: meta column {name!r} has dtype {col.dtype}: not a number, bool, string or "
                            "timestamp")
        lacking = _missing(col)
        if kind == "str" or col.dtype.kind == "O":
            col = np.where(lacking, "", col).astype(str) if kind == "str" else np.where(lacking, 0, col).astype(
                {"bool": np.bool_, "int": np.int64}[kind])
        same = (col[1:] == col[:-1]) & (lacking[1:] == lacking[:-1]) | (lacking[1:] & lacking[:-1])
        changes = np.flatnonzero(~same & ~np.isin(np.arange(1, len(col)), first))
        if len(changes):
            r = int(changes[0]) + 1
            i = int(np.searchsorted(bounds, r, side="right")) - 1
            was, then = (None if lacking[x] else _py(col[x]) for x in (r - 1, r))
            raise PackError(f"{where}: meta column {name!r} changes within id {keys[i]!r} ({was!r}, then {then!r}): "
                            "a meta column holds one value per id; name it in value_columns to keep it as a feature "
                            "of every step")
        entry = _column(kind, col[first] if len(col) else col, lacking[first] if len(col) else lacking, keys)
        if entry[0] == "left":
            left[name] = entry[1]
        else:
            fields[name] = entry
    order_col = opts.get("order_column")
    if order_col is not None and not {"start", "freq"} & set(fields):
        derived = _start_freq(columns[order_col][rows], bounds, keys, order_col, where,
                              bool(opts.get("regular_order", False)))
        if isinstance(derived, str):
            left["start"] = left["freq"] = derived
        elif derived is not None:
            fields.update(derived)
    return fields, left


def _column(kind: str, values: np.ndarray, lacking: np.ndarray, keys: list[str]) -> tuple:
    """(kind, stored values, vocabulary) of one value per sequence, masked where ``lacking``; ("left", why, None)
    when a value cannot be stored."""
    vocab = None
    if kind == "str":
        words, codes = np.unique(values[~lacking], return_inverse=True)
        values = np.zeros(len(values), dtype=np.int32)
        values[~lacking] = codes.reshape(-1)
        vocab = tuple(str(v) for v in words.tolist())
    elif kind in ("time", "duration"):
        values, bad, why = column_ns(values)
        if why:
            return "left", f"{why} (sequence {keys[bad]!r})", None
    return kind, np.ma.masked_array(values, lacking) if lacking.any() else values, vocab


def _start_freq(t: np.ndarray, bounds: np.ndarray, keys: list[str], name: str, where: str,
                required: bool) -> Fields | str | None:
    """start and freq per sequence from its (sorted) order values, or why not (a string), or None (not a time)."""
    kind = t.dtype.kind
    if kind not in "iuM":
        return f"order column {name!r} holds {t.dtype}, not integers or timestamps" if kind == "f" else None
    ints = t.astype(np.int64)
    first = bounds[:-1]
    if kind == "M":
        ints, bad, why = column_ns(t)
        if why:
            i = int(np.searchsorted(bounds, bad, side="right")) - 1
            if required:
                raise PackError(f"{where}: order column {name!r} of id {keys[i]!r}: {why}")
            return f"order column {name!r}: {why} (id {keys[i]!r})"
    steps = np.diff(ints)
    inside = ~np.isin(np.arange(1, len(ints)), first)  # step r: from row r to r + 1, both of one id
    lengths = np.diff(bounds)
    freq = np.zeros(len(first), dtype=np.int64)
    has = lengths > 1
    freq[has] = steps[first[has]]
    expect = np.repeat(freq, lengths)[1:]
    bad = np.flatnonzero(inside & (steps != expect))
    if len(bad):
        r = int(bad[0]) + 1
        i = int(np.searchsorted(bounds, r, side="right")) - 1
        why = (f"order column {name!r} is irregular in id {keys[i]!r} (steps of {int(expect[r - 1])} and "
               f"{int(steps[r - 1])}{' ns' if kind == 'M' else ''})")
        if required:
            raise PackError(f"{where}: {why}; without regular_order=True start and freq are left out (name the "
                            "column in value_columns to keep it as a feature of every step)")
        return why
    if (has & (freq <= 0)).any():
        i = int(np.flatnonzero(has & (freq <= 0))[0])
        why = f"order column {name!r} repeats a value in id {keys[i]!r}"
        if required:
            raise PackError(f"{where}: {why}")
        return why
    time = kind == "M"
    return {"start": ("time" if time else "int", ints[first], None),
            "freq": ("duration" if time else "int", freq, None)}


def _py(value):
    """A numpy scalar as the Python value an error message shows."""
    return value.item() if isinstance(value, np.generic) else value
