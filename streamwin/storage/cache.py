"""A node-local cache of whole shards, shared by every process on the node.

A shard is downloaded once per node even when eight processes ask at the same moment: the
first takes a file lock, downloads to a temporary name, checks size and sha256 against the
manifest and renames it into place (atomic); the others wait on the lock and then find it.
Hits refresh the file's mtime; past ``limit_bytes`` the least recently used shards are
evicted. A copy is keyed by content: its file name holds a hash of the shard URL and the
manifest's sha256 of the shard, so a dataset re-packed in place (same names, same sizes)
is fetched anew, and the copies of the old shards age out by LRU. File names are made only
of hex digits and a sanitized base name, never of anything inside a shard, so no shard or
manifest can make the cache write outside its directory. A download killed midway leaves its
temporary file (``<copy>.tmp-<pid>-<hex>``); the next download or eviction on the node removes
every one whose copy's lock nobody holds (its download is over: a download holds the lock
until it renames its file), whatever process namespace wrote it.

A copy is checked whole (sha256) when it is fetched; a byte that changes on the node's disk
later fails the reads' chunk checks. ``repair`` then checks the copy again, and drops it when
it no longer holds what the manifest says (with a warning naming the file), so that the next
read fetches it anew; a fresh copy that fails too fails its fetch, naming the remote shard.
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
import uuid
import warnings
from typing import Callable

from filelock import FileLock, Timeout

from streamwin.arguments import check_keywords
from streamwin.errors import ShardError
from streamwin.formats.manifest import ShardEntry
from streamwin.storage.manifests import load_manifest
from streamwin.storage.retry import describe, with_retries
from streamwin.storage.urls import join, url_to_fs

_SAFE = re.compile(r"[^A-Za-z0-9_-]")
_TMP = re.compile(r"\.tmp-\d+-[0-9a-f]+$")
COPY_CHUNK = 8 << 20


@check_keywords()
class ShardCache:
    """Verified local copies of remote shards under ``cache_dir``, evicted LRU down to ``limit_bytes``."""

    def __init__(self, cache_dir: str, *, limit_bytes: int | None = None, retries: int = 5, backoff: float = 0.2):
        self.dir = os.path.realpath(os.path.expanduser(str(cache_dir)))
        os.makedirs(self.dir, exist_ok=True)
        self.limit_bytes, self.retries, self.backoff = limit_bytes, retries, backoff
        self.hits = self.misses = 0

    def local_path(self, url: str, entry: ShardEntry) -> str:
        """Where the copy of shard ``url`` with the manifest's ``entry`` lives, inside the cache dir.

        The name holds hashes of the URL and of the content (the manifest's sha256), so a
        re-packed shard never matches the copy of its predecessor.
        """
        base = _SAFE.sub("_", url.rstrip("/").rsplit("/", 1)[-1])[:64] or "shard"
        content = _SAFE.sub("_", entry.sha256)[:64] or "nosha"
        path = os.path.join(self.dir, f"{hashlib.sha256(url.encode()).hexdigest()[:16]}-{content}-{base}")
        assert os.path.dirname(path) == self.dir  # by construction: no separator can survive _SAFE
        return path

    def has(self, url: str, entry: ShardEntry) -> bool:
        """Whether a complete copy of the shard, as the manifest describes it, is in the cache now."""
        return self._valid(self.local_path(url, entry), entry)

    def fetch(self, url: str, fs, path: str, entry: ShardEntry, copy: Callable[[str], str] | None = None) -> str:
        """Local path of a verified copy of the shard, downloading it first if needed: with ``copy(dest)`` (which
        writes the shard to local file ``dest`` and returns its sha256) where given, else one stream of ``fs``."""
        local = self.local_path(url, entry)
        if self._valid(local, entry):
            self.hits += 1
            _touch(local)
            return local
        with FileLock(local + ".lock"):
            if self._valid(local, entry):  # another process fetched it while we waited
                self.hits += 1
                _touch(local)
                return local
            self.misses += 1
            self.sweep()
            self._download(url, entry, local, copy or functools.partial(_copy, fs, path))
        self.evict(keep=local)
        return local

    def repair(self, url: str, entry: ShardEntry) -> bool:
        """Drop the copy of shard ``url`` if it no longer holds what ``entry`` says (sha256), warning with its
        path; True if it was dropped (the next ``fetch`` downloads it anew), False if it is whole or gone."""
        local = self.local_path(url, entry)
        with FileLock(local + ".lock"):  # not while another process downloads it
            try:
                digest = _sha256(local)
            except FileNotFoundError:
                return False
            if digest == entry.sha256:
                return False
            os.remove(local)
        warnings.warn(f"streamwin: the node cache's copy {local} of {url} is damaged (sha256 {digest[:16]}..., the "
                      f"manifest says {entry.sha256[:16]}...): dropped it, fetching the shard again", RuntimeWarning,
                      stacklevel=2)
        return True

    def _valid(self, local: str, entry: ShardEntry) -> bool:
        """Whether ``local`` is a whole copy: the manifest's size (its content was checked when it was fetched)."""
        try:
            return os.path.getsize(local) == entry.bytes
        except OSError:
            return False

    def _download(self, url: str, entry: ShardEntry, local: str, copy: Callable[[str], str]) -> None:
        """Copy the shard to a temporary name, check size and sha256 against ``entry``, rename it to ``local``."""
        tmp = f"{local}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            try:  # a transient failure starts the fetch over: a shard is fetched whole
                digest = with_retries(lambda: copy(tmp), retries=self.retries, backoff=self.backoff)
            except ShardError:  # the copy's own, naming the shard and offset (it retried at the byte)
                raise
            except (FileNotFoundError, PermissionError) as e:
                raise ShardError(f"cannot fetch shard into the cache: {e}", shard=url) from e
            except Exception as e:
                raise ShardError(f"fetch {describe(e, self.retries)}", shard=url) from e
            size = os.path.getsize(tmp)
            if size != entry.bytes or digest != entry.sha256:
                raise ShardError(f"checksum mismatch: fetched {size} bytes with sha256 {digest[:16]}..., manifest says "
                                 f"{entry.bytes} bytes with sha256 {entry.sha256[:16]}...", shard=url, offset=0)
            os.replace(tmp, local)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    def sweep(self) -> int:
        """Remove the temporary files of downloads that are over (killed midway: nobody holds their copy's
        lock); returns how many."""
        removed = 0
        for name in os.listdir(self.dir):
            m = _TMP.search(name)
            if m is None:
                continue
            lock = FileLock(os.path.join(self.dir, name[: m.start()]) + ".lock")
            try:
                lock.acquire(timeout=0)
            except Timeout:  # a download in progress
                continue
            try:
                os.remove(os.path.join(self.dir, name))
                removed += 1
            except OSError:  # removed meanwhile
                pass
            finally:
                lock.release()
        return removed

    def evict(self, keep: str | None = None) -> int:
        """Delete least recently used shards until the cache holds at most limit_bytes; returns bytes freed."""
        if self.limit_bytes is None:
            return 0
        with FileLock(os.path.join(self.dir, ".evict.lock")):
            self.sweep()
            files = []
            for name in os.listdir(self.dir):
                p = os.path.join(self.dir, name)
                if ".tmp-" in name or name.endswith(".lock") or not os.path.isfile(p):
                    continue
                st = os.stat(p)
                files.append((st.st_mtime, st.st_size, p))
            total = sum(f[1] for f in files)
            freed = 0
            for _, size, p in sorted(files):
                if total <= self.limit_bytes:
                    break
                if p == keep:
                    continue
                try:
                    os.remove(p)
                except FileNotFoundError:
                    continue
                total -= size
                freed += size
            return freed


def _touch(path: str) -> None:
    """Mark a cached copy as just used (eviction goes by mtime)."""
    try:
        os.utime(path)
    except OSError:
        pass


def _sha256(path: str) -> str:
    """The sha256 of a local file, read in pieces."""
    h, buf = hashlib.sha256(), bytearray(COPY_CHUNK)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(memoryview(buf)[:n])
    return h.hexdigest()


def _copy(fs, path: str, dest: str) -> str:
    """Copy ``path`` of ``fs`` to the local file ``dest``; the sha256 of the bytes copied."""
    h = hashlib.sha256()
    with fs.open(path, "rb") as src, open(dest, "wb") as out:
        while True:
            chunk = src.read(COPY_CHUNK)
            if not chunk:
                break
            h.update(chunk)
            out.write(chunk)
    return h.hexdigest()


@check_keywords()
def prefetch(url: str, cache_dir: str, *, storage_options: dict | None = None, local_rank: int | None = None,
             local_world_size: int | None = None, limit_bytes: int | None = None) -> int:
    """Warm the node cache with every shard of a dataset (and its sums file); returns the shards this process fetched.

    Each of the node's processes fetches its share (by LOCAL_RANK / LOCAL_WORLD_SIZE, or
    SLURM_LOCALID / SLURM_NTASKS_PER_NODE), so the node downloads each shard once, in parallel.
    Call ``torch.distributed.barrier()`` afterwards so that nobody reads before the cache is warm.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", 0))) if local_rank is None else local_rank
    local_world_size = (int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("SLURM_NTASKS_PER_NODE", 1)))
                        if local_world_size is None else local_world_size)
    manifest = load_manifest(url, storage_options)
    fs, root = url_to_fs(url, storage_options, own_retries=True)
    cache = ShardCache(cache_dir, limit_bytes=limit_bytes)
    fetched = 0
    for k, entry in enumerate(manifest.shards):
        if k % local_world_size == local_rank:
            shard_url = f"{url.rstrip('/')}/{entry.name}"
            before = cache.misses
            cache.fetch(shard_url, fs, join(root, entry.name), entry)
            fetched += cache.misses - before
            checks = manifest.checks
            if checks is not None and checks.in_files:  # its chunk checksums, which every read of it needs
                name = entry.name + checks.suffix
                cache.fetch(f"{url.rstrip('/')}/{name}", fs, join(root, name),
                            ShardEntry(name, checks.layout(k).file_bytes, checks.file_sha256(k), 0, 0))
    return fetched
