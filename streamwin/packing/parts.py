"""Pack a dataset in parts, on many machines at once, then merge their indexes into one index.json.

``pack(..., part="i/n")`` packs the i-th of n disjoint parts of the input (a contiguous run
of its files, or every n-th item of an iterable) into shards of its own prefix
(``partIIIII-shard-NNNNNN.tar``) and a part index (``index.partIIIII-of-NNNNN.json``). A
dataset is complete only when `merge` has checked that every part is there and agrees with
the others, and written the combined index.json: that write is the commit marker, as for
a pack in one piece.
"""
from __future__ import annotations

import re
from typing import Iterator

import numpy as np

from streamwin.errors import ManifestError, PackError
from streamwin.formats.checks import Checks
from streamwin.formats.manifest import Manifest, NonFinite, build_manifest
from streamwin.packing.inputs import InputUnit
from streamwin.storage.manifests import load_manifest, write_manifest
from streamwin.storage.urls import join, url_to_fs


def parse_part(part: str | tuple[int, int] | None) -> tuple[int, int] | None:
    """``"i/n"`` or ``(i, n)`` -> (i, n) with 0 <= i < n; None stays None."""
    if part is None:
        return None
    if isinstance(part, str):
        m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", part)
        if not m:
            raise PackError(f"part must look like 'i/n' (0 <= i < n), got {part!r}")
        part = (int(m.group(1)), int(m.group(2)))
    i, n = part
    if not 0 <= i < n:
        raise PackError(f"part {i}/{n}: need 0 <= i < n")
    return i, n


def part_index_name(i: int, n: int) -> str:
    """The name of part i of n's index: ``index.partIIIII-of-NNNNN.json``."""
    return f"index.part{i:05d}-of-{n:05d}.json"


def part_indexes(dest: str, *, storage_options: dict | None = None) -> list[str]:
    """Names of the part indexes (``index.partIIIII-of-NNNNN.json``) at ``dest``, sorted."""
    fs, root = url_to_fs(dest, storage_options)
    return sorted(p.rsplit("/", 1)[-1] for p in fs.glob(join(root, "index.part*-of-*.json")))


def part_units(units: list[InputUnit], part: tuple[int, int] | None) -> list[InputUnit]:
    """The units of part i of n: a contiguous run of files, or every n-th item of an iterable."""
    if part is None:
        return units
    i, n = part
    if len(units) == 1 and units[0].format == "iterable":
        u = units[0]
        return [InputUnit(u.format, u.path, u.name, u.options, data=_every_nth(u.data, i, n))]
    mine = units[i * len(units) // n : (i + 1) * len(units) // n]
    if not mine:
        raise PackError(f"part {i}/{n} is empty: the input has only {len(units)} file(s); use at most that many parts")
    return mine


def _every_nth(items, i: int, n: int) -> Iterator:
    for j, item in enumerate(items):
        if j % n == i:
            yield item


def merge(dest: str, *, storage_options: dict | None = None) -> Manifest:
    """Combine the part indexes written by ``pack(..., part="i/n")`` into one index.json.

    Refuses (ManifestError) when a part index is missing, the parts disagree on n, dtype,
    step shape or compression, a key is in two parts, or a shard a part names is missing.
    """
    fs, root = url_to_fs(dest, storage_options)
    expected = _finished_parts(dest, storage_options)
    parts = [load_manifest(dest, storage_options, name=name) for name in expected]
    _check_parts_agree(dest, expected, parts, {p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)})
    keys = [k for m in parts for k in m.keys(np.arange(m.num_sequences))]
    if len(set(keys)) != len(keys):
        seen: set[str] = set()
        dup = next(k for k in keys if k in seen or seen.add(k))
        raise ManifestError(f"cannot merge {dest}: key {dup!r} appears in more than one part")
    cols = {c: np.concatenate([getattr(m, c) for m in parts]) for c in ("length", "offset", "size", "hlen")}
    counted = all(m.nonfinite is not None for m in parts)
    nonfinite = NonFinite(sum(m.nonfinite.nan for m in parts), sum(m.nonfinite.inf for m in parts),
                          tuple(n for m in parts for n in m.nonfinite.per_shard)) if counted else None
    left_out = {k: v for m in parts for k, v in (m.left_out_columns or {}).items()}
    first = parts[0]
    manifest = build_manifest(first.dtype, first.step_shape, first.compression,
                              [s for m in parts for s in m.shards], keys, cols,
                              sum(m.dropped_empty for m in parts), value_columns=first.value_columns,
                              left_out_columns=left_out if first.value_columns is not None else None,
                              nonfinite=nonfinite, frames=_merged_frames(parts),
                              checks=Checks.concat([m.checks for m in parts]))
    write_manifest(fs, root, manifest)
    return manifest


def _finished_parts(dest: str, storage_options: dict | None) -> list[str]:
    """The names of all n part indexes at ``dest`` (ManifestError when none, some, or two counts are there)."""
    names = part_indexes(dest, storage_options=storage_options)
    if not names:
        raise ManifestError(f"no part indexes (index.partIIIII-of-NNNNN.json) at {dest}: run pack with --part i/n first")
    counts = sorted({int(re.search(r"-of-(\d+)", name).group(1)) for name in names})
    if len(counts) > 1:
        raise ManifestError(f"part indexes at {dest} are for different part counts {counts}; remove the stale ones")
    n = counts[0]
    expected = [part_index_name(i, n) for i in range(n)]
    missing = [name for name in expected if name not in names]
    if missing:
        raise ManifestError(f"cannot merge {dest}: {len(missing)} of {n} parts are not finished: {', '.join(missing[:5])}")
    return expected


def _check_parts_agree(dest: str, names: list[str], parts: list[Manifest], present: set[str]) -> None:
    """ManifestError unless every part has the first one's dtype, step shape, compression and value
    columns, and every shard a part names is ``present``."""
    first = parts[0]
    for name, m in zip(names, parts):
        if (m.dtype, m.step_shape, m.compression) != (first.dtype, first.step_shape, first.compression):
            raise ManifestError(f"{name} has dtype {m.dtype}, step shape {m.step_shape}, compression {m.compression}; "
                                f"{names[0]} has {first.dtype}, {first.step_shape}, {first.compression}")
        if m.value_columns != first.value_columns:
            raise ManifestError(f"{name} has value columns {m.value_columns}, {names[0]} has {first.value_columns}")
    absent = [s.name for m in parts for s in m.shards if s.name not in present]
    if absent:
        raise ManifestError(f"cannot merge {dest}: {len(absent)} shard(s) named by the part indexes are missing: {', '.join(absent[:5])}")


def _merged_frames(parts: list[Manifest]) -> tuple[int, np.ndarray, np.ndarray] | None:
    """The frames fields of part manifests as one (sequence numbers shifted past the parts before)."""
    framed = [(m, before) for m, before in zip(parts, np.cumsum([0] + [m.num_sequences for m in parts]))
              if m.frames is not None]
    if not framed:
        return None
    rows = {m.frames.rows for m, _ in framed}
    if len(rows) > 1:
        raise ManifestError(f"cannot merge: the parts' zstd frames hold different step counts {sorted(rows)}")
    return (rows.pop(), np.concatenate([m.frames.seq + before for m, before in framed]),
            np.concatenate([m.frames.ends for m, _ in framed]))
