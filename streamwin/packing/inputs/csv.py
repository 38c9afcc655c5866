"""CSV inputs: the long layout of `tables` (``id_column`` required), ``.csv`` or ``.csv.gz``.

Read with pyarrow.csv when pyarrow is installed, else with the stdlib csv module: a column is
int64 or float64 when all its cells parse (an empty cell is NaN), else text; an empty cell of a
``meta_columns`` column is a missing value (None), so its sequence has none. Options:
``id_column``, ``order_column``, ``value_columns``, ``squeeze``. A CSV has no schema that says
which columns are values: when neither ``value_columns`` nor ``order_column`` is given and more
than one numeric column is left besides the id column (a time stamp among them?), pack asks
(a PackError naming the columns) instead of taking them all. Naming the time column as
``order_column`` answers it (the other numeric columns are the values, in file order, unless one of
them holds one value per id, a label or a year: then pack asks again), and so
do ``value_columns=[...]`` and ``value_columns="*"`` (all of them).
"""
from __future__ import annotations

import csv
import importlib
import io
from typing import Any, Iterator

import numpy as np

from streamwin.errors import PackError
from streamwin.packing.inputs.base import Batch, InputFormat, InputUnit, Report, open_unit
from streamwin.packing.inputs.tables import LONG_OPTIONS, arrow_owned, long_sequences


def read_csv(unit: InputUnit, opts: dict, report: Report) -> Iterator[Batch]:
    """The sequences of one CSV file, as one Batch."""
    with open_unit(unit) as f:
        try:
            pacsv = importlib.import_module("pyarrow.csv")
        except ImportError:
            columns = _csv_columns_stdlib(f, unit.path)
        else:
            table = pacsv.read_csv(arrow_owned(f.read()))
            columns = {c: table.column(c).to_numpy() for c in table.column_names}
    for name in opts.get("meta_columns") or ():  # an empty cell is a missing value (None), as a null is elsewhere
        if name in columns and columns[name].dtype.kind in "OU":
            cells = columns[name].astype(object)
            cells[cells == ""] = None
            columns[name] = cells
    yield long_sequences(columns, opts, unit.path, report, ask=True)


def _needs_id_column(opts: dict) -> None:
    if "id_column" not in opts:
        raise PackError("csv inputs are long format: pass id_column= (the column naming each sequence)")


CSV = InputFormat("csv", read_csv, suffixes=(".csv", ".csv.gz"), options=LONG_OPTIONS, check=_needs_id_column)


def _csv_columns_stdlib(f: Any, where: str) -> dict[str, np.ndarray]:
    """Columns of a CSV file, each int64 or float64 when all its cells parse (empty -> NaN), else str."""
    reader = csv.reader(io.TextIOWrapper(f, encoding="utf-8", newline=""))
    header = next(reader, [])
    rows = []
    for lineno, row in enumerate(reader, 2):
        if len(row) != len(header):
            raise PackError(f"{where}, line {lineno}: {len(row)} fields, the header has {len(header)}")
        rows.append(row)
    columns = {}
    for name, cells in zip(header, zip(*rows) if rows else [()] * len(header)):
        text = np.asarray(cells, dtype=str)
        columns[name] = text
        for dtype, cells_as in ((np.int64, text), (np.float64, np.where(text == "", "nan", text))):
            try:
                columns[name] = cells_as.astype(dtype)
                break
            except ValueError:
                continue
    return columns
