"""The manifest on storage: index.json (and its columns file) written last, read with retries in bounded time.

Over http(s) and s3, index.json and a remote columns file are read like shard bytes: with
streamwin's own streamed GET (storage.ranged.RangeReader), on connections of their own that
are closed afterwards, under its time limits (a stall: 30 s over http, 60 s over s3; a
transfer: that plus 1 s per MiB) and retries. Through fsspec's shared aiohttp session a
manifest load could wait on a pooled keep-alive connection whose server side had gone
without a FIN (in tests: a loopback server's socket still held open by a forked worker),
until aiohttp's 5 minute timeout, once per retry.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import warnings
from typing import Any, Callable

import fsspec

from streamwin.errors import ManifestError
from streamwin.formats.manifest import (COLUMNAR_FROM, INDEX_NAME, Manifest, ShardEntry, columns_file_entry, columns_name,
                                        parse_manifest)
from streamwin.storage.ranged import BrokenRead, RangeReader
from streamwin.storage.retry import describe, with_retries
from streamwin.storage.urls import is_local, join, remove_if_exists, url_to_fs, write_atomic

MAX_INDEX_BYTES = 1 << 30  # an index.json larger than this is not one streamwin wrote


def write_manifest(fs: fsspec.AbstractFileSystem, root: str, manifest: Manifest, name: str = INDEX_NAME,
                   columnar: bool | None = None, columns: str | None = None) -> None:
    """Write the index file ``name`` (the commit marker), after its columns file when columnar.

    ``columnar`` None: the columnar form (version 2) from COLUMNAR_FROM sequences on (or
    when the chunk checksums outgrow INLINE_SUMS), else the columns inline (version 1, one file).
    ``columns``: the columns file's name (default ``columns_name(name)``); given, a columns
    file of that name is left alone when inline.
    """
    if columnar is None:  # many sequences, or chunk checksums of more than a GB of shards: a columns file
        columnar = manifest.num_sequences >= COLUMNAR_FROM or not manifest.sums_inline()
    if not columnar:
        if columns is None:
            remove_if_exists(fs, join(root, columns_name(name)))
        write_atomic(fs, join(root, name), manifest.to_json().encode())
        return
    columns = columns or columns_name(name)
    parts, layout = manifest.column_parts()
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    nbytes = sum(len(p) for p in parts)
    write_atomic(fs, join(root, columns), parts)
    spec = {"name": columns, "bytes": nbytes, "sha256": digest.hexdigest(), "layout": layout}
    write_atomic(fs, join(root, name), manifest.to_json(columns_file=spec).encode())


def load_manifest(url: str, storage_options: dict[str, Any] | None = None, *, retries: int = 5,
                  backoff: float = 0.2, name: str = INDEX_NAME,
                  fetch_columns: Callable[[str, Any, str, ShardEntry], str] | None = None) -> Manifest:
    """Read ``<url>/index.json``; a missing index means the dataset is not (yet) complete.

    Transient storage errors (503, dropped connections, time-outs) are retried with
    exponential backoff, like every shard read. The columns file of a version 2 manifest is
    memory-mapped where it is a local file; a remote one is mapped from the local path
    ``fetch_columns(url, fs, path, entry)`` returns (the node cache), else read into memory.
    """
    fs, root = url_to_fs(url, storage_options, own_retries=True, fresh=True)
    path = join(root, name)
    where = f"{url.rstrip('/')}/{name}"
    try:
        text = read_object(fs, path, MAX_INDEX_BYTES, retries, backoff)
    except (FileNotFoundError, NotADirectoryError) as e:
        if isinstance(e, NotADirectoryError) or _is_file(fs, root):
            parent = url.rstrip("/").rsplit("/", 1)[0] if "/" in url.rstrip("/") else "."
            raise ManifestError(f"{url} is a file, not a dataset: pass the directory that holds {INDEX_NAME} "
                                f"and the shards (here perhaps {parent!r})") from None
        raise ManifestError(
            f"no {INDEX_NAME} at {url}: not a streamwin dataset, or its pack did not finish "
            "(index.json is written last); rerun the pack, or `streamwin index` existing tar shards"
        ) from e
    except PermissionError as e:
        raise ManifestError(f"cannot read {where}: {e}") from e
    except Exception as e:
        raise ManifestError(f"cannot read {where}: {describe(e, retries)}") from e
    entry = columns_file_entry(text, where)
    if entry is None:
        return parse_manifest(text, where=where)
    columns = _columns_bytes(url, fs, join(root, entry.name), entry, fetch_columns, retries, backoff)
    return parse_manifest(text, where=where, columns=columns)


def _is_file(fs, path: str) -> bool:
    """Whether ``path`` is a file (a dataset URL that names index.json or a shard instead of its directory)."""
    try:
        return bool(fs.isfile(path))
    except Exception:  # only asked to word an error better: never an error of its own
        return False


def _columns_bytes(url: str, fs, path: str, entry: ShardEntry, fetch_columns, retries: int, backoff: float):
    """The columns file's bytes, checked against the size and sha256 index.json names: a read-only map of a
    local file (the dataset's, or the node cache's copy), or the bytes read from storage.

    A cached copy that no longer matches is dropped and fetched again, once, with a warning;
    a damaged file of the dataset itself is a ManifestError naming it.
    """
    where = f"{url.rstrip('/')}/{entry.name}"
    try:
        if not is_local(fs) and fetch_columns is None:
            data = read_object(fs, path, entry.bytes, retries, backoff)
            _check_columns(hashlib.sha256(data).hexdigest(), len(data), entry, where)
            return data
        if not is_local(fs):
            local = fetch_columns(where, fs, path, entry)
            digest, size = _file_sha256(local)
            if (size, digest) != (entry.bytes, entry.sha256):  # the copy was damaged in the cache: fetch it anew
                warnings.warn(f"streamwin: the node cache's copy {local} of {where} is damaged (sha256 {digest[:16]}..., "
                              f"index.json says {entry.sha256[:16]}...): dropped it, fetching it again", RuntimeWarning,
                              stacklevel=4)
                os.remove(local)
                local = fetch_columns(where, fs, path, entry)
                digest, size = _file_sha256(local)
            path = local
        else:
            digest, size = _file_sha256(path)
        _check_columns(digest, size, entry, where)
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return b""
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError as e:
        raise ManifestError(f"{where} is missing: index.json names it as its columns file; the dataset is damaged "
                            "(repack, or rerun `streamwin index`)") from e
    except ManifestError:
        raise
    except Exception as e:
        raise ManifestError(f"cannot read {where}: {type(e).__name__}: {e}") from e


def _file_sha256(path: str) -> tuple[str, int]:
    """(sha256, size) of a local file, read in pieces (never mapped: hashing leaves no page in this process)."""
    h, size, buf = hashlib.sha256(), 0, bytearray(1 << 20)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(memoryview(buf)[:n])
            size += n
    return h.hexdigest(), size


def _check_columns(digest: str, size: int, entry: ShardEntry, where: str) -> None:
    """ManifestError naming the columns file when it is not the one index.json names (size, sha256)."""
    if (size, digest) != (entry.bytes, entry.sha256):
        raise ManifestError(f"{where} is damaged or was changed: it has {size} bytes with sha256 {digest[:16]}..., "
                            f"index.json names {entry.bytes} bytes with sha256 {entry.sha256[:16]}...; rebuild the "
                            "index with `streamwin index`, or repack")


def read_object(fs, path: str, most: int, retries: int, backoff: float) -> bytes:
    """A whole (small) object: local files read, http(s) and s3 through a RangeReader of its own (our
    connections, time limits and retries), anything else through fsspec's cat_file; retried."""
    if is_local(fs):
        return with_retries(lambda: fs.cat_file(path), retries=retries, backoff=backoff)
    reader = RangeReader(fs)
    first = [True]

    def read() -> bytes:
        try:
            return reader.read_all(path, most)
        except BrokenRead as e:  # storage that cannot be connected to at all: say so now, not after the retries
            why = _cannot_connect(e) if first[0] else None
            if why == "refused":
                raise ConnectionRefusedError(f"{e}") from e
            if why is not None:
                raise ConnectionError(f"cannot connect: {e}") from e
            raise
        finally:
            first[0] = False
    try:
        return with_retries(read, retries=retries, backoff=backoff)
    finally:
        reader.close()


def _cannot_connect(error: BaseException) -> str | None:
    """Why a GET failed before it was connected ("refused", or "failed": no such host, a connect time-out), or None."""
    names = {"NewConnectionError", "ConnectTimeoutError", "NameResolutionError"}
    e: BaseException | None = error
    found = None
    for _ in range(8):
        if e is None:
            break
        if isinstance(e, ConnectionRefusedError) or "Connection refused" in str(e):
            return "refused"
        if {c.__name__ for c in type(e).__mro__} & names:
            found = "failed"
        e = e.__cause__ or e.__context__
    return found
