"""Parquet inputs, in the long layout (one row per time step, see `tables`) or the row layout.

Row layout (one row per sequence): chosen when ``list_column`` is given or value columns are
list-typed. Each row's list (or list of lists -> [T, F]) is a sequence, keyed by
``id_column`` or ``<file>_<row>`` (row counted from 0); several list columns are stacked as
features. Options: ``id_column``, ``order_column``, ``value_columns``, ``squeeze``,
``list_column``. Needs pyarrow (``pip install 'streamwin[parquet]'``), imported when a parquet
file is read.
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from streamwin.errors import PackError
from streamwin.packing.inputs.base import (NUMERIC_KINDS, Batch, Columns, InputFormat, InputUnit, Report, file_key, open_unit,
                                           text_key)
from streamwin.packing.inputs.tables import LONG_OPTIONS, arrow_owned, long_sequences

def read_parquet(unit: InputUnit, opts: dict, report: Report) -> Iterator[Batch]:
    """The sequences of one parquet file, as one Batch."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise PackError(f"{unit.path}: reading parquet needs pyarrow: pip install 'streamwin[parquet]'") from e
    with open_unit(unit) as f:
        table = pq.read_table(arrow_owned(f.read()))
    skip = {opts.get("id_column"), opts.get("order_column")}
    candidates = opts.get("value_columns") or [c for c in table.column_names if c not in skip]
    list_cols = opts.get("list_column") or [
        c for c in candidates if c in table.column_names and _is_list(pa, table.schema.field(c).type)]
    if list_cols:
        yield _row_sequences(table, list(list_cols), opts, unit, report)
    else:
        columns = {c: table.column(c).to_numpy() for c in table.column_names}
        index = [c for c in (table.schema.pandas_metadata or {}).get("index_columns", []) if isinstance(c, str)]
        yield long_sequences(columns, opts, unit.path, report, index)


PARQUET = InputFormat("parquet", read_parquet, suffixes=(".parquet", ".pq"), options=(*LONG_OPTIONS, "list_column"))


def _is_list(pa: Any, t: Any) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _row_sequences(table: Any, names: list[str], opts: dict, unit: InputUnit, report: Report) -> Batch:
    """One sequence per row: the row's list(s); several list columns are stacked as features."""
    import pyarrow as pa

    id_col = opts.get("id_column")
    for name in names + ([id_col] if id_col else []):
        if name not in table.column_names:
            raise PackError(f"{unit.path}: no column {name!r} (columns: {table.column_names})")
    per_column = [_list_values(table, name, unit.path) for name in names]
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
        prefix = file_key(unit)
        keys = [text_key(f"{prefix}_{row}") for row in range(table.num_rows)]
    bounds = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=bounds[1:])
    return Batch(keys, values, bounds)


def _list_values(table: Any, name: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(values end to end, list length per row) of a list<number> column ([N] values) or a
    list<list<number>> column ([N, F] values)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    col = table.column(name).combine_chunks()
    where = f"{where}, column {name!r}"
    if not _is_list(pa, col.type):
        raise PackError(f"{where}: not a list column (type {col.type})")
    if col.null_count:
        raise PackError(f"{where}: {col.null_count} rows are null")
    lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)
    inner = col.flatten()
    if _is_list(pa, inner.type):  # [T, F]: every step must have the same width F
        widths = pc.list_value_length(inner).to_numpy(zero_copy_only=False)
        width = int(widths[0]) if len(widths) else 0
        if inner.null_count or (widths != width).any():
            raise PackError(f"{where}: inner lists must all have one length (got {sorted(set(widths))[:5]})")
        values = inner.flatten().to_numpy(zero_copy_only=False).reshape(len(widths), width)
    else:
        values = inner.to_numpy(zero_copy_only=False)
    if values.dtype.kind not in NUMERIC_KINDS:
        raise PackError(f"{where}: values are not numeric (dtype {values.dtype})")
    return values, lengths
