"""Arrow tables as sequences: the row layout (one row per sequence), or the long layout of `tables`.

Parquet files, Arrow IPC files and in-memory tables (a Hugging Face dataset's rows, a Ray
block, a Dask partition) all arrive here as a pyarrow Table. `table_sequences` picks the
layout: the row layout when ``list_column`` is given or a value column is a list of
numbers, else the long layout (``id_column`` required). In the row layout each row's list is
a sequence ([T]); a list of lists is [T, F] (each inner list one step), or, with
``variates_first=True``, [F, T] (each inner list one variate, as LOTSA and GluonTS store
multivariate series), transposed to [T, F]. Several list columns are stacked as features.
Keys come from ``id_column``, else ``<unit>_<row>`` (rows counted from ``first_row``).
Options: ``id_column``, ``order_column``, ``value_columns``, ``squeeze``, ``list_column``,
``variates_first``. Needs pyarrow, imported when a table is read.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from streamwin.errors import PackError
from streamwin.packing.inputs.base import NUMERIC_KINDS, Batch, Columns, InputUnit, Report, file_key, text_key
from streamwin.packing.inputs.metacols import meta_fields
from streamwin.packing.inputs.tables import LONG_OPTIONS, long_sequences, named_values

TABLE_OPTIONS = (*LONG_OPTIONS, "list_column", "variates_first")


def table_sequences(table: Any, opts: dict, unit: InputUnit, report: Report, first_row: int = 0,
                    prefix: str | None = None) -> Batch:
    """The sequences of one table, row layout or long layout (see the module docstring), as one Batch."""
    import pyarrow as pa

    skip = {opts.get("id_column"), opts.get("order_column")}
    candidates = named_values(opts) or [c for c in table.column_names if c not in skip]
    list_cols = opts.get("list_column") or [c for c in candidates if c in table.column_names
                                            and _is_numeric_list(pa, table.schema.field(c).type)]
    if list_cols:
        return _row_sequences(table, list(list_cols), opts, unit, report, first_row, prefix)
    columns = {c: table.column(c).to_numpy() for c in table.column_names}
    index = [c for c in (table.schema.pandas_metadata or {}).get("index_columns", []) if isinstance(c, str)]
    return long_sequences(columns, opts, unit.path, report, index)


def _is_list(pa: Any, t: Any) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _is_numeric_list(pa: Any, t: Any) -> bool:
    """A list (of lists) of numbers: a timestamp or string list column is not a value column."""
    if not _is_list(pa, t):
        return False
    while _is_list(pa, t):
        t = t.value_type
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _row_sequences(table: Any, names: list[str], opts: dict, unit: InputUnit, report: Report, first_row: int,
                   prefix: str | None) -> Batch:
    """One sequence per row: the row's list(s); several list columns are stacked as features."""
    import pyarrow as pa

    id_col = opts.get("id_column")
    for name in names + ([id_col] if id_col else []):
        if name not in table.column_names:
            raise PackError(f"{unit.path}: no column {name!r} (columns: {table.column_names})")
    per_column = [_list_values(table, name, unit.path, bool(opts.get("variates_first"))) for name in names]
    if not any(_is_list(pa, table.schema.field(n).type.value_type) for n in names):  # one name per feature
        left_out = [(c, "id column" if c == id_col else "not a list column") for c in table.column_names
                    if c not in names]
        report(Columns(tuple(names), tuple(left_out), unit.path))
    lengths = per_column[0][1]
    if len(per_column) > 1:
        nested = any(values.ndim != 1 for values, _ in per_column)
        bad = np.flatnonzero(np.logical_or.reduce([np.full(len(lengths), nested)] +
                                                  [other != lengths for _, other in per_column[1:]]))
        if len(bad):
            raise PackError(f"{unit.path}, row {bad[0]}: list columns {names} differ in length or are nested")
    values = per_column[0][0] if len(per_column) == 1 else np.stack([v for v, _ in per_column], axis=1)
    if id_col:
        keys = [text_key(str(i)) for i in table.column(id_col).to_pylist()]
    else:
        prefix = file_key(unit) if prefix is None else prefix
        keys = [text_key(f"{prefix}_{first_row + row}") for row in range(table.num_rows)]
    bounds = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=bounds[1:])
    fields = None
    if opts.get("meta_columns"):  # one value per row: the row's fields (a label, a start time)
        rows = np.arange(len(keys))
        cols = {c: table.column(c).to_numpy() for c in opts["meta_columns"] if c in table.column_names}
        fields, left = meta_fields(cols, {"meta_columns": opts["meta_columns"]}, keys, rows,
                                   np.arange(len(keys) + 1), unit.path)
        fields.update({name: ("left", why, None) for name, why in left.items()})
    return Batch(keys, values, bounds, fields)


