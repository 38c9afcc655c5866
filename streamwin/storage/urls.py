"""URLs to filesystems, and writes that readers see whole or not at all.

Everything that touches a filesystem goes through fsspec, so local paths, file://, s3://,
gs://, http(s):// and memory:// behave the same.
"""
from __future__ import annotations

import os
import posixpath
import uuid
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from streamwin.errors import StreamwinError

REACH_TIMEOUT = 5.0  # seconds to connect (and to answer) when probing object storage


def url_to_fs(url: str, storage_options: dict[str, Any] | None = None, *,
              own_retries: bool = False, fresh: bool = False) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path inside it) for a URL or a local path.

    ``own_retries``: the caller retries transient errors itself (reads do), so the filesystem
    must not retry inside each attempt: for s3, botocore's retries are turned off and s3fs'
    own loop cut to one attempt, unless ``config_kwargs`` sets ``retries``.
    ``fresh``: for http(s), a filesystem of its own (not fsspec's cached instance), whose
    aiohttp session reuses no keep-alive connection of an earlier request.
    """
    url = str(url)
    opts = dict(storage_options or {})
    if fresh and fsspec.core.split_protocol(url)[0] in ("http", "https"):
        opts["skip_instance_cache"] = True
    quiet = own_retries and fsspec.core.split_protocol(url)[0] in ("s3", "s3a")
    if quiet:
        config = dict(opts.get("config_kwargs") or {})
        quiet = "retries" not in config  # the user's own retry settings win
        if quiet:
            opts["config_kwargs"] = {**config, "retries": {"total_max_attempts": 1}}
    fs, path = fsspec.core.url_to_fs(url, **opts)
    if quiet:
        fs.retries = 1  # this instance is ours: its options hold the config above
    return fs, path


def join(root: str, name: str) -> str:
    """``name`` under directory ``root`` of a filesystem, with posix separators (no root: ``name`` itself)."""
    return posixpath.join(root.rstrip("/"), name) if root else name


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` is the local filesystem: its files can be opened, mapped and renamed directly."""
    return isinstance(fs, LocalFileSystem)


TEMP_MARK = ".streamwin-tmp-"  # a write in progress: <final name>.streamwin-tmp-<32 hex digits>


def temp_path(path: str) -> str:
    """A unique temporary name beside ``path`` for a write in progress: ``<path>.streamwin-tmp-<32 hex digits>``,
    which no user's file matches by accident (so a clean-up can tell it from theirs)."""
    return f"{path}{TEMP_MARK}{uuid.uuid4().hex}"


def write_atomic(fs: fsspec.AbstractFileSystem, path: str, data: bytes | list) -> None:
    """Write ``data`` (bytes, or a list of buffers written in order) so that readers see either nothing or all of it.

    Local files go through a temporary name (`temp_path`) and os.replace; object stores make a PUT
    visible only once it is complete, so they are written directly.
    """
    parts = data if isinstance(data, list) else [data]
    if is_local(fs):
        tmp = temp_path(path)
        try:
            with open(tmp, "wb") as f:
                for part in parts:
                    f.write(part)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise
    else:
        with fs.open(path, "wb") as f:
            for part in parts:
                f.write(part)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_if_exists(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Remove ``path`` from ``fs`` if it is there."""
    try:
        if fs.exists(path):
            fs.rm(path)
    except FileNotFoundError:
        pass


def create_exclusive(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> bool:
    """Create ``path`` holding ``data`` only if nothing is there; False when something is (a lock's create).

    The store itself decides, atomically, so of processes creating one path at once exactly one
    succeeds, and a reader never sees the file without its content: a local file is written
    under a temporary name and hard-linked into place (a link fails when the name exists;
    O_EXCL where there are no links); s3 is a PUT with ``If-None-Match: *``, gcs an upload
    with ``ifGenerationMatch=0``, azure a blob upload with ``If-None-Match: *`` (each refused
    by the store when the object exists), other filesystems fsspec's ``mode="create"``.
    """
    if is_local(fs):
        return _create_local(path, data)
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    try:
        if protocols & {"az", "abfs", "abfss"}:
            fs.pipe_file(path, data, overwrite=False)  # adlfs: If-None-Match: *
        else:  # s3fs: IfNoneMatch="*"; gcsfs: ifGenerationMatch=0
            fs.pipe_file(path, data, mode="create")
    except FileExistsError:
        return False
    except TypeError as e:  # a gcsfs too old to know mode="create"
        raise StreamwinError(f"cannot create {path} exclusively: this {type(fs).__name__} has no exclusive create "
                             f"({e}); upgrade it (pip install -U gcsfs s3fs adlfs)") from e
    except OSError as e:  # 412 Precondition Failed / 409 BlobAlreadyExists when the object exists
        if _exists_error(e):
            return False
        raise
    fs.invalidate_cache(path)
    return True


def _create_local(path: str, data: bytes) -> bool:
    tmp = temp_path(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)  # atomic, and the content is whole before the name appears
        return True
    except FileExistsError:
        return False
    except OSError:  # no hard links here: an exclusive create, written at once
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True
    finally:
        _unlink(tmp)


def _exists_error(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e!r} {e}"
    return any(word in text for word in ("PreconditionFailed", "Precondition Failed", "412", "BlobAlreadyExists",
                                          "ResourceExists", "ConditionNotMet"))


def reach(url: str, storage_options: dict[str, Any] | None = None) -> None:
    """Fail fast, in one line, when the object storage of ``url`` (s3) cannot be reached or refuses us.

    One listing of the URL's prefix with no retries and REACH_TIMEOUT seconds to connect and to
    answer: a refused connection, an unknown host, a time-out, missing or rejected credentials
    are a StreamwinError naming the URL and the cause within seconds, where the verb's own
    calls (with retries for transient errors) would take tens of seconds and end in a
    traceback. A missing prefix is no error here (the verb says what is missing).
    """
    if fsspec.core.split_protocol(str(url))[0] not in ("s3", "s3a"):
        return
    opts = dict(storage_options or {})
    config = {"connect_timeout": REACH_TIMEOUT, "read_timeout": REACH_TIMEOUT, **(opts.get("config_kwargs") or {}),
              "retries": {"total_max_attempts": 1}}
    opts.update(config_kwargs=config, skip_instance_cache=True)
    try:
        fs, root = url_to_fs(url, opts, own_retries=True)
        fs.ls(root, refresh=True)
    except FileNotFoundError:
        return
    except PermissionError as e:
        raise StreamwinError(f"access to {url} denied: {e} (check the credentials in --storage-option / "
                             "storage_options or the environment)") from e
    except Exception as e:
        raise StreamwinError(f"cannot reach {url}: {type(e).__name__}: {e}") from e
