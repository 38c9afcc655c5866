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
import json
import mmap
import os
import warnings
from typing import Any, Callable

import fsspec
import xxhash

from streamwin.arguments import check_keywords
from streamwin.errors import ManifestError
from streamwin.formats.manifest import (COLUMNAR_FROM, INDEX_NAME, Manifest, ShardEntry, columns_file_entry, columns_name,
                                        parse_manifest)
from streamwin.formats.seal import CONTENT_FIELD
from streamwin.storage.ranged import BrokenRead, RangeReader
from streamwin.storage.retry import describe, with_retries
from streamwin.storage.urls import is_local, join, remove_if_exists, url_to_fs, write_atomic

MAX_INDEX_BYTES = 1 << 30  # an index.json larger than this is not one streamwin wrote
COLUMNS_HASH = "xxh3_128"  # the columns file's hash a sealed index.json names beside its sha256, checked on load


def write_manifest(fs: fsspec.AbstractFileSystem, root: str, manifest: Manifest, name: str = INDEX_NAME,
                   columnar: bool | None = None, columns: str | None = None) -> None:
    """Write the index file ``name`` (the commit marker), after its columns file when columnar.

    ``columnar`` None: the columnar form (version 2) from COLUMNAR_FROM sequences on (or
    when the chunk checksums outgrow INLINE_SUMS), else the columns inline (version 1, one file).
    ``columns``: the columns file's name (default ``columns_name(name)``); given, a columns
    file of that name is left alone when inline.
    """
    if columnar is None:  # many sequences, chunk checksums of more than a GB of shards, continuations: a columns file
        columnar = manifest.num_sequences >= COLUMNAR_FROM or not manifest.sums_inline() or \
            manifest.segments is not None
    if not columnar:
        if columns is None:
            remove_if_exists(fs, join(root, columns_name(name)))
        write_atomic(fs, join(root, name), manifest.to_json().encode())
        return
    columns = columns or columns_name(name)
    parts, layout = manifest.column_parts()
    digest, fast = hashlib.sha256(), xxhash.xxh3_128()
    for part in parts:
        digest.update(part)
        fast.update(part)
    nbytes = sum(len(p) for p in parts)
    write_atomic(fs, join(root, columns), parts)
    spec = {"name": columns, "bytes": nbytes, "sha256": digest.hexdigest(), COLUMNS_HASH: fast.hexdigest(),
            "layout": layout}
    write_atomic(fs, join(root, name), manifest.to_json(columns_file=spec).encode())


@check_keywords()
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
    columns = _columns_bytes(url, fs, join(root, entry.name), entry, fetch_columns, retries, backoff,
                             _columns_check(text))
    return parse_manifest(text, where=where, columns=columns)


def _is_file(fs, path: str) -> bool:
    """Whether ``path`` is a file (a dataset URL that names index.json or a shard instead of its directory)."""
    try:
        return bool(fs.isfile(path))
    except Exception:  # only asked to word an error better: never an error of its own
        return False


def _columns_bytes(url: str, fs, path: str, entry: ShardEntry, fetch_columns, retries: int, backoff: float,
                   check: tuple[str, str] | None):
    """The columns file's bytes, checked against the hash index.json names (``check``: (algorithm, hex digest),
    or None for an unsealed manifest, checked by size only): a read-only map of a local file (the
    dataset's, or the node cache's copy), or the bytes read from storage.

    A cached copy that no longer matches is dropped and fetched again, once, with a warning;
    a damaged file of the dataset itself is a ManifestError naming it.
    """
    where = f"{url.rstrip('/')}/{entry.name}"
    try:
        if not is_local(fs) and fetch_columns is None:
            data = read_object(fs, path, entry.bytes, retries, backoff)
            _check_columns(data, check, where)
            return data
        if not is_local(fs):
            local = fetch_columns(where, fs, path, entry)
            if check is not None and _hash(local, check[0]) != check[1]:  # damaged in the cache: fetch it anew
                warnings.warn(f"streamwin: the node cache's copy {local} of {where} is damaged (its {check[0]} differs "
                              "from index.json's): dropped it, fetching it again", RuntimeWarning, stacklevel=4)
                os.remove(local)
                local = fetch_columns(where, fs, path, entry)
            path = local
        _check_columns(path, check, where)
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


def _columns_check(text: str | bytes) -> tuple[str, str] | None:
    """How to check the columns file a version 2 index.json names: (algorithm, hex digest) of a sealed one
    (its xxh3_128, several times faster than sha256 over a large file), None of an unsealed one."""
    doc = json.loads(text)  # small: the columns are in their file (columns_file_entry parsed it already)
    spec = doc.get("columns_file")
    if CONTENT_FIELD not in doc or not isinstance(spec, dict):
        return None
    fast = spec.get(COLUMNS_HASH)
    return (COLUMNS_HASH, fast) if isinstance(fast, str) else ("sha256", str(spec.get("sha256")))


def _hash(source: str | bytes, algorithm: str) -> str:
    """The hex digest of bytes, or of a local file read in pieces (never mapped: no page stays in this process)."""
    h = xxhash.xxh3_128() if algorithm == COLUMNS_HASH else hashlib.sha256()
    if not isinstance(source, str):
        h.update(source)
        return h.hexdigest()
    buf = bytearray(1 << 20)
    with open(source, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(memoryview(buf)[:n])
    return h.hexdigest()


def _check_columns(source: str | bytes, check: tuple[str, str] | None, where: str) -> None:
    """ManifestError naming the columns file when its content is not the one index.json names."""
    if check is not None and _hash(source, check[0]) != check[1]:
        raise ManifestError(f"{where} is damaged or was changed: its {check[0]} is not the one index.json names; "
                            "rebuild the index with `streamwin index`, or repack")


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
