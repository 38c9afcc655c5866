"""Inputs: turn what the user has into a deterministic stream of sequences ``(key, array, meta)``.

The packer needs two things from an input: a list of independent *units* of work that it
can hand to worker processes, and a way to read one unit. So an input is read in two steps::

    units = list_units("data/ecg/")              # format detected from the file suffixes
    for unit in units:                           # sorted by relative path; picklable
        for key, array, meta in read_unit(unit): # deterministic order inside the unit
            ...

In: a local path (file or directory), a list of paths, an fsspec URL (``s3://bucket/dir``,
``memory://x``), or an iterable of ``(key, array)`` / ``(key, array, meta)`` tuples, with
the format's options. Out: `InputUnit` s, and per unit its sequences, as items or, where the
format allows, as a `Batch` of many sequences end to end (``read_batches``), which the
packer encodes without a Python object per sequence; a table also reports the `Columns`
its values came from.

One module per format, each saying what it reads, the options it accepts and how keys are
made, and declaring its `InputFormat` (name, suffixes, options, reader), which ``units`` lists:
``npy`` (.npy and .npz; ``zipdir`` reads an .npz's zip directory), ``parquet`` and
``csv`` (``tables``: the long layout they share), ``jsonl``, ``text``, ``iterable``. ``base``
holds what they share; ``units`` lists units, detects formats and checks options.

Options that name columns, fields or suffixes take one name (a string) or a list of names.
Ids and array names become keys with their dots replaced, never cut as extensions. Keys are
not checked for duplicates here: that needs the whole stream, which only the packer sees.
Everything unreadable or malformed raises PackError naming the file (and line, row, array or
column), raised from the original exception. Arrays must be numeric: object, string and
structured arrays are refused, and nothing is ever unpickled.
"""
from streamwin.packing.inputs.base import Batch, Columns, InputFormat, InputUnit, Item, Report
from streamwin.packing.inputs.units import (FORMATS, INPUT_OPTIONS, detect_format, format_of, list_units, read_batches,
                                           read_unit)

__all__ = ["FORMATS", "INPUT_OPTIONS", "Batch", "Columns", "InputFormat", "InputUnit", "Item", "Report", "detect_format",
           "format_of", "list_units", "read_batches", "read_unit"]
