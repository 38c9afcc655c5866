"""Tables (parquet, csv) in the long layout: one row per time step, rows grouped into sequences.

``id_column`` names each row's sequence, ``order_column`` (optional) sorts its rows (stable:
file order on ties, and file order without one), and the value columns are stacked to
[T, F] ([T] for one column when ``squeeze``, the default). Without ``value_columns`` (or with
``value_columns="*"``) every numeric column is taken (a CSV with neither ``order_column`` nor ``value_columns``
asks instead, when that is more than one) but the id, the order and a pandas index (``__index_level_0__``,
``Unnamed: 0``, an unnamed column, the index named in parquet's pandas metadata). Sequences
come in order of their id's first row; a sequence must lie within one file. The reader
reports the `Columns` it took (one name per feature) and the ones it left out, and why.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import numpy as np

from streamwin.errors import PackError
from streamwin.packing.inputs.base import NUMERIC_KINDS, Batch, Columns, Report, text_key
from streamwin.packing.inputs.metacols import meta_fields

LONG_OPTIONS = ("id_column", "order_column", "value_columns", "squeeze", "meta_columns", "regular_order")
_PANDAS_INDEX = re.compile(r"__index_level_\d+__|Unnamed: \d+|")  # what pandas writes for its index; "" too


def named_values(opts: dict) -> tuple[str, ...] | None:
    """The value columns the options name; None when they name none, or ``"*"`` (every numeric column)."""
    chosen = opts.get("value_columns")
    return None if chosen in (None, ("*",)) else chosen


def choose_columns(kinds: dict[str, str], opts: dict, where: str, index_columns: Iterable[str] = ()) -> Columns:
    """Which columns hold the values: ``value_columns`` when given, else every numeric column
    (numpy dtype ``kinds``) but the id and order columns and a pandas index."""
    id_col, order_col, chosen = opts.get("id_column"), opts.get("order_column"), named_values(opts)
    index, meta = set(index_columns), set(opts.get("meta_columns") or ())
    left_out = []
    for name, kind in kinds.items():
        if chosen is not None and name in chosen:
            continue
        why = ("id column" if name == id_col else "order column" if name == order_col else "meta column" if name in meta
               else "not in value_columns" if chosen is not None
               else "pandas index" if name in index or _PANDAS_INDEX.fullmatch(name)
               else "not numeric" if kind not in NUMERIC_KINDS else None)
        if why is not None:
            left_out.append((name, why))
    out = {name for name, _ in left_out}
    taken = tuple(chosen) if chosen is not None else tuple(n for n in kinds if n not in out)
    return Columns(taken, tuple(left_out), where)


def long_sequences(columns: dict[str, np.ndarray], opts: dict, where: str, report: Report,
                   index_columns: Iterable[str] = (), ask: bool = False) -> Batch:
    """One sequence per id: its rows, sorted by the order column (stable: file order on ties);
    ids in order of first appearance in the file. ``ask``: refuse to guess between several numeric
    columns when neither ``value_columns`` nor ``order_column`` is given (a CSV's time column would become
    a feature); with ``order_column`` named, the other numeric columns are the values, in file order,
    unless one of them holds one value per id (a label, a year: asked too)."""
    id_col, order_col = opts.get("id_column"), opts.get("order_column")
    if id_col is None:
        raise PackError(f"{where}: long layout needs id_column= (or list columns for one row per sequence)")
    for name in filter(None, (id_col, order_col)):
        if name not in columns:
            raise PackError(f"{where}: no column {name!r} (columns: {list(columns)})")
    chosen = choose_columns({c: a.dtype.kind for c, a in columns.items()}, opts, where, index_columns)
    uniq, first, inverse = np.unique(columns[id_col], return_index=True, return_inverse=True)
    order = np.argsort(first)  # group ranks: by first appearance
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    row_rank = rank[inverse.reshape(-1)]
    if ask and opts.get("value_columns") is None and len(chosen.taken) > 1:
        _ask_for_values(columns, chosen.taken, row_rank, id_col, order_col, where)
    values = _value_matrix(columns, chosen.taken, opts, where)
    report(chosen)
    sort_keys = (row_rank,) if order_col is None else (columns[order_col], row_rank)
    rows = np.lexsort(sort_keys)  # grouped by rank (last key is primary), then by order, stable
    bounds = np.zeros(len(uniq) + 1, dtype=np.int64)
    np.cumsum(np.bincount(row_rank, minlength=len(uniq)), out=bounds[1:])
    keys = [text_key(str(uniq[g])) for g in order.tolist()]
    if not opts.get("meta_columns") and order_col is None:
        return Batch(keys, values[rows], bounds)
    fields, left = meta_fields(columns, opts, keys, rows, bounds, where)
    fields.update({name: ("left", why, None) for name, why in left.items()})
    return Batch(keys, values[rows], bounds, fields or None)


def _ask_for_values(columns: dict[str, np.ndarray], taken: tuple[str, ...], row_rank: np.ndarray, id_col: str,
                    order_col: str | None, where: str) -> None:
    """Refuse to guess a CSV's value columns: with no order column (is one of them the time?), or when one of
    them holds one value per id (a label, a year: a feature of no step)."""
    if order_col is None:
        raise PackError(f"{where}: id_column={id_col!r} leaves {len(taken)} numeric columns, "
                        f"{', '.join(map(repr, taken))}, and each would become a feature of every step. Name "
                        "the time or step column, order_column=... (the other numeric columns are then the values), "
                        "or the values, value_columns=[...], or pass value_columns='*' to take them all")
    per_id = _one_value_per_id(columns, taken, row_rank)
    rest = [name for name in taken if name not in per_id]
    if per_id and rest:  # (all of them one value per id: nothing tells them apart, they are the values)
        raise PackError(f"{where}: {', '.join(map(repr, per_id))} hold{'s' if len(per_id) == 1 else ''} one value "
                        f"per {id_col} (a label, a year?) and would become a feature of every step. Name the values, "
                        f"value_columns={rest!r}, or pass value_columns='*' to take them all (per-sequence fields: "
                        f"meta_columns={per_id!r})")


def _one_value_per_id(columns: dict[str, np.ndarray], names: tuple[str, ...], row_rank: np.ndarray) -> list[str]:
    """The columns among ``names`` whose value is the same on every row of each id (some id having two rows)."""
    grouped = np.argsort(row_rank, kind="stable")
    same_id = row_rank[grouped][1:] == row_rank[grouped][:-1]
    if not same_id.any():
        return []
    return [name for name in names if np.all((columns[name][grouped][1:] == columns[name][grouped][:-1]) | ~same_id)]


def _value_matrix(columns: dict[str, np.ndarray], names: tuple[str, ...], opts: dict, where: str) -> np.ndarray:
    """The value columns stacked to [N, F], or [N] for one column when squeeze (default True)."""
    if not names:
        raise PackError(f"{where}: no numeric value columns (columns: {list(columns)})")
    for name in names:
        if name not in columns:
            raise PackError(f"{where}: no column {name!r} (columns: {list(columns)})")
        if columns[name].dtype.kind not in NUMERIC_KINDS:
            raise PackError(f"{where}: column {name!r} is not numeric (dtype {columns[name].dtype})")
    if len(names) == 1 and opts.get("squeeze", True):
        return columns[names[0]]
    return np.column_stack([columns[n] for n in names])


def arrow_owned(data: bytes) -> Any:
    """A reader over a copy of ``data`` in memory pyarrow allocated. pyarrow's threaded readers
    (csv, parquet) release their input on one of their own threads after the read returns; if
    that input is a Python object (a file, bytes) and the interpreter is exiting by then, the
    process aborts ("terminate called without an active exception")."""
    import pyarrow as pa

    buf = pa.allocate_buffer(len(data))
    memoryview(buf).cast("B")[:] = data
    return pa.BufferReader(buf)
