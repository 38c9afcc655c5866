"""In-memory tables: a pyarrow Table or a pandas DataFrame, one unit each (``format="table"``).

Dataset objects are cut into such units before they are packed: a range of rows of a Hugging
Face ``datasets.Dataset``, a batch of rows of an ``IterableDataset``, a block of a Ray
Dataset, a partition of a Dask DataFrame (see ``streamwin.packing.sources``). The unit's
``data`` is the table, or a `TableSlice` (a table and the number of its first row, for keys
``<name>_<row>`` counted across units). A pandas DataFrame becomes a pyarrow Table first (a
named index becomes a column). Read as parquet's tables are (`rows`); same options.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from streamwin.errors import PackError
from streamwin.packing.inputs.base import Batch, InputFormat, InputUnit, Report
from streamwin.packing.inputs.rows import TABLE_OPTIONS, table_sequences


@dataclass(frozen=True)
class TableSlice:
    """A table (pyarrow, pandas or anything ``as_table`` takes) whose first row is row ``first_row`` of its dataset."""

    table: Any
    first_row: int = 0


def as_table(data: Any, where: str) -> Any:
    """A pyarrow Table of ``data``: a pyarrow Table or RecordBatch, a pandas DataFrame, a dict of columns."""
    import pyarrow as pa

    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    if type(data).__module__.startswith("pandas"):
        return pa.Table.from_pandas(data)
    if isinstance(data, dict):
        return pa.table(data)
    raise PackError(f"{where}: expected a pyarrow Table or a pandas DataFrame, got {type(data).__name__}")


def read_table(unit: InputUnit, opts: dict, report: Report) -> Iterator[Batch]:
    """The sequences of one in-memory table, as one Batch."""
    data = unit.data
    first_row = 0
    if isinstance(data, TableSlice):
        data, first_row = data.table, data.first_row
    yield table_sequences(as_table(data, unit.path), opts, unit, report, first_row, prefix=unit.name)


TABLE = InputFormat("table", read_table, options=TABLE_OPTIONS)
