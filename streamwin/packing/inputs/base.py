"""What every input reader shares: the unit it reads, what it yields, and how it makes keys.

Each format's module declares an `InputFormat`: its name, suffixes, options and reader. A
reader takes one `InputUnit` (one input file, or an in-memory iterable) with its format's
options and yields the unit's sequences in a deterministic order, either one at a time as
``(key, array, meta)`` items or many at a time as a `Batch`. A table reader also reports the
`Columns` its values came from. Keys are made here, the same way for every format: from a
file's path relative to the input root (`file_key`) or from free text such as an id
(`text_key`), always valid tar member names.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import fsspec
import numpy as np

from streamwin.errors import PackError
from streamwin.formats.keys import key_from_name

Item = tuple[str, np.ndarray, dict | None]
NUMERIC_KINDS = "biufc"  # bool, signed, unsigned, float, complex


@dataclass(frozen=True)
class InputUnit:
    """One independent piece of an input, cheap to pickle and send to a worker.

    Args:
        format: one of FORMATS.
        path: what fsspec opens: a local path or a URL ("<iterable>" for iterables).
        name: the path relative to the input root; keys are derived from it.
        options: the format's options, sorted (key, value) pairs with lists made tuples.
        single: the input named this one file (npz keys are then the bare array names).
        data: the Python iterable of an "iterable" unit (the table of a "table" unit), else None.
        size: the file's size in bytes, when listing it told (0 otherwise).
    """

    format: str
    path: str
    name: str
    options: tuple[tuple[str, Any], ...] = ()
    single: bool = False
    data: Any = field(default=None, compare=False, repr=False)
    size: int = 0


@dataclass(frozen=True)
class Columns:
    """The columns of a table that became the values of its sequences (one per feature, in
    order), and each column left out with the reason, as ``(name, why)`` pairs."""

    taken: tuple[str, ...]
    left_out: tuple[tuple[str, str], ...]
    where: str


Report = Callable[[Columns], None]
Reader = Callable[["InputUnit", dict, Report], Iterator["Batch | Item"]]


@dataclass(frozen=True)
class InputFormat:
    """One input format, as its module declares it; ``units`` lists every format.

    Args:
        name: what ``format=`` and ``InputUnit.format`` call it.
        read: ``read(unit, options, report)`` yields the unit's sequences, items or Batches, in
            a deterministic order (options: the given ones, as a dict).
        suffixes: the file suffixes that select this format (lower case, matched case-insensitively).
        options: the options it accepts (an unknown option is an error).
        one_per_file: each file is one sequence, so files are encoded many per task.
        check: checks the given options together (PackError), after each is known to be accepted.
    """

    name: str
    read: Reader
    suffixes: tuple[str, ...] = ()
    options: tuple[str, ...] = ()
    one_per_file: bool = False
    check: Callable[[dict], None] | None = None


@dataclass(frozen=True, eq=False)
class Batch:
    """Many sequences of one dtype and step shape, end to end: sequence i is
    ``values[bounds[i]:bounds[i + 1]]`` and is keyed ``keys[i]`` (keys already valid)."""

    keys: list[str]
    values: np.ndarray
    bounds: np.ndarray
    fields: dict | None = None  # meta columns: name -> (kind, one value per sequence, vocabulary of str codes),
    # the values a masked array where some are missing; a field left out: name -> ("left", why, None)

    def __len__(self) -> int:
        return len(self.keys)

    def items(self) -> Iterator[Item]:
        """The batch as ``(key, array, None)`` items, as `read_unit` yields them (meta columns: `meta`)."""
        ends = self.bounds.tolist()
        for key, a, b in zip(self.keys, ends, ends[1:]):
            yield key, self.values[a:b], None

    def meta(self, i: int) -> dict | None:
        """Sequence i's meta columns as a meta dict (str codes decoded), or None."""
        if self.fields is None:
            return None
        return {k: (vocab[int(v[i])] if kind == "str" else _scalar(kind, v[i]))
                for k, (kind, v, vocab) in self.fields.items() if kind != "left" and v[i] is not np.ma.masked}

    def slice(self, i: int, j: int) -> "Batch":
        """Sequences i..j-1 (their values, bounds from 0, meta columns)."""
        b = self.bounds
        return Batch(self.keys[i:j], self.values[b[i] : b[j]], b[i : j + 1] - b[i], cut_fields(self.fields, slice(i, j)))


def cut_fields(fields: dict | None, rows) -> dict | None:
    """Meta columns of some sequences (``rows``: a slice or a mask); fields left out stay as they are."""
    if fields is None:
        return None
    return {k: e if e[0] == "left" else (e[0], e[1][rows], e[2]) for k, e in fields.items()}


def open_unit(unit: InputUnit, mode: str = "rb") -> Any:
    """The unit's file, opened through fsspec (``.gz`` decompressed; text mode is UTF-8)."""
    encoding = "utf-8" if "t" in mode else None
    return fsspec.open(unit.path, mode, compression="infer", encoding=encoding)


_PLAIN_KEY = re.compile(r"[!-\-0-\[\]-~]{1,90}")  # already a valid key: printable ASCII but . / \\


def text_key(text: str) -> str:
    """A key from free text (an id, an array name): dots are replaced, never cut as an extension."""
    if _PLAIN_KEY.fullmatch(text):  # most ids and names: nothing to replace (~10x faster)
        return text
    return key_from_name(text + ".")  # key_from_name strips only the last suffix, here the empty one


def file_key(unit: InputUnit) -> str:
    """The key part of a file name: ``dir/b.jsonl.gz`` -> ``dir__b``."""
    name = unit.name[:-3] if unit.name.endswith(".gz") else unit.name
    return key_from_name(name)


def check_array(arr: Any, where: str) -> np.ndarray:
    """``arr`` if it is a numeric numpy array of at least one dimension, else PackError naming ``where``."""
    if not isinstance(arr, np.ndarray):
        raise PackError(f"{where}: expected a numpy array, got {type(arr).__name__}")
    if arr.dtype.kind not in NUMERIC_KINDS:
        raise PackError(f"{where}: dtype {arr.dtype} is not numeric (object, string and structured "
                        "arrays are refused)")
    if arr.ndim == 0:
        raise PackError(f"{where}: a sequence needs shape [T] or [T, F, ...], got a scalar")
    return arr


def _scalar(kind: str, value: Any) -> Any:
    """A meta column's value as its meta dict holds it: time and duration as numpy datetime64 / timedelta64."""
    if kind == "time":
        return np.datetime64(int(value), "ns")
    if kind == "duration":
        return np.timedelta64(int(value), "ns")
    return value.item() if isinstance(value, np.generic) else value
