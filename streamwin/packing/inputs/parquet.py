"""Parquet inputs, in the long layout (one row per time step, see `tables`) or the row layout (`rows`).

Row layout (one row per sequence): chosen when ``list_column`` is given or value columns are
lists of numbers. Each row's list (or list of lists -> [T, F]; ``variates_first=True`` for
[F][T]) is a sequence, keyed by ``id_column`` or ``<file>_<row>`` (row counted from 0);
several list columns are stacked as features. Options: ``id_column``, ``order_column``,
``value_columns``, ``squeeze``, ``list_column``, ``variates_first``. Needs pyarrow
(``pip install 'streamwin[parquet]'``), imported when a parquet file is read.
"""
from __future__ import annotations

from typing import Iterator

from streamwin.errors import PackError
from streamwin.packing.inputs.base import Batch, InputFormat, InputUnit, Report, open_unit
from streamwin.packing.inputs.rows import TABLE_OPTIONS, table_sequences
from streamwin.packing.inputs.tables import arrow_owned


def read_parquet(unit: InputUnit, opts: dict, report: Report) -> Iterator[Batch]:
    """The sequences of one parquet file, as one Batch."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise PackError(f"{unit.path}: reading parquet needs pyarrow: pip install 'streamwin[parquet]'") from e
    with open_unit(unit) as f:
        table = pq.read_table(arrow_owned(f.read()))
    yield table_sequences(table, opts, unit, report)


PARQUET = InputFormat("parquet", read_parquet, suffixes=(".parquet", ".pq"), options=TABLE_OPTIONS)
