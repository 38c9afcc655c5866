"""Records: many short sequences encoded as consecutive tar records in one buffer.

A shard is a run of records: per sequence a tar header, its npy member (header and rows),
padding to a block, and its ``.json`` member when it has metadata. Packing millions of
short sequences one Python object at a time would cost more than writing them, so the
sequences of an ``.npz`` or a table (a `Batch` of an input) are encoded all at once
(`encode_batch`): npy headers from one template per length, tar headers with numpy
(``tar_headers``), the rows copied into one buffer. The manifest columns (key, length,
offset of the npy content, size, npy header length, NaN and inf counts) travel beside the
buffer, so the writer cuts Records into shards with a few writes per shard.

`records_of` lays out sequences encoded one by one (`EncodedSeq`) the same way; the two
give the same bytes for the same sequences (tests/test_pack.py checks it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from streamwin.formats import npy as npyfmt
from streamwin.formats import tar as tarfmt
from streamwin.packing.encode import EncodedSeq, check_empty, check_numeric
from streamwin.packing.inputs import Batch
from streamwin.packing.inputs.base import cut_fields
from streamwin.packing.nonfinite import check_cast, count_nonfinite, first_nonfinite_step, nonfinite_per_sequence, refused

RECORD_MAX = 1 << 20  # sequences up to this many bytes are copied into Records; longer ones are written from their arrays


@dataclass(frozen=True, eq=False)
class Records:
    """Encoded sequences as consecutive tar records in one buffer, with their manifest columns.

    Sequence i's records (its npy member: header, content, padding; then its .json member,
    if any) are ``data[ends[i - 1]:ends[i]]``; its npy content starts ``content[i]`` bytes into
    them. Its key is ``keys[key_ends[i - 1]:key_ends[i]]``. ``frames``: (i, frame ends) of the
    members packed as several zstd frames.
    """

    data: Any  # uint8 buffer: ndarray, bytes or memoryview
    ends: np.ndarray
    content: np.ndarray
    keys: np.ndarray  # uint8, every key end to end
    key_ends: np.ndarray
    length: np.ndarray
    size: np.ndarray
    hlen: np.ndarray
    nan: np.ndarray
    inf: np.ndarray
    dtype: str
    step_shape: tuple[int, ...]
    frames: tuple[tuple[int, tuple[int, ...]], ...] = ()
    fields: Any = None  # per sequence its meta dict (a tuple), or a table's meta columns (packing.fieldcols)

    def __len__(self) -> int:
        return len(self.ends)

    @property
    def nbytes(self) -> int:
        """Bytes of every record."""
        return int(self.ends[-1]) if len(self.ends) else 0

    def key(self, i: int) -> str:
        """Sequence i's key."""
        start = int(self.key_ends[i - 1]) if i else 0
        return bytes(self.keys[start : int(self.key_ends[i])]).decode("ascii")


def records_of(seqs: list[EncodedSeq], suffix: str) -> Records:
    """One Records for sequences encoded one by one (``suffix``: ".npy" or ".npy.zst"), laid out as
    `ShardWriter.add` writes them; all must have one dtype and step shape."""
    parts, ends, content, at = [], [], [], 0
    for s in seqs:
        head = tarfmt.tar_header(s.key + suffix, s.size)
        parts += [head, s.head, s.body, tarfmt.tar_padding(s.size)]
        at += len(head) + s.size + (-s.size % tarfmt.BLOCK)
        if s.meta is not None:
            meta_head = tarfmt.tar_header(f"{s.key}.json", len(s.meta))
            parts += [meta_head, s.meta, tarfmt.tar_padding(len(s.meta))]
            at += len(meta_head) + len(s.meta) + (-len(s.meta) % tarfmt.BLOCK)
        content.append(len(head))
        ends.append(at)
    col = lambda name: np.array([getattr(s, name) for s in seqs], dtype=np.int64)  # noqa: E731
    keys = "".join(s.key for s in seqs).encode("ascii")
    return Records(np.frombuffer(b"".join(parts), dtype=np.uint8), np.array(ends, dtype=np.int64),
                   np.array(content, dtype=np.int64), np.frombuffer(keys, dtype=np.uint8),
                   np.cumsum([len(s.key) for s in seqs], dtype=np.int64), col("length"), col("size"), col("hlen"),
                   col("nan"), col("inf"), seqs[0].dtype, seqs[0].step_shape,
                   tuple((i, s.frame_ends) for i, s in enumerate(seqs) if s.frame_ends), tuple(s.fields for s in seqs))


