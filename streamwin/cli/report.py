"""How the command line describes a dataset: sizes, dtype and step shape, value columns, NaN/inf.

Shared by the verbs that print a manifest (pack, merge, index, inspect), so each says it the
same way.
"""
from __future__ import annotations

import numpy as np

from streamwin.formats.manifest import Manifest
from streamwin.storage.manifests import load_manifest


def mb(nbytes: float) -> str:
    """``12,345,678`` -> ``"12.3 MB"``."""
    return f"{nbytes / 1e6:,.1f} MB"


def layout(m: Manifest) -> str:
    """``"float32 [T, 3], zstd"``: the dtype, step shape and compression of a dataset."""
    shape = ", ".join(["T", *map(str, m.step_shape)])
    return f"{m.dtype.name} [{shape}]" + (", zstd" if m.compression else "")


def _name(column: str) -> str:
    """A column name as typed: quoted when it is empty or holds spaces or commas."""
    return column if column and column.isprintable() and not set(column) & set(" ,'\"") else repr(column)


def value_columns(m: Manifest) -> str:
    """``a, b  (left out: c (id column), ...)``: the value columns and the ones left out."""
    left_out = ", ".join(f"{_name(c)} ({why})" for c, why in (m.left_out_columns or {}).items())
    return ", ".join(map(_name, m.value_columns)) + (f"  (left out: {left_out})" if left_out else "")


def nonfinite_shards(m: Manifest) -> str:
    """``"2 of 7 shards"``: the shards holding NaN or inf values."""
    return f"{sum(1 for n in m.nonfinite.per_shard if n):,} of {len(m.shards):,} shards"


def fields_line(m: Manifest) -> str:
    """``label int 0..3, store str (4 values)  (left out: tags (why))``: the per-sequence fields, kinds and ranges."""
    parts = []
    for name, info in m.fields.describe().items():
        kind = info["kind"]
        if kind == "str":
            parts.append(f"{name} str ({info['values']:,} values)")
        elif "min" not in info:
            parts.append(f"{name} {kind}")
        elif kind in ("time", "duration"):
            unit = "datetime64" if kind == "time" else "timedelta64"
            lo, hi = (np.array(info[k], dtype=np.int64).view(f"{unit}[ns]") for k in ("min", "max"))
            parts.append(f"{name} {kind} {lo}..{hi}")
        else:
            parts.append(f"{name} {kind} {info['min']:g}..{info['max']:g}" if kind == "float" else
                         f"{name} {kind} {info['min']}..{info['max']}")
    left = ", ".join(f"{_name(c)} ({why})" for c, why in m.fields.left_out.items())
    return (", ".join(parts) or "none") + (f"  (left out: {left})" if left else "")


def grown(m: Manifest) -> str:
    """What the last append added to a dataset: "appended N sequences and extended M"."""
    g = m.growth
    added = g.sequences[-1] - g.sequences[-2]
    extended = int((g.view == len(g.views) - 1).sum())
    return f"appended {added:,} sequences" + (f" and extended {extended:,}" if extended else "")


def continuations(url: str, storage_options: dict | None) -> int:
    """The continuation members the dataset at ``url`` holds."""
    m = load_manifest(url, storage_options)
    return m.segments.count if m.segments is not None else 0


def growth_line(m: Manifest) -> str:
    """How a dataset grew: its appends, and the continuation members of extended sequences (compact merges them)."""
    g = m.growth
    parts = [f"{len(g.views) - 1:,} append(s) since it was first packed ({g.sequences[0]:,} sequences then)"]
    if m.segments is not None:
        per = np.bincount(m.segments.seq, minlength=m.num_sequences)
        parts.append(f"{m.segments.count:,} continuation members in {int((per > 0).sum()):,} sequences (at most "
                     f"{int(per.max())} in one; `streamwin compact` merges them)")
    return "; ".join(parts)
