"""JSON Lines inputs (``.jsonl``, ``.jsonl.gz``, ``.ndjson``): one sequence per JSON object.

Options: ``field`` (the list of numbers, default "tokens"), ``key_field`` (default "id" when
the object has one, else ``<file>_<line>``, line counted from 1), ``dtype`` (default int32 for
integers, float32 otherwise), ``meta_fields`` (default: every other JSON scalar, kept as the
sequence's metadata). Blank lines are skipped.
"""
from __future__ import annotations

import json
from typing import Any, Iterator

import numpy as np

from streamwin.errors import PackError
from streamwin.packing.inputs.base import InputFormat, InputUnit, Item, Report, check_array, file_key, open_unit, text_key


def read_jsonl(unit: InputUnit, opts: dict, report: Report) -> Iterator[Item]:
    """One sequence per non-blank line of a JSON Lines file."""
    field_name = opts.get("field", "tokens")
    with open_unit(unit, "rt") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{unit.path}, line {lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise PackError(f"{where}: invalid JSON: {e}") from e
            if not isinstance(obj, dict) or field_name not in obj:
                raise PackError(f"{where}: expected a JSON object with field {field_name!r}")
            key_field = opts.get("key_field", "id" if "id" in obj else None)
            if key_field is None:
                key = text_key(f"{file_key(unit)}_{lineno}")
            elif key_field in obj:
                key = text_key(str(obj[key_field]))
            else:
                raise PackError(f"{where}: no key field {key_field!r}")
            arr = _json_array(obj[field_name], opts.get("dtype"), f"{where}, field {field_name!r}")
            yield key, arr, _json_meta(obj, {field_name, key_field}, opts.get("meta_fields"))


JSONL = InputFormat("jsonl", read_jsonl, suffixes=(".jsonl", ".jsonl.gz", ".ndjson"),
                    options=("field", "key_field", "dtype", "meta_fields"))


def _json_array(value: Any, dtype: str | None, where: str) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except ValueError as e:  # ragged lists
        raise PackError(f"{where}: {e}") from e
    if arr.size and arr.dtype.kind not in "iuf":
        raise PackError(f"{where}: expected a list of numbers, got dtype {arr.dtype}")
    floats = arr.size and arr.dtype.kind == "f"  # an empty list counts as integers
    target = np.dtype(dtype or (np.float32 if floats else np.int32))
    out = check_array(arr, where).astype(target)
    if target.kind in "iu" and not np.array_equal(out, arr):
        raise PackError(f"{where}: values do not fit {target} exactly; pass a wider dtype= (e.g. 'int64')")
    return out


def _json_meta(obj: dict, used: set, meta_fields: tuple | None) -> dict | None:
    if meta_fields is not None:
        meta = {k: obj[k] for k in meta_fields if k in obj}
    else:
        scalar = (str, int, float, bool, type(None))
        meta = {k: v for k, v in obj.items() if k not in used and isinstance(v, scalar)}
    return meta or None