def batch_fits(batch: Batch) -> bool:
    """Whether `encode_batch` takes this batch: every sequence is short (at most RECORD_MAX bytes)."""
    steps = np.diff(batch.bounds)
    step_bytes = batch.values.dtype.itemsize * int(np.prod(batch.values.shape[1:], dtype=np.int64))
    return len(batch) > 0 and int(steps.max()) * step_bytes <= RECORD_MAX


def encode_batch(batch: Batch, *, cast: str | None = None, empty: str = "skip",
                 nan: str = "count") -> tuple[Records | None, int]:
    """(Records, zero-length sequences skipped) for many short uncompressed sequences at once:
    byte for byte what `encode_sequence` and `records_of` make of them one by one, with the
    checks and errors of `encode_sequence`, but headers made with numpy for all of them."""
    values, keys, starts, lengths, skipped, fields = _nonempty(batch, empty)
    if not keys:
        return None, skipped
    check_numeric(keys[0], values.dtype)
    if cast is not None:
        if np.dtype(cast).kind not in "fc" and sum(count_nonfinite(values)):
            nans, infs = nonfinite_per_sequence(values, starts)
            i = int(np.flatnonzero(nans + infs)[0])
            check_cast(keys[i], values[starts[i] : starts[i] + lengths[i]], cast)
        values = values.astype(cast)
    values = np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("<") if values.dtype.byteorder == ">" else None)
    nans, infs = nonfinite_per_sequence(values, starts)
    if nan == "raise" and (nans.any() or infs.any()):
        i = int(np.flatnonzero(nans + infs)[0])
        raise refused(keys[i], nans[i], infs[i], first_nonfinite_step(values[starts[i] : starts[i] + lengths[i]]))
    step_shape = tuple(values.shape[1:])
    step_bytes = values.dtype.itemsize * int(np.prod(step_shape, dtype=np.int64))
    uniq, which = np.unique(lengths, return_inverse=True)
    heads = [np.frombuffer(npyfmt.npy_header_for(values.dtype, (int(t),) + step_shape), dtype=np.uint8) for t in uniq]
    hlen = np.array([len(h) for h in heads], dtype=np.int64)[which]
    size = hlen + lengths * step_bytes
    ends = np.cumsum(tarfmt.record_size(size))
    blob = np.frombuffer("".join(keys).encode("ascii"), dtype=np.uint8)
    key_ends = np.cumsum([len(k) for k in keys], dtype=np.int64)
    out = np.zeros(int(ends[-1]), dtype=np.uint8)
    first = ends - tarfmt.record_size(size)
    out.reshape(-1, tarfmt.BLOCK)[first // tarfmt.BLOCK] = tarfmt.tar_headers(blob, key_ends, ".npy", size)
    _copy_contents(out, first + tarfmt.BLOCK, heads, which, values.reshape(-1).view(np.uint8),
                   starts * step_bytes, lengths * step_bytes)
    return Records(out, ends, np.full(len(keys), tarfmt.BLOCK, dtype=np.int64), blob, key_ends, lengths, size, hlen,
                   nans, infs, values.dtype.str, step_shape, fields=fields), skipped


def _nonempty(batch: Batch, empty: str) -> tuple[np.ndarray, list[str], np.ndarray, np.ndarray, int, Any]:
    """(values, keys, first steps, lengths) of the batch's non-empty sequences, how many were empty, and the
    non-empty ones' meta columns."""
    lengths = np.diff(batch.bounds)
    keep = lengths > 0
    if keep.all():
        return batch.values, list(batch.keys), batch.bounds[:-1], lengths, 0, batch.fields
    check_empty(batch.keys[int(np.argmin(keep))], empty)
    keys = [k for k, ok in zip(batch.keys, keep.tolist()) if ok]
    fields = cut_fields(batch.fields, keep)
    return batch.values, keys, batch.bounds[:-1][keep], lengths[keep], int((~keep).sum()), fields


def _copy_contents(out: np.ndarray, at: np.ndarray, heads: list[np.ndarray], which: np.ndarray,
                   data: np.ndarray, src: np.ndarray, nbytes: np.ndarray) -> None:
    """Each sequence's npy header ``heads[which[i]]`` and its ``nbytes[i]`` bytes of ``data`` from ``src[i]``, at ``out[at[i]:]``."""
    for a, h, s, n in zip(at.tolist(), which.tolist(), src.tolist(), nbytes.tolist()):
        head = heads[h]
        b = a + len(head)
        out[a:b] = head
        out[b : b + n] = data[s : s + n]