def _list_values(table: Any, name: str, where: str, variates_first: bool) -> tuple[np.ndarray, np.ndarray]:
    """(values end to end, steps per row) of a list<number> column ([N] values) or a
    list<list<number>> column ([N, F] values; [F][T] rows transposed when ``variates_first``)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    col = table.column(name).combine_chunks()
    where = f"{where}, column {name!r}"
    if not _is_list(pa, col.type):
        raise PackError(f"{where}: not a list column (type {col.type})")
    if col.null_count:
        raise PackError(f"{where}: {col.null_count} rows are null")
    outer = pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)
    inner = col.flatten()
    if not _is_list(pa, inner.type):
        if variates_first:
            raise PackError(f"{where}: variates_first=True needs a list of lists per row ([F][T]), got {col.type}")
        values = inner.to_numpy(zero_copy_only=False)
        lengths = outer
    else:
        widths = pc.list_value_length(inner).to_numpy(zero_copy_only=False).astype(np.int64)
        if inner.null_count:
            raise PackError(f"{where}: {inner.null_count} inner lists are null")
        flat = inner.flatten().to_numpy(zero_copy_only=False)
        if variates_first:
            values, lengths = _variates_first(flat, outer, widths, where)
        else:
            values, lengths = _steps_first(flat, widths, where), outer
    if values.dtype.kind not in NUMERIC_KINDS:
        raise PackError(f"{where}: values are not numeric (dtype {values.dtype})")
    return values, lengths


def _steps_first(flat: np.ndarray, widths: np.ndarray, where: str) -> np.ndarray:
    """[T][F] rows: every step must have the same width F; values [sum T, F]."""
    width = int(widths[0]) if len(widths) else 0
    if (widths != width).any():
        raise PackError(f"{where}: inner lists must all have one length (got {sorted(set(widths.tolist()))[:5]})")
    return flat.reshape(len(widths), width)


def _variates_first(flat: np.ndarray, variates: np.ndarray, steps: np.ndarray, where: str) -> tuple[np.ndarray, np.ndarray]:
    """[F][T] rows (F lists of T values each) -> values [sum T, F] and T per row."""
    width = int(variates[0]) if len(variates) else 0
    if (variates != width).any() or width == 0:
        raise PackError(f"{where}: variates_first=True needs the same number of variates in every row "
                        f"(got {sorted(set(variates.tolist()))[:5]})")
    per_row = steps.reshape(-1, width)
    length = per_row[:, 0]
    bad = np.flatnonzero((per_row != length[:, None]).any(axis=1))
    if len(bad):
        raise PackError(f"{where}, row {bad[0]}: its variates have different lengths {per_row[bad[0]].tolist()}")
    starts = np.repeat(np.concatenate([[0], np.cumsum(length * width)[:-1]]), length)  # each output step's row start
    t = np.arange(int(length.sum())) - np.repeat(np.concatenate([[0], np.cumsum(length)[:-1]]), length)
    index = (starts + t)[:, None] + np.repeat(length, length)[:, None] * np.arange(width)[None, :]
    return flat[index], length
