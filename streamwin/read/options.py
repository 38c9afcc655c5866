"""How a reader reaches a dataset's shards: storage options, retries, the error policy, the node cache.

``WindowDataset`` takes these as keyword arguments and hands them to each shard reader as
one frozen ``ReadOptions``; a bad value is refused here with the same error, naming the
argument as the user typed it, whichever way the options were made.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from streamwin.arguments import check_bool, check_choice, check_int, is_real
from streamwin.read.ahead import LIMIT_BYTES

ON_ERROR = ("raise", "skip")


@dataclass(frozen=True)
class ReadOptions:
    """The I/O options of a shard reader, validated on construction.

    Args:
        storage_options: passed to fsspec (credentials, endpoint_url, ...), or None.
        retries: failed attempts in a row allowed per read on transient storage errors.
        retry_backoff: seconds before the first retry, doubling with each failure in a row.
        on_error: "raise" a ShardError on bad data, or "skip" what cannot be read: those windows
            become zeros of weight 0, counted in the reader's stats.
        cache_dir, cache_limit: keep verified node-local copies of the shards under ``cache_dir``
            (fetched once per node), evicted least-recently-used down to ``cache_limit`` bytes.
        verify_checksums: check every byte read against the manifest's chunk checksums (False only to
            measure what that costs; manifests packed before checksums have none to check).
        readahead_bytes: bytes of blocks a process may read ahead from remote storage, per source, beyond the
            ``readahead`` blocks of each stream (read/ahead.py: it reads as far ahead as the latency needs).
    """

    storage_options: Mapping[str, Any] | None = None
    retries: int = 5
    retry_backoff: float = 0.2
    on_error: str = "raise"
    cache_dir: str | os.PathLike | None = None
    cache_limit: int | None = None
    verify_checksums: bool = True
    readahead_bytes: int = LIMIT_BYTES

    def __post_init__(self) -> None:
        check_int("retries", self.retries, 0)
        if self.cache_limit is not None:
            check_int("cache_limit", self.cache_limit, 0)
        backoff = self.retry_backoff
        if not is_real(backoff) or not 0 <= backoff < float("inf"):
            error = ValueError if is_real(backoff) else TypeError
            raise error(f"retry_backoff must be a number of seconds >= 0, got {backoff!r}")
        check_choice("on_error", self.on_error, ON_ERROR)
        check_bool("verify_checksums", self.verify_checksums)
        check_int("readahead_bytes", self.readahead_bytes, 0)
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise TypeError(f"storage_options must be a dict of fsspec options (or None), got {self.storage_options!r}")
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise TypeError(f"cache_dir must be a directory path (or None), got {self.cache_dir!r}")
        object.__setattr__(self, "retries", int(self.retries))
        object.__setattr__(self, "readahead_bytes", int(self.readahead_bytes))
        object.__setattr__(self, "retry_backoff", float(backoff))
        if self.cache_limit is not None:
            object.__setattr__(self, "cache_limit", int(self.cache_limit))
