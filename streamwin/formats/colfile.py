"""The columns file of a version 2 or 3 manifest: fixed-width little-endian arrays, each 64-byte aligned.

index.json names the file (name, size, sha256) and its layout: per array its offset, dtype and
rows. `lay_out` turns named arrays into the bytes to write and that layout; `map_column`
takes one array back out as a view of the file's bytes (a read-only mmap), checked against
the layout and the rows the rest of the manifest implies. Pure, no I/O.
"""
from __future__ import annotations

import json

import numpy as np

import streamwin.formats.fields as fields
from streamwin.errors import ManifestError

COLUMNS_SUFFIX = ".columns"  # index.json -> index.columns
ALIGN = 64
COLUMNAR_VERSIONS = (2, 3)  # the manifest versions that keep their columns in a file


def columns_name(index_name: str) -> str:
    """The columns file that goes with an index file: index.json -> index.columns."""
    return index_name[: -len(".json")] + COLUMNS_SUFFIX if index_name.endswith(".json") else index_name + COLUMNS_SUFFIX


def lay_out(named: list[tuple[str, str, object]]) -> tuple[list, dict[str, list]]:
    """(byte buffers to write in order, layout name -> [offset, dtype, rows]) of arrays ``(name, dtype, values)``."""
    parts, layout, at = [], {}, 0
    for name, dt, values in named:
        data = np.ascontiguousarray(values, dtype=dt)
        pad = -at % ALIGN
        if pad:
            parts.append(bytes(pad))
        at += pad
        layout[name] = [at, dt, len(data)]
        parts.append(memoryview(data).cast("B"))
        at += data.nbytes
    return parts, layout


def map_column(layout: dict, name: str, dt: str, rows: int | None, columns, where: str, path: str) -> np.ndarray:
    """Column ``name`` of the file (``rows`` of them, or any number when None) as a view in native byte order."""
    got = fields.listing(layout.get(name), where, f"columns_file.layout.{name}")
    if len(got) != 3:
        raise fields.fail(where, f"columns_file.layout.{name}", f"must be [offset, dtype, rows], got {got!r}")
    offset = fields.integer(got[0], where, f"columns_file.layout.{name}[0]")
    count = fields.integer(got[2], where, f"columns_file.layout.{name}[2]")
    if got[1] != dt or (rows is not None and count != rows) or offset % ALIGN:
        raise ManifestError(f"{where} describes column {name} of {path} as {got[1]} x {count} at byte {offset}; "
                            f"expected {dt} x {rows if rows is not None else 'the key bytes'}, {ALIGN}-byte aligned")
    if offset + count * np.dtype(dt).itemsize > len(columns):
        raise ManifestError(f"{path} is damaged: column {name} would end past its {len(columns)} bytes")
    arr = np.frombuffer(columns, dtype=dt, count=count, offset=offset)
    return arr if dt == "|u1" else arr.view(dt.replace("<", "="))


def file_spec(text: str | bytes, where: str) -> dict | None:
    """The ``columns_file`` entry of a version 2 or 3 index.json (a JSON object), or None for version 1."""
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ManifestError(f"{where} is not valid JSON: {type(e).__name__}: {e}") from None
    if not isinstance(doc, dict) or doc.get("version") not in COLUMNAR_VERSIONS or \
            isinstance(doc.get("version"), bool):
        return None
    return fields.mapping(doc.get("columns_file"), where, "columns_file")


def map_members(spec: dict, columns, rows: int, names: dict[str, str], where: str) -> tuple[dict, str]:
    """Views of the columns file's arrays ``names`` (``rows`` each; the key bytes and chunk sums any number, which
    the rest of the manifest checks) and the file's path;
    ManifestError naming the file if it is not the one index.json names."""
    name = spec.get("name")
    path = f"{where.rsplit('/', 1)[0]}/{name}" if "/" in where else name
    if columns is None:
        raise ManifestError(f"{where} keeps its per-sequence columns in {name}: load it with "
                            "streamwin.load_manifest(url), which maps that file")
    if len(columns) != spec.get("bytes"):
        raise ManifestError(f"{path} is damaged: it has {len(columns)} bytes, {where} says {spec.get('bytes')} "
                            f"(sha256 {str(spec.get('sha256'))[:16]}...); repack, or rerun `streamwin index`")
    layout = fields.mapping(spec.get("layout"), where, "columns_file.layout")
    out = {col: map_column(layout, col, dt, None if col in ("keys", "check_sums") else rows, columns, where, path)
           for col, dt in {**names, **({"check_sums": "<u4"} if "check_sums" in layout else {})}.items()}
    ends = out["key_ends"]
    if rows and (int(ends[-1]) != len(out["keys"]) or int(ends[0]) < 0):
        raise ManifestError(f"{path} is damaged: its key offsets end at {int(ends[-1])}, its key bytes number "
                            f"{len(out['keys'])}")
    out["keys"] = memoryview(out["keys"])
    return out, path
