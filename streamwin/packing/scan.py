"""Check a dataset against its manifest, and write a manifest for tar shards streamwin did not pack.

Both read every shard once, front to back, through one scanner (`scanner.scan_shard`: bytes
hashed as they stream by, npy headers parsed, nothing unpickled).

- ``verify(url)`` compares what it finds with index.json: per shard its bytes, sha256,
  sequence and step counts and chunk checksums (its sums file, checked against the digest
  index.json keeps of it); per sequence the member name, content offset and size, npy
  header length, dtype and shape. Every shard is checked; the first problem of each failing
  shard is collected, and one ShardError is raised at the end naming the first failure
  (shard, member, byte offset) with all of them in its ``failures`` attribute.
- ``index_shards(url)`` writes index.json for existing shards (e.g. from
  ``webdataset.ShardWriter``), taking the key of a member as webdataset does: its path up to
  the first dot of its base name, counting the NaN and inf values of float arrays as
  pack does, and writing each shard's sums file (formats/checks.py) as pack does. A dataset
  whose sequences were extended (``<key>.gGGGGGG.npy`` continuation members, formats/growth.py)
  is indexed with its continuations, each after the ones of lower generation; its record of
  views is not in the shards, so the index starts a dataset of one view.
"""
from __future__ import annotations

import dataclasses
import hashlib
import posixpath
import time
from typing import Any

import numpy as np

from streamwin.arguments import check_keywords
from streamwin.errors import ManifestError, ShardError
from streamwin.formats import tar as tarfmt
from streamwin.formats.checks import SUFFIX, Checks
from streamwin.formats.growth import parse_continuation
from streamwin.formats.sums import ShardSumsWriter
from streamwin.formats.manifest import INDEX_NAME, Manifest, NonFinite, ShardEntry, build_manifest, columns_file_entry
from streamwin.packing.fieldcols import FieldCollector
from streamwin.packing.grow import split_members
from streamwin.packing.lock import PackLock, exclude_parts
from streamwin.packing.scanner import CHUNK, NpyMember, ShardScan, scan_all
from streamwin.storage.manifests import load_manifest, write_manifest
from streamwin.storage.urls import join, url_to_fs, write_atomic


# ---- verify --------------------------------------------------------------------------------------

@check_keywords()
def verify(url: str, storage_options: dict | None = None, progress: bool = True) -> dict[str, Any]:
    """Re-read every shard of the dataset at ``url`` and check it against index.json.

    Returns a summary dict (shards, sequences, steps, bytes, seconds, mb_per_s). Raises
    ManifestError if index.json is missing or malformed, and ShardError naming the shard, member
    and byte offset of the first problem; its ``failures`` attribute lists the first problem of
    every failing shard.
    """
    start = time.perf_counter()
    url = str(url).rstrip("/")
    manifest = load_manifest(url, storage_options)
    fs, root = url_to_fs(url, storage_options)
    _check_columns_file(fs, root, url)
    failures: list[ShardError] = []

    members = manifest.members()  # with continuations: a row per member (formats/growth.py)
    in_shard = _rows_by_shard(members)

    def check(k: int, result: ShardScan | ShardError) -> None:
        problem = result if isinstance(result, ShardError) else _compare(members, k, in_shard[k], result, url, fs,
                                                                          root)
        if problem is not None:
            failures.append(problem)

    names = [s.name for s in manifest.shards]
    scan_all(fs, root, url, names, sum(s.bytes for s in manifest.shards), progress, f"verify {url}", check)
    if len(failures) == 1:
        failures[0].failures = failures
        raise failures[0]
    if failures:
        first = failures[0]
        where = str(ShardError("", shard=first.shard, member=first.member, offset=first.offset))
        text = str(first)
        text = text[: -len(where)] if text.endswith(where) else text
        err = ShardError(f"{len(failures)} of {len(names)} shards failed verification; the first: {text}",
                         shard=first.shard, member=first.member, offset=first.offset)
        err.failures = failures
        raise err from first
    seconds = time.perf_counter() - start
    nbytes = sum(s.bytes for s in manifest.shards)
    return {"shards": len(manifest.shards), "sequences": manifest.num_sequences, "steps": manifest.num_steps,
            "bytes": nbytes, "seconds": seconds, "mb_per_s": nbytes / 1e6 / max(seconds, 1e-9)}


