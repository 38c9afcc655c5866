"""Per-sequence fields in every batch: one value per window (per crop with ``pack_length``), looked up by sequence.

``WindowDataset(..., select=sw.Select(fields=["label", "store", "time"]))`` adds one array per field to each
batch, filled where the batch is gathered (a worker, or the stream's thread) from the
manifests' field columns (formats/meta.py) by each window's sequence index, ``seq``: one
``np.take`` per field and source, no Python per window. ``time`` is each window's first
step's timestamp, ``start + offset * freq`` (the fields ``start`` and ``freq``). str fields
arrive as int64 codes into ``ds.vocabulary(name)``: a dataset's own vocabulary (whose codes an
append keeps), or in a mix the sorted union of every source's (and the fill values), so a code
means one string in a mix. A source without a
field is refused unless ``fill={name: value}`` declares its value there. ``where={name:
[values]}`` keeps only the sequences whose field holds one of the values (`keep_mask`, its
values checked in selection.py); the plan then has no window of the others, so they are never read.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from streamwin.formats.meta import BATCH_DTYPES, DERIVED, SeqFields, classify

RESERVED = ("x", "y", "key", "start", "mask", "y_mask", "length", "observed", "y_observed", "seq", "weight", "source",
            "crops", "segment_ids", "positions", "row")  # batch keys a field may not be named like


@dataclass(frozen=True)
class FieldSpec:
    """The fields a dataset's batches carry: names, kinds, fills, the union vocabulary of each str field."""

    names: tuple[str, ...]
    kinds: tuple[str, ...]
    fill: tuple[tuple[str, Any], ...]  # (name, stored value) of declared fills
    vocabulary: tuple[tuple[str, tuple[str, ...]], ...]

    def dtypes(self) -> list[tuple[str, np.dtype]]:
        return [(n, np.dtype(BATCH_DTYPES[k])) for n, k in zip(self.names, self.kinds)]


def field_names(names: Any, fill: Any) -> None:
    """Refuse ``fields=`` and ``fill=`` unless a list of distinct names and a dict of some of them (or None)."""
    if names is None:
        if fill:
            raise ValueError(f"fill={fill!r} gives values of fields: pass fields=[...] too")
        return
    if isinstance(names, str) or not isinstance(names, Sequence) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"fields must be a list of field names, got {names!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"fields names a field twice: {list(names)!r}")
    if (fill is not None and not isinstance(fill, Mapping)) or set(fill or {}) - set(names):
        raise ValueError(f"fill must map some of fields={list(names)!r} to values, got {fill!r}")


def field_spec(names: Any, fill: Any, sources: list[tuple[str, SeqFields | None]]) -> FieldSpec | None:
    """The FieldSpec of ``fields=`` and ``fill=`` over the sources ``(url, manifest fields)``; ValueError naming the
    field (and the source) when one is missing, reserved or of different kinds."""
    field_names(names, fill)
    if names is None:
        return None
    fill = dict(fill or {})
    kinds, fills, vocab = [], [], []
    for name in names:
        if name in RESERVED:
            hint = ("ask for 'time' (each window's timestamp: start + offset x freq)" if name == "start" else
                    "rename the field when packing")
            raise ValueError(f"fields: {name!r} is a batch key already (batches hold {', '.join(RESERVED)}); {hint}")
        needs = ("start", "freq") if name == DERIVED else (name,)
        found = {need: _kind_in(need, name, sources, fill) for need in needs}
        if name == DERIVED:
            if name in fill:
                raise ValueError("fill: 'time' is derived from start and freq: fill those instead")
            kinds.append("time" if found["start"] == "time" else "int")
            continue
        kind = found[name]
        kinds.append(kind)
        if name in fill:
            got_kind, value = classify(fill[name])
            if kind == "float" and got_kind == "missing" and isinstance(fill[name], (float, np.floating)):
                got_kind, value = "float", float("nan")  # NaN: a float field's fill, where a source has none
            if got_kind != kind and not (kind == "float" and got_kind == "int"):
                raise ValueError(f"fill[{name!r}] = {fill[name]!r} is a {got_kind or type(fill[name]).__name__}, the "
                                 f"field is {kind}")
            fills.append((name, float(value) if kind == "float" else value))
        if kind == "str":
            if len(sources) == 1 and name not in fill:  # one dataset: its own codes (an append keeps every old one)
                vocab.append((name, tuple(sources[0][1].vocabulary[name])))
                continue
            words = set().union(*(f.vocabulary[name] for _, f in sources if f is not None and name in f.kinds))
            words |= {fill[name]} if name in fill else set()
            vocab.append((name, tuple(sorted(words))))
    return FieldSpec(tuple(names), tuple(kinds), tuple(fills), tuple(vocab))


