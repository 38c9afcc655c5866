"""Arrow IPC inputs (``.arrow``, ``.feather``, ``.ipc``): the file format (Feather v2) and the stream format.

Hugging Face ``datasets`` keeps its cache as Arrow stream files, GluonTS and LOTSA ship Arrow
files; both read here as a pyarrow Table, then as parquet's are (`rows`: the row layout, one
row per sequence, or the long layout). Options: those of parquet. Needs pyarrow.
"""
from __future__ import annotations

from typing import Iterator

from streamwin.errors import PackError
from streamwin.packing.inputs.base import Batch, InputFormat, InputUnit, Report, open_unit
from streamwin.packing.inputs.rows import TABLE_OPTIONS, table_sequences
from streamwin.packing.inputs.tables import arrow_owned


def read_arrow(unit: InputUnit, opts: dict, report: Report) -> Iterator[Batch]:
    """The sequences of one Arrow IPC file (file or stream format), as one Batch."""
    try:
        import pyarrow as pa
    except ImportError as e:
        raise PackError(f"{unit.path}: reading Arrow files needs pyarrow: pip install 'streamwin[parquet]'") from e
    with open_unit(unit) as f:
        data = f.read()
    try:
        table = pa.ipc.open_file(arrow_owned(data)).read_all()
    except pa.ArrowInvalid:  # not the file format: the stream format (datasets' cache files)
        try:
            table = pa.ipc.open_stream(arrow_owned(data)).read_all()
        except pa.ArrowInvalid as e:
            raise PackError(f"{unit.path}: not an Arrow IPC file or stream: {e}") from e
    yield table_sequences(table, opts, unit, report)


ARROW = InputFormat("arrow", read_arrow, suffixes=(".arrow", ".feather", ".ipc"), options=TABLE_OPTIONS)
