"""In-memory inputs: any Python iterable of ``(key, array)`` or ``(key, array, meta)``.

Keys are checked as given (no derivation), arrays go through ``np.asarray`` (so lists,
tensors and array-likes work), ``meta`` is a dict or None. No options. The iterable is read
once, in-process (a generator cannot be sent to a worker or read twice).
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from streamwin.errors import PackError
from streamwin.formats.keys import check_key
from streamwin.packing.inputs.base import InputFormat, InputUnit, Item, Report, check_array


def read_iterable(unit: InputUnit, opts: dict, report: Report) -> Iterator[Item]:
    """The items of the unit's iterable, each checked."""
    for i, item in enumerate(unit.data):
        where = f"iterable item {i}"
        if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
            raise PackError(f"{where}: expected (key, array) or (key, array, meta), got {type(item).__name__}")
        try:
            key = check_key(item[0])
        except PackError as e:
            raise PackError(f"{where}: {e}") from e
        meta = item[2] if len(item) == 3 else None
        if meta is not None and not isinstance(meta, dict):
            raise PackError(f"{where} (key {key!r}): meta must be a dict or None, got {type(meta).__name__}")
        try:
            arr = np.asarray(item[1])
        except Exception as e:
            raise PackError(f"{where} (key {key!r}): cannot make an array: {e}") from e
        yield key, check_array(arr, f"{where} (key {key!r})"), meta


ITERABLE = InputFormat("iterable", read_iterable)