def _kind_in(name: str, asked: str, sources: list[tuple[str, SeqFields | None]], fill: dict) -> str:
    """The kind of field ``name`` in every source (one kind, or int and float: float); ValueError where missing."""
    kinds = set()
    for url, f in sources:
        if f is not None and name in f.kinds:
            kinds.add(f.kinds[name])
            continue
        if asked in fill and name == asked:
            continue
        why = f"it was left out when packing: {f.left_out[name]}" if f is not None and name in f.left_out else \
            f"its fields are {', '.join(sorted(f.kinds)) if f is not None and f.kinds else 'none'}"
        if asked != name:
            raise ValueError(f"fields: 'time' (each window's start + offset x freq) needs the fields 'start' and "
                             f"'freq', and {url} has no field {name!r} ({why})")
        hint = f"; pass fill={{{name!r}: value}} to give its sequences one value" if len(sources) > 1 else ""
        raise ValueError(f"fields: {url} has no field {name!r} ({why}){hint}")
    if not kinds and name in fill:
        kind, _ = classify(fill[name])
        return kind
    if len(kinds) > 1 and kinds != {"int", "float"}:
        raise ValueError(f"fields: {name!r} is {' in one source, '.join(sorted(kinds))} in another")
    return "float" if len(kinds) > 1 else kinds.pop()


class FieldGather:
    """Fills a batch's field arrays from its ``seq`` (and ``source``) arrays; made where batches are gathered."""

    def __init__(self, spec: FieldSpec, fields: list[SeqFields | None]):
        self.spec = spec
        vocab, fill = dict(spec.vocabulary), dict(spec.fill)
        self.tables = []  # per field, per source: (column or None, remap of str codes or None, fill value)
        for name, kind in zip(spec.names, spec.kinds):
            per = []
            for f in fields:
                if name == DERIVED:
                    per.append((f.columns["start"], f.columns["freq"], None))
                elif f is not None and name in f.kinds:
                    remap = None
                    if kind == "str":
                        index = {w: i for i, w in enumerate(vocab[name])}
                        remap = np.array([index[w] for w in f.vocabulary[name]], dtype=np.int64)
                    per.append((f.columns[name], remap, None))
                else:
                    value = fill[name]
                    per.append((None, None, vocab[name].index(value) if kind == "str" else value))
            self.tables.append((name, per))

    def fill(self, out: dict[str, np.ndarray], count: int | None = None) -> None:
        """Write each field's values for the batch's first ``count`` windows (all: None) into ``out``."""
        n = len(out["seq"]) if count is None else count
        seq = out["seq"][:n]
        source = out.get("source")
        start = out["start"][:n]
        for name, per in self.tables:
            dest = out[name]
            if n < len(dest):
                dest[n:] = 0
            if source is None or len(per) == 1:
                _one(per[0], seq, start, dest[:n], name == DERIVED)
                continue
            src = source[:n]
            for i, table in enumerate(per):
                rows = np.flatnonzero(src == i)
                if len(rows):
                    part = np.empty(len(rows), dtype=dest.dtype)
                    _one(table, seq[rows], start[rows], part, name == DERIVED)
                    dest[rows] = part


def _one(table: tuple, seq: np.ndarray, start: np.ndarray, dest: np.ndarray, derived: bool) -> None:
    """One source's values of one field for sequences ``seq`` (windows starting at ``start``) into ``dest``."""
    col, remap, value = table
    if derived:  # time: the sequence's start + the window's offset x its freq
        np.multiply(np.take(remap, seq), start, out=dest)
        dest += np.take(col, seq)
    elif col is None:
        dest[:] = value
    elif remap is not None:
        np.take(remap, np.take(col, seq), out=dest)
    else:
        dest[:] = np.take(col, seq)


def keep_mask(where: Any, fields: SeqFields | None, url: str, fill: Mapping | None = None) -> np.ndarray | bool:
    """Which sequences of a source ``where={field: [values]}`` keeps: a bool per sequence (or one bool for all when
    the source has not the field and ``fill`` gives its value); ValueError naming the field and the source."""
    keep: np.ndarray | bool = True
    for name, wanted in where.items():
        if isinstance(wanted, (str, bytes)) or not isinstance(wanted, (Sequence, np.ndarray, set, frozenset)):
            raise TypeError(f"where[{name!r}] must be a list of the values kept, got {wanted!r}")
        if fields is None or name not in fields.kinds:
            if fill is not None and name in fill:
                keep = keep & (classify(fill[name])[1] in list(wanted))  # as stored, as ``wanted`` is
                continue
            has = ", ".join(sorted(fields.kinds)) if fields is not None and fields.kinds else "none"
            why = f"left out when packing: {fields.left_out[name]}" if fields is not None and name in fields.left_out \
                else f"its fields are {has}"
            raise ValueError(f"where: {url} has no field {name!r} ({why})")
        kind, col = fields.kinds[name], fields.columns[name]
        if kind == "str":
            codes = [fields.vocabulary[name].index(w) for w in wanted if w in fields.vocabulary[name]]
            hit = np.isin(col, np.array(codes, dtype=col.dtype))
        else:
            values = [classify(w)[1] for w in wanted]
            hit = np.isin(col, np.array(values, dtype=col.dtype) if values else np.zeros(0, col.dtype))
        keep = hit if keep is True else keep & hit
    return keep


def vocabulary_of(spec: FieldSpec | None, name: str) -> tuple[str, ...]:
    """The strings of str field ``name`` of ``spec``; KeyError naming the str fields there are."""
    vocab = dict(spec.vocabulary) if spec is not None else {}
    if name not in vocab:
        raise KeyError(f"{name!r} is not a str field of this dataset's select=sw.Select(fields=...) (str fields: "
                       f"{sorted(vocab)})")
    return vocab[name]
