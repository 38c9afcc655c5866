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

Fields = dict[str, tuple[str, np.ndarray, tuple[str, ...] | None]]


def _kind(values: np.ndarray) -> str | None:
    k = values.dtype.kind
    return {"b": "bool", "i": "int", "u": "int", "f": "float", "M": "time", "m": "duration", "U": "str",
            "O": "str", "S": "str"}.get(k)


def meta_fields(columns: dict[str, np.ndarray], opts: dict, keys: list[str], rows: np.ndarray, bounds: np.ndarray,
                where: str) -> tuple[Fields, dict[str, str]]:
    """(fields, left out with why) of the sequences of a long table: rows ``rows`` grouped by sequence
    (``bounds``), keyed ``keys``."""
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
        if kind == "str":
            col = col.astype(str)
        changes = np.flatnonzero((col[1:] != col[:-1]) & ~np.isin(np.arange(1, len(col)), first))
        if len(changes):
            r = int(changes[0]) + 1
            i = int(np.searchsorted(bounds, r, side="right")) - 1
            raise PackError(f"{where}: meta column {name!r} changes within id {keys[i]!r} ({_py(col[r - 1])!r}, then "
                            f"{_py(col[r])!r}): a meta column holds one value per id; name it in value_columns to keep "
                            "it as a feature of every step")
        fields[name] = _column(kind, col[first] if len(col) else col)
    order_col = opts.get("order_column")
    if order_col is not None and not {"start", "freq"} & set(fields):
        derived = _start_freq(columns[order_col][rows], bounds, keys, order_col, where,
                              bool(opts.get("regular_order", False)))
        if isinstance(derived, str):
            left["start"] = left["freq"] = derived
        elif derived is not None:
            fields.update(derived)
    return fields, left


def _column(kind: str, values: np.ndarray) -> tuple[str, np.ndarray, tuple[str, ...] | None]:
    """(kind, stored values, vocabulary) of one value per sequence."""
    if kind == "str":
        vocab, codes = np.unique(values, return_inverse=True)
        return kind, codes.reshape(-1).astype(np.int32), tuple(str(v) for v in vocab.tolist())
    if kind in ("time", "duration"):
        return kind, values.astype(f"{values.dtype.str[1]}8[ns]").astype(np.int64), None
    return kind, values, None


def _start_freq(t: np.ndarray, bounds: np.ndarray, keys: list[str], name: str, where: str,
                required: bool) -> Fields | str | None:
    """start and freq per sequence from its (sorted) order values, or why not (a string), or None (not a time)."""
    kind = t.dtype.kind
    if kind not in "iuM":
        return f"order column {name!r} holds {t.dtype}, not integers or timestamps" if kind == "f" else None
    ints = t.astype("datetime64[ns]").astype(np.int64) if kind == "M" else t.astype(np.int64)
    first = bounds[:-1]
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
