"""Index fragments: what packing one unit of input wrote, and how fragments merge into one manifest.

Each unit of input (a file, a run of small files, a partition, a block) is packed on its own
(`unit.pack_unit`) and returns a `Fragment`: the index of the shards it wrote, as index.json
text (per-sequence columns inline), plus what the manifest cannot say about a unit that
wrote no sequence. Fragments are small, picklable and the same wherever the unit ran (in
this process, a worker process, a Ray task, a Dask task), so the merge, `FragmentMerger`,
builds the same manifest from them: it appends each fragment's columns in unit order (to
files, so memory does not grow with the number of sequences), checks that every unit
agrees on dtype, step shape, compression and value columns, and finally that no key
appears twice. ``parts.merge`` merges the indexes of `pack(part="i/n")` the same way.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from streamwin.errors import PackError
from streamwin.formats.checks import Checks
from streamwin.formats.manifest import Frames, Manifest, NonFinite, ShardEntry, parse_manifest
from streamwin.packing.columns import SequenceColumns, duplicate_key
from streamwin.packing.fieldcols import merge_fields
from streamwin.packing.inputs import Columns


@dataclass(frozen=True)
class Fragment:
    """What packing one unit wrote: its number, its index (None when it wrote no sequence), the
    zero-length sequences it skipped, a table's value columns, and where it came from.

    ``index`` is the unit's Manifest where it was packed, and its index.json text once the
    fragment has crossed a process boundary (pickling turns it into text, ~13 bytes a sequence).
    """

    unit: int
    index: Manifest | str | None
    dropped: int
    columns: Columns | None
    where: str
    nbytes: int = 0  # bytes of the shards it wrote
    sequences: int = 0  # sequences it wrote
    missing: tuple = ()  # its fields' missing values (SeqFields.missing, which index.json does not keep), as items
    continued: Manifest | str | None = None  # extending a dataset: the index of its continuation members (unit.py)

    @property
    def manifest(self) -> Manifest | None:
        if isinstance(self.index, str):
            m = parse_manifest(self.index, where=f"the index of {self.where}")
            if m.fields is not None and self.missing:
                m = dataclasses.replace(m, fields=dataclasses.replace(m.fields, missing=dict(self.missing)))
            return m
        return self.index

    @property
    def continuations(self) -> Manifest | None:
        """The index of the continuation members the unit wrote (keys ``<key>.gGGGGGG``), if any."""
        if isinstance(self.continued, str):
            return parse_manifest(self.continued, where=f"the continuations' index of {self.where}")
        return self.continued

    def __reduce__(self):
        text = self.index.to_json() if isinstance(self.index, Manifest) else self.index
        fields = self.index.fields if isinstance(self.index, Manifest) else None
        missing = tuple(fields.missing.items()) if fields is not None else self.missing
        continued = self.continued.to_json() if isinstance(self.continued, Manifest) else self.continued
        return (Fragment, (self.unit, text, self.dropped, self.columns, self.where, self.nbytes, self.sequences,
                           missing, continued))


class FragmentMerger:
    """Fragments in, in unit order; one Manifest out (`finish`)."""

    def __init__(self):
        self.sequences: SequenceColumns | None = None  # made when a second unit arrives
        self.only: Manifest | None = None  # the one unit's manifest, while there is one
        self.shards: list[ShardEntry] = []
        self.per_shard: list[int] = []
        self.nan = self.inf = self.dropped = 0
        self.counted = True
        self.first: tuple[Manifest, str] | None = None
        self.columns: Columns | None = None
        self.framed: list[np.ndarray] = []
        self.frame_ends: list[np.ndarray] = []
        self.frame_rows: set[int] = set()
        self.checks: list[Checks | None] = []  # each unit's chunk checksums, in unit order
        self.fields: list[tuple] = []  # each unit's (fields, sequences, where, first key), in unit order

    def add(self, manifest: Manifest | None, dropped: int = 0, columns: Columns | None = None, where: str = "") -> None:
        """Append one unit's manifest (None: it wrote nothing) after the ones added before."""
        self.dropped += dropped
        if manifest is None:
            return
        self._check_layout(manifest, where)
        _check_known(manifest)
        self.fields.append((manifest.fields, manifest.num_sequences, where or f"unit {len(self.fields)}",
                            manifest.key(0) if manifest.num_sequences else ""))
        self.columns = _same_columns(self.columns, columns)
        if self.sequences is None and self.only is None:
            self.only = manifest  # one unit: its columns are the manifest's, no copy
            return
        if self.only is not None:
            only, self.only = self.only, None
            self.sequences = SequenceColumns()
            self._append(only)
        self._append(manifest)

    def _append(self, manifest: Manifest) -> None:
        before = len(self.sequences)
        keys = np.frombuffer(manifest.key_blob, dtype=np.uint8)
        self.sequences.extend(keys, manifest.key_ends, length=manifest.length, offset=manifest.offset,
                              size=manifest.size, hlen=manifest.hlen)
        self.shards.extend(manifest.shards)
        self.checks.append(manifest.checks)
        nf = manifest.nonfinite
        self.counted = self.counted and nf is not None
        if nf is not None:
            self.nan, self.inf = self.nan + nf.nan, self.inf + nf.inf
            self.per_shard.extend(nf.per_shard)
        if manifest.frames is not None:
            self.frame_rows.add(manifest.frames.rows)
            self.framed.append(manifest.frames.seq + before)
            self.frame_ends.append(manifest.frames.ends)

    def add_fragment(self, fragment: Fragment) -> None:
        """`add` a unit's Fragment."""
        self.add(fragment.manifest, fragment.dropped, fragment.columns, fragment.where)

    def _check_layout(self, m: Manifest, where: str) -> None:
        if self.first is None:
            self.first = (m, where)
            return
        first, first_where = self.first
        if (m.dtype, m.step_shape) != (first.dtype, first.step_shape):
            raise PackError(
                f"sequence {m.key(0)!r} ({where}) has dtype {m.dtype} and step shape {m.step_shape}, but "
                f"{first.key(0)!r} ({first_where}) and the ones before it have dtype {first.dtype} and step shape "
                f"{first.step_shape}; pass cast= to convert the dtype, or pack them as separate datasets")
        if m.compression != first.compression:
            raise PackError(f"{where} is packed with compression {m.compression}, {first_where} with {first.compression}")

    def result(self) -> Manifest | None:
        """The merged manifest, or None when nothing was written (PackError for a key twice)."""
        return None if self.first is None else self.finish()

    def finish(self) -> Manifest:
        """The merged manifest: PackError when nothing was written, or a key twice."""
        if self.first is None:
            raise PackError(f"the input yielded no non-empty sequence ({self.dropped} empty ones): nothing to pack")
        if self.only is not None:
            m = self.only
            self.shards = list(m.shards)
            self._check_unique(np.frombuffer(m.key_blob, dtype=np.uint8), m.key_ends)
            return dataclasses.replace(m, dropped_empty=self.dropped, value_columns=self._taken(),
                                       left_out_columns=self._left_out(), fields=merge_fields(self.fields))
        first = self.first[0]
        cols = self.sequences.columns()
        keys, key_ends = cols.pop("keys"), cols.pop("key_ends")
        self._check_unique(keys, key_ends)
        frames = None
        if self.framed:
            if len(self.frame_rows) > 1:
                raise PackError(f"units packed zstd frames of different step counts {sorted(self.frame_rows)}")
            frames = Frames.make(self.frame_rows.pop(), np.concatenate(self.framed), np.concatenate(self.frame_ends),
                                 cols["length"])
        nonfinite = NonFinite(self.nan, self.inf, tuple(self.per_shard)) if self.counted else None
        return Manifest(dtype=first.dtype, step_shape=first.step_shape, compression=first.compression,
                        shards=tuple(self.shards), key_blob=memoryview(keys), key_ends=key_ends,
                        dropped_empty=self.dropped, value_columns=self._taken(), left_out_columns=self._left_out(),
                        nonfinite=nonfinite, frames=frames, checks=Checks.concat(self.checks),
                        fields=merge_fields(self.fields), **cols)

    def _taken(self) -> tuple[str, ...] | None:
        return self.columns.taken if self.columns else None

    def _left_out(self) -> dict[str, str] | None:
        return dict(self.columns.left_out) if self.columns else None

    def _check_unique(self, keys: np.ndarray, key_ends: np.ndarray) -> None:
        twice = duplicate_key(keys, key_ends)
        if twice is None:
            return
        starts = np.cumsum([0] + [s.num_sequences for s in self.shards])
        i, j = (self.shards[int(np.searchsorted(starts, k, side="right")) - 1].name for k in twice)
        key = bytes(keys[int(key_ends[twice[1] - 1]) : int(key_ends[twice[1]])]).decode("ascii")
        raise PackError(f"duplicate sequence key {key!r} (first written to {i}, again to {j}); "
                        "keys must be unique in a dataset")

    def discard(self) -> None:
        """Drop what was merged so far (the pack failed)."""
        if self.sequences is not None:
            self.sequences.discard()


