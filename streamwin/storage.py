"""Storage access over fsspec: URLs, atomic writes, and reading the manifest.

Everything that touches a filesystem goes through here, so local paths, file://, s3://,
gs://, http(s):// and memory:// behave the same.
"""
from __future__ import annotations

import os
import posixpath
import time
import uuid
from typing import Any, Callable, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .errors import ManifestError
from .manifest import INDEX_NAME, Manifest, parse_manifest

T = TypeVar("T")


def url_to_fs(url: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path inside it) for a URL or a local path."""
    return fsspec.core.url_to_fs(str(url), **(storage_options or {}))


def join(root: str, name: str) -> str:
    return posixpath.join(root.rstrip("/"), name) if root else name


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def write_atomic(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write ``data`` so that readers see either nothing or all of it.

    Local files go through a temporary name and os.replace; object stores make a PUT
    visible only once it is complete, so they are written directly.
    """
    if is_local(fs):
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    else:
        with fs.open(path, "wb") as f:
            f.write(data)


def remove_if_exists(fs: fsspec.AbstractFileSystem, path: str) -> None:
    try:
        if fs.exists(path):
            fs.rm(path)
    except FileNotFoundError:
        pass


def with_retries(call: Callable[[], T], *, retries: int, backoff: float) -> T:
    """``call()``, retried on transient errors with exponential backoff (``backoff``, 2x, 4x, ...).

    A missing or forbidden object (FileNotFoundError, PermissionError) is raised at once; any
    other error is raised as is once ``retries`` retries have failed too.
    """
    for attempt in range(retries + 1):
        try:
            return call()
        except (FileNotFoundError, PermissionError):
            raise
        except Exception:
            if attempt == retries:
                raise
            time.sleep(backoff * 2**attempt)
    raise AssertionError("unreachable")


def load_manifest(url: str, storage_options: dict[str, Any] | None = None, *, retries: int = 5,
                  backoff: float = 0.2) -> Manifest:
    """Read ``<url>/index.json``; a missing index means the dataset is not (yet) complete.

    Transient storage errors (503, dropped connections, time-outs) are retried with
    exponential backoff, like every shard read.
    """
    fs, root = url_to_fs(url, storage_options)
    path = join(root, INDEX_NAME)
    where = f"{url.rstrip('/')}/{INDEX_NAME}"
    try:
        text = with_retries(lambda: fs.cat_file(path), retries=retries, backoff=backoff)
    except FileNotFoundError as e:
        raise ManifestError(
            f"no {INDEX_NAME} at {url}: not a streamwin dataset, or its pack did not finish "
            "(index.json is written last); rerun the pack, or `streamwin index` existing tar shards"
        ) from e
    except PermissionError as e:
        raise ManifestError(f"cannot read {where}: {e}") from e
    except Exception as e:
        raise ManifestError(f"cannot read {where} after {retries} retries: {type(e).__name__}: {e}") from e
    return parse_manifest(text, where=where)
