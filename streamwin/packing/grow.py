"""Appending to a packed dataset: the keys already there, and the manifest of the old and new as one dataset.

An append packs its input as a new generation of shards (pack.py) and commits one manifest
for the old and the new (`grow`): the old rows and shards as they are, then the new
sequences' rows and shards, then, with ``mode="extend"``, the continuation members of the
sequences it extended (formats/growth.py), and one more view in the growth record. Nothing
of the old dataset is rewritten. `ExistingKeys` is what a unit needs to know of the old
dataset to tell an extension from a new sequence (a hash of every key) and to check that
an extension's timestamps continue where its sequence ends (fields ``start`` and ``freq``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from streamwin.errors import PackError
from streamwin.formats.checks import Checks
from streamwin.formats.framed import Frames, NonFinite
from streamwin.formats.growth import Growth, Segments, continuation_key, parse_continuation, view_id
from streamwin.formats.manifest import Manifest
from streamwin.formats.meta import classify
from streamwin.packing.columns import key_hashes
from streamwin.packing.fieldcols import grow_fields

GAPS = ("error", "allow")
_CHUNK = 1 << 16


def hash_keys(keys: list[str]) -> np.ndarray:
    """The 64-bit hash of each key (the one pack's duplicate check uses)."""
    if not keys:
        return np.zeros(0, dtype=np.uint64)
    raw = [k.encode("ascii") for k in keys]
    blob = np.frombuffer(b"".join(raw), dtype=np.uint8)
    return key_hashes(blob, np.cumsum([len(r) for r in raw]), 0, len(raw))


def manifest_hashes(m: Manifest) -> np.ndarray:
    """The hash of each of a manifest's keys, in row order."""
    n = m.num_sequences
    blob, ends = np.frombuffer(m.key_blob, dtype=np.uint8), np.asarray(m.key_ends[:n], dtype=np.int64)
    out = np.empty(n, dtype=np.uint64)
    for a in range(0, n, _CHUNK):
        out[a : a + _CHUNK] = key_hashes(blob, ends, a, min(a + _CHUNK, n))
    return out


@dataclass(frozen=True, eq=False)
class ExistingKeys:
    """The keys of the dataset an extension appends to, as each unit needs them (picklable, 8 bytes a key, 24
    where the dataset has times): ``hashes`` sorted; where it has the fields ``start`` and ``freq``, ``ends[i]``
    is when the next step of the sequence of ``hashes[i]`` is due (start + length x freq) and ``freq[i]`` its
    step. ``tag`` is the generation that writes the continuations; ``gaps`` "error" or "allow". (The merge finds
    each continuation's sequence by its key: ``grow``.)
    """

    hashes: np.ndarray
    tag: int
    gaps: str = "error"
    ends: np.ndarray | None = None
    freq: np.ndarray | None = None
    time_kind: str | None = None

    @classmethod
    def of(cls, m: Manifest, tag: int, gaps: str) -> "ExistingKeys":
        h = manifest_hashes(m)
        order = np.argsort(h, kind="stable")
        f = m.fields
        ends = freq = kind = None
        if f is not None and "start" in f.kinds and "freq" in f.kinds and f.kinds["start"] in ("time", "int"):
            freq = np.asarray(f.columns["freq"], dtype=np.int64)[order]
            ends = np.asarray(f.columns["start"], dtype=np.int64)[order] + np.asarray(m.length, np.int64)[order] * freq
            kind = f.kinds["start"]
        return cls(h[order], tag, gaps, ends, freq, kind)

    def find(self, keys: list[str]) -> np.ndarray:
        """The position (in ``hashes``) of each key that may be in the dataset, else -1 (a hash match; the merge
        checks each against the key itself)."""
        h = hash_keys(keys)
        at = np.minimum(np.searchsorted(self.hashes, h), max(len(self.hashes) - 1, 0))
        return np.where(len(self.hashes) and self.hashes[at] == h, at, -1) if len(self.hashes) else np.full(len(h), -1)

    def continuation(self, key: str, at: int, meta: dict | None) -> str:
        """The name of ``key``'s continuation member (without .npy), once its timestamps are found to continue where
        the sequence ends (PackError naming the key and both times, unless ``gaps="allow"``)."""
        if self.ends is not None and meta and self.gaps == "error":
            _check_times(key, meta, int(self.ends[at]), int(self.freq[at]), self.time_kind)
        return continuation_key(key, self.tag)


def _check_times(key: str, meta: dict, due: int, freq: int, kind: str) -> None:
    """PackError unless an extension's ``start`` is when its sequence's next step is due, and ``freq`` its step."""
    def ns(name: str) -> int | None:
        if name not in meta:
            return None
        got_kind, value = classify(meta[name])
        return value if got_kind in ("time", "duration", "int") else None
    start, step = ns("start"), ns("freq")
    shown = (lambda v: str(np.datetime64(v, "ns"))) if kind == "time" else str
    if step is not None and step != freq:
        raise PackError(f"sequence {key!r} is extended with freq {step} ns, it was packed with freq {freq} ns: "
                        "pack the new steps at the sequence's own freq, or pass gaps='allow'")
    if start is not None and start != due:
        what = "a gap" if start > due else "an overlap"
        raise PackError(f"sequence {key!r} is extended with {what}: its new steps start at {shown(start)}, its packed "
                        f"steps end with the step before {shown(due)} (start + length x freq); pass the steps from "
                        f"{shown(due)} on, or gaps='allow' to append them as they are")


def grow(old: Manifest, heads: Manifest | None, conts: Manifest | None, *, extend: bool, dest: str) -> Manifest:
    """One manifest for ``old`` and what an append wrote: ``heads``, the new sequences' index, and ``conts``,
    the continuation members' (keys ``<key>.gGGGGGG``); PackError naming what does not fit."""
    new = [m for m in (heads, conts) if m is not None]
    if not new:
        raise PackError(f"nothing to append to {dest}: the input yielded no non-empty sequence")
    for m in new:
        if (m.dtype, m.step_shape, m.compression) != (old.dtype, old.step_shape, old.compression):
            raise PackError(f"cannot append to {dest}: it holds dtype {old.dtype}, step shape {old.step_shape} and "
                            f"compression {old.compression}; the new sequences have dtype {m.dtype}, step shape "
                            f"{m.step_shape} and compression {m.compression} (pass cast= to convert the dtype)")
    n0, n1 = old.num_sequences, heads.num_sequences if heads is not None else 0
    if heads is not None:
        _refuse_existing(old, heads, dest, extend)
    targets = _targets(old, conts, dest) if conts is not None else np.zeros(0, dtype=np.int64)
    om = old.members()
    s0 = len(om.length) - n0
    old_seq = np.asarray(old.segments.seq, dtype=np.int64) if old.segments is not None else np.zeros(0, np.int64)
    shards0, shards1 = len(old.shards), len(heads.shards) if heads is not None else 0
    new_shard = (shards0 + shards1 + conts.shards_of(np.arange(conts.num_sequences))) if conts is not None \
        else np.zeros(0, dtype=np.int64)
    old_shard = np.asarray(old.segments.shard, dtype=np.int64) if old.segments is not None else np.zeros(0, np.int64)
    seg_seq = np.concatenate([old_seq, targets])
    order = np.argsort(seg_seq, kind="stable")  # a sequence's continuations in step order: the old ones first
    cols = {}
    for name in ("length", "offset", "size", "hlen"):
        parts = [_col(om, name)[:n0], _col(heads, name) if heads is not None else [],
                 np.concatenate([_col(om, name)[n0:], _col(conts, name) if conts is not None else []])[order]]
        cols[name] = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
    key_blob, key_ends = _keys(om, heads, conts, n0, order)
    totals = np.concatenate([np.asarray(old.length, np.int64),
                             np.asarray(heads.length if heads is not None else [], np.int64)])
    ext_steps = np.asarray(conts.length, dtype=np.int64) if conts is not None else np.zeros(0, np.int64)
    np.add.at(totals, targets, ext_steps)
    shard_list = list(old.shards) + (list(heads.shards) if heads is not None else []) + \
        ([dataclasses.replace(s, num_sequences=0) for s in conts.shards] if conts is not None else [])
    segments = None
    if len(seg_seq):
        segments = Segments(seg_seq[order], np.concatenate([old_shard, new_shard])[order], cols["length"],
                            cols["offset"], cols["size"], cols["hlen"], key_ends)
    growth = old.growth if old.growth is not None else Growth.first(old.digest, n0)
    sums = [s.sha256 for m in new for s in m.shards]
    growth = growth.grown(view_id(growth.views[-1], sums), n0 + n1, targets, ext_steps)
    fields = old.fields if heads is None else grow_fields(old.fields, n0, heads.fields, n1, old.key(0) if n0 else "",
                                                         heads.key(0), len(growth.views) - 1)
    heads_cols = {k: v[: n0 + n1] if segments is not None else v for k, v in cols.items()}
    heads_cols["length"] = totals
    return Manifest(dtype=old.dtype, step_shape=old.step_shape, compression=old.compression,
                    shards=tuple(shard_list), key_blob=memoryview(key_blob),
                    key_ends=key_ends[: n0 + n1] if segments is not None else key_ends,
                    dropped_empty=old.dropped_empty + sum(m.dropped_empty for m in new),
                    value_columns=_value_columns(old, new, dest),
                    left_out_columns=_left_out(old, new), nonfinite=_nonfinite(old, new),
                    frames=_frames(old, om, heads, conts, n0, n1, s0, order, cols["length"]),
                    checks=_checks(old, new, dest), fields=fields, segments=segments, growth=growth, **heads_cols)


def _col(m: Manifest, name: str) -> np.ndarray:
    """Column ``name`` of a manifest's rows."""
    return np.asarray(getattr(m, name))


def _keys(om: Manifest, heads: Manifest | None, conts: Manifest | None, n0: int, order: np.ndarray
          ) -> tuple[bytes, np.ndarray]:
    """(key bytes, their ends) of the new manifest's members in row order: the sequences' keys (copied whole), then
    the continuations' names in their new order."""
    blob0 = bytes(om.key_blob)
    head_end = int(om.key_ends[n0 - 1]) if n0 else 0
    parts, ends = [blob0[:head_end]], [np.asarray(om.key_ends[:n0], dtype=np.int64)]
    if heads is not None:
        parts.append(bytes(heads.key_blob))
        ends.append(np.asarray(heads.key_ends, dtype=np.int64) + head_end)
    at = head_end + (len(parts[-1]) if heads is not None else 0)
    names = []  # the continuations' names: the old ones, then the new, each (start, end) in its blob
    old_ends = np.asarray(om.key_ends, dtype=np.int64)
    names += [blob0[int(old_ends[i - 1]) : int(old_ends[i])] for i in range(n0, len(old_ends))]
    if conts is not None:
        blob, ce = bytes(conts.key_blob), np.asarray(conts.key_ends, dtype=np.int64)
        names += [blob[(int(ce[i - 1]) if i else 0) : int(ce[i])] for i in range(len(ce))]
    moved = [names[i] for i in order.tolist()]
    parts.append(b"".join(moved))
    ends.append(at + np.cumsum(np.fromiter(map(len, moved), dtype=np.int64, count=len(moved))))
    return b"".join(parts), np.concatenate(ends)


def _refuse_existing(old: Manifest, heads: Manifest, dest: str, extend: bool) -> None:
    """PackError naming the new sequences whose keys the dataset holds already (an append adds new keys only)."""
    have = np.sort(manifest_hashes(old))
    new = manifest_hashes(heads)
    at = np.minimum(np.searchsorted(have, new), max(len(have) - 1, 0))
    maybe = np.flatnonzero(have[at] == new) if len(have) else []
    if not len(maybe):
        return
    old_keys = set(old.keys(np.arange(old.num_sequences))) if len(maybe) else set()
    found = [k for k in heads.keys(maybe) if k in old_keys]
    if found:
        more = f" and {len(found) - 5} more" if len(found) > 5 else ""
        how = "" if extend else "; to add their new steps to them, pass mode='extend' (--extend)"
        raise PackError(f"cannot append to {dest}: it holds sequences keyed {', '.join(map(repr, found[:5]))}{more} "
                        f"already (an append adds sequences of new keys){how}")


def _targets(old: Manifest, conts: Manifest, dest: str) -> np.ndarray:
    """The row of ``old`` each continuation extends, its key checked byte for byte."""
    names = conts.keys(np.arange(conts.num_sequences))
    keys = []
    for name in names:
        got = parse_continuation(name)
        if got is None:
            raise PackError(f"{dest}: {name!r} is not the name of a continuation member")
        keys.append(got[0])
    have = manifest_hashes(old)
    order = np.argsort(have, kind="stable")
    h = hash_keys(keys)
    at = order[np.minimum(np.searchsorted(have[order], h), len(order) - 1)]
    rows = np.asarray(at, dtype=np.int64)
    wrong = [k for k, r in zip(keys, rows.tolist()) if old.key(r) != k]
    if wrong:
        raise PackError(f"cannot extend {dest}: it holds no sequence keyed {wrong[0]!r}")
    return rows


def _value_columns(old: Manifest, new: list[Manifest], dest: str) -> tuple[str, ...] | None:
    taken = [m.value_columns for m in (old, *new) if m.value_columns is not None]
    if any(t != taken[0] for t in taken):
        raise PackError(f"cannot append to {dest}: its values are the table columns {list(taken[0])}, the new "
                        f"sequences' {list(next(t for t in taken if t != taken[0]))}; pass value_columns= to take the "
                        "same columns")
    return taken[0] if taken else None


def _left_out(old: Manifest, new: list[Manifest]) -> dict[str, str] | None:
    out = {}
    for m in (old, *new):
        out.update(m.left_out_columns or {})
    return out if any(m.left_out_columns is not None for m in (old, *new)) else None


def _nonfinite(old: Manifest, new: list[Manifest]) -> NonFinite | None:
    counts = [m.nonfinite for m in (old, *new)]
    if any(c is None for c in counts):
        return None
    return NonFinite(sum(c.nan for c in counts), sum(c.inf for c in counts),
                     tuple(k for c in counts for k in c.per_shard))


def _checks(old: Manifest, new: list[Manifest], dest: str) -> Checks | None:
    if old.checks is None:
        return None
    out = Checks.concat([old.checks, *(m.checks for m in new)])
    if out is None:
        raise PackError(f"cannot append to {dest}: it keeps its checksums in the manifest (packed before sums files "
                        "beside the shards); repack it once (pack with the same inputs), then append")
    return out


def _frames(old: Manifest, om: Manifest, heads: Manifest | None, conts: Manifest | None, n0: int, n1: int, s0: int,
            order: np.ndarray, length: np.ndarray) -> Frames | None:
    """The zstd frames of every member, at its row of the new manifest."""
    where = np.empty(len(order), dtype=np.int64)
    where[order] = np.arange(len(order))  # continuation c (old ones, then new) -> its place among them
    found = []  # (row, frame ends)
    rows = None
    for m, row_of in ((om, lambda r: r if r < n0 else n0 + n1 + int(where[r - n0])),
                      (heads, lambda r: n0 + r), (conts, lambda r: n0 + n1 + int(where[s0 + r]))):
        if m is None or m.frames is None:
            continue
        rows = m.frames.rows
        fr = m.frames
        for i, r in enumerate(fr.seq.tolist()):
            found.append((row_of(r), fr.ends[fr.first[i] : fr.first[i + 1]]))
    if not found:
        return None
    found.sort(key=lambda x: x[0])
    return Frames.make(rows, np.array([r for r, _ in found]), np.concatenate([e for _, e in found]), length)


def split_members(m: Manifest, where: str) -> Manifest:
    """A manifest whose rows are members in shard order, continuation members (``<key>.gGGGGGG``) among them (as
    ``streamwin index`` finds them), as one of sequences with continuations (formats/growth.py), or itself when it
    has none. ``m.fields`` holds values of the sequences' first members only."""
    names = m.keys(np.arange(m.num_sequences))
    parsed = [parse_continuation(k) for k in names]
    cont = np.array([p is not None for p in parsed], dtype=bool)
    if not cont.any():
        return m
    head_rows, cont_rows = np.flatnonzero(~cont), np.flatnonzero(cont)
    row_of = {names[r]: i for i, r in enumerate(head_rows.tolist())}
    missing = [names[r] for r in cont_rows.tolist() if parsed[r][0] not in row_of]
    if missing:
        raise PackError(f"{where}: continuation member {missing[0]}.npy continues no sequence of the shards (no "
                        f"{parse_continuation(missing[0])[0]}.npy)")
    seq = np.array([row_of[parsed[r][0]] for r in cont_rows.tolist()], dtype=np.int64)
    order = np.lexsort((np.array([parsed[r][1] for r in cont_rows.tolist()]), seq))  # step order: by generation
    rows = np.concatenate([head_rows, cont_rows[order]])
    shard = m.shards_of(np.arange(m.num_sequences))
    counts = np.bincount(shard[head_rows], minlength=len(m.shards))
    shards = tuple(dataclasses.replace(s, num_sequences=int(c)) for s, c in zip(m.shards, counts))
    cols = {k: np.asarray(getattr(m, k), dtype=np.int64)[rows] for k in ("length", "offset", "size", "hlen")}
    member_names = [names[r].encode("ascii") for r in rows.tolist()]
    key_ends = np.cumsum([len(b) for b in member_names]).astype(np.int64)
    n = len(head_rows)
    segments = Segments(seq[order], shard[cont_rows[order]], cols["length"], cols["offset"], cols["size"],
                        cols["hlen"], key_ends)
    totals = segments.totals()
    where_of = np.empty(m.num_sequences, dtype=np.int64)
    where_of[rows] = np.arange(len(rows))
    frames = None
    if m.frames is not None:
        fr = m.frames
        moved = sorted((int(where_of[r]), fr.ends[fr.first[i] : fr.first[i + 1]]) for i, r in enumerate(fr.seq.tolist()))
        frames = Frames.make(fr.rows, np.array([r for r, _ in moved]), np.concatenate([e for _, e in moved]),
                             cols["length"])
    heads = {k: v[:n] for k, v in cols.items()}
    heads["length"] = totals
    return dataclasses.replace(m, shards=shards, key_blob=memoryview(b"".join(member_names)), key_ends=key_ends[:n],
                               segments=segments, frames=frames, **heads)