# the Manifest fields this merger merges; a field added to Manifest must be merged in
# `_append` and `finish` (concatenated in unit order, per-sequence offsets shifted) before a fragment may carry it
_MERGED = {"dtype", "step_shape", "compression", "shards", "length", "offset", "size", "hlen", "key_blob", "key_ends",
           "dropped_empty", "digest", "value_columns", "left_out_columns", "nonfinite", "frames", "checks", "fields",
           "shard_starts"}


def _check_known(m: Manifest) -> None:
    """PackError if a unit's manifest holds a field this merger does not merge (it would be lost silently)."""
    for f in dataclasses.fields(m):
        if f.name not in _MERGED and getattr(m, f.name) not in (None, f.default):
            raise PackError(f"packing.fragments cannot merge the manifest field {f.name!r} yet: merge it in "
                            "FragmentMerger (concatenated in unit order) before units write it")


def _same_columns(current: Columns | None, found: Columns | None) -> Columns | None:
    """Every table must give the same value columns; the left-out ones of all tables are kept."""
    if found is None:
        return current
    if current is None:
        return found
    if found.taken != current.taken:
        raise PackError(f"{found.where} gives value columns {list(found.taken)}, but {current.where} gave "
                        f"{list(current.taken)}; pass value_columns= to take the same columns from every file")
    left_out = dict(current.left_out) | dict(found.left_out)
    return Columns(current.taken, tuple(left_out.items()), current.where)
