"""Compaction: merge each extended sequence's continuation members back into one member, atomically.

A sequence extended by appends (``mode="extend"``) is a chain of members in several shards;
reading a window that spans two of them reads both and copies the window's steps together
(read/segments.py), and a remote read makes a request per member. ``compact(url)`` rewrites,
as a new generation, every shard that holds the first member of an extended sequence: the
same members in the same order, each extended sequence's one member now holding all its
steps (``<key>.npy``, its npy header the total shape); and the shards that held only
continuations leave the dataset. Every sequence stays in its shard, so the plan, and every
batch, is the same before and after (a state saved before resumes after it, exactly); the
views of the dataset's growth are kept. Every byte read is checked against the sha256 the
manifest names first. The commit is a pack's (`dest.commit`): a compaction killed at any
moment leaves the dataset as it was; readers of the old generation keep its shards.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import tarfile
from collections import OrderedDict

import numpy as np

from streamwin.arguments import check_keywords
from streamwin.errors import ManifestError, PackError
from streamwin.formats import npy as npyfmt
from streamwin.formats import tar as tarfmt
from streamwin.formats import zstd
from streamwin.formats.checks import SUFFIX, Checks
from streamwin.formats.framed import Frames, NonFinite
from streamwin.formats.manifest import Manifest, ShardEntry
from streamwin.formats.sums import ShardSumsWriter
from streamwin.packing.dest import (committed, refuse_foreign, refuse_unmerged, remove_generations, shard_prefix,
                                    survey)
from streamwin.packing.lock import PackLock, exclude_parts
from streamwin.packing.nonfinite import count_nonfinite
from streamwin.progress import progress_bar
from streamwin.storage.manifests import load_manifest
from streamwin.storage.urls import join, url_to_fs, write_atomic

CACHED_SHARDS = 4  # shards of continuations held at once while the shards of their sequences are rewritten


@check_keywords()
def compact(url: str, *, storage_options: dict | None = None, progress: bool = True) -> Manifest:
    """Merge every extended sequence's continuations into one member (see the module); the new manifest, or the
    manifest as it is when no sequence has continuations. Reads before and after are byte for byte the same."""
    fs, root = url_to_fs(url, storage_options)
    with PackLock(fs, root, url, what="compact") as lock:
        exclude_parts(fs, root, url, lock)
        start = survey(fs, root)
        refuse_foreign(start, url, False)
        refuse_unmerged(start, url, False)  # (a commit removes part indexes: merge them first)
        old = load_manifest(url, storage_options)
        if start.index is None or old.digest != hashlib.sha256(start.index).hexdigest()[:16]:
            raise PackError(f"{url} was committed by another pack while compact started: run it again")
        if old.segments is None:
            return old
        if old.checks is not None and not old.checks.in_files:
            raise PackError(f"cannot compact {url}: it keeps its checksums in the manifest (packed before sums files "
                            "beside the shards); repack it")
        remove_generations(fs, root, start, {start.gen, start.kept})  # what killed packs left
        gen = max(start.newest, lock.stale_gen) + 1
        lock.set_generation(gen)
        return committed(fs, root, url, lambda: _Compactor(fs, root, url, old, gen).run(progress), gen, start,
                         lock, False)


class _Compactor:
    """Writes the compacted shards of ``old`` as generation ``gen`` and builds the manifest that names them."""

    def __init__(self, fs, root: str, url: str, old: Manifest, gen: int):
        self.fs, self.root, self.url, self.old, self.gen = fs, root, url, old, gen
        seg = old.segments
        self.n = seg.heads
        self.begin = seg.per_sequence(self.n)
        self.members = old.members()
        self.cached: OrderedDict[int, bytes] = OrderedDict()

    def run(self, progress: bool) -> Manifest:
        old, seg, n = self.old, self.old.segments, self.n
        heads_of = old.shards_of(np.unique(seg.seq))  # the shards of the extended sequences' first members
        rewrite, drop = set(heads_of.tolist()), set(np.asarray(seg.shard).tolist())
        if rewrite & drop:
            raise ManifestError(f"{self.url}: shards {sorted(rewrite & drop)[:3]} hold both first members of extended "
                                "sequences and continuations; streamwin writes them apart (the manifest was edited?)")
        cols = {k: np.array(getattr(old, k)[:n] if k != "length" else seg.length[:n], dtype=np.int64)
                for k in ("length", "offset", "size", "hlen")}
        frames = self._frames_of_kept(rewrite)
        shards, digests, files, per_shard = [], [], [], []
        nf = old.nonfinite
        bar = progress_bar(desc=f"compact {self.url}", unit="shard", total=len(rewrite), disable=not progress)
        try:
            for k, entry in enumerate(old.shards):
                if k in drop:
                    continue
                if k not in rewrite:
                    shards.append(entry)
                    digests.append(int(old.checks.digests[k]) if old.checks is not None else 0)
                    files.append(old.checks.sha256[k] if old.checks is not None else None)
                    per_shard.append(nf.per_shard[k] if nf is not None else 0)
                    continue
                entry, sums, more, found = self._rewrite(k, cols)
                frames.extend(found)
                shards.append(entry)
                digests.append(int(sums[0], 16))
                files.append(np.frombuffer(bytes.fromhex(sums[1]), dtype=np.uint8))
                per_shard.append((nf.per_shard[k] if nf is not None else 0) + more)
                bar.update(1)
        finally:
            bar.close()
        checks = None if old.checks is None else Checks.stored(
            old.checks.algorithm, old.checks.chunk, old.checks.block, old.checks.page_blocks,
            np.array(digests, dtype=np.uint64), np.stack(files) if files else np.zeros((0, 32), np.uint8),
            [s.bytes for s in shards])
        frames.sort(key=lambda f: f[0])
        fr = Frames.make(zstd.frame_rows(old.step_bytes), np.array([r for r, _ in frames], dtype=np.int64),
                         np.concatenate([e for _, e in frames]) if frames else np.zeros(0, np.int64),
                         cols["length"]) if frames else None
        cols["length"] = np.asarray(old.length, dtype=np.int64)
        return dataclasses.replace(
            old, shards=tuple(shards), segments=None, key_blob=bytes(old.key_blob[: int(old.key_ends[-1])]),
            key_ends=np.asarray(old.key_ends, dtype=np.int64), frames=fr, checks=checks,
            nonfinite=None if nf is None else NonFinite(nf.nan, nf.inf, tuple(per_shard)), digest="", **cols)

    def _frames_of_kept(self, rewrite: set[int]) -> list[tuple[int, np.ndarray]]:
        """(row, frame ends) of the framed first members in shards that are kept as they are."""
        fr = self.old.frames
        if fr is None:
            return []
        shard = self.old.shards_of(np.minimum(fr.seq, self.n - 1))
        return [(row, self._framed(row)) for row, k in zip(fr.seq.tolist(), shard.tolist())
                if row < self.n and k not in rewrite]

    def _shard(self, k: int) -> bytes:
        """Shard k's bytes, checked against the sha256 the manifest names (the last few kept)."""
        if k in self.cached:
            self.cached.move_to_end(k)
            return self.cached[k]
        entry = self.old.shards[k]
        data = self.fs.cat_file(join(self.root, entry.name))
        if len(data) != entry.bytes or hashlib.sha256(data).hexdigest() != entry.sha256:
            raise ManifestError(f"cannot compact {self.url}: shard {entry.name} is not the one index.json names "
                                "(size or sha256 differ); run `streamwin verify` on it")
        self.cached[k] = data
        while len(self.cached) > CACHED_SHARDS:
            self.cached.popitem(last=False)
        return data

    def _steps(self, row: int) -> tuple[bytes, int, int]:
        """(the array bytes of member ``row`` of ``members()``, NaN + inf among them, steps)."""
        m = self.members
        k = int(m.shard_of(row))
        data = self._shard(k)
        a, size, hlen = int(m.offset[row]), int(m.size[row]), int(m.hlen[row])
        raw = data[a : a + size]
        if m.compression:
            ends = self._framed(row)
            raw = zstd.decompress_frames(raw, ends if ends is not None else [size])
        body = raw[hlen:]
        steps = int(m.length[row])
        arr = np.frombuffer(body, dtype=m.dtype)
        nan, inf = count_nonfinite(arr) if arr.dtype.kind in "fc" else (0, 0)
        return body, nan + inf, steps

    def _framed(self, row: int) -> np.ndarray | None:
        """Where each zstd frame of member ``row`` ends, if it is packed as frames."""
        fr = self.old.frames
        at = int(np.searchsorted(fr.seq, row)) if fr is not None else 0
        if fr is None or at >= len(fr.seq) or int(fr.seq[at]) != row:
            return None
        return fr.ends[fr.first[at] : fr.first[at + 1]]

    def _rewrite(self, k: int, cols: dict) -> tuple[ShardEntry, tuple[str, str], int, list]:
        """Write shard k anew with its extended sequences' members merged; (entry, sums digests, NaN + inf added,
        (row, frame ends) of its framed members)."""
        old, n = self.old, self.n
        data = self._shard(k)
        lo, hi = int(old.shard_starts[k]), int(old.shard_starts[k + 1])
        rows = {int(old.offset[i]): i for i in range(lo, hi)}
        out, pos, added, frames = [], 0, 0, []
        sha, sums = hashlib.sha256(), ShardSumsWriter()

        def put(b: bytes) -> None:
            nonlocal pos
            out.append(b)
            sha.update(b)
            sums.update(b)
            pos += len(b)
        for info in tarfile.open(fileobj=io.BytesIO(data), mode="r:"):
            i = rows.get(info.offset_data)
            end = info.offset_data + info.size + (-info.size % tarfmt.BLOCK)
            if i is None or self.begin[i] == self.begin[i + 1]:  # not an extended sequence's member: as it is
                if i is not None:
                    cols["offset"][i] = pos + info.offset_data - info.offset
                    if self._framed(i) is not None:
                        frames.append((i, self._framed(i)))
                put(data[info.offset : end])
                continue
            members = [i] + [n + j for j in range(self.begin[i], self.begin[i + 1])]
            parts = [self._steps(r) for r in members]
            added += sum(p[1] for p in parts[1:])
            steps = sum(p[2] for p in parts)
            head = npyfmt.npy_header_for(old.dtype, (steps,) + old.step_shape)
            body = b"".join(p[0] for p in parts)
            content, ends = (zstd.compress_member(head, np.frombuffer(body, np.uint8), steps) if old.compression
                             else (head + body, None))
            name = info.name
            header = tarfmt.tar_header(name, len(content))
            put(header)
            cols["offset"][i], cols["size"][i], cols["hlen"][i], cols["length"][i] = pos, len(content), len(head), steps
            put(content)
            put(tarfmt.tar_padding(len(content)))
            if ends is not None:
                frames.append((i, np.asarray(ends, dtype=np.int64)))
        put(tarfmt.TAR_END)
        name = f"{shard_prefix(self.gen, k)}000000.tar"
        write_atomic(self.fs, join(self.root, name), out)
        file, digests = sums.file()
        write_atomic(self.fs, join(self.root, name + SUFFIX), file)
        entry = dataclasses.replace(old.shards[k], name=name, bytes=pos, sha256=sha.hexdigest(),
                                    num_steps=int(cols["length"][lo:hi].sum()))
        return entry, digests, added, frames