def _check_columns_file(fs, root: str, url: str) -> None:
    """The sha256 of a version 2 manifest's columns file against the one index.json names (ManifestError)."""
    entry = columns_file_entry(fs.cat_file(join(root, INDEX_NAME)), f"{url}/{INDEX_NAME}")
    if entry is None:
        return
    digest = hashlib.sha256()
    with fs.open(join(root, entry.name), "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    if digest.hexdigest() != entry.sha256:
        raise ManifestError(f"{url}/{entry.name} is damaged: its sha256 is {digest.hexdigest()[:16]}..., "
                            f"{INDEX_NAME} says {entry.sha256[:16]}...; repack, or rerun `streamwin index`")


def _rows_by_shard(m: Manifest) -> list[np.ndarray]:
    """The rows of each shard's members, in the order they lie in it."""
    rows = np.arange(m.num_members)
    shard = m.shards_of(rows)
    order = np.lexsort((np.asarray(m.offset), shard))
    bounds = np.searchsorted(shard[order], np.arange(len(m.shards) + 1))
    return [order[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def _compare(m: Manifest, k: int, rows: np.ndarray, scan: ShardScan, url: str, fs, root: str) -> ShardError | None:
    """The first disagreement between shard ``k`` as scanned and the manifest's members ``rows`` of it, or None."""
    entry = m.shards[k]
    shard_url = f"{url}/{entry.name}"
    count = len(rows)
    suffix = ".npy.zst" if m.compression == "zstd" else ".npy"
    for j, i in enumerate(rows.tolist()):
        if j >= len(scan.members):
            return ShardError(f"manifest lists {count} members, the shard holds {len(scan.members)} .npy members",
                              shard=shard_url, member=m.key(i) + suffix, offset=int(m.offset[i]))
        got = scan.members[j]
        want = (m.key(i) + suffix, int(m.offset[i]), int(m.size[i]), m.dtype,
                (int(m.length[i]),) + m.step_shape, int(m.hlen[i]))
        have = (got.name, got.offset, got.size, got.dtype, got.shape, got.hlen)
        if have != want:
            fields = ("member name", "content offset", "size", "dtype", "shape", "npy header length")
            diffs = "; ".join(f"{f}: shard {h!r} / manifest {w!r}" for f, h, w in zip(fields, have, want) if h != w)
            return ShardError(f"sequence {i} disagrees with the manifest: {diffs}", shard=shard_url,
                              member=got.name, offset=got.offset)
    if len(scan.members) > count:
        extra = scan.members[count]
        return ShardError(f"shard holds {len(scan.members)} .npy members, manifest lists {count}",
                          shard=shard_url, member=extra.name, offset=extra.offset)
    steps = int(np.asarray(m.length)[rows].sum())
    if steps != entry.num_steps:
        return ShardError(f"steps mismatch: the manifest's sequences of this shard sum to {steps} steps, its shard "
                          f"entry says {entry.num_steps}", shard=shard_url)
    bad = _first_bad_chunk(m, k, scan.sums, fs, root, url) if m.checks is not None and scan.sums is not None else None
    if isinstance(bad, ShardError):
        return bad
    if bad is not None:  # where the bytes differ from what was packed, to the chunk
        at = bad * m.checks.chunk
        j = int(np.searchsorted(np.asarray(m.offset)[rows] + np.asarray(m.size)[rows], at, side="right"))
        named = j < count  # the first member ending past it
        i = int(rows[j]) if named else 0
        return ShardError(f"checksum mismatch: bytes {at}..{min(at + m.checks.chunk, scan.nbytes)} (chunk {bad}) differ "
                          "from what was packed", shard=shard_url, member=m.key(i) + suffix if named else None,
                          offset=max(at, int(m.offset[i]) - tarfmt.BLOCK) if named else at)
    for what, have, want in (("bytes", scan.nbytes, entry.bytes), ("sha256", scan.sha256, entry.sha256)):
        if have != want:
            return ShardError(f"{what} mismatch: shard has {have}, manifest says {want}", shard=shard_url)
    return None


def _first_bad_chunk(m: Manifest, k: int, sums: ShardSumsWriter, fs, root: str, url: str) -> int | ShardError | None:
    """The first chunk of shard k whose checksum differs from the manifest's (its sums file's, read and checked
    whole), or None; a ShardError naming the sums file when that is missing or damaged."""
    fine, coarse = sums.finish()
    if m.checks.in_files:
        name = m.shards[k].name + m.checks.suffix
        try:
            want_coarse, want = m.checks.parse_file(k, fs.cat_file(join(root, name)))
        except FileNotFoundError:
            return ShardError(f"its chunk checksums file {url}/{name} is missing", shard=f"{url}/{m.shards[k].name}")
        except ValueError as e:
            return ShardError(f"its chunk checksums file {url}/{name} is damaged: {e}", shard=f"{url}/{m.shards[k].name}")
        if not np.array_equal(coarse, want_coarse) and np.array_equal(fine, want):  # no chunk differs, a block does
            return ShardError(f"its chunk checksums file {url}/{name} is damaged: its block sums disagree with the "
                              "shard, its chunk sums do not", shard=f"{url}/{m.shards[k].name}")
    else:
        want = m.checks.shard(k)
    if len(fine) != len(want):
        return min(len(fine), len(want))
    wrong = np.flatnonzero(fine != want)
    return int(wrong[0]) if len(wrong) else None


# ---- index ---------------------------------------------------------------------------------------

@check_keywords()
def index_shards(url: str, pattern: str = "*.tar", storage_options: dict | None = None,
                 progress: bool = True) -> Manifest:
    """Write ``<url>/index.json`` for the existing tar shards matching ``pattern`` under ``url``.

    Every ``<key>.npy`` (or ``<key>.npy.zst``) member is a sequence, in shard order then member
    order; other members (``.json``, ``.cls``, and also ``<key>.input.npy``: the extension
    must be exactly ``npy``) are left alone. All arrays must share one
    dtype and step shape (ShardError naming the shard and member otherwise); keys must be
    unique printable ASCII (webdataset keys may contain '/'). Zero-length arrays are kept as
    sequences of length 0 (they yield no windows).
    """
    url = str(url).rstrip("/")
    fs, root = url_to_fs(url, storage_options)
    found = sorted(p for p in fs.glob(join(root, pattern)) if not p.endswith(INDEX_NAME))
    if not found:
        raise ManifestError(f"no shards matching {pattern!r} at {url}")
    names = [posixpath.relpath(p, root) if root else p for p in found]
    with PackLock(fs, root, url, what="index") as lock:  # commits index.json: one writer at a time, as pack
        exclude_parts(fs, root, url, lock)
        sizes = [fs.size(p) for p in found] if progress else [0]
        acc = _Indexer(url, fs, root)
        scan_all(fs, root, url, names, sum(sizes), progress, f"index {url}", acc.add)
        manifest = acc.manifest()
        lock.check()
        write_manifest(fs, root, manifest)
    return manifest


class _Indexer:
    """Accumulates scanned shards into manifest columns, checking consistency as it goes."""

    def __init__(self, url: str, fs, root: str):
        self.url, self.fs, self.root = url, fs, root
        self.shards: list[ShardEntry] = []
        self.keys: list[str] = []
        self.columns: dict[str, list[int]] = {"length": [], "offset": [], "size": [], "hlen": []}
        self.first: tuple[str, NpyMember] | None = None
        self.seen: dict[str, str] = {}
        self.nan = self.inf = 0
        self.shard_nonfinite: list[int] = []
        self.digests: list[tuple[str, str]] = []  # of each shard's sums file, written as it is scanned
        self.fields = FieldCollector()  # from the .json members, as pack took them from the meta dicts

    def add(self, k: int, scan: ShardScan | ShardError) -> None:
        """Take shard k's members as the next sequences (raise the error a shard's scan gave)."""
        if isinstance(scan, ShardError):
            raise scan
        shard_url = f"{self.url}/{scan.name}"
        for mem in scan.members:
            self._check(mem, shard_url)
            self.seen[mem.key] = scan.name
            self.keys.append(mem.key)
            if parse_continuation(mem.key) is None:  # (continuations have no fields of their own)
                self.fields.add(mem.key, mem.meta)
            for col, value in (("length", mem.shape[0]), ("offset", mem.offset), ("size", mem.size), ("hlen", mem.hlen)):
                self.columns[col].append(value)
        steps = sum(mem.shape[0] for mem in scan.members)
        self.shards.append(ShardEntry(scan.name, scan.nbytes, scan.sha256, len(scan.members), steps))
        nan, inf = sum(mem.nan for mem in scan.members), sum(mem.inf for mem in scan.members)
        self.nan, self.inf = self.nan + nan, self.inf + inf
        self.shard_nonfinite.append(nan + inf)
        sums, digest = scan.sums.file()
        write_atomic(self.fs, join(self.root, scan.name + SUFFIX), sums)
        self.digests.append(digest)

    def _check(self, mem: NpyMember, shard_url: str) -> None:
        where = dict(shard=shard_url, member=mem.name, offset=mem.offset)
        if not mem.key.isascii() or not mem.key.isprintable() or " " in mem.key:
            raise ShardError(f"key {mem.key!r} is not printable ASCII without spaces", **where)
        if mem.key in self.seen:
            raise ShardError(f"duplicate key {mem.key!r} (also in {self.seen[mem.key]})", **where)
        if self.first is None:
            self.first = (shard_url, mem)
            return
        first_url, first = self.first
        if (mem.dtype.str, mem.shape[1:], mem.compressed) != (first.dtype.str, first.shape[1:], first.compressed):
            raise ShardError(
                f"dtype {mem.dtype.str}, step shape {mem.shape[1:]}{', zstd' if mem.compressed else ''} differs from "
                f"dtype {first.dtype.str}, step shape {first.shape[1:]}{', zstd' if first.compressed else ''} of "
                f"{first.name} in {first_url}; a dataset has one dtype, step shape and compression", **where)

    def manifest(self) -> Manifest:
        """The manifest of every shard added; ManifestError when none held an npy member."""
        if self.first is None:
            raise ManifestError(f"no .npy or .npy.zst members in the shards at {self.url}: nothing to index")
        first = self.first[1]
        grown = any(parse_continuation(k) for k in self.keys)  # continuation members of extended sequences
        m = build_manifest(first.dtype, first.shape[1:], "zstd" if first.compressed else None,
                           self.shards, self.keys, self.columns,
                           nonfinite=NonFinite(self.nan, self.inf, tuple(self.shard_nonfinite)),
                           checks=Checks.of_shards(self.digests, [s.bytes for s in self.shards]),
                           fields=None if grown else self.fields.result())
        return dataclasses.replace(split_members(m, self.url), fields=self.fields.result()) if grown else m
